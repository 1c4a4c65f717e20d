"""fedstale installed where its users are (tests/environments.py): a fresh virtualenv on
Python 3.12 with PyPI's torch 2.11.0 (a CUDA build, as on the GPU box) and numpy 2.5.5
installed first, on Python 3.13 with torch 2.15.0, and on Python 3.11 with the oldest torch
fedstale runs on (2.0.1) and numpy 1.26.4, and on Python 3.11 with torch 2.14.1 and
torchvision 0.29.1 (torchvision's models by name). Installing the wheel changes neither torch nor
numpy, and `fedstale run --local`, `fedstale run` in Flower simulation and the quickstart's
library door complete there, from a folder outside the checkout. Each environment is
removed when its test ends (about 5 GB each: the CUDA builds' libraries). The suite runs
the two a GPU user meets (3.12 and 3.13, about 4 minutes each beside the rest); the floor
and torchvision run by `python -m bench.environments`, or here with
FEDSTALE_ENVIRONMENTS=all (docs/testing.md, "Environments")."""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import pytest

from tests.environments import (
    ENVIRONMENTS,
    make,
    run_local,
    run_quickstart,
    run_simulation,
    versions,
)
from tests.wheel_env import build_wheel, elsewhere, run

pytestmark = [pytest.mark.integration, pytest.mark.xdist_group("venvs")]
ROOT = Path(__file__).resolve().parent.parent
QUICKSTART = ROOT / "examples" / "async-quickstart"


@pytest.fixture(scope="module")
def wheel(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_wheel(tmp_path_factory.mktemp("dist"))


@pytest.mark.parametrize("name", list(ENVIRONMENTS))
def test_the_wheel_keeps_the_users_torch_and_numpy_and_runs_every_door(
    name: str, wheel: Path, tmp_path: Path
) -> None:
    environment = ENVIRONMENTS[name]
    if not environment.in_ci and os.environ.get("FEDSTALE_ENVIRONMENTS") != "all":
        pytest.skip(f"{name}: by `python -m bench.environments` (FEDSTALE_ENVIRONMENTS=all here)")
    if environment.interpreter() is None:
        pytest.skip(f"no Python {environment.python} on this machine")
    folder = tmp_path / "venv"
    try:
        made = make(environment, wheel, folder)
        pinned = {pin.split("==")[0]: pin.split("==")[1] for pin in environment.pins}
        assert {p: made.before[p] for p in pinned} == pinned
        assert {p: made.after[p] for p in pinned} == pinned, made.changed()
        found = versions(made.bin_dir)
        assert found["python"].startswith(environment.python + ".")
        here = elsewhere(tmp_path)
        local = run_local(made.bin_dir, here)
        assert local["updates_accepted"] == 8
        simulated = run_simulation(made.bin_dir, here, tmp_path / "home")
        assert simulated["updates_accepted"] == 8
        # the same seed on the virtual clock: the same run in both doors
        assert simulated["final_accuracy"] == local["final_accuracy"]
        door = tmp_path / "door"
        door.mkdir()
        library = run_quickstart(made.bin_dir, QUICKSTART, door, tmp_path / "home-door")
        assert (library["versions"], library["updates_rejected"]) == (3, 0)
        if "torchvision" in pinned:
            check_torchvision_models(made.bin_dir, here)

    finally:
        shutil.rmtree(folder, ignore_errors=True)


def check_torchvision_models(bin_dir: Path, here: Path) -> None:
    """`model=resnet18` trains (digits' grey 8x8 images repeated into three channels); a
    name torchvision lacks is one line, exit 2."""
    resnet = run_local(bin_dir, here, "model=resnet18 local-steps=1 max-updates=4", "resnet")
    assert resnet["updates_accepted"] == 4
    config = "dataset=digits model=resnet81"
    output = run([bin_dir / "fedstale", "check", "--run-config", config], 300, here, code=2)
    assert "model=resnet81: neither fedstale's" in output, output
