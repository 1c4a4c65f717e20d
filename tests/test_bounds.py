"""Both ends of the dependency ranges in pyproject.toml: the wheel installed with flwr and
numpy at their lower bounds and at the newest versions the ranges allow (tests/wheel_env.py)
runs fedstale on Flower from a directory outside the checkout, as a user runs it: a Flower
simulation (`fedstale run`: `flwr run` of the installed app on the local SuperLink it
starts) and a real deployment (`fedstale deploy`: `flower-superlink`, two
`flower-supernode`s). Each writes its results to ./runs."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from fedstale.launcher.ports import free_port
from tests.wheel_env import EXPECTED, elsewhere, installed, run, versions

pytestmark = [pytest.mark.integration, pytest.mark.xdist_group("deployments")]
BOUNDS = sorted(EXPECTED)
TINY = "strategy=fedbuff dataset=digits buffer-size=2 max-virtual-time=0 eval-interval=500"


def summary(folder: Path) -> dict:
    return json.loads((folder / "summary.json").read_text())


@pytest.mark.parametrize("bound", BOUNDS)
def test_flower_simulation_at_the_bound(bound: str, tmp_path: Path) -> None:
    bin_dir, here = installed()[1][bound], elsewhere(tmp_path)
    found = versions(bin_dir)
    for package, version in EXPECTED[bound].items():
        assert found[package].startswith(version), (package, found)
    home = tmp_path / "flwr-home"
    ports = {
        "FLWR_HOME": str(home),
        "FLWR_LOCAL_SUPERLINK_HTTP_API_PORT": str(free_port()),
        "FLWR_LOCAL_CONTROL_API_PORT": str(free_port()),
    }
    config = f"{TINY} num-clients=4 concurrency=2 max-updates=8 run-name=sim"
    run([bin_dir / "fedstale", "run", "--run-config", config], 1200, here, ports)
    assert summary(here / "runs" / "sim")["updates_accepted"] == 8
    recorded = json.loads((here / "runs" / "sim" / "config.json").read_text())["provenance"]
    assert {k: recorded[k] for k in ("flwr", "numpy")} == {k: found[k] for k in ("flwr", "numpy")}
    # The app bundle held the app's description only: the SuperLink ran the installed code.
    bundled = [p.name for p in (home / "apps").rglob("*") if p.is_file()]
    assert bundled == ["pyproject.toml"]


@pytest.mark.parametrize("bound", BOUNDS)
def test_real_deployment_at_the_bound(bound: str, tmp_path: Path) -> None:
    bin_dir, here = installed()[1][bound], elsewhere(tmp_path)
    config = f"{TINY} max-updates=4 run-name=deployed"
    command = [bin_dir / "fedstale", "deploy", "--nodes", "2", "--timeout", "1200"]
    run([*command, "--run-config", config], 1300, here)
    assert summary(here / "runs" / "deployed")["updates_accepted"] == 4
