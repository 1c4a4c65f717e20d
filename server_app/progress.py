"""A one-line progress report every few wall seconds while the engine runs."""

from __future__ import annotations

import logging
import time
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from server_app.engine import Engine

log = logging.getLogger("fedstale")


class Progress:
    def __init__(self, interval: float) -> None:
        self.interval = interval
        self.last = time.monotonic()

    def __call__(self, engine: Engine) -> None:
        now = time.monotonic()
        if now - self.last < self.interval:
            return
        self.last = now
        run, counters = engine.run, engine.counters
        elapsed = now - engine.wall_start
        budget = run.max_virtual_time
        clock = f"t={engine.clock.now():,.0f}" + (f"/{budget:,.0f}" if budget else "")
        share = engine.clock.now() / budget if budget else 0.0
        eta = f" eta {elapsed * (1 - share) / share:,.0f}s" if 0 < share < 1 else ""
        accuracy = engine.evaluations[-1].accuracy if engine.evaluations else float("nan")
        log.info(
            "[%s] %s v=%d updates=%d rejected=%d lost=%d acc=%.4f %.1f upd/s%s",
            run.strategy,
            clock,
            engine.version,
            counters.accepted,
            counters.rejected,
            counters.failed,
            accuracy,
            counters.accepted / max(elapsed, 1e-9),
            eta,
        )
