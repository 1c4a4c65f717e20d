"""Users' environments, made as a user makes them: a fresh virtualenv on another Python,
their torch and numpy installed first from PyPI (a GPU box's CUDA build, or the oldest torch
fedstale runs on), then fedstale's wheel (`make`, for `python -m bench.environments`); and
the same resolved without installing anything (`resolution`, for tests/test_environments.py:
pip's dry run reads each wheel's metadata, which PyPI serves on its own, so no multi-GB
torch is downloaded).

pip runs with no configuration file (PIP_CONFIG_FILE=os.devnull), so that neither this
machine's torch cap (/etc/xdg/pip) nor its local wheel folders change what a user gets.
"""

from __future__ import annotations

import glob
import json
import os
import shutil
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from fedstale.launcher.deploy import CONNECTION
from tests.wheel_env import resolved, run

INSTALL_SECONDS = 1200  # bench.environments' multi-GB installs, outside any test's bound
TINY = (
    "strategy=fedbuff dataset=digits buffer-size=2 max-virtual-time=0 eval-interval=500 "
    "num-clients=4 concurrency=2 max-updates=8"
)


@dataclass(frozen=True)
class Environment:
    name: str
    python: str  # "3.12": found under pyenv or on PATH
    pins: tuple[str, ...]  # what the user had installed first

    def interpreter(self) -> Path | None:
        root = Path(os.environ.get("PYENV_ROOT", Path.home() / ".pyenv"))
        found = sorted(glob.glob(str(root / "versions" / f"{self.python}.*" / "bin" / "python")))
        if found:
            return Path(found[-1])
        on_path = shutil.which(f"python{self.python}")
        return Path(on_path) if on_path else None


ENVIRONMENTS = {
    # The GPU box measured on: Python 3.12, PyPI's torch 2.11.0 (CUDA 13), numpy 2.5.5.
    "py312-torch2.11": Environment("py312-torch2.11", "3.12", ("torch==2.11.0", "numpy==2.5.5")),
    # The newest of each: Python 3.13, torch 2.15.0.
    "py313-torch2.15": Environment("py313-torch2.15", "3.13", ("torch==2.15.0", "numpy==2.5.5")),
    # The floor: the oldest torch fedstale runs on (torch.func arrived in 2.0), numpy's floor.
    "py311-torch2.0.1": Environment("py311-torch2.0.1", "3.11", ("torch==2.0.1", "numpy==1.26.4")),
    # torchvision's models by name (`model=resnet18`): the pair the env notes name for x86_64.
    "py311-torchvision0.29.1": Environment(
        "py311-torchvision0.29.1", "3.11", ("torch==2.14.1", "torchvision==0.29.1")
    ),
}


def pip_env() -> dict[str, str]:
    return {"PIP_CONFIG_FILE": os.devnull, "PIP_DISABLE_PIP_VERSION_CHECK": "1"}


def frozen(bin_dir: Path) -> dict[str, str]:
    """{name: version} of what that virtualenv holds (pip's own view)."""
    output = run([bin_dir / "python", "-m", "pip", "list", "--format", "json"], 300)
    items = json.loads(output.strip().splitlines()[-1])
    return {item["name"].lower(): item["version"] for item in items}


@dataclass
class Made:
    """What making an environment measured."""

    bin_dir: Path
    before: dict[str, str]
    after: dict[str, str]
    seconds: dict[str, float]

    def changed(self) -> dict[str, tuple[str, str | None]]:
        """Distributions installing the wheel changed or removed: name -> (before, after)."""
        return {
            name: (version, self.after.get(name))
            for name, version in self.before.items()
            if self.after.get(name) != version
        }


def make(environment: Environment, wheel: Path, folder: Path) -> Made:
    """The user's virtualenv in `folder`: their pins first, then the wheel."""
    python = environment.interpreter()
    assert python is not None, f"no Python {environment.python} here"
    seconds: dict[str, float] = {}
    start = time.monotonic()
    run([python, "-m", "venv", folder], 120)
    bin_dir = folder / "bin"
    pip = [bin_dir / "python", "-m", "pip", "install", "-q"]
    run([*pip, *environment.pins], INSTALL_SECONDS, extra_env=pip_env())
    seconds["user's torch"] = time.monotonic() - start
    before = frozen(bin_dir)
    start = time.monotonic()
    run([*pip, wheel], INSTALL_SECONDS, extra_env=pip_env())
    seconds["fedstale wheel"] = time.monotonic() - start
    return Made(bin_dir, before, frozen(bin_dir), seconds)


def resolution(environment: Environment, wheel: Path, folder: Path) -> dict[str, str]:
    """{name: version} of what pip would install, in a fresh virtualenv on the environment's
    Python, for the user's pins and the wheel together: where the wheel's ranges admit the
    user's torch and numpy, those very versions. A range that excludes one fails here
    (AssertionError, pip's reason in it), as installing the wheel would replace it."""
    python = environment.interpreter()
    assert python is not None, f"no Python {environment.python} here"
    run([python, "-m", "venv", folder], 120)
    pip, report, pins = folder / "bin" / "pip", folder / "report.json", list(environment.pins)
    return resolved(pip, report, wheel, pins, extra_env=pip_env())


def narrowed(wheel: Path, requirement: str, folder: Path) -> Path:
    """A copy of `wheel` whose dependency on `requirement`'s project is `requirement`
    instead (its METADATA and RECORD rewritten), to show the checks catch a narrowed range."""
    import base64
    import hashlib
    import re
    import zipfile

    project = re.split(r"[<>=!~ ]", requirement, maxsplit=1)[0]
    folder.mkdir(parents=True, exist_ok=True)
    copy = folder / wheel.name
    with zipfile.ZipFile(wheel) as source, zipfile.ZipFile(copy, "w") as target:
        names = source.namelist()
        (metadata_name,) = [n for n in names if n.endswith(".dist-info/METADATA")]
        text = source.read(metadata_name).decode()
        pattern = rf"^Requires-Dist: {re.escape(project)}\b[^;\n]*"
        changed, count = re.subn(pattern, f"Requires-Dist: {requirement}", text, flags=re.M)
        assert count == 1, f"{wheel.name} names {project} {count} times"
        digest = base64.urlsafe_b64encode(hashlib.sha256(changed.encode()).digest())
        entry = f"{metadata_name},sha256={digest.decode().rstrip('=')},{len(changed.encode())}"
        for name in names:
            data = source.read(name)
            if name == metadata_name:
                data = changed.encode()
            elif name.endswith(".dist-info/RECORD"):
                record = data.decode().splitlines()
                data = (
                    "\n".join(
                        entry if r.startswith(metadata_name + ",") else r for r in record
                    ).encode()
                    + b"\n"
                )
            target.writestr(name, data)
    return copy


def summary_of(folder: Path) -> dict:
    return json.loads((folder / "summary.json").read_text())


def run_local(bin_dir: Path, here: Path, extra: str = "", name: str = "local") -> dict:
    """`fedstale run --local` of a tiny FedBuff run (and `extra` keys) from `here`; its
    summary."""
    command = [bin_dir / "fedstale", "run", "--local", "--run-config", f"{TINY} run-name={name}"]
    run([*command, "--run-config", extra], 900, here)
    return summary_of(here / "runs" / name)


def run_simulation(bin_dir: Path, here: Path, home: Path) -> dict:
    """`fedstale run` (Flower simulation on the local SuperLink it starts); its summary."""
    command = [bin_dir / "fedstale", "run", "--run-config", f"{TINY} run-name=sim"]
    run(command, 900, here, {"FLWR_HOME": str(home)})
    return summary_of(here / "runs" / "sim")


def run_quickstart(bin_dir: Path, quickstart: Path, here: Path, home: Path) -> dict:
    """The quickstart's ServerApp with fedstale's FedBuff (the library door), by that
    virtualenv's `flwr run` on a simulation SuperLink of that virtualenv; its summary."""
    app = here.parent / quickstart.name
    shutil.copytree(quickstart, app, ignore=shutil.ignore_patterns("__pycache__"))
    flwr_run_in_simulation(bin_dir, app, here, home, 600)
    (folder,) = (here / "runs").iterdir()
    return summary_of(folder)


def flwr_run_in_simulation(bin_dir: Path, app: Path, here: Path, home: Path, timeout: float) -> str:
    """`flwr run` of `app` (3 rounds, 4 nodes) by that virtualenv's Flower, on a simulation
    SuperLink of that virtualenv started in `here` (the ServerApp writes the library's runs/
    in its working directory) and stopped after; the output."""
    from tests.flower_procs import _Deployment

    link = _Deployment(home, 0, simulation=True, bin_dir=bin_dir)
    previous = Path.cwd()
    os.chdir(here)
    try:
        link.start()
    finally:
        os.chdir(previous)
    try:
        command = [bin_dir / "flwr", "run", app, CONNECTION, "--stream"]
        command += ["--run-config", "num-server-rounds=3"]
        command += ["--federation-config", "num-supernodes=4 client-resources-num-cpus=1"]
        return run(command, timeout, here, {"FLWR_HOME": str(link.home)})
    finally:
        link.stop()


def versions(bin_dir: Path) -> dict[str, str]:
    code = (
        "import importlib.metadata as m, json, sys, torch; print(json.dumps({'python': "
        "sys.version.split()[0], 'cuda_build': bool(torch.version.cuda), **{p: m.version(p) "
        "for p in ('torch', 'numpy', 'flwr', 'fedstale')}}))"
    )
    return json.loads(run([bin_dir / "python", "-c", code], 300).strip().splitlines()[-1])


if __name__ == "__main__":
    sys.exit("use `python -m bench.environments`")
