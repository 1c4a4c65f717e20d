"""Progress reporting: the budget share behind the bar and ETA; the bar only on a terminal."""

from __future__ import annotations

import io
import time
from types import SimpleNamespace

import pytest

from fedstale.server_app import progress
from fedstale.server_app.stages.central_dp import CentralDP
from fedstale.server_app.stages.pipeline import Pipeline
from tests.helpers import run_config


def engine_at(clock: float, accepted: int, version: int, **budgets: float) -> SimpleNamespace:
    return SimpleNamespace(
        run=run_config(**budgets),
        counters=SimpleNamespace(accepted=accepted),
        version=version,
        standing=SimpleNamespace(clock=SimpleNamespace(now=lambda: clock)),
        scores=SimpleNamespace(done=[]),
        wall_start=time.monotonic(),
        stages=Pipeline(),  # no stage: no privacy
    )


def test_the_share_is_the_nearest_budget() -> None:
    assert progress.budget_share(engine_at(250, 10, 1, max_virtual_time=1000)) == 0.25
    both = engine_at(250, 60, 1, max_virtual_time=1000, max_updates=100)
    assert progress.budget_share(both) == 0.6
    on_target_only = engine_at(250, 60, 1, max_virtual_time=0, target_accuracy=0.9)
    assert progress.budget_share(on_target_only) == 0.0


def test_the_bar_only_on_a_terminal(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr("sys.stderr", io.StringIO())
    assert isinstance(progress.progress_for(5.0), progress.Progress)

    class Terminal(io.StringIO):
        def isatty(self) -> bool:
            return True

    monkeypatch.setattr("sys.stderr", Terminal())
    bar = progress.progress_for(5.0)
    assert isinstance(bar, progress.ProgressBar)
    bar.close()


def test_the_line_names_the_runs_metric_and_shows_no_score_before_one_exists(
    caplog: pytest.LogCaptureFixture,
) -> None:
    def line(metric: str, scores: list[float], epsilon: float | None = None) -> str:
        engine = engine_at(250, 6, 3, max_virtual_time=1000, metric=metric)
        if epsilon is not None:
            stage = SimpleNamespace(epsilon=lambda: epsilon)
            engine.stages = SimpleNamespace(find=lambda kind: stage if kind is CentralDP else None)
        engine.strategy = "fedbuff"  # type: ignore[attr-defined]
        engine.counters = SimpleNamespace(accepted=6, rejected=0, failed=0)
        engine.scores.done = [SimpleNamespace(accuracy=s) for s in scores]
        caplog.clear()
        with caplog.at_level("INFO", logger="fedstale"):
            progress.Progress(0.0)(engine)  # type: ignore[arg-type]
        return caplog.records[-1].getMessage()

    assert " acc=0.8123 " in line("accuracy", [0.5, 0.8123])
    regression = line("neg-mse", [-1.0654])
    assert " neg-mse=-1.0654 " in regression and "acc" not in regression
    unscored = line("accuracy", [float("nan")])  # a library run without evaluate_fn
    assert "nan" not in unscored and "acc" not in unscored and "lost=0 " in unscored
    assert " acc=0.8123 eps=12.3 " in line("accuracy", [0.8123], epsilon=12.34)  # under DP
    assert " eps=1.5 " in line("accuracy", [float("nan")], epsilon=1.5)


def test_the_rate_shows_a_slow_run_moving() -> None:
    """A paused SuperLink let about 0.03 updates a second through: the line said 0.0."""
    assert progress.rate(0, 10.0) == "0.0 upd/s"
    assert progress.rate(30, 10.0) == "3.0 upd/s"
    assert progress.rate(3, 100.0) == "0.03 upd/s"
    assert progress.rate(1, 600.0) == "0.10 upd/min"


def test_before_any_reply_the_line_says_what_it_waits_for(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """While the first ClientApps start (36-52 s in a simulation on 2 cores) the line said
    `updates=0 ... acc=0.0556` again and again; it says the run waits for them instead."""
    engine = engine_at(0, 0, 0, max_virtual_time=1000)
    engine.counters = SimpleNamespace(accepted=0, rejected=0, failed=0)
    engine.standing.book = SimpleNamespace(tasks={1: "task", 2: "task", 3: "task"})
    with caplog.at_level("INFO", logger="fedstale"):
        progress.Progress(0.0)(engine)  # type: ignore[arg-type]
    said = caplog.records[-1].getMessage()
    assert said.startswith("[fedbuff] waiting for the first replies: 3 tasks sent")
    engine.counters = SimpleNamespace(accepted=1, rejected=0, failed=0)
    with caplog.at_level("INFO", logger="fedstale"):
        progress.Progress(0.0)(engine)  # type: ignore[arg-type]
    assert " v=0 updates=1 " in caplog.records[-1].getMessage()
