"""One run lifecycle behind both doors (fedstale/server_app/lifecycle.py): fedstale's own
ServerApp (`--local`, in process) and the library (`AsyncStrategy`'s door, here over a
scripted transport; tests/test_library.py runs it in real Flower simulation). What the two
assemblies once did differently must now hold in both: the rule's edge slowdown under the
virtual clock, no folder left by a refused run, and the progress display closed."""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any, ClassVar

import numpy as np
import pytest

import fedstale
from fedstale.common.config import ConfigError, RunConfig
from fedstale.common.schema import TaskKeys
from fedstale.launcher.local import local_transport
from fedstale.server_app import lifecycle
from fedstale.server_app.experiment import run_experiment
from fedstale.server_app.flower_strategy import AsyncStrategy, LibraryDoor
from fedstale.server_app.heartbeat import Heartbeat
from fedstale.server_app.results import read_jsonl
from fedstale.server_app.transport import Transport
from fedstale.strategies.registry import load_config
from tests.helpers import ScriptedTransport, run_config

LATENCY = 100.0  # every client's latency: an edge's first round closes at LATENCY x factor
SLOWED = {
    "clock": "virtual",
    "latency": "uniform",
    "latency_min": LATENCY,
    "latency_max": LATENCY,
    "latency_jitter": 0.0,
    "mafsa_edges": 2,
    "mafsa_edge_slowdown": "1,4",
    "max_versions": 6,  # MAFSA's cloud moves on each edge upload: edge 0 uploads 4 times first
}
EDGE_FACTORS = {0: 1.0, 1: 4.0}


def library_train(
    partition: int, config: Mapping[str, Any], arrays: dict[str, np.ndarray]
) -> tuple[dict, dict]:
    """A plain ClientApp's reply (Flower's train contract): the trained model, the
    examples it saw; with MAFSA's mod, the count of stale rounds it trained (none)."""
    metrics: dict[str, Any] = {"num-examples": 10 + partition, "train_loss": 0.5}
    if "mafsa" in str(config.get(TaskKeys.CLIENT_RULES, "")):
        metrics["mafsa-stale-rounds"] = 0
    return metrics, {k: v + 0.1 for k, v in arrays.items()}


class ScriptedLibraryDoor(LibraryDoor):
    """The library's door with a scripted transport in place of a Grid."""

    def __init__(
        self, run: RunConfig, strategy: AsyncStrategy, scripted: ScriptedTransport
    ) -> None:
        arrays = {"w": np.zeros((3, 2), np.float32), "b": np.zeros(2, np.float32)}
        super().__init__(run, strategy, None, arrays, {}, None)  # type: ignore[arg-type]
        self.scripted = scripted

    def transport(self) -> Transport:
        return self.scripted  # type: ignore[return-value]


def library_run(rule: str, runs_dir: Path, **settings: Any) -> dict[str, Any]:
    strategy: AsyncStrategy = getattr(fedstale, rule)(
        num_clients=4, runs_dir=str(runs_dir), run_name="lib", **settings
    )
    run, params = strategy.run_config(4, 2, 3600.0, {})
    door = ScriptedLibraryDoor(run, strategy, ScriptedTransport(4, library_train))
    return lifecycle.run_through(door, params)


def app_run(rule: str, runs_dir: Path, **settings: Any) -> dict[str, Any]:
    values = {
        "strategy": rule,
        "dataset": "digits",
        "num-clients": 4,
        "concurrency": 4,
        "local-steps": 2,
        "max-versions": 2,
        "runs-dir": str(runs_dir),
        "run-name": "app",
        **{key.replace("_", "-"): value for key, value in settings.items()},
    }
    run, params = load_config(values)
    return run_experiment(run, params, local_transport(run))


def first_close_per_edge(folder: Path) -> dict[int, float]:
    first: dict[int, float] = {}
    for row in read_jsonl(folder / "updates.jsonl"):
        first.setdefault(int(row["edge"]), float(row["time"]))
    return first


@pytest.mark.parametrize("rule", ["hierfedavg", "mafsa"])
def test_the_edge_slowdown_slows_each_edge_in_both_doors(rule: str, tmp_path: Path) -> None:
    """Every client takes LATENCY; edge 1 is 4x slower, so its first round closes at 4x."""
    expected = {edge: LATENCY * factor for edge, factor in EDGE_FACTORS.items()}
    app_run(rule, tmp_path, **SLOWED)
    assert first_close_per_edge(tmp_path / "app") == pytest.approx(expected)
    name = "HierFedAvg" if rule == "hierfedavg" else "MAFSA"
    library_run(name, tmp_path, **SLOWED)
    assert first_close_per_edge(tmp_path / "lib") == pytest.approx(expected)


def test_a_run_refused_at_bind_leaves_no_folder_in_both_doors(tmp_path: Path) -> None:
    """FedPSA through the library without `model_fn` is refused when the rule binds, after
    the folder was claimed; through the app, a calibration batch larger than the test set."""
    with pytest.raises(ConfigError, match="pass FedPSA\\(model_fn="):
        library_run("FedPSA", tmp_path)
    assert not (tmp_path / "lib").exists()
    with pytest.raises(ConfigError, match="fedpsa-calib-size"):
        app_run("fedpsa", tmp_path, fedpsa_calib_source="real", fedpsa_calib_size=10**6)
    assert not (tmp_path / "app").exists()
    assert list(tmp_path.iterdir()) in ([], [tmp_path / "runs"])


class Display:
    """A progress display that remembers whether it was closed."""

    opened: ClassVar[list[Display]] = []

    def __init__(self, interval: float, label: str = "") -> None:
        self.closed = False
        Display.opened.append(self)

    def __call__(self, engine: Any) -> None:
        pass

    def close(self) -> None:
        self.closed = True


class Beating(Heartbeat):
    """The heartbeat, remembering that it beat while its run ran."""

    started: ClassVar[list[Beating]] = []

    def __enter__(self) -> Beating:
        super().__enter__()
        self.beat_seen = self.path.exists() and self.thread.is_alive()
        Beating.started.append(self)
        return self


def test_both_doors_close_their_progress_display_and_heartbeat(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(lifecycle, "progress_for", Display)
    monkeypatch.setattr(lifecycle, "Heartbeat", Beating)
    Display.opened.clear()
    app_run("fedbuff", tmp_path, buffer_size=2)
    library_run("FedBuff", tmp_path, buffer_size=2, concurrency=2)
    assert len(Display.opened) == 2 and all(d.closed for d in Display.opened)
    assert [beat.path.parent.name for beat in Beating.started] == ["app", "lib"]
    for beat in Beating.started:  # it beat while the run ran; its thread ended with the run
        assert beat.beat_seen and not beat.thread.is_alive() and not beat.path.exists()
        assert (beat.path.parent / "summary.json").exists()


def test_a_library_run_records_provenance_and_its_train_config(tmp_path: Path) -> None:
    import json

    library_run("FedBuff", tmp_path, buffer_size=2, concurrency=2)
    config = json.loads((tmp_path / "lib" / "config.json").read_text())
    assert config["train-config"] == {} and "python" in json.dumps(config["provenance"])
    assert "dataset" not in config  # the user's ClientApp decides its data
    assert "buffer-size" in config and not RunConfig.app_only_keys() & set(config)
    assert {"dataset", "model", "trainer", "eval-where"} <= RunConfig.app_only_keys()
    rows = read_jsonl(tmp_path / "lib" / "updates.jsonl")
    assert len(rows) >= 4  # two versions of buffer 2


def refuse_while_built(*args: Any, **kwargs: Any) -> None:
    raise ConfigError("dp-max-epsilon 0.5 is below the epsilon of one release")


def disk_fails(*args: Any, **kwargs: Any) -> None:
    raise OSError("no space left on device")


def start(door: str, runs_dir: Path) -> dict[str, Any]:
    return app_run("fedbuff", runs_dir) if door == "app" else library_run("FedBuff", runs_dir)


@pytest.mark.parametrize("door", ["app", "lib"])
def test_a_run_that_fails_before_its_loop_closes_its_display_and_leaves_no_folder(
    door: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Refused while the engine is built (as the accountant's check refuses), or any other
    exception before the loop: the progress display opened is closed, the folder removed."""
    monkeypatch.setattr(lifecycle, "progress_for", Display)
    Display.opened.clear()
    monkeypatch.setattr(lifecycle, "Engine", refuse_while_built)
    with pytest.raises(ConfigError, match="dp-max-epsilon"):
        start(door, tmp_path)
    assert len(Display.opened) == 1 and Display.opened[0].closed
    assert not (tmp_path / door).exists()
    monkeypatch.setattr(lifecycle, "build_strategy", disk_fails)
    with pytest.raises(OSError, match="no space"):
        start(door, tmp_path)
    assert not (tmp_path / door).exists()


def test_the_config_is_split_by_who_reads_it() -> None:
    """Every key has one reader: the engine (unmarked), the client's training (each one a
    TaskSpec field, so it travels in every task) or fedstale's own app (refused by the
    library); a rule's keys are its Params."""
    from dataclasses import fields

    from fedstale.common.schema import TaskSpec

    readers = {r: RunConfig.fields_read_by(r) for r in ("engine", "client", "app")}
    assert sorted(name for names in readers.values() for name in names) == sorted(
        RunConfig.model_fields
    )
    per_task = {"task_id", "version", "seed", "returns", "rules", "extra"}
    assert set(readers["client"]) == {f.name for f in fields(TaskSpec)} - per_task
    run = run_config(lr=0.5, momentum=0.9, local_steps=3)
    assert run.client_training()["momentum"] == 0.9
    with pytest.raises(ValueError, match="reader 'rule' is not one of"):
        RunConfig.fields_read_by("rule")
