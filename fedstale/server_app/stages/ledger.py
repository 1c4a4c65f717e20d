"""The privacy ledger: one line per release, written and flushed to disk before the
released model leaves the server, so that a crash at any point loses no release a client
received.

One ledger serves a run's whole lineage: the run that starts it keeps it in its folder
(`privacy-ledger.jsonl`), and every resume of that run and every fork of any of its
checkpoints, in whatever folder, appends to the same file (its absolute path travels in
the checkpoint). The accountant of a resumed run is rebuilt from the ledger, never from the
checkpoint, and before each release it takes in what other branches appended since, under
a lock held across check and append: two forks running at once share one budget.

The ledger cannot be rewound unseen. Its first line names the lineage (a random id) and
every line carries the SHA-256 of the line before it (`prev`): a line removed, inserted,
reordered or edited breaks the chain at the next line. A checkpoint records the lineage,
how many lines the ledger held and the hash of the last (its head); a resume or fork
refuses, in one line, a ledger of another lineage, shorter than its checkpoint says, whose
chain is broken anywhere, or whose line at the checkpoint's count is not the head it
recorded. Only a torn last line (no newline: a crash during the write, so a release whose
flush never returned, never sent) is tolerated: said, and cut off before the next append.
"""

from __future__ import annotations

import fcntl
import hashlib
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
LINEAGE = "lineage"  # the first line: the lineage's random id
MOVED = "moved"  # an --overwrite moved the run folder, ledger included, to `to`
NOT_EVENTS = (LINEAGE, MOVED)
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


class LedgerError(ConfigError):
    """A ledger that was rewound, edited or is not this lineage's: nothing is released."""


class ForeignLineage(LedgerError):
    """A whole, chained ledger of another lineage where the checkpoint's ledger was."""


def untrusted(problem: str) -> LedgerError:
    return LedgerError(
        f"resume-from: the privacy ledger of this run's lineage cannot be trusted: {problem}; "
        "restore it, or start a new run"
    )


def line_hash(raw: bytes) -> str:
    return hashlib.sha256(raw).hexdigest()


class Ledger:
    """Append-only, hash-chained list of releases, on disk (`path`) or, for an engine built
    without a run folder (unit tests, benches), in memory. Each reader sees every line
    once: `held` gives the lines written since it last looked (by anyone), checked."""

    def __init__(self, path: Path | None = None, run: str = "") -> None:
        self.path = path
        self.run = run
        self.kept: list[dict[str, Any]] = []  # the in-memory ledger
        self.seen = 0  # lines (in memory) or bytes (on disk) this reader has taken in
        self.count = 0  # lines read (on disk), the lineage line included
        self.head = ""  # the hash of the last line read
        self.lineage = ""
        self.torn = 0  # bytes of a torn last line, cut off before the next append
        self.moved_to: set[str] = set()  # where an --overwrite moved this ledger
        self._handle: IO[bytes] | None = None

    @classmethod
    def at(cls, path: Path, run: str) -> Ledger:
        """The file ledger at `path`: a new lineage's when the file is absent or empty."""
        path.parent.mkdir(parents=True, exist_ok=True)
        path.touch(exist_ok=True)
        ledger = cls(path.resolve(), run)
        with ledger.held():
            if not ledger.count:
                ledger.append({"origin": LINEAGE, "lineage": os.urandom(16).hex(), "run": run})
        return cls(path.resolve(), run)  # a reader that has seen nothing yet

    @classmethod
    def resumed(cls, state: dict[str, Any], run: str, near: Path | None = None) -> Ledger:
        """The ledger a checkpoint names, checked against what the checkpoint recorded; if
        that path now holds another lineage (the folder was overwritten), the checkpoint's
        own folder's ledger when it is the lineage's. One LedgerError line otherwise."""
        if "path" not in state:
            ledger = cls(None, run)
            ledger.kept = [dict(line) for line in state.get("entries", [])]
            return ledger
        if "lineage" not in state:
            raise LedgerError(
                f"resume-from: the checkpoint predates the chained privacy ledger "
                f"({state['path']}): its releases cannot be checked; start a new run"
            )
        recorded = Path(state["path"])
        beside = near / LEDGER_FILE if near is not None else None
        try:
            cls.checked(recorded, state, run)
            return cls(recorded.resolve(), run)
        except ForeignLineage as err:
            # the run folder was overwritten: the lineage's ledger moved aside with the
            # folder this resume reads its checkpoint from (only then is it looked for)
            if beside is None or beside.resolve() == recorded.resolve():
                raise untrusted(str(err)) from None
            try:
                ledger = cls.checked(beside, state, run)
            except LedgerError as other:
                raise untrusted(f"{err}; {other}") from None
            if str(beside.resolve()) not in ledger.moved_to:
                # a copy cannot be told from the lineage's ledger: releases made after the
                # copy was taken would go uncounted; only a move by --overwrite is followed
                raise untrusted(
                    f"{err}; {beside} is of this lineage but no --overwrite moved it there "
                    "(a copy may miss later releases)"
                ) from None
            log.warning("privacy ledger: %s holds another lineage; using %s", recorded, beside)
            return cls(beside.resolve(), run)
        except LedgerError as err:
            raise untrusted(str(err)) from None

    @classmethod
    def checked(cls, path: Path, state: dict[str, Any], run: str) -> Ledger:
        """The ledger at `path` verified against the checkpoint (a reader that has read it
        all: read it again from a fresh one); LedgerError: missing, rewound, edited;
        ForeignLineage."""
        if not path.is_file():
            raise LedgerError(f"{path} is missing")
        verified = cls(path.resolve(), run)
        verified.verify(state)
        return verified

    def verify(self, state: dict[str, Any]) -> None:
        """The whole file read and chained; its lineage and its line at the checkpoint's
        count are the checkpoint's."""
        heads: dict[int, str] = {}
        with self.held(heads=heads):
            pass
        if self.lineage and self.lineage != state["lineage"]:
            raise ForeignLineage(f"{self.path} is another lineage's ledger ({self.lineage})")
        lines = int(state["lines"])
        if self.count < lines:
            raise LedgerError(
                f"{self.path} holds {self.count} lines, the checkpoint counted {lines} "
                "(lines were removed)"
            )
        if heads.get(lines) != state["head"]:
            raise LedgerError(f"{self.path}: line {lines} is not the one the checkpoint recorded")

    def state(self) -> dict[str, Any]:
        """What a checkpoint keeps: the file's path, lineage, line count and head (the
        entries when held in memory)."""
        if self.path is None:
            return {"entries": [dict(line) for line in self.kept]}
        return {
            "path": str(self.path),
            "lineage": self.lineage,
            "lines": self.count,
            "head": self.head,
        }

    @contextmanager
    def held(self, heads: dict[int, str] | None = None) -> Iterator[list[dict[str, Any]]]:
        """The release lines written since this reader last looked, checked against the
        chain, with the ledger locked against other writers until the block ends (appends
        inside it reach the disk at once). `heads` gets each line's hash by its number."""
        if self.path is None:
            new, self.seen = self.kept[self.seen :], len(self.kept)
            yield new
            return
        with self.path.open("a+b") as handle:
            fcntl.flock(handle, fcntl.LOCK_EX)
            self._handle = handle
            try:
                handle.seek(self.seen)
                yield self.chained(handle.read(), heads)
            finally:
                self._handle = None
                fcntl.flock(handle, fcntl.LOCK_UN)

    def chained(self, data: bytes, heads: dict[int, str] | None) -> list[dict[str, Any]]:
        """The complete lines of `data` (read from `seen` on), each checked to follow the
        one before; a last line without its newline is a torn write (LedgerError for any
        other damage)."""
        lines = []
        complete, _, rest = data.rpartition(b"\n")
        body = complete + b"\n" if complete or data.startswith(b"\n") else b""
        self.torn = len(rest)
        if rest:
            log.warning(
                "privacy ledger %s: its last line was cut short by a crash (a release whose "
                "write never returned, never sent): it will be cut off",
                self.path,
            )
        for raw in body.splitlines():
            self.count += 1
            line = self.link(raw)
            if heads is not None:
                heads[self.count] = self.head
            if line.get("origin") == MOVED:
                self.moved_to.add(str(line.get("to")))
            if line.get("origin") not in NOT_EVENTS:
                lines.append(line)
        self.seen += len(body)
        return lines

    def link(self, raw: bytes) -> dict[str, Any]:
        try:
            line = json.loads(raw)
            if line.get("origin") not in NOT_EVENTS:
                _ = [line[name] for name in EVENT_FIELDS]
        except (json.JSONDecodeError, KeyError, TypeError, AttributeError):
            raise LedgerError(
                f"{self.path}: line {self.count} is not a ledger line (edited or damaged)"
            ) from None
        if line.get("prev", "") != self.head:
            raise LedgerError(
                f"{self.path}: line {self.count} does not follow line {self.count - 1} "
                "(lines removed, inserted or edited)"
            )
        if self.count == 1:
            if line.get("origin") != LINEAGE:
                raise LedgerError(f"{self.path}: its first line names no lineage")
            self.lineage = str(line["lineage"])
        self.head = line_hash(raw)
        return line

    def append(self, line: dict[str, Any]) -> None:
        """Chain one line to the last and flush it to the disk (inside `held` for a file
        ledger); this reader has seen it."""
        if self.path is None:
            self.kept.append(line)
            self.seen = len(self.kept)
            return
        handle = self._handle
        if handle is None:
            raise RuntimeError("a file ledger is appended to inside held()")
        if self.torn:  # the torn tail of a crashed write: never a release that was sent
            handle.truncate(self.seen)
            self.torn = 0
        raw = json.dumps({**line, "prev": self.head}, sort_keys=True).encode("utf-8")
        handle.seek(0, os.SEEK_END)
        handle.write(raw + b"\n")
        handle.flush()
        os.fsync(handle.fileno())
        self.count += 1
        self.head = line_hash(raw)
        if self.count == 1:
            self.lineage = str(line["lineage"])
        self.seen = handle.tell()

    def entries(self) -> list[dict[str, Any]]:
        """The lines this reader has not taken in yet (a new reader: all of them)."""
        with self.held() as lines:
            return lines


def releases(lines: list[dict[str, Any]]) -> int:
    """How many of the entries are releases of the lineage (not an accountant's priors)."""
    return sum(1 for line in lines if line.get("origin") == RELEASE)


def mark_moved(moved: Path) -> None:
    """`--overwrite` moved a run folder, its ledger with it, to `moved`'s folder: said on the
    ledger (a chained line), so that a fork of the old checkpoint follows it there, and a
    copy made by hand is never taken for it."""
    ledger = Ledger(moved.resolve())
    with ledger.held():
        ledger.append({"origin": MOVED, "to": str(moved.resolve()), "time": round(time.time(), 3)})
