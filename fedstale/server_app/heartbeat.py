"""A sign of life of the ServerApp in its run folder, so that `fedstale run` can tell a
server that died from one that is busy: a daemon thread touches `runs/<name>/heartbeat`
every HEARTBEAT_SECONDS while the engine runs (it dies with the process), and the file is
removed when the run ends normally. The thread is joined when the run ends, however it ends:
a daemon thread still waking at interpreter exit raced the process's teardown (a grid stopped
by SIGTERM aborted with "terminate called without an active exception")."""

from __future__ import annotations

import threading
import time
from pathlib import Path
from types import TracebackType

HEARTBEAT_FILE = "heartbeat"
HEARTBEAT_SECONDS = 2.0
STALE_SECONDS = 20.0  # no beat for this long: the server is gone


class Heartbeat:
    def __init__(self, path: Path, interval: float = HEARTBEAT_SECONDS) -> None:
        self.path = path
        self.interval = interval
        self.stopped = threading.Event()
        self.thread = threading.Thread(target=self._beat, daemon=True, name="heartbeat")

    def _beat(self) -> None:
        while not self.stopped.wait(self.interval):
            self.path.touch()

    def __enter__(self) -> Heartbeat:
        self.path.touch()
        self.thread.start()
        return self

    def __exit__(
        self,
        kind: type[BaseException] | None,
        error: BaseException | None,
        trace: TracebackType | None,
    ) -> None:
        self.stopped.set()
        self.thread.join(self.interval + 1.0)  # a touch in progress takes milliseconds
        self.path.unlink(missing_ok=True)


def last_beat(run_dir: Path) -> float | None:
    """Wall time (time.time) of the last beat, or None when there is no heartbeat file."""
    try:
        return (run_dir / HEARTBEAT_FILE).stat().st_mtime
    except OSError:
        return None


def server_died(run_dir: Path, since: float) -> bool:
    """A heartbeat written after `since` has gone stale."""
    beat = last_beat(run_dir)
    return beat is not None and beat >= since and time.time() - beat > STALE_SECONDS
