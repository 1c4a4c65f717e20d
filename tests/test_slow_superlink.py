"""A SuperLink paused (SIGSTOP, then SIGCONT past the pull wait) while a ServerApp's pull is
taking replies, several times in one run, on a real deployment at both ends of the flwr
range (tests/superlink_pauses.py): every training the nodes finished is accepted, none is
lost to the error reply an overlapping pull of the same id gets (or, from Flower 1.43 on, to
the reply Flower's grid drops for that pull), none counts twice."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from fedstale.launcher.deploy import LocalDeployment, stop
from fedstale.server_app.results import read_jsonl
from tests import timing
from tests.superlink_pauses import SuperLinkPauser
from tests.test_deployment import ROOT, SMALL, wait_until
from tests.wheel_env import installed

pytestmark = [pytest.mark.integration, pytest.mark.xdist_group("venvs")]
# (the wheel group: its lower-bound case uses the wheel's virtualenv)
PAUSES = 3
UPDATES = 12


def bin_dir(bound: str) -> Path | None:
    """This environment's Flower (the newest the range allows), or the lower bound's venv."""
    return None if bound == "newest" else installed()[1][bound]


def paused_run(
    tmp_path: Path, name: str, settings: dict, bound: str = "newest"
) -> tuple[str, dict, Path]:
    """`settings` run as `name` on 3 SuperNodes, the SuperLink paused PAUSES times once
    updates flow; the run's log, summary.json and updates.jsonl."""
    runs, log = tmp_path / "runs", tmp_path / "run.log"
    updates = runs / name / "updates.jsonl"
    config = {**SMALL, **settings, "max-updates": UPDATES, "runs-dir": str(runs), "run-name": name}
    deployment = LocalDeployment(tmp_path / "home", 3, bin_dir=bin_dir(bound))
    pauser = SuperLinkPauser(deployment, PAUSES, gap=1.5)
    with deployment:
        process = deployment.launch_app(ROOT, config, log)
        try:
            wait_until(
                lambda: updates.exists() and updates.stat().st_size > 0, timing.left(), "updates"
            )
            pauser.arm()
            code = process.wait(timing.left())
        finally:
            pauser.close()
            stop(process)
    output = log.read_text()
    assert code == 0, output[-3000:]
    assert pauser.done == PAUSES, output[-3000:]
    return output, json.loads((runs / name / "summary.json").read_text()), updates


@pytest.mark.parametrize("bound", ["newest", "lower"])
def test_a_superlink_paused_while_replies_are_pulled_loses_no_finished_training(
    bound: str, tmp_path: Path
) -> None:
    output, summary, updates = paused_run(tmp_path, "paused", {}, bound)
    overlaps = re.findall(r"an overlapping pull's error reply to \w+ dropped", output)
    # The race happened: up to Flower 1.42 the overlapping pull gets an error reply, which
    # fedstale drops; from 1.43 on Flower's grid drops that reply itself and logs it.
    dropped_by_flower = re.findall(r"Message \w+ objects unavailable", output)
    assert overlaps or dropped_by_flower, output[-3000:]
    assert len(overlaps) == len(set(overlaps)), overlaps  # said once per id
    assert summary["tasks_lost"] == 0 and summary["updates_rejected"] == 0, summary
    assert summary["late_refused"] == {} and "task" not in re.findall(r"(task) \d+ lost", output)
    tasks = [row["task"] for row in read_jsonl(updates)]
    assert len(tasks) == len(set(tasks))  # none counted twice
    assert 0 <= summary["updates_accepted"] - len(tasks) < 2  # the rest sit in the buffer
    # Every task sent was accepted, except those still training when the budget was spent.
    unfinished = summary["tasks_dispatched"] - summary["updates_accepted"]
    assert 0 <= unfinished <= 3, summary


def test_a_paused_superlink_loses_no_secure_buffer(tmp_path: Path) -> None:
    """The same pauses with secure aggregation on: the key round, the masked updates and
    the holders' answers all pass through the paused SuperLink; no task is lost, no update
    rejected, no buffer dropped."""
    _, summary, updates = paused_run(tmp_path, "secure", {"secure-aggregation": True})
    assert summary["tasks_lost"] == 0 and summary["updates_rejected"] == 0, summary
    secure = summary["secure_aggregation"]
    assert secure["buffers_dropped"] == 0 and secure["buffers"] == summary["versions"] > 0
    tasks = [row["task"] for row in read_jsonl(updates)]
    assert len(tasks) == len(set(tasks))
