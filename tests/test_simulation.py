"""End to end: `flwr run` in Flower simulation (Ray backend) on a real SuperLink."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest

from fedstale.launcher.deploy import spawn, stop_tree
from fedstale.launcher.launch import flower_env, parse_pairs, tool
from fedstale.launcher.local import local_transport
from fedstale.launcher.local_link import PORT_ENV, await_healthy
from fedstale.launcher.ports import start_listening
from fedstale.server_app.experiment import run_experiment
from fedstale.server_app.results import read_jsonl
from fedstale.strategies.registry import load_config
from tests import timing
from tests.flower_procs import (
    CONNECTION,
    ONE_CLIENTAPP,
    SimulationSuperLink,
    flower_processes_of_this_session,
)
from tests.goldens import differences, golden_values, without_wall_time
from tests.helpers import UNKNOWN_STRATEGY

pytestmark = pytest.mark.integration
ROOT = Path(__file__).resolve().parent.parent
TINY = "dataset=digits num-clients=10 concurrency=3 lr=0.1 max-virtual-time=3000 eval-interval=250"


def fedstale_run(
    link: SimulationSuperLink, runs: Path, name: str, config: str
) -> tuple[subprocess.CompletedProcess, Path]:
    return link.run_app(ROOT, runs, name, config, timing.left())


def test_tiny_run_beats_chance_and_replays_identically(
    superlink: SimulationSuperLink, tmp_path: Path
) -> None:
    first, first_dir = fedstale_run(superlink, tmp_path, "a", TINY + " seed=5")
    assert first.returncode == 0, first.stderr[-3000:]
    # The replay assigns partitions to nodes (no query message) and is the same run.
    assigned = TINY + " seed=5 node-partitions=assign"
    second, second_dir = fedstale_run(superlink, tmp_path, "b", assigned)
    assert second.returncode == 0, second.stderr[-3000:]

    summary = json.loads((first_dir / "summary.json").read_text())
    assert summary["final_accuracy"] > 0.3  # ten classes: chance is 0.1
    assert summary["updates_accepted"] > 20
    for name in ("config.json", "model.pt", "accuracy.png", "updates.jsonl"):
        assert (first_dir / name).stat().st_size > 0

    def without_wall(rows: list[dict]) -> list[dict]:
        return [{k: v for k, v in row.items() if k != "wall_time"} for row in rows]

    metrics_a = without_wall(read_jsonl(first_dir / "metrics.jsonl"))
    assert metrics_a == without_wall(read_jsonl(second_dir / "metrics.jsonl"))
    assert len(metrics_a) == 13  # t = 0, 250, ..., 3000
    assert read_jsonl(first_dir / "updates.jsonl") == read_jsonl(second_dir / "updates.jsonl")
    said, replayed = first.stdout + first.stderr, second.stdout + second.stderr
    assert "serves client" in said and "serves client" not in replayed
    assert "default simulated SuperNodes changed" not in said  # fedstale sized it
    assert "10 nodes assigned clients 0..9 in node-id order" in replayed

    # The same engine and client code in one process, without Flower: the same run.
    values = {**parse_pairs(TINY + " seed=5"), "run-name": "c", "runs-dir": str(tmp_path)}
    run, params = load_config(values)
    run_experiment(run, params, local_transport(run))
    assert without_wall(read_jsonl(tmp_path / "c" / "metrics.jsonl")) == metrics_a
    assert read_jsonl(tmp_path / "c" / "updates.jsonl") == read_jsonl(first_dir / "updates.jsonl")

    # `fedstale run --local` on two worker processes: the same run again.
    pooled = fedstale_local(tmp_path, "d", TINY + " seed=5", workers=2)
    assert without_wall(read_jsonl(pooled / "metrics.jsonl")) == metrics_a
    assert read_jsonl(pooled / "updates.jsonl") == read_jsonl(first_dir / "updates.jsonl")


def fedstale_local(runs: Path, name: str, config: str, workers: int) -> Path:
    """`fedstale run --local --workers N` as a user runs it; its run folder."""
    command = [tool("fedstale"), "run", "--local", "--workers", str(workers), "--app", str(ROOT)]
    command += ["--run-config", f"{config} run-name={name} runs-dir={runs}"]
    result = subprocess.run(
        command, capture_output=True, text=True, timeout=timing.left(), check=False
    )
    assert result.returncode == 0, result.stderr[-3000:]
    assert f"locally on {workers} worker(s)" in result.stderr
    return runs / name


def test_corrupt_replies_are_rejected_and_the_run_finishes(
    superlink: SimulationSuperLink, tmp_path: Path
) -> None:
    faults = "nan@3,shape@5,unknown-task@7,dtype@9,no-metric@11,replay@13,inf@15"
    result, run_dir = fedstale_run(superlink, tmp_path, "faults", f"{TINY} test-faults={faults}")
    assert result.returncode == 0, result.stderr[-3000:]
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["updates_rejected"] == 7
    rejected = [line for line in result.stdout.splitlines() if "rejected update" in line]
    assert len(rejected) == 7
    for task, reason in [
        (3, "NaN or Inf"),
        (5, "shape"),
        (7, "unknown task 1000000000"),
        (9, "dtype float64"),
        (11, "'num-examples' missing"),
        (13, "answered task 12"),
    ]:
        assert any(f"task {task} " in line and reason in line for line in rejected), (
            task,
            rejected,
        )
    handled = {row["task"] for row in read_jsonl(run_dir / "updates.jsonl")}
    assert handled.isdisjoint({3, 5, 7, 9, 11, 13, 15})
    assert summary["final_accuracy"] > 0.3


def test_flwr_run_with_a_bad_value_logs_one_line(superlink: SimulationSuperLink) -> None:
    result = subprocess.run(
        [tool("flwr"), "run", str(ROOT), CONNECTION, "--stream", "--run-config", "strategy='nope'"],
        env=superlink.env,
        capture_output=True,
        text=True,
        timeout=timing.left(),
        check=False,
    )
    errors = [line for line in result.stdout.splitlines() if line.startswith("fedstale ERROR")]
    assert errors == [f"fedstale ERROR: {UNKNOWN_STRATEGY}"]
    assert "Traceback" not in result.stdout


@pytest.mark.parametrize("strategy", ["fedasync", "fedbuff"])
def test_demo_budget_reaches_078_on_fashion_mnist(
    strategy: str, superlink: SimulationSuperLink, tmp_path: Path
) -> None:
    result, run_dir = fedstale_run(superlink, tmp_path, strategy, f"strategy={strategy}")
    assert result.returncode == 0, result.stderr[-3000:]
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["final_accuracy"] >= 0.78, summary


def test_fedpsa_signals_travel_over_flower(superlink: SimulationSuperLink, tmp_path: Path) -> None:
    """Sketches and update norms go through real MetricRecords; kappa and Temp are logged."""
    result, run_dir = fedstale_run(
        superlink, tmp_path, "psa", f"{TINY} strategy=fedpsa fedpsa-queue=10"
    )
    assert result.returncode == 0, result.stderr[-3000:]
    rows = read_jsonl(run_dir / "updates.jsonl")
    assert rows and all({"kappa", "temp", "weight"} <= set(row) for row in rows)
    assert any(row["temp"] != 5.5 for row in rows)  # the thermometer filled and moved
    assert all(-1.0 <= row["kappa"] <= 1.0 for row in rows)
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["updates_rejected"] == 0 and summary["final_accuracy"] > 0.3


def in_process(config: str, tmp_path: Path, name: str) -> Path:
    values = {**parse_pairs(config), "run-name": name, "runs-dir": str(tmp_path)}
    run, params = load_config(values)
    run_experiment(run, params, local_transport(run))
    return tmp_path / name


def without_wall(rows: list[dict]) -> list[dict]:
    return [{k: v for k, v in row.items() if k != "wall_time"} for row in rows]


def test_superseded_tasks_over_flower_match_the_in_process_run(
    superlink: SimulationSuperLink, tmp_path: Path
) -> None:
    """FedAsync with bounded staleness supersedes tasks that Flower is still running: their
    replies are discarded, counted, and the run is the one the in-process engine gives."""
    config = f"{TINY} strategy=fedasync fedasync-max-staleness=2 seed=5"
    result, run_dir = fedstale_run(superlink, tmp_path, "sup", config)
    assert result.returncode == 0, result.stderr[-3000:]
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["tasks_superseded"] > 0 and summary["tasks_lost"] == 0
    ended = summary["updates_accepted"] + summary["updates_rejected"] + summary["tasks_superseded"]
    assert 0 <= summary["tasks_dispatched"] - ended <= 3  # the rest were in flight at the end
    for local in (
        in_process(config, tmp_path, "sup-local"),
        fedstale_local(tmp_path, "sup-pooled", config, workers=2),
    ):
        assert read_jsonl(local / "updates.jsonl") == read_jsonl(run_dir / "updates.jsonl")
        assert without_wall(read_jsonl(local / "metrics.jsonl")) == without_wall(
            read_jsonl(run_dir / "metrics.jsonl")
        )


def test_per_client_evaluation_in_flower_simulation(
    superlink: SimulationSuperLink, tmp_path: Path
) -> None:
    config = f"{TINY} strategy=fedbuff eval-target=per-client seed=5"
    result, run_dir = fedstale_run(superlink, tmp_path, "pc", config)
    assert result.returncode == 0, result.stderr[-3000:]
    rows = read_jsonl(run_dir / "metrics.jsonl")
    assert len(rows) == 13 and all(row["clients"] == 10 for row in rows)
    assert all(0 <= row["accuracy_std"] <= 0.5 for row in rows)
    assert rows[-1]["accuracy"] > 0.5
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["evaluation"] == "per-client"
    local = in_process(config, tmp_path, "pc-local")
    assert without_wall(read_jsonl(local / "metrics.jsonl")) == without_wall(rows)


def flower_processes() -> set[tuple[int, str]]:
    """(pid, command line) of every live Flower process this test process started (zombies
    aside): a suite running beside it, or another worker, has its own."""
    return set(flower_processes_of_this_session())


def local_connection_env(tmp_path: Path) -> dict[str, str]:
    """Flower's default `local` connection with a FLWR_HOME of its own. No port is fixed:
    `fedstale run` then starts its SuperLink on a port it holds until the SuperLink listens
    (fedstale/launcher/ports.py), so no other process can take it in between."""
    env = flower_env(FLWR_HOME=str(tmp_path / "flwr-home"))
    env.pop(PORT_ENV, None)
    return env


def test_fedstale_run_leaves_no_flower_process_behind(tmp_path: Path) -> None:
    """On Flower's `local` connection `flwr run` would start a SuperLink and leave it (and its
    SuperExec) running; `fedstale run` starts it itself and stops it. A local SuperLink that
    was up before is used and left up."""
    env = local_connection_env(tmp_path)
    before = flower_processes()
    command = [tool("fedstale"), "run", "--app", str(ROOT), "--federation-config", ONE_CLIENTAPP]
    command += ["--run-config"]
    config = f"{TINY.replace('max-virtual-time=3000', 'max-virtual-time=500')} runs-dir={tmp_path}"
    result = subprocess.run(
        [*command, f"{config} run-name=own"],
        env=env,
        capture_output=True,
        text=True,
        timeout=timing.left(),
    )
    assert result.returncode == 0, result.stderr[-3000:]
    assert (tmp_path / "own" / "summary.json").is_file()
    assert flower_processes() - before == set()

    link = [tool("flower-superlink"), "--insecure", "--simulation", "--isolation", "subprocess"]

    def launch(port: int) -> subprocess.Popen:
        return spawn(
            [*link, "--host", "127.0.0.1", "--port", str(port)], env, tmp_path / "theirs.log"
        )

    theirs, port = start_listening(
        launch, "their SuperLink", tmp_path / "theirs.log", stop=stop_tree
    )
    try:
        await_healthy(theirs, port, tmp_path / "theirs.log", timeout=30)
        result = subprocess.run(
            [*command, f"{config} run-name=reused"],
            env={**env, PORT_ENV: str(port)},
            capture_output=True,
            text=True,
            timeout=timing.left(),
        )
        assert result.returncode == 0, result.stderr[-3000:]
        assert "using the local SuperLink already up" in result.stderr
        assert theirs.poll() is None  # not ours to stop
    finally:
        stop_tree(theirs)
    assert flower_processes() - before == set()


def test_cohort_training_in_flower_simulation_matches_the_golden_run(
    superlink: SimulationSuperLink, tmp_path: Path
) -> None:
    """trainer=cohort in Flower simulation: FedBuff's golden config trains its tasks in
    train.cohort messages, and its results are the golden per-task run's within the golden
    tolerances, field by field."""
    values = golden_values("fedbuff", tmp_path)
    config = " ".join(f"{k}={v}" for k, v in values.items() if k not in ("run-name", "runs-dir"))
    result, run_dir = fedstale_run(
        superlink, tmp_path, "fedbuff", f"{config} trainer=cohort node-partitions=assign"
    )
    assert result.returncode == 0, result.stderr[-3000:]
    said = result.stdout + result.stderr
    assert "trainer=cohort: 10 tasks train together in one message to node" in said
    produced = {
        "metrics.jsonl": without_wall_time((run_dir / "metrics.jsonl").read_text()),
        "updates.jsonl": (run_dir / "updates.jsonl").read_text(),
    }
    assert differences("fedbuff", produced) == []


def test_secure_aggregation_over_flower_is_the_in_process_secure_run(
    superlink: SimulationSuperLink, tmp_path: Path
) -> None:
    """fedstale's ClientApp masks through its secagg_mod in Flower simulation: keys, masked
    updates, sealed shares and the holders' answers travel as real records; the masks cancel
    exactly in the field, so the run equals the in-process secure run to the last digit."""
    config = f"{TINY} strategy=fedbuff buffer-size=3 seed=5 secure-aggregation=true"
    result, run_dir = fedstale_run(superlink, tmp_path, "sec", config)
    assert result.returncode == 0, result.stderr[-3000:]
    summary = json.loads((run_dir / "summary.json").read_text())
    secure = summary["secure_aggregation"]
    assert secure["holders"] == 10 and secure["buffers"] == summary["versions"] > 5
    assert secure["buffers_dropped"] == 0 and summary["updates_rejected"] == 0
    local = in_process(config, tmp_path, "sec-local")
    assert read_jsonl(local / "updates.jsonl") == read_jsonl(run_dir / "updates.jsonl")
    assert without_wall(read_jsonl(local / "metrics.jsonl")) == without_wall(
        read_jsonl(run_dir / "metrics.jsonl")
    )
