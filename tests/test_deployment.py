"""A real local deployment: `flower-superlink` and `flower-supernode` processes on
127.0.0.1 (fedstale/launcher/deploy.py), wall clock, every process stopped by PID."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from fedstale.launcher.deploy import LocalDeployment, TlsFiles, make_keys, stop
from fedstale.launcher.ports import free_port
from fedstale.server_app.results import read_jsonl
from tests import timing

# One worker runs the tests that start real SuperNodes (xdist_group), one after another.
pytestmark = [pytest.mark.integration, pytest.mark.xdist_group("deployments")]
ROOT = Path(__file__).resolve().parent.parent
# Runs end on their update or version budgets; the wall-clock cap (the deployment default
# is 300 s) and each test's bound from its measured time (tests/timing.py) only stop a run
# that hangs, so a busy machine, on which every ClientApp process starts slower, makes a
# test slower, never failing.
SMALL = {
    "dataset": "digits",
    "lr": 0.1,
    "buffer-size": 2,
    "eval-interval": 15.0,
    "max-virtual-time": 1200.0,
}


@pytest.fixture
def deployment(tmp_path: Path) -> Iterator[LocalDeployment]:
    dep = LocalDeployment(tmp_path / "home", 3)
    try:
        yield dep.start()
    finally:
        dep.stop()


def wait_until(
    condition: Callable[[], bool],
    timeout: float,
    what: str,
    run: subprocess.Popen | None = None,
    log: Path | None = None,
) -> None:
    """Wait for `condition`; fail at once, with its log, when the `run` it needs has ended."""
    deadline = time.monotonic() + timeout
    while not condition():
        if run is not None and run.poll() is not None:
            said = log.read_text()[-3000:] if log is not None and log.exists() else ""
            raise AssertionError(f"the run ended (code {run.returncode}) before {what}: {said}")
        if time.monotonic() > deadline:
            raise TimeoutError(f"waited {timeout:g} s for {what}")
        time.sleep(0.5)


def rows(path: Path) -> list[dict]:
    """The rows so far; none before the run has made the file."""
    return read_jsonl(path) if path.exists() else []


def run_deployed(
    tmp_path: Path, name: str, config: dict, delays: list[float]
) -> tuple[dict, list[dict], list[dict]]:
    """One SuperNode per delay, `config` run on them as run `name`, every process stopped;
    the run's summary, updates.jsonl and metrics.jsonl rows."""
    runs = tmp_path / "runs"
    config = {**config, "runs-dir": str(runs), "run-name": name}
    with LocalDeployment(tmp_path / "home", len(delays), delays=delays) as deployment:
        result = deployment.run_app(ROOT, config, timing.left())
    assert result.returncode == 0, result.stderr[-3000:]
    summary = json.loads((runs / name / "summary.json").read_text())
    return summary, rows(runs / name / "updates.jsonl"), rows(runs / name / "metrics.jsonl")


def finish(process: subprocess.Popen) -> int:
    try:
        return process.wait(timing.left())
    finally:
        stop(process)


def restarted_nodes_serve(log: Path, clients: tuple[int, ...]) -> bool:
    """Whether a second node (the first was the client's old one) serves each client."""
    text = log.read_text()
    return all(len(re.findall(rf"node \d+ serves client {c}\b", text)) >= 2 for c in clients)


def test_run_survives_killed_nodes_and_restarted_ones_get_work(
    deployment: LocalDeployment, tmp_path: Path
) -> None:
    runs, log = tmp_path / "runs", tmp_path / "run.log"
    config = {**SMALL, "max-updates": 30, "runs-dir": str(runs), "run-name": "faults"}
    process = deployment.launch_app(ROOT, config, log)
    updates = runs / "faults" / "updates.jsonl"
    try:
        first = lambda: len(rows(updates)) >= 2  # noqa: E731
        wait_until(first, timing.left(), "the first aggregation", process, log)
        deployment.kill_node(1, signal.SIGTERM)
        deployment.kill_node(2, signal.SIGKILL)
        time.sleep(2)
        deployment.start_node(1)
        deployment.start_node(2)
        wait_until(lambda: restarted_nodes_serve(log, (1, 2)), timing.left(), "the restarted nodes")
        before = {c: sum(r["client"] == c for r in rows(updates)) for c in (1, 2)}
        assert finish(process) == 0, log.read_text()[-3000:]
    finally:
        stop(process)
    output = log.read_text()
    summary = json.loads((runs / "faults" / "summary.json").read_text())
    lost = {
        int(task): int(client)
        for task, client in re.findall(r"task (\d+) lost: node \d+ \(client (\d+)\)", output)
    }
    for client in (1, 2):  # its task in flight was lost, or it was idle and a send refused
        refused = re.search(rf"\(client {client}\) left: the SuperLink refused", output)
        assert client in lost.values() or refused, (client, output[-3000:])
    handled = rows(updates)
    tasks = [row["task"] for row in handled]
    assert len(tasks) == len(set(tasks))  # no update counted twice
    assert not set(lost) & set(tasks)  # no lost task counted
    assert 0 <= summary["updates_accepted"] - len(handled) < 2  # the rest sit in the buffer
    for client in (1, 2):
        # The restarted node trained and replied (its own log since the restart), and the
        # client's updates went on. Not "two more updates": a SIGKILLed node's task stays
        # in flight until the SuperLink misses its heartbeats (about a minute), and on a
        # busy machine the run may reach its budget first.
        since_restart = restarted_log(deployment, client)
        assert "Receiving: train message" in since_restart, client
        assert "Sending: train message" in since_restart, client
        assert sum(r["client"] == client for r in handled) > before[client], client
    assert summary["stop_reason"] == "update budget 30"


def restarted_log(deployment: LocalDeployment, partition: int) -> str:
    """What SuperNode `partition` logged since its last start."""
    log = deployment.home / f"supernode-{partition}.log"
    with log.open("rb") as handle:
        handle.seek(deployment.node_log_starts[partition])
        return handle.read().decode(errors="replace")


BAD_INPUT = {
    3: ("nan", "NaN or Inf"),
    4: ("inf", "NaN or Inf"),
    5: ("shape", "shape"),
    6: ("dtype", "dtype float64"),
    7: ("no-metric", "'num-examples' missing"),
    8: ("mistyped-metric", "'num-examples' is float"),
    9: ("bad-metric", "'num-examples' = -5"),
    10: ("sketch-length", "should be 16 floats, got 15"),
    11: ("unknown-task", "unknown task 1000000000"),
    12: ("replay", "task 11"),
    13: ("oversized", "unexpected ['padding']"),
}


def test_bad_input_over_the_network_is_rejected_and_the_run_goes_on(
    deployment: LocalDeployment, tmp_path: Path
) -> None:
    faults = ",".join(f"{kind}@{task}" for task, (kind, _) in BAD_INPUT.items())
    config = {
        **SMALL,
        "strategy": "fedpsa",
        "fedpsa-calib-source": "real",  # sent once: later tasks' fresh processes read the cache
        "max-versions": 5,
        "test-faults": faults,
        "runs-dir": str(tmp_path / "runs"),
        "run-name": "bad",
    }
    result = deployment.run_app(ROOT, config, timing.left())
    assert result.returncode == 0, result.stderr[-3000:]
    output = result.stdout + result.stderr
    rejected = [line for line in output.splitlines() if "rejected update" in line]
    for task, (kind, reason) in BAD_INPUT.items():
        hits = [line for line in rejected if f"task {task} " in line and reason in line]
        assert len(hits) == 1, (kind, reason, rejected)
        assert re.search(r"node \d+, task", hits[0])
    summary = json.loads((tmp_path / "runs" / "bad" / "summary.json").read_text())
    assert summary["updates_rejected"] == len(BAD_INPUT)
    assert summary["tasks_lost"] == 0  # no client lacked the real calibration batch
    assert summary["versions"] == 5
    handled = {row["task"] for row in rows(tmp_path / "runs" / "bad" / "updates.jsonl")}
    assert handled.isdisjoint(BAD_INPUT)


def test_serverapp_killed_mid_run_resumes_from_its_checkpoint(
    deployment: LocalDeployment, tmp_path: Path
) -> None:
    runs = tmp_path / "runs"
    config = {**SMALL, "max-versions": 8, "checkpoint-every": 2, "runs-dir": str(runs)}
    log = tmp_path / "first.log"
    first = deployment.launch_app(ROOT, {**config, "run-name": "crash"}, log)
    checkpoint = runs / "crash" / "checkpoint.pkl"
    try:
        wait_until(checkpoint.exists, timing.left(), "the first checkpoint")
        pids = deployment.serverapp_pids()
        assert pids, "no flwr-serverapp process found"
        for pid in pids:
            os.kill(pid, signal.SIGKILL)
        # fedstale run notices the silent heartbeat, says so and prints the resume command.
        assert first.wait(90) == 1
    finally:
        stop(first, grace=5)
    assert not (runs / "crash" / "summary.json").exists()
    said = log.read_text()
    assert "fedstale: the ServerApp died" in said, said[-2000:]
    assert f'resume-from="{runs / "crash"}"' in said, said[-2000:]

    resumed = {**config, "run-name": "crash", "resume-from": str(runs / "crash")}
    result = deployment.run_app(ROOT, resumed, timing.left())
    assert result.returncode == 0, result.stderr[-3000:]
    assert "resumed from" in result.stdout + result.stderr
    summary = json.loads((runs / "crash" / "summary.json").read_text())
    assert summary["versions"] == 8
    versions = [row["version"] for row in rows(runs / "crash" / "metrics.jsonl")]
    assert versions == sorted(versions) and versions[0] == 0


def intruder(deployment: LocalDeployment, partition: int, insecure: bool) -> subprocess.Popen:
    command = [
        *deployment.node_command(partition, free_port(), insecure=insecure),
        "--max-retries",
        "1",
    ]
    return subprocess.Popen(
        command,
        env=deployment.env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,
    )


def test_tls_and_node_auth_run_completes_and_intruders_are_refused(tmp_path: Path) -> None:
    """Also the one host deployment on Flower's own SuperExec (a fresh flwr-clientapp per
    message, `--clientapp-exec flower`); every other test here forks its tasks warm."""
    tls = TlsFiles.make(tmp_path / "certs")
    keys = tmp_path / "keys"
    deployment = LocalDeployment(
        tmp_path / "home", 2, tls=tls, auth_keys=keys, clientapp_exec="flower"
    )
    intruders: list[subprocess.Popen] = []
    try:
        deployment.start()
        make_keys(tmp_path / "spare", 1)  # a well-formed key the SuperLink never registered
        for suffix in ("", ".pub"):
            (tmp_path / "spare" / f"supernode-0{suffix}").rename(keys / f"supernode-5{suffix}")
        intruders = [intruder(deployment, 5, insecure=True), intruder(deployment, 5, False)]
        config = {**SMALL, "max-versions": 2, "runs-dir": str(tmp_path / "runs"), "run-name": "t"}
        result = deployment.run_app(ROOT, config, timing.left())
        assert result.returncode == 0, result.stderr[-3000:]
        assert "all 2 clients connected" in result.stdout + result.stderr
        insecure, unregistered = intruders
        output = insecure.communicate(timeout=90)[0]
        assert insecure.returncode != 0 and "SuperNode ID" not in output, output[-2000:]
        stop(unregistered)  # it keeps asking to be let in; it never was
        output = unregistered.communicate(timeout=30)[0]
        assert "SuperNode ID" not in output, output[-2000:]
    finally:
        for process in intruders:
            stop(process)
        deployment.stop()


def test_supersede_and_per_client_evaluation_over_real_supernodes(tmp_path: Path) -> None:
    """FedAsync with bounded staleness supersedes the slow node's task while that node is
    still training it: its reply is dropped and the replacement waits behind it on the
    node. Per-client evaluation goes out as Flower evaluate messages."""
    config = {
        **SMALL,
        "strategy": "fedasync",
        "fedasync-max-staleness": 2,
        "eval-target": "per-client",
        "eval-interval": 20.0,
        "max-versions": 10,
    }
    summary, updates, metrics = run_deployed(tmp_path, "sup", config, [0.0, 0.0, 8.0])
    assert summary["tasks_superseded"] >= 1 and summary["tasks_lost"] == 0
    assert summary["updates_rejected"] == 0 and summary["versions"] == 10
    assert summary["evaluation"] == "per-client"
    assert metrics and all(row["clients"] == 3 for row in metrics)  # every node answered
    assert metrics[-1]["accuracy"] > 0.3
    handled = [row["task"] for row in updates]
    assert len(handled) == len(set(handled)) == summary["updates_accepted"]


def test_pace_multicast_and_personal_evaluation_over_real_supernodes(tmp_path: Path) -> None:
    """PACE on real SuperNodes: a multicast supersedes the task the slow node is training
    (its reply is dropped, its new task waits behind it) and every client's personalised
    model is scored on that node's own split through Flower evaluate messages."""
    config = {
        **SMALL,
        "strategy": "pace",
        "test-split": "local",
        "client-val-fraction": 0.25,
        "pace-omega": 8.0,  # one task three arrivals behind (9 > 8) is multicast
        "pace-multicast-max": 1,
        "eval-interval": 20.0,
        "max-updates": 10,
    }
    summary, updates, metrics = run_deployed(tmp_path, "pace", config, [0.0, 0.0, 10.0])
    assert summary["evaluation"] == "per-client"
    assert summary["tasks_superseded"] >= 1 and summary["tasks_lost"] == 0
    assert summary["updates_accepted"] == 10 and summary["updates_rejected"] == 0
    assert sum(row["multicast"] for row in updates) == summary["tasks_superseded"]
    assert metrics and all(row["clients"] == 3 for row in metrics)
    assert metrics[-1]["accuracy"] > 0.3


def test_fedqs_over_real_supernodes(tmp_path: Path) -> None:
    """FedQS-SGD on real SuperNodes of different speeds: every client trains all the time,
    the server aggregates every K = 2 arrivals, classifies clients at dispatch once speeds
    and angles exist, and the flag each task carried comes back with its update."""
    config = {**SMALL, "strategy": "fedqs-sgd", "grad-clip": 20.0, "max-updates": 16}
    summary, updates, _ = run_deployed(tmp_path, "fedqs", config, [0.0, 1.0, 4.0])
    assert summary["updates_accepted"] == 16 and summary["updates_rejected"] == 0
    assert summary["versions"] == 8  # K = 2
    assert {"type", "theta", "lr", "momentum", "flag", "weight"} <= set(updates[0])
    kinds = [row["type"] for row in updates]
    assert kinds[:2] == ["", ""] and any(kinds)  # classified once speeds and angles exist
    assert all(row["flag"] == 1 for row in updates if row["type"] == "FBC")
    assert all(row["flag"] == 0 for row in updates if row["type"] in ("FUC", "SUC", ""))
    assert summary["final_accuracy"] > 0.2


def test_mafsa_edges_over_real_supernodes_with_a_node_killed(tmp_path: Path) -> None:
    """MAFSA on 2 edges x 3 SuperNodes that name their edge (`fedstale deploy --edges 2`):
    one node is killed mid-run; its edge stops waiting for it, counts it as dropped, and both
    edges go on uploading to the cloud."""
    runs, log = tmp_path / "runs", tmp_path / "run.log"
    config = {
        "dataset": "digits",
        "strategy": "mafsa",
        "local-steps": 5,
        "batch-size": 10,
        "lr": 0.05,
        # Flower finds a SIGKILLed node dead by its heartbeat only about a minute after the
        # kill; the task-timeout retires its task sooner, so its edge goes on within 30 s
        # (and again for a task sent to it before Flower calls it dead).
        "task-timeout": 30.0,
        "max-versions": 20,  # cloud updates: past edge 1's 30 s wait for its killed node
        "max-virtual-time": 1200.0,
        "eval-interval": 30.0,
        "runs-dir": str(runs),
        "run-name": "mafsa",
    }
    home = tmp_path / "home"
    with LocalDeployment(home, 6, delays=[0.3], edges=2) as deployment:
        process = deployment.launch_app(ROOT, config, log)
        updates = runs / "mafsa" / "updates.jsonl"
        try:
            enough = lambda: len(rows(updates)) >= 12  # noqa: E731
            wait_until(enough, timing.left(), "two rounds of each edge", process, log)
            deployment.kill_node(4, signal.SIGKILL)
            killed_at = max(row["time"] for row in rows(updates))
            assert finish(process) == 0, log.read_text()[-3000:]
        finally:
            stop(process)
    assert "edge-id=1" in " ".join(deployment.node_command(4, deployment.node_ports[4]))
    summary = json.loads((runs / "mafsa" / "summary.json").read_text())
    handled = rows(updates)
    assert {row["client"]: row["edge"] for row in handled} == {0: 0, 1: 0, 2: 0, 3: 1, 4: 1, 5: 1}
    later = [row for row in handled if row["time"] > killed_at + 1.0]
    assert later and 4 not in {row["client"] for row in later}, log.read_text()[-3000:]
    assert {row["edge"] for row in later} == {0, 1}  # both edges went on without waiting
    assert summary["cloud_updates"] == summary["versions"] >= 6
    assert min(summary["edge_rounds"]) >= 3 and summary["stop_reason"] == "version budget 20"


def test_secure_aggregation_over_real_supernodes_with_a_holder_killed(tmp_path: Path) -> None:
    """FedBuff with secure aggregation on 5 real SuperNodes (N = 5 holders, U = 3, T = 2:
    U + T reaches N): one node is killed mid-run; every buffer is still unmasked and checked
    by the 4 holders left (U + f, f = 1), the run reaches its budget, nothing rejected or
    dropped."""
    runs, log = tmp_path / "runs", tmp_path / "run.log"
    config = {
        **SMALL,
        "secure-aggregation": True,
        "secagg-recovery": 3,
        "secagg-privacy": 2,
        "secagg-timeout": 20.0,
        "max-updates": 16,
        "runs-dir": str(runs),
        "run-name": "secure",
    }
    with LocalDeployment(tmp_path / "home", 5) as deployment:
        process = deployment.launch_app(ROOT, config, log)
        updates = runs / "secure" / "updates.jsonl"
        try:
            first = lambda: len(rows(updates)) >= 2  # noqa: E731
            wait_until(first, timing.left(), "the first unmasked buffer", process, log)
            deployment.kill_node(3, signal.SIGKILL)
            assert finish(process) == 0, log.read_text()[-3000:]
        finally:
            stop(process)
    summary = json.loads((runs / "secure" / "summary.json").read_text())
    secure = summary["secure_aggregation"]
    assert (secure["holders"], secure["recovery_threshold"], secure["privacy_threshold"]) == (
        5,
        3,
        2,
    )
    assert secure["buffers"] == summary["versions"] >= 6 and secure["buffers_dropped"] == 0
    assert summary["updates_rejected"] == 0 and summary["stop_reason"] == "update budget 16"
