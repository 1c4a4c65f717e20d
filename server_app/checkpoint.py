"""Server checkpoints: the engine's counters and clock, the strategy's state and how many
result rows were written, saved every `checkpoint-every` versions to
runs/<name>/checkpoint.pkl; `resume-from=<file or run folder>` starts a run from one.

Tasks in flight when the checkpoint was taken belonged to the old ServerApp's Flower run;
their replies can never arrive, so the resumed run treats them as lost and dispatches anew.
"""

from __future__ import annotations

import logging
import pickle
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from common.config import ConfigError
from common.files import write_atomically
from server_app.clock import VirtualClock, WallClock
from server_app.engine import Counters, Engine, Evaluation

log = logging.getLogger("fedstale")
CHECKPOINT_FILE = "checkpoint.pkl"
FORMAT = 1
RUN_OWN = ("run", "params")  # taken from the resumed run's config, not the checkpoint


@dataclass
class Checkpoint:
    strategy: str
    run_dir: str
    version: int
    next_task_id: int
    counters: dict[str, Any]
    evaluations: list[dict[str, Any]]
    next_eval: float
    clock_time: float
    rng_state: dict[str, Any]
    time_to_target: float | None
    target_hit: bool
    in_flight: list[int]
    strategy_state: dict[str, Any]
    metric_rows: int
    update_rows: int
    saved_at: float = field(default_factory=time.time)
    format: int = FORMAT


def strategy_state(strategy: object) -> dict[str, Any]:
    """The strategy's attributes minus bound callables (FedPSA's sketcher is rebound)."""
    return {k: v for k, v in vars(strategy).items() if k not in RUN_OWN and not callable(v)}


def snapshot(engine: Engine, run_dir: Path, metric_rows: int, update_rows: int) -> Checkpoint:
    return Checkpoint(
        strategy=engine.run.strategy,
        run_dir=str(run_dir),
        version=engine.version,
        next_task_id=engine.next_task_id,
        counters=asdict(engine.counters),
        evaluations=[asdict(e) for e in engine.evaluations],
        next_eval=engine.next_eval,
        clock_time=engine.clock.now(),
        rng_state=engine.rng.bit_generator.state,
        time_to_target=engine.time_to_target,
        target_hit=engine.target_hit,
        in_flight=sorted(t.client for t in engine.tasks.values()),
        strategy_state=strategy_state(engine.strategy),
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
    if not isinstance(checkpoint, Checkpoint) or checkpoint.format != FORMAT:
        raise ConfigError(f"resume-from: {path} is not a fedstale checkpoint of this version")
    return checkpoint


def restore(engine: Engine, checkpoint: Checkpoint) -> None:
    """Put the engine and its strategy where the checkpoint left them."""
    if checkpoint.strategy != engine.run.strategy:
        raise ConfigError(
            f"resume-from: the checkpoint is of strategy '{checkpoint.strategy}', this run is "
            f"'{engine.run.strategy}'; resume with strategy={checkpoint.strategy}"
        )
    saved_model = checkpoint.strategy_state.get("model")
    if saved_model is not None and saved_model.shape != engine.strategy.model.shape:
        raise ConfigError(
            "resume-from: the checkpoint's model has a different size; resume with the same "
            "dataset and model"
        )
    vars(engine.strategy).update(checkpoint.strategy_state)
    engine.version = checkpoint.version
    engine.next_task_id = checkpoint.next_task_id
    engine.counters = Counters(**checkpoint.counters)
    engine.evaluations = [Evaluation(**e) for e in checkpoint.evaluations]
    engine.next_eval = checkpoint.next_eval
    engine.rng.bit_generator.state = checkpoint.rng_state
    engine.time_to_target = checkpoint.time_to_target
    engine.target_hit = checkpoint.target_hit
    if isinstance(engine.clock, VirtualClock):
        engine.clock.time = checkpoint.clock_time
    elif isinstance(engine.clock, WallClock):
        engine.clock.start = time.monotonic() - checkpoint.clock_time
    for client in checkpoint.in_flight:
        engine.strategy.on_task_lost(client)
    engine.counters.failed += len(checkpoint.in_flight)
    log.info(
        "resumed from %s: version %d, %d updates, time %.0f (%d tasks in flight were lost)",
        checkpoint.run_dir,
        checkpoint.version,
        engine.counters.accepted,
        checkpoint.clock_time,
        len(checkpoint.in_flight),
    )
