"""The privacy ledger: one line per release, written and flushed to disk before the
released model leaves the server, so that a crash at any point loses no release a client
received.

One ledger serves a run's whole lineage: the run that starts it keeps it in its folder
(`privacy-ledger.jsonl`), and every resume of that run and every fork of any of its
checkpoints, in whatever folder, appends to the same file (its absolute path travels in
the checkpoint). The accountant of a resumed run is rebuilt from the ledger, never from the
checkpoint, and before each release it takes in what other branches appended since, under
a lock held across check and append: two forks running at once share one budget.

A line that does not parse can only be the last one a crash cut short before its flush
returned, i.e. a release never sent: it is skipped with a warning.
"""

from __future__ import annotations

import fcntl
import json
import logging
import os
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import IO, Any

from fedstale.common.config import ConfigError

log = logging.getLogger("fedstale")
LEDGER_FILE = "privacy-ledger.jsonl"
RELEASE = "release"  # a model this lineage released
PRIOR = "accountant"  # an event the accountant held when the lineage began (library door)
EVENT_FIELDS = ("noise_multiplier", "sample_size", "population_size")


def entry(origin: str, run: str, version: int, event: Any) -> dict[str, Any]:
    """One ledger line: what the accountant needs (the event) and whose release it was."""
    return {
        "origin": origin,
        "run": run,
        "version": version,
        "time": round(time.time(), 3),
        **{name: getattr(event, name) for name in EVENT_FIELDS},
    }


class Ledger:
    """Append-only list of releases, on disk (`path`) or, for an engine built without a run
    folder (unit tests, benches), in memory. Each reader sees every line once: `held`
    gives the lines written since it last looked (by anyone)."""

    def __init__(self, path: Path | None = None, run: str = "") -> None:
        self.path = path
        self.run = run
        self.kept: list[dict[str, Any]] = []  # the in-memory ledger
        self.seen = 0  # lines (in memory) or bytes (on disk) this reader has taken in
        self._handle: IO[bytes] | None = None

    @classmethod
    def at(cls, path: Path, run: str) -> Ledger:
        """The file ledger at `path` (created empty if it is not there)."""
        path.parent.mkdir(parents=True, exist_ok=True)
        path.touch(exist_ok=True)
        return cls(path.resolve(), run)

    @classmethod
    def resumed(cls, state: dict[str, Any], run: str) -> Ledger:
        """The ledger a checkpoint names, or one ConfigError line when it is gone."""
        if "path" not in state:
            ledger = cls(None, run)
            ledger.kept = [dict(line) for line in state.get("entries", [])]
            return ledger
        path = Path(state["path"])
        if not path.is_file():
            raise ConfigError(
                f"resume-from: the privacy ledger of this run's lineage, {path}, is missing: "
                "the releases it recorded cannot be counted; restore it, or start a new run"
            )
        return cls(path, run)

    def state(self) -> dict[str, Any]:
        """What a checkpoint keeps: the file's path (the entries when held in memory)."""
        if self.path is None:
            return {"entries": [dict(line) for line in self.kept]}
        return {"path": str(self.path)}

    @contextmanager
    def held(self) -> Iterator[list[dict[str, Any]]]:
        """The lines written since this reader last looked, with the ledger locked against
        other writers until the block ends (appends inside it reach the disk at once)."""
        if self.path is None:
            new, self.seen = self.kept[self.seen :], len(self.kept)
            yield new
            return
        with self.path.open("a+b") as handle:
            fcntl.flock(handle, fcntl.LOCK_EX)
            self._handle = handle
            try:
                handle.seek(self.seen)
                text = handle.read()
                self.seen += len(text)
                yield parsed(text.decode("utf-8", errors="replace"), self.path)
            finally:
                self._handle = None
                fcntl.flock(handle, fcntl.LOCK_UN)

    def append(self, line: dict[str, Any]) -> None:
        """Write one line and flush it to the disk (inside `held` for a file ledger); this
        reader has seen it."""
        if self.path is None:
            self.kept.append(line)
            self.seen = len(self.kept)
            return
        handle = self._handle
        if handle is None:
            raise RuntimeError("a file ledger is appended to inside held()")
        handle.seek(0, os.SEEK_END)
        end = handle.tell()
        if end:
            handle.seek(end - 1)
            if handle.read(1) != b"\n":
                handle.write(b"\n")  # after a line a crash cut short
        handle.write((json.dumps(line, sort_keys=True) + "\n").encode("utf-8"))
        handle.flush()
        os.fsync(handle.fileno())
        self.seen = handle.tell()

    def entries(self) -> list[dict[str, Any]]:
        """The lines this reader has not taken in yet (a new reader: all of them)."""
        with self.held() as lines:
            return lines


def parsed(text: str, path: Path) -> list[dict[str, Any]]:
    lines = []
    for number, raw in enumerate(text.splitlines(), start=1):
        if not raw.strip():
            continue
        try:
            line = json.loads(raw)
            _ = [line[name] for name in EVENT_FIELDS]
        except (json.JSONDecodeError, KeyError, TypeError):
            log.warning("privacy ledger %s: line %d cut short by a crash, never sent", path, number)
            continue
        lines.append(line)
    return lines


def releases(lines: list[dict[str, Any]]) -> int:
    """How many of the entries are releases of the lineage (not an accountant's priors)."""
    return sum(1 for line in lines if line.get("origin") == RELEASE)
