"""What a tracker is to a run, and the run's trackers together: every call made on one
worker thread, so a slow or dead tracking server never holds the engine up, and a tracker
that fails is said once and left out while the run goes on."""

from __future__ import annotations

import json
import logging
import math
import queue
import threading
import time
from abc import ABC, abstractmethod
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import IO, Any, ClassVar

from fedstale.common.files import write_atomically

log = logging.getLogger("fedstale")
IDS_FILE = "tracking.json"  # the tracked runs' ids (a resume continues them), last step
DRAIN_SECONDS = 60.0  # at the end, how long the trackers may take to catch up
# Logs are sent at most once a period, every step since in one request: an MLflow request
# to its SQLite store took 17 ms, one per version cost a 6-s --local run 37% (bench.tracking_cost)
FLUSH_SECONDS = 1.0


@dataclass(frozen=True)
class Opening:
    """What a tracked run is opened with."""

    folder: Path  # the run's folder (its files are the artifacts)
    name: str  # the run's name
    experiment: str  # MLflow's experiment, W&B's project
    uri: str  # MLflow's tracking URI ("": SQLite beside the run folders)
    config: Mapping[str, Any]  # the run's config.json, as parameters
    tags: Mapping[str, str]  # strategy, dataset, seed, provenance
    resume_id: str | None = None  # the tracked run a resumed run continues
    started: float = field(default_factory=time.time)  # when the run opened it


class Tracker(ABC):
    """One experiment tracker. `package` is what `pip install` names (the tracker alone, so
    the user's torch stays)."""

    name: ClassVar[str]
    package: ClassVar[str]

    @abstractmethod
    def open(self, opening: Opening) -> str:
        """Start the tracked run (or continue `opening.resume_id`); its id."""

    @abstractmethod
    def log(self, step: int, values: Mapping[str, float]) -> None:
        """Metrics at `step` (the global model's version)."""

    def log_many(self, entries: Sequence[tuple[int, Mapping[str, float]]]) -> None:
        """Several steps' metrics that were waiting (a tracker with a batch call overrides
        this: one request instead of one a step)."""
        for step, values in entries:
            self.log(step, values)

    def upload(self, folder: Path, files: Sequence[Path]) -> None:
        """The run folder's files as artifacts (a tracker that writes beside them: none)."""

    @abstractmethod
    def close(self, failed: bool) -> None:
        """End the tracked run (FAILED when the run did not end well)."""


Call = tuple["Tracker", str, tuple[Any, ...]]  # (tracker, method name, arguments)


@dataclass
class Missed:
    """What did not reach one tracker: from which step, and why."""

    since: int
    error: str
    calls: int = 0


@dataclass
class Tracking:
    """The run's trackers as one listener: a recorder of its rows (`metric`, `update`)
    and, once an engine loop, of its state (`watch`)."""

    trackers: list[Tracker]
    folder: Path = Path(".")  # the run's folder, where tracking.json goes (set by `open`)
    saving: bool = True  # keep tracking.json up to date (not for an earlier run's folder)
    ids: dict[str, str] = field(default_factory=dict)
    missed: dict[str, Missed] = field(default_factory=dict)
    # the last version sent, of evaluations and of the server's view: each version once (a
    # resumed run replays the versions after its checkpoint; the same model scores the same)
    last: dict[str, int] = field(default_factory=lambda: {"eval": -1, "server": -1})
    pending: dict[int, list[dict[str, Any]]] = field(default_factory=dict)  # version -> rows
    # the calls, made on the worker thread in order; None: stop
    calls: queue.Queue[Call | None] = field(default_factory=queue.Queue)

    def __post_init__(self) -> None:
        self.flushed = -math.inf  # when the worker last sent logs
        self.worker = threading.Thread(target=self._work, name="fedstale-tracking", daemon=True)
        self.worker.start()

    # ------------------------------------------------------------ the worker
    def _work(self) -> None:
        held: Call | None = None
        while (call := held or self.calls.get()) is not None:
            tracker, name, args = call
            held = None
            if name != "log":
                self._call(tracker, name, args)
                continue
            logs, held = self._waiting_logs({tracker.name: [args]})
            for each in self.trackers:  # what waited goes in one request each tracker
                self._call(each, "log_many", (logs.get(each.name, []),))
            self.flushed = time.monotonic()

    def _waiting_logs(self, logs: dict[str, list[tuple[Any, ...]]]) -> tuple[dict, Call | None]:
        """`logs` and the log calls that come behind them within a flush period, by
        tracker; and the first other call, held back to keep the order (the end of the queue
        goes back in it, and sends what was gathered at once)."""
        until = self.flushed + FLUSH_SECONDS
        while True:
            try:
                call = self.calls.get(timeout=max(0.0, until - time.monotonic()))
            except queue.Empty:
                return logs, None
            if call is None:
                self.calls.put(None)
                return logs, None
            if call[1] != "log":
                return logs, call
            logs.setdefault(call[0].name, []).append(call[2])

    def _call(self, tracker: Tracker, name: str, args: tuple[Any, ...]) -> None:
        if tracker.name in self.missed:
            self.missed[tracker.name].calls += 1
            return
        if name == "log_many" and not args[0]:
            return
        try:
            result = getattr(tracker, name)(*args)
            if name == "open":
                self.ids[tracker.name] = str(result)
        except Exception as err:  # a tracker must never cost the run
            step = max(self.last["server"], 0)
            self.missed[tracker.name] = Missed(step, f"{type(err).__name__}: {err}")
            log.warning(
                "tracking: %s failed (%s: %s); the run goes on without it, its folder "
                "holds everything (fedstale track sends it later)",
                tracker.name,
                type(err).__name__,
                str(err).splitlines()[0][:200] if str(err) else "",
            )

    def _each(self, name: str, *args: Any) -> None:
        for tracker in self.trackers:
            self.calls.put((tracker, name, args))

    # ------------------------------------------------------------ the run's events
    def open(self, opening: Opening, resumed: Mapping[str, Any]) -> None:
        self.folder = opening.folder
        self.last.update({k: int(v) for k, v in resumed.get("last", {}).items()})
        for tracker in self.trackers:
            again = resumed.get("ids", {}).get(tracker.name)
            self.calls.put((tracker, "open", (replace(opening, resume_id=again),)))

    def metric(self, row: Mapping[str, Any]) -> None:
        """An evaluation row: its numbers under eval/, at the version it scored."""
        step = int(row.get("version", 0))
        values = {f"eval/{k}": float(v) for k, v in row.items() if k != "version" and number(v)}
        self._send("eval", step, values)

    def update(self, row: Mapping[str, Any]) -> None:
        """An update row, summed up per version when that version is out (`watch`)."""
        self.pending.setdefault(int(row.get("version", 0)), []).append(dict(row))

    def watch(self, engine: Any) -> None:
        """Once a loop: each version released since, with the server's view of the run."""
        for version in sorted(v for v in self.pending if v <= engine.version):
            rows = self.pending.pop(version)
            self._send("server", version, {**per_version(rows), **server_view(engine)})

    def replay(
        self, metric_rows: Sequence[Mapping[str, Any]], update_rows: Sequence[Mapping[str, Any]]
    ) -> None:
        """An earlier run's rows (`fedstale track`): its evaluations, and per version what
        its update rows say (the engine's counters were not kept)."""
        for row in metric_rows:
            self.metric(row)
        by_version: dict[int, list[dict[str, Any]]] = {}
        for row in update_rows:
            by_version.setdefault(int(row.get("version", 0)), []).append(dict(row))
        updates = 0
        for version in sorted(by_version):
            rows = by_version[version]
            updates += len(rows)
            self._send("server", version, {**per_version(rows), "server/updates": float(updates)})

    def _send(self, kind: str, step: int, values: dict[str, float]) -> None:
        if step <= self.last[kind]:
            return
        self.last[kind] = step
        self._each("log", step, values)
        if self.saving:
            self.save()  # what was sent, for a resume from any later crash

    def finish(self, folder: Path, files: Sequence[Path], failed: bool) -> dict[str, Any]:
        """Upload the run folder's files, close every tracked run, wait for the trackers
        (at most DRAIN_SECONDS); what reached which tracker, for summary.json."""
        self._each("upload", folder, list(files))
        self._each("close", failed)
        self.calls.put(None)
        self.worker.join(DRAIN_SECONDS)
        late = self.worker.is_alive()
        if late:
            log.warning("tracking: the trackers did not catch up in %g s", DRAIN_SECONDS)
        return {
            "trackers": [t.name for t in self.trackers],
            "runs": dict(self.ids),
            "missed": {
                name: {"since_version": m.since, "error": m.error}
                for name, m in self.missed.items()
            }
            | ({"all": {"error": "still sending at the end"}} if late else {}),
        }

    def state(self) -> dict[str, Any]:
        return {"ids": dict(self.ids), "last": dict(self.last)}

    def save(self) -> None:
        """The tracked runs' ids and the last versions sent, in the run folder: a resume
        continues those runs and sends no version twice."""
        text = (json.dumps(self.state()) + "\n").encode()

        def write(handle: IO[bytes]) -> None:
            handle.write(text)

        write_atomically(self.folder / IDS_FILE, write)


def number(value: Any) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool) and math.isfinite(value)


def per_version(rows: list[dict[str, Any]]) -> dict[str, float]:
    """The updates of one release: how many, their staleness and the rule's weights."""
    staleness = [float(r["staleness"]) for r in rows if number(r.get("staleness"))]
    weights = [float(r["weight"]) for r in rows if number(r.get("weight"))]
    values = {"server/release_updates": float(len(rows))}
    if staleness:
        values["server/staleness_mean"] = sum(staleness) / len(staleness)
        values["server/staleness_max"] = max(staleness)
    if weights:
        values["server/weight_mean"] = sum(weights) / len(weights)
        values["server/weight_max"] = max(weights)
    return values


def server_view(engine: Any) -> dict[str, float]:
    """The engine's counters, tasks in flight, updates per second, and what its stages
    report (epsilon spent under DP, buffers under secure aggregation)."""

    counters = engine.counters
    elapsed = max(time.monotonic() - engine.wall_start, 1e-9)
    values = {
        "server/updates": float(counters.accepted),
        "server/rejected": float(counters.rejected),
        "server/lost": float(counters.failed),
        "server/late": float(counters.late),
        "server/in_flight": float(len(engine.standing.book.tasks)),
        "server/updates_per_second": counters.accepted / elapsed,
        "server/virtual_time": float(engine.standing.clock.now()),
    }
    return {**values, **engine.stages.figures()}
