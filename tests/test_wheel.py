"""The wheel: built from the repository and installed into a fresh virtualenv that already
holds the user's torch, it installs one top-level import name, ships the app's description
and the deploy scripts, and gives a working `fedstale` command (every subcommand's --help,
check, run --local) from a directory outside the checkout."""

from __future__ import annotations

import json
import zipfile
from pathlib import Path

import pytest

from fedstale.launcher.cli import COMMANDS
from tests.wheel_env import ROOT, elsewhere, installed, run

pytestmark = pytest.mark.xdist_group("venvs")  # one worker builds the virtualenvs

SHIPPED = {
    "pyproject.toml": "fedstale/app/pyproject.toml",
    "docker/certs.sh": "fedstale/app/docker/certs.sh",
    "docker/keys.sh": "fedstale/app/docker/keys.sh",
}
TINY = "dataset=digits num-clients=4 concurrency=2 max-updates=6 max-virtual-time=0"


def test_the_wheel_holds_one_name_the_app_and_the_deploy_scripts() -> None:
    wheel, _ = installed()
    with zipfile.ZipFile(wheel) as archive:
        names = archive.namelist()
        top = {name.split("/")[0] for name in names}
        assert {t for t in top if not t.endswith(".dist-info")} == {"fedstale"}
        for source, packaged in SHIPPED.items():
            assert archive.read(packaged) == (ROOT / source).read_bytes(), packaged


def test_the_installed_command_works_outside_the_checkout(tmp_path: Path) -> None:
    _, bins = installed()
    fedstale, here = bins["newest"] / "fedstale", elsewhere(tmp_path)
    assert run([fedstale, "--version"], 120, here).startswith("fedstale 0.")
    for name in COMMANDS:
        assert f"usage: fedstale {name}" in run([fedstale, name, "--help"], 120, here)
    checked = run([fedstale, "check", "--run-config", TINY], 300, here)
    assert "config ok (fedbuff on digits)" in checked
    too_many_config = TINY.replace("concurrency=2", "concurrency=9")
    too_many = run([fedstale, "check", "--run-config", too_many_config], 120, here, code=2)
    assert too_many.strip().count("\n") == 0 and "exceeds num-clients" in too_many
    assert "fix it with --run-config" in too_many and "pyproject" not in too_many  # a wheel user
    unknown = run([fedstale, "check", "--run-config", "nosuchkey=1"], 120, here, code=2)
    assert unknown.strip().count("\n") == 0 and "unknown key 'nosuchkey'" in unknown
    # a wheel user has no pyproject.toml of theirs: the line names the one installed
    assert "every key and its default: [tool.flwr.app.config] in " in unknown
    assert "fedstale/app/pyproject.toml" in unknown
    refused = run([fedstale, "check", "--app", tmp_path / "none"], 120, here, code=2)
    assert refused.strip().count("\n") == 0 and "no pyproject.toml" in refused
    imported = run(
        [bins["newest"] / "python", "-c", "import fedstale; print(fedstale.__file__)"], 120, here
    )
    assert str(bins["newest"].parent) in imported


@pytest.mark.parametrize("bound", ["newest", "lower"])
def test_the_installed_command_runs_locally_into_this_directory(bound: str, tmp_path: Path) -> None:
    """At both ends of the ranges, with central DP on (Flower's RdpAccountant on the
    dp-accounting the wheel pulls in): 6 updates, 3 noised releases accounted."""
    _, bins = installed()
    here = elsewhere(tmp_path)
    dp = "dp-noise-multiplier=1.0 dp-clipping-norm=1.0 buffer-size=2"
    config = f"{TINY} {dp} run-name=tiny"
    command = [bins[bound] / "fedstale", "run", "--local", "--workers", "1"]
    run([*command, "--run-config", config], 300, here)
    summary = json.loads((here / "runs" / "tiny" / "summary.json").read_text())
    assert summary["updates_accepted"] == 6
    assert summary["privacy"]["releases"] == 3 and summary["privacy"]["epsilon"] > 0
