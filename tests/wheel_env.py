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

ROOT = Path(__file__).resolve().parent.parent
TORCH = "torch==2.13.0"  # the CPU build from the local wheel directory
# The pins of each bound, and the versions each must end up with (prefixes for "newest":
# the top of each range, whichever patch release the registry serves).
PINS = {"lower": ["flwr[simulation]==1.41.0", "numpy==1.26.4"], "newest": []}
EXPECTED = {
    "lower": {"flwr": "1.41.0", "numpy": "1.26.4", "torch": "2.13.0"},
    "newest": {"flwr": "1.42.", "numpy": "2.4.", "torch": "2.13.0"},
}
INSTALL_SECONDS = 900


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
    """A fresh virtualenv with CPU torch (linked from this environment where it has that
    build, else installed), then the wheel (and `pins`); its bin folder. Byte-compiled as
    pip does by default: without `.pyc` files the first start of each Flower and Ray process
    compiles its imports, and Ray's raylet gives its dashboard agent a fixed 15 s to start
    (ray-project/ray#65983), which a loaded machine missed."""
    run([sys.executable, "-m", "venv", venv], 120)
    pip = venv / "bin" / "pip"
    if not link_torch(site_packages(venv)):
        run([pip, "install", "-q", TORCH], INSTALL_SECONDS)
    run([pip, "install", "-q", wheel, *pins], INSTALL_SECONDS)
    return venv / "bin"


def site_packages(venv: Path) -> Path:
    (folder,) = venv.glob("lib/python3.*/site-packages")
    return folder


def link_torch(target: Path) -> bool:
    """Hard-link this interpreter's torch (the same CPU build) and the distributions it
    needs, as pip installed and compiled them, into `target`, instead of unpacking and
    compiling them again for each virtualenv; False, with nothing linked, where this
    environment's torch is not that build or another filesystem holds it. Distributions the
    fresh virtualenv already has (pip, setuptools) stay its own."""
    try:
        if metadata.version("torch").split("+")[0] != TORCH.split("==")[1]:
            return False
    except metadata.PackageNotFoundError:
        return False
    have = {named(d) for d in metadata.distributions(path=[str(target)])}
    chosen = [d for d in requirement_closure("torch") if named(d) not in have]
    files = [(Path(str(d.locate_file(f))), f) for d in chosen for f in d.files or []]
    inside = [(source, f) for source, f in files if ".." not in f.parts and source.is_file()]
    probe = target / ".link-probe"
    try:  # another filesystem, or a bind mount of the same one, refuses links (EXDEV)
        os.link(inside[0][0], probe)
    except OSError:
        return False
    probe.unlink()
    for source, relative in inside:
        (target / relative).parent.mkdir(parents=True, exist_ok=True)
        os.link(source, target / relative)  # the same inode: .pyc headers still match
    return True


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
    wheel = build_wheel(base / "dist")
    with ThreadPoolExecutor(len(PINS)) as pool:
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
        1200,
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
