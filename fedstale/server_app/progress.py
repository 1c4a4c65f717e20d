"""Progress while the engine runs: a rich bar with an ETA on a terminal, otherwise a
one-line log report every few wall seconds (what a log file or Flower's stream wants)."""

from __future__ import annotations

import logging
import math
import sys
import time
from typing import TYPE_CHECKING, Any

from fedstale.common.config import metric_name
from fedstale.server_app.stages.central_dp import CentralDP

if TYPE_CHECKING:
    from fedstale.server_app.engine import Engine

log = logging.getLogger("fedstale")


def budget_share(engine: Engine) -> float:
    """How far the run is through its nearest budget (0..1; 0 when it has none)."""
    run, counters = engine.run, engine.counters
    shares = [
        (engine.standing.clock.now(), run.max_virtual_time),
        (counters.accepted, run.max_updates),
        (engine.version, run.max_versions),
        (time.monotonic() - engine.wall_start, run.max_wall_seconds),
    ]
    return min(1.0, max((done / budget for done, budget in shares if budget), default=0.0))


def latest_score(engine: Engine) -> str:
    """` acc=0.8123` (`neg-mse=...` for that metric), or "" before anything was scored (a
    library run without `evaluate_fn` scores nothing)."""
    score = engine.scores.done[-1].accuracy if engine.scores.done else math.nan
    if not math.isfinite(score):
        return spent(engine)
    name = metric_name(engine.run.metric)
    return f" {'acc' if name == 'accuracy' else name}={score:.4f}{spent(engine)}"


def spent(engine: Engine) -> str:
    """` eps=1.23` under DP with noise, else ""."""
    privacy = engine.stages.find(CentralDP)
    epsilon = privacy.epsilon() if privacy is not None else None
    return "" if epsilon is None else f" eps={epsilon:.3g}"


def rate(updates: int, seconds: float) -> str:
    """Updates per second, to the precision that shows a slow run moving (0.03 upd/s, not
    0.0), or per minute below one in a hundred seconds."""
    per_second = updates / max(seconds, 1e-9)
    if per_second >= 1 or per_second == 0:
        return f"{per_second:.1f} upd/s"
    if per_second >= 0.01:
        return f"{per_second:.2f} upd/s"
    return f"{per_second * 60:.2f} upd/min"


class Progress:
    def __init__(self, interval: float, label: str = "") -> None:
        self.interval = interval
        self.label = label  # the line's tag: the run's rule unless given
        self.last = time.monotonic()
        self.last_accepted = 0

    def __call__(self, engine: Engine) -> None:
        now = time.monotonic()
        if now - self.last < self.interval:
            return
        since, self.last = now - self.last, now
        run, counters = engine.run, engine.counters
        elapsed = now - engine.wall_start
        tag = self.label or run.strategy
        if (
            not counters.accepted + counters.rejected + counters.failed
            and engine.standing.book.tasks
        ):
            log.info(
                "[%s] waiting for the first replies: %d tasks sent %.0f s ago; each client's "
                "ClientApp starts with its first task (in a simulation, Ray starts them)",
                tag,
                len(engine.standing.book.tasks),
                elapsed,
            )
            return
        budget = run.max_virtual_time
        clock = f"t={engine.standing.clock.now():,.0f}" + (f"/{budget:,.0f}" if budget else "")
        share = budget_share(engine)
        eta = f" eta {elapsed * (1 - share) / share:,.0f}s" if 0 < share < 1 else ""
        recent = rate(counters.accepted - self.last_accepted, since)
        self.last_accepted = counters.accepted
        log.info(
            "[%s] %s v=%d updates=%d rejected=%d lost=%d%s %s%s",
            tag,
            clock,
            engine.version,
            counters.accepted,
            counters.rejected,
            counters.failed,
            latest_score(engine),
            recent,
            eta,
        )

    def close(self) -> None:
        """Nothing to tear down for log lines."""


class ProgressBar:
    """A rich bar over the run's nearest budget, with the version, updates and accuracy."""

    STEPS = 1000
    REDRAW = 0.25  # seconds: rich redraws at 10 Hz; epsilon under PLD is not free

    def __init__(self) -> None:
        from rich.progress import (
            BarColumn,
            TaskProgressColumn,
            TextColumn,
            TimeElapsedColumn,
            TimeRemainingColumn,
        )
        from rich.progress import Progress as RichProgress

        self.bar = RichProgress(
            TextColumn("{task.description}"),
            BarColumn(),
            TaskProgressColumn(),
            TimeElapsedColumn(),
            TextColumn("eta"),
            TimeRemainingColumn(),
            TextColumn("{task.fields[status]}"),
            transient=False,
        )
        self.task = self.bar.add_task("", total=self.STEPS, status="", start=True)
        self.last = -math.inf
        self.undrawn: Engine | None = None
        self.bar.start()
        # Log lines go above the bar: rich's stand-in for stderr while the bar is live.
        self.handlers = [h for h in log.handlers if isinstance(h, logging.StreamHandler)]
        self.streams = [h.setStream(sys.stderr) for h in self.handlers]

    def __call__(self, engine: Engine) -> None:
        now = time.monotonic()
        if now - self.last < self.REDRAW:
            self.undrawn = engine
            return
        self.last, self.undrawn = now, None
        self.draw(engine)

    def draw(self, engine: Engine) -> None:
        counters = engine.counters
        status = (
            f"v={engine.version} updates={counters.accepted} rejected={counters.rejected} "
            f"lost={counters.failed}{latest_score(engine)}"
        )
        self.bar.update(
            self.task,
            completed=round(budget_share(engine) * self.STEPS),
            description=f"[{engine.run.strategy}] t={engine.standing.clock.now():,.0f}",
            status=status,
        )

    def close(self) -> None:
        if self.undrawn is not None:
            self.draw(self.undrawn)
        self.bar.stop()
        for handler, stream in zip(self.handlers, self.streams, strict=True):
            handler.setStream(stream)


def progress_for(interval: float, label: str = "") -> Progress | ProgressBar:
    """The bar when stderr is a terminal (rich draws there), else the log line; log lines
    tagged `label` for a run that shares stderr with others (a grid's: one bar per run
    would fight over the terminal)."""
    return ProgressBar() if sys.stderr.isatty() and not label else Progress(interval, label)


class StderrHandler(logging.StreamHandler):
    """Log lines to whatever `sys.stderr` is when a line is written, not the stream it was
    at set-up: a caller that swaps stderr (pytest's capture, rich's live display, a
    notebook) gets the lines, and one that closed its stream leaves no broken handler."""

    @property  # type: ignore[override]
    def stream(self) -> Any:
        return sys.stderr

    @stream.setter
    def stream(self, value: Any) -> None:
        pass  # always the current sys.stderr


def setup_logging() -> None:
    """fedstale's log lines on stderr, once per process."""
    if not log.handlers:
        handler = StderrHandler()
        handler.setFormatter(logging.Formatter("fedstale %(levelname)s: %(message)s"))
        log.addHandler(handler)
        log.setLevel(logging.INFO)
        log.propagate = False
