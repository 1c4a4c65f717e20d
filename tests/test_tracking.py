"""Experiment trackers as listeners of a run (fedstale/server_app/tracking/): the real
MLflow (a tracking server started here on 127.0.0.1, SQLite backend, stopped by its process
group), TensorBoard's event files read back with TensorBoard's own reader, W&B offline;
live while the run goes, continued on resume, and never a cost to the run when they fail."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from fedstale.common.config import ConfigError
from fedstale.launcher.ports import free_port
from fedstale.server_app.tracking import Opening, Tracker, Tracking, trackers_named
from tests import timing

ROOT = Path(__file__).resolve().parent.parent
TINY = "dataset=digits num-clients=6 concurrency=3 buffer-size=2 lr=0.1 max-virtual-time=0"


class Recording(Tracker):
    """A tracker that keeps what it is sent (or fails from its `fail_at`-th log on)."""

    name = "recording"
    package = "json"

    def __init__(self, fail_at: int = -1) -> None:
        self.logged: list[tuple[int, dict[str, float]]] = []
        self.fail_at = fail_at
        self.closed: bool | None = None

    def open(self, opening: Opening) -> str:
        return f"run-of-{opening.name}" if opening.resume_id is None else opening.resume_id

    def log(self, step: int, values: Mapping[str, float]) -> None:
        if len(self.logged) == self.fail_at:
            raise ConnectionError("tracking server went away")
        self.logged.append((step, dict(values)))

    def close(self, failed: bool) -> None:
        self.closed = failed


def engine_at(version: int) -> Any:
    from types import SimpleNamespace

    from fedstale.server_app.stages.pipeline import Pipeline

    counters = SimpleNamespace(accepted=3 * version, rejected=1, failed=0, late=0)
    return SimpleNamespace(
        version=version,
        counters=counters,
        wall_start=time.monotonic() - 2.0,
        standing=SimpleNamespace(
            book=SimpleNamespace(tasks={1: 0}), clock=SimpleNamespace(now=lambda: 5.0)
        ),
        stages=Pipeline(),
    )


def opened(
    tmp_path: Path, *trackers: Tracker, resumed: Mapping[str, Any] | None = None
) -> Tracking:
    tracking = Tracking(list(trackers))
    tracking.open(
        Opening(tmp_path, "r", "fedstale", "", {"lr": 0.1}, {"strategy": "fedbuff"}), resumed or {}
    )
    return tracking


def test_each_version_is_sent_once_with_its_updates_and_the_servers_view(tmp_path: Path) -> None:
    fine, failing = Recording(), Recording(fail_at=1)
    failing.name = "failing"
    tracking = opened(tmp_path, fine, failing)
    tracking.metric({"version": 0, "accuracy": 0.1, "virtual_time": 0.0})
    tracking.metric({"version": 0, "accuracy": 0.1, "virtual_time": 250.0})  # the same model
    for staleness, weight in ((0, 0.5), (2, 0.25)):
        tracking.update({"version": 1, "staleness": staleness, "weight": weight, "client": 3})
    tracking.watch(engine_at(1))
    tracking.watch(engine_at(1))  # nothing new
    tracking.metric({"version": 1, "accuracy": 0.4})
    result = tracking.finish(tmp_path, [], failed=False)
    assert [step for step, _ in fine.logged] == [0, 1, 1]
    server = fine.logged[1][1]
    assert server["server/staleness_mean"] == 1.0 and server["server/staleness_max"] == 2.0
    assert server["server/weight_mean"] == 0.375 and server["server/updates"] == 3.0
    assert server["server/in_flight"] == 1.0 and server["server/rejected"] == 1.0
    assert fine.logged[0][1] == {"eval/accuracy": 0.1, "eval/virtual_time": 0.0}
    assert fine.closed is False and failing.closed is None  # a failed tracker is left alone
    assert result["runs"] == {"recording": "run-of-r", "failing": "run-of-r"}
    assert result["missed"]["failing"]["error"] == "ConnectionError: tracking server went away"
    assert json.loads((tmp_path / "tracking.json").read_text())["last"] == {"eval": 1, "server": 1}


def test_a_resumed_run_continues_its_tracked_run_and_sends_no_version_twice(
    tmp_path: Path,
) -> None:
    again = Recording()
    resumed = {"ids": {"recording": "run-7"}, "last": {"eval": 4, "server": 5}}
    tracking = opened(tmp_path, again, resumed=resumed)
    for version in (4, 5, 6):  # the versions after the checkpoint, made again
        tracking.metric({"version": version, "accuracy": 0.5})
        tracking.update({"version": version, "staleness": 0, "weight": 1.0})
        tracking.watch(engine_at(version))
    result = tracking.finish(tmp_path, [], failed=False)
    assert result["runs"] == {"recording": "run-7"}
    assert [step for step, _ in again.logged] == [5, 6, 6]


def test_a_tracker_not_installed_is_one_line_naming_its_install(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util, "find_spec", lambda name, *a: None if name == "mlflow" else real(name, *a)
    )
    with pytest.raises(
        ConfigError, match=r"^tracking=mlflow: mlflow is not installed; pip install mlflow"
    ):
        trackers_named("tensorboard,mlflow")
    with pytest.raises(ConfigError, match="unknown tracker 'comet'"):
        from fedstale.strategies.registry import load_config

        load_config({"tracking": "comet"})


# ---------------------------------------------------------------- the real trackers
@dataclass
class Server:
    uri: str
    process: subprocess.Popen


@pytest.fixture
def mlflow_server(tmp_path: Path) -> Iterator[Server]:
    """`mlflow server` on 127.0.0.1 with an SQLite store, stopped by its process group."""
    pytest.importorskip("mlflow")
    port = free_port()
    env = {**os.environ, "MLFLOW_SERVER_ENABLE_JOB_EXECUTION": "false"}
    command = [sys.executable, "-m", "mlflow", "server", "--host", "127.0.0.1", "--port", str(port)]
    command += ["--backend-store-uri", f"sqlite:///{tmp_path / 'mlflow-server.db'}"]
    command += ["--default-artifact-root", (tmp_path / "artifacts").as_uri()]
    with (tmp_path / "mlflow-server.log").open("w") as log:
        server = subprocess.Popen(command, env=env, stdout=log, stderr=log, start_new_session=True)
    uri = f"http://127.0.0.1:{port}"
    try:
        wait_until(lambda: healthy(uri), 120, "the MLflow server to answer")
        yield Server(uri, server)
    finally:
        stop_group(server)


def healthy(uri: str) -> bool:
    import httpx

    try:
        return httpx.get(f"{uri}/health", timeout=2).status_code == 200
    except httpx.HTTPError:
        return False


def stop_group(process: subprocess.Popen) -> None:
    for sent in (signal.SIGTERM, signal.SIGKILL):
        try:
            os.killpg(process.pid, sent)
        except ProcessLookupError:
            return
        try:
            process.wait(10)
            return
        except subprocess.TimeoutExpired:
            continue


def wait_until(ready: Any, seconds: float, what: str) -> None:
    deadline = time.monotonic() + seconds
    while not ready():
        assert time.monotonic() < deadline, f"waited {seconds:g} s for {what}"
        time.sleep(0.5)


def start_local_run(
    runs: Path, name: str, config: str, env: Mapping[str, str] | None = None
) -> subprocess.Popen:
    pairs = f"{config} run-name={name} runs-dir={runs}"
    command = [sys.executable, "-m", "fedstale.launcher.cli", "run", "--local", "--workers", "1"]
    log = (runs.parent / f"{name}.out").open("w")
    return subprocess.Popen(
        [*command, "--run-config", pairs],
        cwd=ROOT,
        stdout=log,
        stderr=subprocess.STDOUT,
        env={**os.environ, **(env or {})},
    )


def mlflow_history(uri: str, name: str, key: str) -> list[tuple[int, float]]:
    from mlflow.tracking import MlflowClient

    client = MlflowClient(tracking_uri=uri)
    experiment = client.get_experiment_by_name("fedstale")
    if experiment is None:
        return []
    runs = client.search_runs([experiment.experiment_id], f"attributes.run_name = '{name}'")
    if not runs:
        return []
    return [(m.step, m.value) for m in client.get_metric_history(runs[0].info.run_id, key)]


@contextmanager
def live_run(
    uri: str, runs: Path, name: str, seconds: float, env: Mapping[str, str] | None = None
) -> Iterator[subprocess.Popen]:
    """A wall-clock run of `seconds` logging to MLflow at `uri`, handed over once its first
    two evaluations can be read there; killed on the way out if it still runs."""
    config = f"{TINY} clock=wall max-wall-seconds={seconds:g} eval-interval=1 tracking=mlflow"
    process = start_local_run(runs, name, f"{config} tracking-uri={uri}", env)
    try:
        history = lambda: mlflow_history(uri, name, "eval/accuracy")  # noqa: E731
        wait_until(lambda: len(history()) >= 2, 60, "live metrics")
        yield process
    finally:
        process.kill()


@pytest.mark.integration
def test_a_local_run_logs_live_to_an_mlflow_server_and_a_resume_continues_its_run(
    mlflow_server: Server, tmp_path: Path
) -> None:
    uri = mlflow_server.uri
    runs = tmp_path / "runs"
    with live_run(uri, runs, "live", 20) as process:
        assert process.poll() is None  # read through MLflow's client while the run goes on
        assert not (runs / "live" / "summary.json").exists()
        assert process.wait(timing.left()) == 0
    summary = json.loads((runs / "live" / "summary.json").read_text())
    assert summary["tracking"]["missed"] == {}
    steps = [step for step, _ in mlflow_history(uri, "live", "server/updates")]
    assert steps == sorted(set(steps)) and steps[-1] == summary["versions"]

    # a run stopped after its checkpoint at version 4, resumed to version 8: one tracked run
    counted = f"{TINY} max-versions=4 checkpoint-every=2 tracking=mlflow tracking-uri={uri}"
    assert start_local_run(runs, "first", counted).wait(timing.left()) == 0
    first_id = json.loads((runs / "first" / "tracking.json").read_text())["ids"]["mlflow"]
    more = counted.replace("max-versions=4", "max-versions=8") + f" resume-from={runs / 'first'}"
    assert start_local_run(runs, "first", more + " overwrite=false").wait(timing.left()) == 0
    assert json.loads((runs / "first" / "tracking.json").read_text())["ids"]["mlflow"] == first_id
    steps = [step for step, _ in mlflow_history(uri, "first", "server/updates")]
    assert steps == list(range(1, 9))  # each version once, in one run


@pytest.mark.integration
def test_a_tracking_server_that_goes_away_costs_the_run_nothing(
    mlflow_server: Server, tmp_path: Path
) -> None:
    uri = mlflow_server.uri
    runs = tmp_path / "runs"
    quick = {"MLFLOW_HTTP_REQUEST_MAX_RETRIES": "0", "MLFLOW_HTTP_REQUEST_TIMEOUT": "3"}
    with live_run(uri, runs, "cut", 12, quick) as process:
        stop_group(mlflow_server.process)  # the tracking server dies mid-run
        assert process.wait(timing.left()) == 0
    folder = runs / "cut"
    summary = json.loads((folder / "summary.json").read_text())
    assert summary["tracking"]["missed"]["mlflow"]["error"]
    assert {"metrics.jsonl", "updates.jsonl", "model.pt", "accuracy.png"} <= {
        p.name for p in folder.iterdir()
    }
    said = [
        line
        for line in (folder / "run.log").read_text().splitlines()
        if "tracking: mlflow failed" in line
    ]
    assert len(said) == 1, said


@pytest.mark.integration
def test_tensorboard_event_files_and_wandb_offline_files_beside_the_run(tmp_path: Path) -> None:
    pytest.importorskip("tensorboard")
    pytest.importorskip("wandb")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    runs = tmp_path / "runs"
    config = f"{TINY} max-versions=5 eval-interval=200 tracking=tensorboard,wandb"
    env = {"WANDB_MODE": "offline", "WANDB_SILENT": "true"}
    assert start_local_run(runs, "tb", config, env).wait(timing.left()) == 0
    folder = runs / "tb"
    events = EventAccumulator(str(folder / "tensorboard"))
    events.Reload()
    accuracy = events.Scalars("eval/accuracy")
    assert [e.step for e in accuracy] == sorted({e.step for e in accuracy}) and accuracy[
        -1
    ].step == 5
    assert [e.step for e in events.Scalars("server/staleness_mean")] == [1, 2, 3, 4, 5]
    offline = list((folder / "wandb").glob("offline-run-*/run-*.wandb"))
    assert len(offline) == 1 and offline[0].stat().st_size > 0
    summary = json.loads((folder / "summary.json").read_text())
    assert summary["tracking"]["missed"] == {} and set(summary["tracking"]["runs"]) == {
        "tensorboard",
        "wandb",
    }


def test_earlier_run_folders_go_into_mlflow_with_fedstale_track(tmp_path: Path) -> None:
    """`fedstale track` sends a run made without tracking, as the run would have."""
    pytest.importorskip("mlflow")
    runs = tmp_path / "runs"
    assert (
        start_local_run(runs, "past", f"{TINY} max-versions=3 eval-interval=200").wait(
            timing.left()
        )
        == 0
    )
    uri = f"sqlite:///{tmp_path / 'later.db'}"
    (tmp_path / "elsewhere").mkdir()
    command = [sys.executable, "-m", "fedstale.launcher.cli", "track", str(runs / "past")]
    result = subprocess.run(
        [*command, "--to", "mlflow", "--tracking-uri", uri],
        cwd=tmp_path / "elsewhere",  # nothing lands in the folder it is run from
        capture_output=True,
        text=True,
        timeout=timing.left(),
    )
    assert result.returncode == 0, result.stderr[-2000:]
    assert not any((tmp_path / "elsewhere").iterdir())  # MLflow's files beside its store
    assert (tmp_path / "mlartifacts").is_dir()
    assert [step for step, _ in mlflow_history(uri, "past", "server/updates")] == [1, 2, 3]
    assert not (runs / "past" / "tracking.json").exists()  # the folder is read, not changed
    missing = subprocess.run(
        [*command[:-1], str(tmp_path), "--to", "mlflow"], capture_output=True, text=True
    )
    assert missing.returncode == 2 and "not a run folder" in missing.stderr


@pytest.mark.integration
def test_the_mlflow_ui_shows_the_run_and_its_accuracy_in_a_real_browser(
    mlflow_server: Server, tmp_path: Path
) -> None:
    """Headless Chromium (`make tools` installs Debian's) opens the finished run's page in
    MLflow's own UI; its screenshot stays in the test's folder."""
    from mlflow.tracking import MlflowClient

    browser = shutil.which("chromium")
    assert browser is not None, "no chromium: make tools installs it"
    runs, uri = tmp_path / "runs", mlflow_server.uri
    config = f"{TINY} max-versions=3 eval-interval=200 tracking=mlflow tracking-uri={uri}"
    assert start_local_run(runs, "shown", config).wait(timing.left()) == 0
    run_id = json.loads((runs / "shown" / "tracking.json").read_text())["ids"]["mlflow"]
    experiment = MlflowClient(tracking_uri=uri).get_run(run_id).info.experiment_id
    page = f"{uri}/#/experiments/{experiment}/runs/{run_id}"
    headless = [browser, "--headless", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage"]
    headless += ["--virtual-time-budget=20000", "--window-size=1400,1000"]
    dom = subprocess.run(
        [*headless, "--dump-dom", page], capture_output=True, text=True, timeout=timing.left()
    ).stdout
    assert ">shown<" in dom and "eval/accuracy" in dom and "fedbuff" in dom
    shot = tmp_path / "mlflow-run.png"
    subprocess.run([*headless, f"--screenshot={shot}", page], capture_output=True, timeout=120)
    assert shot.stat().st_size > 20_000
