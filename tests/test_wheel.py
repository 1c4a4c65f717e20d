"""The wheel: built from the repository and installed into a fresh virtualenv that already
holds the user's torch, it installs one top-level import name and gives a working
`fedstale` command from a directory outside the checkout."""

from __future__ import annotations

import os
import subprocess
import sys
import zipfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def run(command: list[object], timeout: float, cwd: Path | None = None) -> str:
    done = subprocess.run(
        [str(part) for part in command],
        cwd=cwd,
        capture_output=True,
        text=True,
        timeout=timeout,
        env={**os.environ, "FLWR_DISABLE_RUNTIME_DEPENDENCY_INSTALLATION": "1"},
    )
    assert done.returncode == 0, f"{command}: {done.stderr[-2000:]}"
    return done.stdout + done.stderr


def test_the_wheel_installs_one_name_and_works_outside_the_checkout(tmp_path: Path) -> None:
    dist = tmp_path / "dist"
    run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "-w", dist, ROOT], 600)
    (wheel,) = dist.glob("fedstale-*.whl")
    with zipfile.ZipFile(wheel) as archive:
        top = {name.split("/")[0] for name in archive.namelist()}
    assert {t for t in top if not t.endswith(".dist-info")} == {"fedstale"}
    venv = tmp_path / "venv"
    run([sys.executable, "-m", "venv", venv], 120)
    pip = venv / "bin" / "pip"
    run([pip, "install", "-q", "torch==2.13.0"], 900)  # the user's torch, there first
    run([pip, "install", "-q", wheel], 900)
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    fedstale = venv / "bin" / "fedstale"
    assert run([fedstale, "--version"], 120, elsewhere).startswith("fedstale 0.")
    checked = run(
        [
            fedstale,
            "check",
            "--app",
            ROOT,
            "--run-config",
            "dataset=digits num-clients=4 concurrency=2",
        ],
        300,
        elsewhere,
    )
    assert "config ok" in checked and "on digits" in checked
    imported = run(
        [venv / "bin" / "python", "-c", "import fedstale; print(fedstale.__file__)"], 120, elsewhere
    )
    assert str(venv) in imported
