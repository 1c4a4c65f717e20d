"""Both ends of the dependency ranges in pyproject.toml: the wheel installed with flwr and
numpy at their lower bounds and at the newest versions the ranges allow (tests/wheel_env.py)
runs fedstale on Flower from a directory outside the checkout, as a user runs it: a Flower
simulation (`fedstale run`: `flwr run` of the installed app on the local SuperLink it
starts) and a real deployment (`fedstale deploy`: `flower-superlink`, two
`flower-supernode`s). Each writes its results to ./runs.

Here at the lower bound; at the newest, the same two doors run a rule from another installed
package in that virtualenv, with the same checks (tests/test_rule_package.py), and the
quickstart's ServerApp with it (the library door)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests import timing
from tests.wheel_env import elsewhere, installed, run, simulate_outside_the_checkout

pytestmark = [pytest.mark.integration, pytest.mark.xdist_group("venvs")]
TINY = "strategy=fedbuff dataset=digits buffer-size=2 max-virtual-time=0 eval-interval=500"


def summary(folder: Path) -> dict:
    return json.loads((folder / "summary.json").read_text())


def test_flower_simulation_at_the_lower_bound(tmp_path: Path) -> None:
    bin_dir, here = installed()[1]["lower"], elsewhere(tmp_path)
    config = f"{TINY} num-clients=4 concurrency=2 max-updates=8"
    folder = simulate_outside_the_checkout(bin_dir, "lower", config, "sim", here, tmp_path / "home")
    assert summary(folder)["updates_accepted"] == 8


def test_real_deployment_at_the_lower_bound(tmp_path: Path) -> None:
    bin_dir, here = installed()[1]["lower"], elsewhere(tmp_path)
    config = f"{TINY} max-updates=4 run-name=deployed"
    command = [bin_dir / "fedstale", "deploy", "--nodes", "2", "--timeout", timing.deploy_timeout()]
    # TMPDIR: the deployment's home (a temporary folder, as a user gets it) inside tmp_path
    run([*command, "--run-config", config], timing.left(), here, {"TMPDIR": str(tmp_path)})
    assert summary(here / "runs" / "deployed")["updates_accepted"] == 4
    assert not list(tmp_path.glob("fedstale-deploy-*"))  # its home went with the run
