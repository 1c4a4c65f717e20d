"""Checkpoints: a run stopped part-way resumes from its last checkpoint and finishes."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from fedstale.client_app.task import evaluate_task, train_task
from fedstale.common.config import ConfigError
from fedstale.common.schema import MSG_TRAIN
from fedstale.launcher.inprocess import InProcessTransport
from fedstale.server_app import checkpoint
from fedstale.server_app.experiment import run_experiment
from fedstale.strategies.registry import load_config

BASE = {
    "dataset": "digits",
    "num-clients": 6,
    "concurrency": 3,
    "buffer-size": 2,
    "lr": 0.1,
    "max-virtual-time": 0.0,
    "eval-interval": 200.0,
    "checkpoint-every": 4,
}


class FirstModelSeen(InProcessTransport):
    """Remembers the parameters of the first train task it runs."""

    first: np.ndarray | None = None

    def send(self, node_id, message_type, config, arrays=None, sets=None):  # type: ignore[no-untyped-def]
        if message_type == MSG_TRAIN and self.first is None:
            self.first = np.concatenate([np.ravel(a) for a in arrays.values()])
        return super().send(node_id, message_type, config, arrays, sets)


def run(tmp_path: Path, name: str, **values: object) -> tuple[dict, FirstModelSeen]:
    config, params = load_config({**BASE, "runs-dir": str(tmp_path), "run-name": name, **values})
    transport = FirstModelSeen(config, train_task, evaluate_task)
    return run_experiment(config, params, transport), transport


def lines(path: Path) -> list[str]:
    return path.read_text().splitlines()


@pytest.mark.parametrize("strategy", ["fedbuff", "fedpsa", "ca2fl"])
def test_resume_continues_from_the_last_checkpoint(tmp_path: Path, strategy: str) -> None:
    run(tmp_path, "first", strategy=strategy, **{"max-versions": 10})
    first = tmp_path / "first"
    saved = checkpoint.load(str(first))
    assert saved.version == 8  # checkpoints at 4 and 8; the run went on to 10
    assert "sketch_global" not in saved.strategy_state  # a callable, rebound on resume

    summary, transport = run(
        tmp_path, "second", strategy=strategy, **{"max-versions": 14}, **{"resume-from": str(first)}
    )
    second = tmp_path / "second"
    assert summary["versions"] == 14
    assert np.array_equal(transport.first, saved.strategy_state["model"])
    kept_metrics = lines(first / "metrics.jsonl")[: saved.metric_rows]
    assert lines(second / "metrics.jsonl")[: saved.metric_rows] == kept_metrics
    kept_updates = lines(first / "updates.jsonl")[: saved.update_rows]
    new_updates = lines(second / "updates.jsonl")
    assert new_updates[: saved.update_rows] == kept_updates
    assert all(json.loads(row)["version"] > 8 for row in new_updates[saved.update_rows :])
    # Tasks in flight at the checkpoint are lost, never counted as updates.
    assert summary["tasks_lost"] == len(saved.in_flight)
    dispatched, accepted = summary["tasks_dispatched"], summary["updates_accepted"]
    in_flight_at_end = dispatched - accepted - summary["tasks_lost"]
    assert 0 <= in_flight_at_end <= BASE["concurrency"]
    times = [json.loads(row)["virtual_time"] for row in lines(second / "metrics.jsonl")]
    assert times == sorted(times)


def test_resume_refuses_a_missing_or_foreign_checkpoint(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="no checkpoint at"):
        run(tmp_path, "x", **{"max-versions": 2, "resume-from": str(tmp_path / "nope")})
    run(tmp_path, "fb", **{"max-versions": 4})
    with pytest.raises(ConfigError, match="strategy 'fedbuff'"):
        run(
            tmp_path,
            "y",
            strategy="fedasync",
            **{"max-versions": 6, "resume-from": str(tmp_path / "fb")},
        )


def test_resume_refuses_a_run_folder_with_fewer_rows_than_checkpointed(tmp_path: Path) -> None:
    run(tmp_path, "cut", **{"max-versions": 5})
    (tmp_path / "cut" / "metrics.jsonl").write_text("")
    with pytest.raises(ConfigError, match=r"metrics\.jsonl has 0 rows, the checkpoint counted"):
        run(tmp_path, "z", **{"max-versions": 8, "resume-from": str(tmp_path / "cut")})


def test_a_checkpoint_at_a_flush_counts_that_flush_s_rows(tmp_path: Path) -> None:
    """The checkpoint is written after the rows of the version it saves: every row up to
    that version is kept on resume, none after it."""
    run(tmp_path, "flush", strategy="fedbuff", **{"max-versions": 6})
    saved = checkpoint.load(str(tmp_path / "flush"))
    rows = [json.loads(row) for row in lines(tmp_path / "flush" / "updates.jsonl")]
    upto = [row for row in rows if row["version"] <= saved.version]
    assert len(upto) == saved.update_rows == saved.version * BASE["buffer-size"]
    assert rows[: saved.update_rows] == upto


def test_resume_refuses_a_checkpoint_of_another_format_in_one_line(tmp_path: Path) -> None:
    run(tmp_path, "old", **{"max-versions": 4})
    path = tmp_path / "old" / checkpoint.CHECKPOINT_FILE
    saved = checkpoint.load(str(path))
    saved.format = checkpoint.FORMAT - 1
    checkpoint.save(saved, path)
    with pytest.raises(ConfigError, match=f"checkpoint format {checkpoint.FORMAT - 1}, this"):
        run(tmp_path, "new", **{"max-versions": 6, "resume-from": str(tmp_path / "old")})


def test_a_resumed_dp_run_accounts_every_release_before_and_after(tmp_path: Path) -> None:
    """The ledger, not the checkpoint, holds the releases: the first run was checkpointed
    at version 8 and went on to 10; resumed from 8 to 14, the lineage has made 10 + 6
    releases, and the resumed run's epsilon is theirs."""
    from fedstale.server_app.stages.central_dp import Accounting

    dp = {"dp-clipping-norm": 1.0, "dp-noise-multiplier": 1.0}
    run(tmp_path, "first", strategy="fedbuff", **dp, **{"max-versions": 10})
    first = tmp_path / "first"
    saved = checkpoint.load(str(first))
    assert saved.version < 10  # releases after the checkpoint went out
    resumed = {"max-versions": 14, "resume-from": str(first)}
    summary, _ = run(tmp_path, "second", strategy="fedbuff", **dp, **resumed)
    privacy = summary["privacy"]
    config, _ = load_config({**BASE, **dp, "max-versions": 14})
    lineage = 10 + 14 - saved.version
    assert summary["versions"] == 14 and privacy["releases"] == lineage
    assert privacy["releases_this_run"] == 14 - saved.version
    assert privacy["epsilon"] == pytest.approx(
        Accounting.of(config).epsilon_after(lineage), rel=1e-12
    )
    assert privacy["ledger"] == str((first / "privacy-ledger.jsonl").resolve())


def test_a_run_from_before_a_key_existed_resumes_at_that_keys_default(tmp_path: Path) -> None:
    """A checkpoint's config.json without a key added since (here the dp-* keys) matches
    this run's default for it, the behaviour every run had before; any other value of the
    new key is refused in one line."""
    run(tmp_path, "first", strategy="fedbuff", **{"max-versions": 8})
    first = tmp_path / "first"
    config = json.loads((first / "config.json").read_text())
    for key in [k for k in config if k.startswith("dp-")]:
        del config[key]
    (first / "config.json").write_text(json.dumps(config))
    resumed = {"max-versions": 10, "resume-from": str(first)}
    summary, _ = run(tmp_path, "second", strategy="fedbuff", **resumed)
    assert summary["versions"] == 10
    with pytest.raises(ConfigError, match=r"dp-clipping-norm=None, this one 1\.0"):
        run(tmp_path, "third", strategy="fedbuff", **resumed, **{"dp-clipping-norm": 1.0})
