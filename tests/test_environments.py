"""fedstale's wheel beside its users' own torch and numpy (tests/environments.py), for every
environment the README names: Python 3.12 with PyPI's torch 2.11.0 (a CUDA build, as on the
GPU box) and numpy 2.5.5, Python 3.13 with torch 2.15.0, Python 3.11 with the oldest torch
fedstale runs on (2.0.1) and numpy 1.26.4, and Python 3.11 with torch 2.14.1 and
torchvision 0.29.1. pip resolves the user's pins and the wheel together in a dry run (about
a minute each, nothing of torch downloaded but its metadata): the pins come out as they
went in. A wheel whose torch or numpy range is narrowed past them is caught.

Installing each for real (about 5 GB each: the CUDA builds' libraries) and running every
door there is `python -m bench.environments`, before a release and after any change of a
dependency range (docs/testing.md, "Environments"); the suite's own real installs are the
small ones over this machine's CPU torch (tests/test_bounds.py, tests/test_wheel.py)."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.environments import ENVIRONMENTS, narrowed, resolution
from tests.wheel_env import build_wheel

pytestmark = [pytest.mark.integration, pytest.mark.xdist_group("resolve")]
GPU_BOX = ENVIRONMENTS["py312-torch2.11"]


@pytest.fixture(scope="module")
def wheel(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_wheel(tmp_path_factory.mktemp("dist"))


def pins_of(name: str) -> dict[str, str]:
    return {pin.split("==")[0]: pin.split("==")[1] for pin in ENVIRONMENTS[name].pins}


@pytest.mark.parametrize("name", list(ENVIRONMENTS))
def test_installing_the_wheel_keeps_the_users_torch_and_numpy(
    name: str, wheel: Path, tmp_path: Path
) -> None:
    environment = ENVIRONMENTS[name]
    if environment.interpreter() is None:
        pytest.skip(f"no Python {environment.python} on this machine")
    resolved = resolution(environment, wheel, tmp_path / "venv")
    assert {project: resolved[project] for project in pins_of(name)} == pins_of(name)
    assert resolved["fedstale"] == wheel.name.split("-")[1]


@pytest.mark.parametrize("requirement", ["torch>=2.12,<3", "numpy>=2.6,<3"], ids=["torch", "numpy"])
def test_a_wheel_whose_range_would_replace_the_users_torch_or_numpy_is_caught(
    requirement: str, wheel: Path, tmp_path: Path
) -> None:
    """The check above fails, with pip's reason, for a wheel that asks for a torch or numpy
    the GPU box's 2.11.0 and 2.5.5 do not meet (installing it would replace them)."""
    if GPU_BOX.interpreter() is None:
        pytest.skip(f"no Python {GPU_BOX.python} on this machine")
    narrow = narrowed(wheel, requirement, tmp_path / "narrowed")
    with pytest.raises(AssertionError, match=r"ResolutionImpossible|conflict"):
        resolution(GPU_BOX, narrow, tmp_path / "venv")
