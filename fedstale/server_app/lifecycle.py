"""One run, whichever door it came through: fedstale's ServerApp (`fedstale run`, `--local`,
`deploy`) or the library (`AsyncStrategy.start` in a user's ServerApp).

The lifecycle is the same for both: refuse what cannot run before the folder is touched,
claim the folder, write config.json with provenance, build and bind the rule, apply the
rule's latency factors, build the engine, resume, loop (heartbeat beside it), summarise,
save the model, plot, and close what it opened. A run refused before it looped leaves no
folder. A `Door` supplies only what differs: its transport, contract and node mapping,
the model and its evaluator, and what it knows of the clients.
"""

from __future__ import annotations

import logging
import math
import time
from abc import ABC, abstractmethod
from collections.abc import Callable
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import numpy as np

from fedstale.common.config import (
    ConfigError,
    KebabModel,
    PrivacySettings,
    RunConfig,
    RunSettings,
    score_key,
    score_label,
    score_words,
    summary_score,
)
from fedstale.common.files import resume_folder
from fedstale.common.latency import LatencyProfile, profile_for
from fedstale.common.layout import ParamLayout
from fedstale.server_app import checkpoint
from fedstale.server_app.contract import Contract, FedstaleContract
from fedstale.server_app.engine import Engine, Listeners, Recorder
from fedstale.server_app.evaluation import Scoreboard
from fedstale.server_app.federation import Federation
from fedstale.server_app.heartbeat import HEARTBEAT_FILE, Heartbeat
from fedstale.server_app.nodes import NodeBook, Nodes
from fedstale.server_app.progress import Progress, ProgressBar, progress_for
from fedstale.server_app.provenance import provenance
from fedstale.server_app.results import (
    RunRecorder,
    check_run_dir,
    checkpointed_rows,
    claim_run_dir,
    writable_runs_dir,
)
from fedstale.server_app.scored import ClientScorer, Evaluator
from fedstale.server_app.stages import stages_for
from fedstale.server_app.stages.central_dp import (
    Accounting,
    check_resume,
    privacy_words,
    resumed_from,
)
from fedstale.server_app.summary import summarize
from fedstale.server_app.tracking import Tracking, open_tracking, trackers_named
from fedstale.server_app.transport import Transport
from fedstale.strategies.base import ModelServices, ServerModel, Setup, Strategy, Topology
from fedstale.strategies.registry import build_strategy

log = logging.getLogger("fedstale")


@dataclass(frozen=True)
class Model:
    """The model a run starts from: its layout and flat initial parameters."""

    layout: ParamLayout
    initial: np.ndarray


class Door(ABC):
    """What one way into the engine supplies. Called in the lifecycle's order: `name`,
    `settings` and `refuse` before the folder is claimed; the rest after."""

    run: RunConfig  # the one run this door lets in
    contract: Contract | None = None  # None: fedstale's own task and reply format
    label = ""  # names the run in its progress lines instead of the rule (a grid's runs)

    @abstractmethod
    def transport(self) -> Transport: ...

    def nodes(self) -> Nodes | None:
        """How nodes map to clients (None: each node names its partition)."""
        return None

    @abstractmethod
    def name(self) -> str:
        """The run folder's name."""

    @abstractmethod
    def settings(self, params: KebabModel, name: str) -> dict[str, Any]:
        """config.json's settings; a resumed run must have been written with the same."""

    def refuse(self) -> None:
        """Raise ConfigError on what refuses the run before its folder is touched."""

    def config_extras(self) -> dict[str, Any]:
        """Entries config.json holds beside the settings and the provenance."""
        return {}

    @abstractmethod
    def model(self) -> Model: ...

    @abstractmethod
    def setup(self, model: Model) -> Setup:
        """What every rule may take before the run (Strategy.bind)."""

    @abstractmethod
    def services(self, model: Model) -> ModelServices:
        """What a rule computing on the model at the server takes (ServerModel)."""

    @abstractmethod
    def evaluator(self, model: Model, version: Callable[[], int]) -> Evaluator:
        """The global model's scorer; `version()` is the engine's version at the call."""

    def client_scorer(self) -> ClientScorer | None:
        return None

    def recorder(self, name: str, kept: dict[str, list[str]]) -> RunRecorder:
        return RunRecorder(claim_run_dir(self.run, name), kept)

    def plot_title(self) -> str:
        return self.run.strategy

    def accountant(self) -> Any:
        """The privacy accountant to compose the run's releases into (None: a new one from
        the run config, when the run adds noise)."""
        return None

    def looping(self) -> AbstractContextManager[Any]:
        """What holds while the engine loops."""
        return nullcontext()

    def started(self, engine: Engine) -> None:
        """The engine is built and resumed, the loop about to start."""

    def finished(self, engine: Engine, recorder: RunRecorder) -> None:
        """The loop ended; the summary, model and plot are written after this."""


def prepare_folder(
    run: RunSettings, settings: dict[str, Any], name: str
) -> tuple[checkpoint.Checkpoint | None, dict[str, list[str]]]:
    """The runs directory, the checkpoint to resume (and its rows, if it was written with
    these `settings`), the folder's earlier run: each refuses the run in one line before
    its folder is touched."""
    writable_runs_dir(run)
    resumed, kept = None, {}
    if run.resume_from:
        resumed = checkpoint.load(run.resume_from)
        source = resume_folder(run.resume_from)
        checkpoint.check_resumable(resumed, source, settings)
        kept = checkpointed_rows(source, resumed.metric_rows, resumed.update_rows)
    check_run_dir(run, name)
    return resumed, kept


def prepare(
    door: Door, params: KebabModel
) -> tuple[str, dict[str, Any], checkpoint.Checkpoint | None, dict[str, list[str]]]:
    """Everything that can refuse the run before its folder is touched."""
    run = door.run
    # before any folder: a refused budget, or a tracker not installed, leaves no runs directory
    Accounting.of(run).check_budget()
    trackers_named(run.tracking)
    name = door.name()
    settings = door.settings(params, name)
    resumed, kept = prepare_folder(run, settings, name)
    if resumed is not None:
        check_resume(run, resumed.engine_state.get("privacy"), door.accountant())
    door.refuse()
    return name, settings, resumed, kept


def run_through(door: Door, params: KebabModel) -> dict[str, Any]:
    """The door's run from its config to its summary."""
    started = time.monotonic()
    name, settings, resumed, kept = prepare(door, params)
    recorder = door.recorder(name, kept)
    looped, progress, tracking = False, None, None
    try:
        config = {**settings, **door.config_extras(), "provenance": provenance()}
        recorder.write_config(config)
        source = resumed_from(door.run) if resumed is not None else None
        tracking = open_tracking(door.run, recorder.dir, name, config, source)
        engine, progress = build_engine(door, params, recorder, tracking)
        if resumed is not None:
            checkpoint.restore(engine, resumed)
        log.info("run %s: %s, results in %s", name, door.run.strategy, recorder.dir)
        door.started(engine)
        looped = True
        with Heartbeat(recorder.dir / HEARTBEAT_FILE), door.looping():
            engine.run_loop()
        progress.close()  # before the closing lines, which a live bar would hold back
        progress = None
        door.finished(engine, recorder)
        summary = finish(door, engine, recorder, time.monotonic() - started, tracking)
        tracking = None  # finished
        return summary
    except BaseException:
        if not looped and resumed is None:  # failed before it ran: no half-written folder
            recorder.discard()
        raise
    finally:
        if progress is not None:
            progress.close()
        if tracking is not None:  # the run failed: its tracked runs say so
            tracking.finish(recorder.dir, [], failed=True)
        recorder.close()


def build_engine(
    door: Door, params: KebabModel, recorder: RunRecorder, tracking: Tracking | None = None
) -> tuple[Engine, Progress | ProgressBar]:
    """The rule built and bound, and the engine around it with its progress display (shown
    from here on: whoever builds it closes it)."""
    run = door.run
    model = door.model()
    strategy = build_strategy(run, params, model.initial)
    setup = door.setup(model)
    strategy.bind(setup)
    if isinstance(strategy, ServerModel):
        strategy.bind_services(door.services(model))
    transport = door.transport()
    check_noise_seed(run, transport)
    progress = progress_for(run.progress_interval, door.label)
    try:
        listeners = listeners_of(recorder, progress, tracking)
        engine = make_engine(door, strategy, transport, model, setup, listeners, recorder.dir)
    except BaseException:  # refused while built (the library's accountant check): not shown
        progress.close()
        raise
    return engine, progress


def make_engine(
    door: Door,
    strategy: Strategy,
    transport: Transport,
    model: Model,
    setup: Setup,
    listeners: Listeners,
    folder: Path,
) -> Engine:
    """The engine around the bound rule (its stages' files in `folder`, the run's); `version`
    reads it once it exists."""
    run = door.run
    engine: Engine | None = None

    def version() -> int:
        return engine.version if engine is not None else 0

    layout = model.layout
    latency = latency_of(run, strategy, setup.client_sizes if setup.sizes_known else None)
    evaluator = door.evaluator(model, version)
    scores = Scoreboard(run, strategy, transport, layout, evaluator, door.client_scorer())
    contract = door.contract or FedstaleContract()
    nodes = door.nodes() or NodeBook(run.num_clients)
    federation = Federation(transport, nodes, layout, latency, contract)
    stages = stages_for(run, strategy.params, layout, door.accountant(), folder, folder.name)
    engine = Engine(run, strategy, federation, scores, listeners, stages)
    return engine


def check_noise_seed(run: PrivacySettings, transport: Transport) -> None:
    """`dp-noise-seed` makes the noise replayable, hence subtractable by whoever knows the
    seed: refused in a deployment, said in a simulation (tests, debugging)."""
    if run.dp_noise_seed < 0:
        return
    if not transport.simulated:
        raise ConfigError(
            f"run config: dp-noise-seed={run.dp_noise_seed} makes the DP noise replayable "
            "(anyone who knows the seed can subtract it), so it is refused in a deployment; "
            "drop it: the noise comes from the operating system's entropy"
        )
    log.warning(
        "dp-noise-seed=%d: the DP noise is replayable from the seed and NOT private "
        "(for tests and debugging only)",
        run.dp_noise_seed,
    )


def latency_of(run: RunConfig, strategy: Strategy, sizes: np.ndarray | None) -> LatencyProfile:
    """The run's latency profile, scaled by the factors the rule's topology implies."""
    latency = profile_for(run, sizes)
    factors = strategy.latency_factors() if isinstance(strategy, Topology) else None
    if factors is not None:
        latency = replace(latency, base=latency.base * factors)
    return latency


def listeners_of(
    recorder: RunRecorder, progress: Progress | ProgressBar, tracking: Tracking | None
) -> Listeners:
    """The recorder, the progress display and the checkpointer; with trackers, each hears
    the rows and watches the engine too."""
    if tracking is None:
        return Listeners(recorder, progress, checkpointer(recorder))

    def watch(engine: Engine) -> None:
        progress(engine)
        tracking.watch(engine)

    return Listeners(Rows(recorder, tracking), watch, checkpointer(recorder))


class Rows:
    """The run's rows to the recorder and to the trackers."""

    def __init__(self, *recorders: Recorder) -> None:
        self.recorders = recorders

    def metric(self, row: dict[str, Any]) -> None:
        for recorder in self.recorders:
            recorder.metric(row)

    def update(self, row: dict[str, Any]) -> None:
        for recorder in self.recorders:
            recorder.update(row)


def checkpointer(recorder: RunRecorder) -> Callable[[Engine], None]:
    path = recorder.dir / checkpoint.CHECKPOINT_FILE

    def save(engine: Engine) -> None:
        snapshot = checkpoint.snapshot(
            engine, recorder.dir, recorder.metric_rows, recorder.update_rows
        )
        with engine.standing.watch("checkpoint"):
            checkpoint.save(snapshot, path)

    return save


def finish(
    door: Door,
    engine: Engine,
    recorder: RunRecorder,
    wall_seconds: float,
    tracking: Tracking | None = None,
) -> dict[str, Any]:
    run = door.run
    summary = summarize(engine, wall_seconds)
    recorder.write_summary(summary)
    recorder.save_model(engine.federation.layout.unflatten(engine.strategy.model))
    scores = [e.accuracy for e in engine.scores.done]
    if any(math.isfinite(s) for s in scores):  # a library run without evaluate_fn scores none
        times = [e.virtual_time for e in engine.scores.done]
        label = score_label(run.metric, engine.scores.per_client)
        recorder.plot(door.plot_title(), times, scores, label, score_key(run.metric))
    if tracking is not None:
        tracking.watch(engine)  # the last versions
        files = sorted(path for path in recorder.dir.iterdir() if path.is_file())
        summary["tracking"] = tracking.finish(recorder.dir, files, failed=False)
        tracking.save()
        recorder.write_summary(summary)
    log.info("done: %s", done_line(run, summary, recorder))
    return summary


def done_line(run: RunSettings, summary: dict[str, Any], recorder: RunRecorder) -> str:
    scored = math.isfinite(summary_score(summary, run.metric, "final"))
    score = f"{score_words(summary, run.metric)}, " if scored else ""
    privacy = f"{privacy_words(summary)}, " if privacy_words(summary) else ""
    return (
        f"{score}{privacy}{summary['versions']} versions, {summary['updates_accepted']} updates "
        f"({summary['updates_rejected']} rejected, {summary['tasks_lost']} lost) in "
        f"{summary['wall_seconds']:.1f} s ({recorder.dir})"
    )
