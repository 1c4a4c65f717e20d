"""Server checkpoints: the state the engine, its clock and the strategy expose (their
`state()`), and how many result rows were written, saved every `checkpoint-every` versions
(after that version's rows) to runs/<name>/checkpoint.pkl; `resume-from=<file or run
folder>` starts a run from one.

Tasks in flight when the checkpoint was taken belonged to the old ServerApp's Flower run;
their replies can never arrive, so the resumed run treats them as lost and dispatches anew.
"""

from __future__ import annotations

import json
import logging
import pickle
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from fedstale.common.config import ConfigError, RunConfig
from fedstale.common.files import write_atomically
from fedstale.server_app.engine import Engine
from fedstale.server_app.results import CHECKPOINT_FILE
from fedstale.strategies.base import load_state, state_of
from fedstale.strategies.registry import rule_named, with_new_names

log = logging.getLogger("fedstale")
# 3: strategies keep Buffer objects and their `kept` attributes as they are (deques too).
FORMAT = 3


@dataclass
class Checkpoint:
    strategy: str
    run_dir: str
    engine_state: dict[str, Any]
    clock_state: dict[str, float]
    strategy_state: dict[str, Any]
    in_flight: list[int]  # clients whose tasks were in flight: lost on resume
    metric_rows: int
    update_rows: int
    saved_at: float = field(default_factory=time.time)
    format: int = FORMAT

    @property
    def version(self) -> int:
        return int(self.engine_state["version"])


def public_state(engine: Engine) -> tuple[str, ...] | None:
    """The rule's kept attributes a checkpoint may hold: all (None) unless DP omits the
    clients' values, then those its release declares public."""
    if engine.stages.keeps_client_values:
        return None
    release = rule_named(engine.run.strategy).dp
    return release.public if release is not None else ()


def snapshot(engine: Engine, run_dir: Path, metric_rows: int, update_rows: int) -> Checkpoint:
    return Checkpoint(
        strategy=engine.run.strategy,
        run_dir=str(run_dir),
        engine_state=engine.state(),
        clock_state=engine.standing.clock.state(),
        strategy_state=state_of(engine.strategy, public_state(engine)),
        in_flight=sorted(t.client for t in engine.tasks.values()),
        metric_rows=metric_rows,
        update_rows=update_rows,
    )


def save(checkpoint: Checkpoint, path: Path) -> None:
    """Write atomically: a crash while writing leaves the previous checkpoint intact."""
    write_atomically(path, lambda handle: pickle.dump(checkpoint, handle, pickle.HIGHEST_PROTOCOL))


def load(location: str) -> Checkpoint:
    path = Path(location).expanduser()
    if path.is_dir():
        path = path / CHECKPOINT_FILE
    if not path.is_file():
        raise ConfigError(
            f"resume-from: no checkpoint at {path}; name a checkpoint.pkl or a run folder "
            "written with checkpoint-every > 0"
        )
    try:
        with path.open("rb") as handle:
            checkpoint = pickle.load(handle)
    except (OSError, pickle.UnpicklingError, EOFError, AttributeError) as err:
        raise ConfigError(f"resume-from: {path} is not a readable checkpoint ({err})") from None
    if not isinstance(checkpoint, Checkpoint):
        raise ConfigError(f"resume-from: {path} is not a fedstale checkpoint")
    if checkpoint.format != FORMAT:
        raise ConfigError(
            f"resume-from: {path} has checkpoint format {checkpoint.format}, this fedstale "
            f"reads {FORMAT}; finish that run with the fedstale version that wrote it"
        )
    return checkpoint


# Keys a resumed run may set anew: where results go, budgets, pacing and resources. Any
# other key of the run folder's config.json must be the checkpoint's.
MAY_CHANGE_ON_RESUME = {
    "run-name",
    "runs-dir",
    "resume-from",
    "overwrite",
    "data-dir",
    "device",
    "client-threads",
    "max-virtual-time",
    "max-versions",
    "max-updates",
    "target-accuracy",
    "max-wall-seconds",
    "progress-interval",
    "checkpoint-every",
    "poll-interval",
    "node-wait-seconds",
    "task-ttl",
    "task-timeout",
    "node-partitions",  # how nodes learn their partition, not what they compute
}


def check_resumable(checkpoint: Checkpoint, folder: Path, settings: dict[str, Any]) -> None:
    """One ConfigError line unless `checkpoint` (in run folder `folder`) was written by a run
    of these settings (the run config and the strategy's keys)."""
    strategy = settings.get("strategy")
    if checkpoint.strategy != strategy:
        raise ConfigError(
            f"resume-from: the checkpoint is of strategy '{checkpoint.strategy}', this run is "
            f"'{strategy}'; resume with strategy={checkpoint.strategy}"
        )
    config = folder / "config.json"
    if not config.is_file():
        raise ConfigError(f"resume-from: {folder} has no config.json; name the run's own folder")
    saved = with_new_names(json.loads(config.read_text(encoding="utf-8")), say=False)
    key = first_difference(saved, settings)
    if key is not None:
        raise ConfigError(
            f"resume-from: the checkpoint's run had {key}={saved.get(key)!r}, this one "
            f"{settings.get(key)!r}; resume with the same settings (only budgets, pacing, "
            "devices and where results go may change)"
        )


def first_difference(saved: dict[str, Any], settings: dict[str, Any]) -> str | None:
    """The first key (in order) whose value in a run folder's config.json (`saved`) is not
    these settings', beyond what may change on resume; None when it is the same run."""
    for key in sorted(set(settings) - MAY_CHANGE_ON_RESUME):
        if key not in saved and settings[key] == key_default(key):
            continue  # a key the folder's run predates, at the behaviour it had then
        if saved.get(key) != settings.get(key):
            return key
    return None


def key_default(key: str) -> Any:
    """A run-config key's default (a strategy's own key: None)."""
    field = RunConfig.model_fields.get(key.replace("-", "_"))
    return field.default if field is not None else None


def restore(engine: Engine, checkpoint: Checkpoint) -> None:
    """Put the engine and its strategy where the checkpoint left them."""
    saved_model = checkpoint.strategy_state.get("model")
    if saved_model is not None and saved_model.shape != engine.strategy.model.shape:
        raise ConfigError(
            "resume-from: the checkpoint's model has a different size; resume with the same "
            "dataset and model"
        )
    load_state(engine.strategy, checkpoint.strategy_state)
    engine.load_state(checkpoint.engine_state)
    engine.standing.clock.load_state(checkpoint.clock_state)
    engine.counters.failed += len(checkpoint.in_flight)
    for client in checkpoint.in_flight:
        engine.task_lost(client)
    log.info(
        "resumed from %s: version %d, %d updates, time %.0f (%d tasks in flight were lost)",
        checkpoint.run_dir,
        checkpoint.version,
        engine.counters.accepted,
        checkpoint.clock_state["time"],
        len(checkpoint.in_flight),
    )
