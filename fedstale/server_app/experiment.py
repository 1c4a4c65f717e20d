"""Everything a run needs, built from the run config, around one Engine."""

from __future__ import annotations

import logging
import math
import statistics
import time
from collections.abc import Callable
from dataclasses import replace
from typing import Any

import numpy as np
import torch

from fedstale.common.calibration import encode, real_batch
from fedstale.common.config import (
    ConfigError,
    KebabModel,
    RunConfig,
    metric_name,
    score_key,
    score_label,
)
from fedstale.common.federation import (
    client_holdout,
    effective_test_split,
    federation_of,
    require_dataset,
    run_model,
    test_data,
)
from fedstale.common.latency import profile_for
from fedstale.common.models import (
    ParamLayout,
    evaluate,
    get_flat,
    set_flat,
)
from fedstale.common.objectives import objective
from fedstale.common.sensitivity import global_sketcher, loss_gradient
from fedstale.common.threads import blas_threads
from fedstale.server_app import checkpoint
from fedstale.server_app.engine import Engine
from fedstale.server_app.evaluation import ClientScorer, Evaluator
from fedstale.server_app.heartbeat import HEARTBEAT_FILE, Heartbeat
from fedstale.server_app.progress import progress_for
from fedstale.server_app.provenance import provenance
from fedstale.server_app.results import (
    RunRecorder,
    aulc,
    check_run_dir,
    checkpointed_rows,
    claim_run_dir,
    resume_folder,
    run_name,
    writable_runs_dir,
)
from fedstale.server_app.transport import Transport
from fedstale.strategies.base import Setup
from fedstale.strategies.registry import build_strategy

log = logging.getLogger("fedstale")
DIAGNOSTIC_BATCH = 512  # held-out test samples behind each gradient of the Sec. 6.6 diagnostic


def make_evaluator(run: RunConfig, model: torch.nn.Module) -> Evaluator:
    """A function scoring a flat parameter vector on the test set."""
    x_test, y_test = test_data(run)
    scoring = objective(run.loss, run.metric)

    def score(flat: np.ndarray) -> tuple[float, float]:
        set_flat(model, flat)
        return evaluate(model, x_test, y_test, run.eval_batch_size, scoring)

    return score


def make_client_scorer(run: RunConfig, model: torch.nn.Module) -> ClientScorer:
    """Scores a client's model on that client's own held-out split, exactly as its
    ClientApp's evaluate handler would (fedstale/client_app/task.py evaluate_task)."""
    scoring = objective(run.loss, run.metric)

    def score(client: int, flat: np.ndarray) -> tuple[float, float]:
        set_flat(model, flat)
        x, y = client_holdout(run, client)
        return evaluate(model, x, y, run.eval_batch_size, scoring)

    return score


def setup_for(run: RunConfig, model: torch.nn.Module, layout: ParamLayout) -> Setup:
    """What a rule may take before the run (Strategy.bind); nothing is computed until a
    rule asks for it."""
    fed = federation_of(run)

    def calibration(size: int) -> tuple[dict[str, Any], Any]:
        try:
            batch = real_batch(*test_data(run), seed=run.seed, size=size)
        except ValueError as err:
            raise ConfigError(f"fedpsa-calib-size: {err}; use a smaller batch") from None
        return encode(batch), batch

    return Setup(
        segments=tuple(layout.segments),
        client_sizes=np.array([len(idx) for idx in fed.train_idx], dtype=np.float64),
        calibration=calibration,
        sketcher=global_sketcher(model, fed.input_shape, fed.num_classes),
        aligner=lambda: gradient_aligner(run, model),
    )


def diagnostic_batch(run: RunConfig) -> tuple[torch.Tensor, torch.Tensor]:
    """The held-out test batch behind the Sec. 6.6 gradients (eq. 21)."""
    x_test, y_test = test_data(run)
    return real_batch(x_test, y_test, seed=run.seed + 1, size=min(DIAGNOSTIC_BATCH, len(y_test)))


def gradient_aligner(run: RunConfig, model: torch.nn.Module) -> Callable:
    """Eq. 21-22 on a held-out test batch: cos(grad L(w_client), grad L(w_server))."""
    device = next(model.parameters()).device
    x, y = (t.to(device) for t in diagnostic_batch(run))

    def gradient(flat: np.ndarray) -> torch.Tensor:
        set_flat(model, flat)
        return loss_gradient(model, x, y)

    def align(clients: list[np.ndarray], server: np.ndarray) -> list[float]:
        g_server = gradient(server)
        return [
            float(torch.nn.functional.cosine_similarity(gradient(c), g_server, dim=0, eps=1e-12))
            for c in clients
        ]

    return align


def summarize(engine: Engine, wall_seconds: float) -> dict[str, Any]:
    loop_seconds = time.monotonic() - (engine.loop_started or engine.wall_start)
    evals = engine.evaluations
    times = [e.virtual_time for e in evals]
    accuracies = [e.accuracy for e in evals]
    scored = [a for a in accuracies if math.isfinite(a)]  # a library run may score nothing
    counters = engine.counters
    key = score_key(engine.run.metric)
    return {
        "strategy": engine.run.strategy,
        "evaluation": "per-client" if engine.scores.per_client else "global",
        "metric": metric_name(engine.run.metric),
        "stop_reason": engine.stop_reason,
        f"final_{key}": accuracies[-1],
        f"best_{key}": max(scored) if scored else math.nan,
        "acc_std" if key == "accuracy" else f"{key}_std": (
            statistics.pstdev(scored) if scored else math.nan
        ),
        "aulc_days": aulc(times, accuracies),
        "time_to_target": engine.time_to_target,
        "virtual_time": times[-1],
        "versions": engine.version,
        "updates_accepted": counters.accepted,
        "updates_rejected": counters.rejected,
        "updates_late": counters.late,  # of the accepted: their task had been written off
        "late_refused": dict(counters.late_refused),  # reason -> late replies the rule refused
        "tasks_lost": counters.failed,
        "tasks_superseded": counters.superseded,
        "downlinks": counters.dispatched,  # train messages: tasks, replacements, multicasts
        # replies to live or written-off tasks (superseded ones are dropped uncounted)
        "uplinks": counters.accepted + counters.rejected + sum(counters.late_refused.values()),
        "tasks_dispatched": counters.dispatched,
        "wall_seconds": wall_seconds,
        "loop_seconds": loop_seconds,
        "updates_per_second": counters.accepted / max(loop_seconds, 1e-9),
        "client_compute_seconds": counters.client_compute_seconds,
        "engine_seconds": {k: round(v, 3) for k, v in sorted(engine.watch.seconds.items())},
        **engine.strategy.summary(),
    }


def checkpointer(recorder: RunRecorder) -> Callable[[Engine], None]:
    path = recorder.dir / checkpoint.CHECKPOINT_FILE

    def save(engine: Engine) -> None:
        snapshot = checkpoint.snapshot(
            engine, recorder.dir, recorder.metric_rows, recorder.update_rows
        )
        with engine.watch("checkpoint"):
            checkpoint.save(snapshot, path)

    return save


def settings_of(run: RunConfig, params: KebabModel, name: str) -> dict[str, Any]:
    """The run config and the strategy's keys, as config.json records them."""
    return {**run.model_dump(by_alias=True), **params.model_dump(by_alias=True), "run-name": name}


def prepare(run: RunConfig, params: KebabModel, name: str) -> tuple[Any, dict[str, list[str]]]:
    """Everything that can refuse the run, before its folder is touched: `prepare_folder`,
    then the dataset."""
    resumed, kept = prepare_folder(run, settings_of(run, params, name), name)
    require_dataset(run)
    return resumed, kept


def prepare_folder(
    run: RunConfig, settings: dict[str, Any], name: str
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


def run_experiment(run: RunConfig, params: KebabModel, transport: Transport) -> dict[str, Any]:
    started = time.monotonic()
    name = run_name(run)
    resumed, kept = prepare(run, params, name)
    if not log.level:
        log.setLevel(logging.INFO)
    recorder = RunRecorder(claim_run_dir(run, name), kept)
    try:
        return record_run(run, params, transport, recorder, resumed, started)
    except ConfigError:
        if resumed is None:  # refused before it ran: leave no half-written folder
            recorder.discard()
        raise
    finally:
        recorder.close()


def record_run(
    run: RunConfig,
    params: KebabModel,
    transport: Transport,
    recorder: RunRecorder,
    resumed: checkpoint.Checkpoint | None,
    started: float,
) -> dict[str, Any]:
    name = recorder.dir.name
    split = effective_test_split(run)
    if split != run.test_split:
        log.warning("%s has no standard test split: testing on a 10%% holdout", run.dataset)
    recorder.write_config(
        {
            **settings_of(run, params, name),
            "test-split-effective": split,
            "provenance": provenance(),
        }
    )
    model = run_model(run)  # the one model the server scores and sketches with
    layout = ParamLayout.of(model)
    strategy = build_strategy(run, params, get_flat(model))
    setup = setup_for(run, model, layout)
    strategy.bind(setup)
    latency = profile_for(run, setup.client_sizes)
    factors = strategy.latency_factors()
    if factors is not None:
        latency = replace(latency, base=latency.base * factors)
    progress = progress_for(run.progress_interval)
    engine = Engine(
        run,
        strategy,
        transport,
        layout,
        latency,
        make_evaluator(run, model),
        recorder,
        progress,
        checkpointer(recorder),
        make_client_scorer(run, model),
    )
    if resumed is not None:
        checkpoint.restore(engine, resumed)
    log.info("run %s: %s, results in %s", name, run.strategy, recorder.dir)
    if run.test_faults:
        log.warning("test-faults is set: clients corrupt tasks %s on purpose", run.test_faults)
    try:
        with Heartbeat(recorder.dir / HEARTBEAT_FILE), blas_threads(1):
            engine.run_loop()
    finally:
        progress.close()
    summary = summarize(engine, time.monotonic() - started)
    recorder.write_summary(summary)
    recorder.save_model(layout.unflatten(strategy.model))
    recorder.plot(
        f"{run.strategy} on {run.dataset}",
        [e.virtual_time for e in engine.evaluations],
        [e.accuracy for e in engine.evaluations],
        score_label(run.metric, engine.scores.per_client),
    )
    key = score_key(run.metric)
    log.info(
        "done: final %s %.4f, best %.4f, %d versions, %d updates in %.1f s (%s)",
        metric_name(run.metric),
        summary[f"final_{key}"],
        summary[f"best_{key}"],
        summary["versions"],
        summary["updates_accepted"],
        summary["wall_seconds"],
        recorder.dir,
    )
    return summary
