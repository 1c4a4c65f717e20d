"""The wheel built from the repository, installed into fresh virtualenvs at the ends of the
dependency ranges (tests/test_wheel.py, tests/test_bounds.py).

Each virtualenv gets the user's CPU torch first (pip choosing torch itself pulls a CUDA
build), then the wheel: "lower" with flwr and numpy pinned to the ranges' lower bounds,
"newest" resolved freely (the newest versions the ranges allow). The wheel is built and
both environments installed once per test session, in parallel, under one temporary
folder removed when the session ends.
"""

from __future__ import annotations

import atexit
import functools
import json
import os
import shutil
import subprocess
import sys
import tempfile
from concurrent.futures import ThreadPoolExecutor
from importlib import metadata
from pathlib import Path

from packaging.requirements import Requirement
from packaging.utils import canonicalize_name
from packaging.version import Version

from tests import timing

ROOT = Path(__file__).resolve().parent.parent
TORCH = "torch==2.13.0"  # the CPU build from the local wheel directory
# The resolution reads each wheel's METADATA only. A registry that does not list PEP 658
# metadata (this machine's mirror) made pip 23.2 (Python's own) download every wheel it
# considered: 3 GB and 50 s of CPU for Python 3.12 with torch 2.11.0. pip 26 with its lazy
# wheels reads the metadata by HTTP range requests instead: no wheel downloaded, 11 s of CPU,
# the same 107 distributions resolved.
RESOLVING_PIP = "pip>=26"
FAST_DEPS = ("--use-feature=fast-deps",)
# The pins of each bound, and the versions each must end up with (prefixes for "newest":
# the top of each range, whichever patch release the registry serves).
PINS = {"lower": ["flwr[simulation]==1.41.0", "numpy==1.26.4"], "newest": []}
EXPECTED = {
    "lower": {"flwr": "1.41.0", "numpy": "1.26.4", "torch": "2.13.0"},
    "newest": {"flwr": "1.42.", "numpy": "2.4.", "torch": "2.13.0"},
}


def env(**extra: str) -> dict[str, str]:
    """This environment without the runtime `uv sync` of Flower's SuperLink."""
    return {**os.environ, "FLWR_DISABLE_RUNTIME_DEPENDENCY_INSTALLATION": "1", **extra}


def run(
    command: list[object],
    timeout: float,
    cwd: Path | None = None,
    extra_env: dict[str, str] | None = None,
    code: int = 0,
) -> str:
    """Run `command`, assert its exit code; its stdout and stderr. Past `timeout` it gets
    SIGTERM first (fedstale then stops the Flower processes it started), SIGKILL 30 s on."""
    with subprocess.Popen(
        [str(part) for part in command],
        cwd=cwd,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        env=env(**(extra_env or {})),
    ) as process:
        try:
            output, _ = process.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            process.terminate()
            try:
                output, _ = process.communicate(timeout=30)
            except subprocess.TimeoutExpired:
                process.kill()
                output, _ = process.communicate()
            raise AssertionError(f"{command} ran past {timeout} s: {output[-3000:]}") from None
    assert process.returncode == code, f"{command} exited {process.returncode}: {output[-3000:]}"
    return output


def build_wheel(dist: Path) -> Path:
    run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "-w", dist, ROOT], 600)
    (wheel,) = dist.glob("fedstale-*.whl")
    return wheel


def install(venv: Path, wheel: Path, pins: list[str]) -> Path:
    """A fresh virtualenv with CPU torch, then the wheel (and `pins`), as pip resolves them
    there; its bin folder. Byte-compiled as pip does by default: without `.pyc` files the
    first start of each Flower and Ray process compiles its imports, and Ray's raylet gives
    its dashboard agent a fixed 15 s to start (ray-project/ray#65983), which a loaded machine
    missed. Each distribution pip resolves to the very version this environment holds is
    hard-linked from here (unpacked and compiled already) rather than installed again; pip
    then installs the rest and checks every requirement, as a user's install does."""
    run([sys.executable, "-m", "venv", venv], 120)
    pip = venv / "bin" / "pip"
    if not (runners_torch_is_cpu_build() and link(requirement_closure("torch"), venv)):
        run([pip, "install", "-q", TORCH], timing.left())
    else:
        link(same_as_here(resolved(pip, venv / "resolved.json", wheel, pins)), venv)
    run([pip, "install", "-q", wheel, *pins], timing.left())
    return venv / "bin"


def site_packages(venv: Path) -> Path:
    (folder,) = venv.glob("lib/python3.*/site-packages")
    return folder


def runners_torch_is_cpu_build() -> bool:
    try:
        return metadata.version("torch").split("+")[0] == TORCH.split("==")[1]
    except metadata.PackageNotFoundError:
        return False


def resolved(
    pip: Path, report: Path, wheel: Path, pins: list[str], extra_env: dict[str, str] | None = None
) -> dict[str, str]:
    """{name: version} of what `pip install wheel pins` would add to that virtualenv (whose
    pip is upgraded first to one that reads wheels lazily)."""
    run([pip, "install", "-q", "--upgrade", RESOLVING_PIP], timing.left(), extra_env=extra_env)
    command = [pip, "install", "-q", "--dry-run", *FAST_DEPS, "--report", report, wheel, *pins]
    run(command, timing.left(), extra_env=extra_env)
    items = json.loads(report.read_text())["install"]
    return {canonicalize_name(i["metadata"]["name"]): i["metadata"]["version"] for i in items}


def same_as_here(wanted: dict[str, str]) -> list[metadata.Distribution]:
    """This environment's distributions of those names and versions, installed from an
    index (an editable or path install, such as this checkout's fedstale, is not one)."""
    here = {named(d): d for d in metadata.distributions()}
    return [
        here[name]
        for name, version in wanted.items()
        if name in here
        and Version(here[name].version) == Version(version)
        and here[name].read_text("direct_url.json") is None
    ]


def link(chosen: list[metadata.Distribution], venv: Path) -> bool:
    """Hard-link the `chosen` distributions' files, as pip installed and compiled them here,
    into `venv`; their console scripts are copied with `venv`'s interpreter in the first line.
    False, with nothing linked, where another filesystem (or a bind mount of the same one)
    refuses links. Distributions `venv` already has (pip, setuptools) stay its own."""
    target = site_packages(venv)
    have = {named(d) for d in metadata.distributions(path=[str(target)])}
    files = [
        (Path(str(d.locate_file(f))), target / f)
        for d in chosen
        if named(d) not in have
        for f in d.files or []
    ]
    files = [(source, dest) for source, dest in files if source.is_file()]
    if not files:
        return True
    probe = target / ".link-probe"
    try:
        os.link(files[0][0], probe)
    except OSError:
        return False
    probe.unlink()
    for source, dest in files:
        dest = Path(os.path.normpath(dest))
        dest.parent.mkdir(parents=True, exist_ok=True)
        if dest.is_relative_to(target):
            os.link(source, dest)  # the same inode: .pyc headers still match
        else:  # outside site-packages (bin/): copied, a script's first line names `venv`
            copy_script(source, dest, venv / "bin" / "python")
    return True


def copy_script(source: Path, dest: Path, python: Path) -> None:
    first, newline, rest = source.read_bytes().partition(b"\n")
    if first.startswith(b"#!") and b"python" in first:
        first = b"#!" + bytes(python)
    dest.write_bytes(first + newline + rest)
    dest.chmod(source.stat().st_mode)


def named(dist: metadata.Distribution) -> str:
    return canonicalize_name(dist.metadata["Name"])


def requirement_closure(name: str) -> list[metadata.Distribution]:
    """`name`'s distribution and, recursively, those its unconditional requirements name."""
    found: dict[str, metadata.Distribution] = {}
    todo = [name]
    while todo:
        dist = metadata.distribution(todo.pop())
        key = named(dist)
        if key in found:
            continue
        found[key] = dist
        for line in dist.requires or []:
            requirement = Requirement(line)
            if requirement.marker is None or requirement.marker.evaluate({"extra": ""}):
                todo.append(requirement.name)
    return list(found.values())


@functools.cache
def installed() -> tuple[Path, dict[str, Path]]:
    """The wheel and {"lower": bin folder, "newest": bin folder}, made once per session."""
    base = Path(tempfile.mkdtemp(prefix="fedstale-wheel-"))
    atexit.register(shutil.rmtree, base, True)
    with timing.one_time("the wheel's virtualenvs"), ThreadPoolExecutor(len(PINS)) as pool:
        wheel = build_wheel(base / "dist")
        futures = {b: pool.submit(install, base / b, wheel, pins) for b, pins in PINS.items()}
        return wheel, {bound: future.result() for bound, future in futures.items()}


def versions(bin_dir: Path) -> dict[str, str]:
    """flwr, numpy and torch versions of that environment."""
    code = (
        "import importlib.metadata as m, json; "
        "print(json.dumps({p: m.version(p) for p in ('flwr', 'numpy', 'torch')}))"
    )
    return json.loads(run([bin_dir / "python", "-c", code], 120).strip().splitlines()[-1])


def simulate_outside_the_checkout(
    bin_dir: Path, bound: str, config: str, name: str, here: Path, home: Path
) -> Path:
    """`fedstale run` of that environment in Flower simulation from `here` as run `name`
    (FLWR_HOME `home`; no port fixed, so the SuperLink it starts holds a port of its own
    from the start); its run folder. Checked as a run at `bound`: the versions the
    environment holds, the same in the run's provenance, and an app bundle holding only the
    app's description (the SuperLink ran the installed code)."""
    found = versions(bin_dir)
    for package, version in EXPECTED[bound].items():
        assert found[package].startswith(version), (package, found)
    run(
        [bin_dir / "fedstale", "run", "--run-config", f"{config} run-name={name}"],
        timing.left(),
        here,
        {"FLWR_HOME": str(home)},
    )
    folder = here / "runs" / name
    recorded = json.loads((folder / "config.json").read_text())["provenance"]
    assert {k: recorded[k] for k in ("flwr", "numpy")} == {k: found[k] for k in ("flwr", "numpy")}
    bundled = [p.name for p in (home / "apps").rglob("*") if p.is_file()]
    assert bundled == ["pyproject.toml"]
    return folder


def elsewhere(tmp_path: Path) -> Path:
    """A working directory outside the checkout."""
    folder = tmp_path / "elsewhere"
    folder.mkdir()
    return folder
