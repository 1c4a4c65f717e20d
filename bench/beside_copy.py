"""The suite with a second suite running beside it (issue 46): `.ci/run` from clean clones,
one after the other, while another clean clone loops the deployment and port tests from the
first suite's start to the last one's end. One command for the measurement in
docs/testing.md ("Beside a copy").

    python -m bench.beside_copy [--suites 2] [--slowdown 1.8] [--commit HEAD] [--out DIR]

`--slowdown F` runs everything (both clones, every process they start) on 1/F of this
machine's CPU time: a CFS quota of cores/F cores on a cgroup of its own, so a fast host
stands in for one F times slower (the suite's wall-clock waits are not scaled, and podman's
containers run in cgroups of their own, outside the quota). It needs a writable cgroup
cpu controller (v1 or v2); without one it stops in one line.

Each suite's and each pass's log, the suites' JUnit files, `results.jsonl` (a row per
suite and per pass of the copy) and `summary.md` go to DIR (default
runs/beside-copy-<UTC time>; an existing DIR is refused, never overwritten). The clones are
made in a temporary folder and removed at the end; nothing the runs start outlives them.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
from bench.golden_drift import machine  # noqa: E402
from fedstale.launcher.deploy import stop  # noqa: E402

SUITE = "CI=true bash .ci/run"
COPY = (
    "make -s setup && .venv/bin/python -m pytest -q -p no:cacheprovider "
    "tests/test_deployment.py tests/test_ports.py"
)
CGROUP_V1 = Path("/sys/fs/cgroup/cpu")
CGROUP_V2 = Path("/sys/fs/cgroup")
PERIOD_US = 20_000  # a short CFS period: a throttled process waits at most this long
STOP_GRACE = 120.0  # a SIGTERMed pytest unwinds its test and stops its Flower processes


def cpu_quota(cores: int, slowdown: float, period_us: int = PERIOD_US) -> int:
    """CFS quota, per `period_us`, that leaves `cores` cores 1/`slowdown` of their time."""
    return max(1000, round(period_us * cores / slowdown))


class Refused(Exception):
    """A failure the user can mend: one line, exit code 2."""


@dataclass
class CpuLimit:
    """This process (and so all it starts afterwards) in a cgroup of its own with a quota."""

    folder: Path

    @staticmethod
    def start(slowdown: float) -> CpuLimit:
        quota = cpu_quota(os.cpu_count() or 1, slowdown)
        v1 = (CGROUP_V1 / "cpu.cfs_quota_us").exists()
        folder = (CGROUP_V1 if v1 else CGROUP_V2) / f"fedstale-beside-{os.getpid()}"
        try:
            folder.mkdir()
            if v1:
                (folder / "cpu.cfs_period_us").write_text(str(PERIOD_US))
                (folder / "cpu.cfs_quota_us").write_text(str(quota))
            else:
                (folder / "cpu.max").write_text(f"{quota} {PERIOD_US}")
            (folder / "cgroup.procs").write_text(str(os.getpid()))
        except OSError as err:
            with contextlib.suppress(OSError):
                folder.rmdir()  # made, but not usable
            raise Refused(
                f"--slowdown needs a writable cgroup cpu controller "
                f"({err}); run without --slowdown, or as a user who may create cgroups"
            ) from None
        return CpuLimit(folder)

    def stop(self) -> None:
        """Back to the parent group; the emptied group removed."""
        (self.folder.parent / "cgroup.procs").write_text(str(os.getpid()))
        for _ in range(50):  # exited children leave the group a moment later
            try:
                self.folder.rmdir()
                return
            except OSError:
                time.sleep(0.2)


def clone(commit: str, folder: Path) -> Path:
    subprocess.run(["git", "clone", "-q", str(ROOT), str(folder)], check=True)
    subprocess.run(["git", "-C", str(folder), "checkout", "-q", commit], check=True)
    return folder


def summary_line(log: Path) -> str:
    """pytest's last "N passed ..." line in `log` ("" if none)."""
    lines = [
        ln
        for ln in log.read_text(errors="replace").splitlines()
        if re.search(r"\d+ passed|\d+ failed|no tests ran", ln)
    ]
    return lines[-1].strip("= ") if lines else ""


@dataclass
class Shell:
    """One `bash -c` command in a session of its own, its output to a log."""

    command: str
    cwd: Path
    log: Path
    env: dict[str, str] = field(default_factory=dict)
    process: subprocess.Popen | None = None
    started: float = field(default_factory=time.monotonic)  # run() restarts it

    def run(self) -> dict[str, Any]:
        self.started = time.monotonic()
        with self.log.open("w") as out:
            self.process = subprocess.Popen(
                ["bash", "-c", self.command],
                cwd=self.cwd,
                env={**os.environ, **self.env},
                stdout=out,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )
            self.process.wait()
        return self.row()

    def row(self) -> dict[str, Any]:
        """Its exit code (None while it runs), wall time so far and pytest's last line."""
        code = self.process.poll() if self.process is not None else None
        wall = round(time.monotonic() - self.started, 1)
        return {"rc": code, "wall_s": wall, "summary": summary_line(self.log)}

    def terminate(self) -> None:
        """SIGTERM to its process group (pytest then unwinds its test), SIGKILL past the grace."""
        if self.process is not None:
            stop(self.process, STOP_GRACE)


class Copy(threading.Thread):
    """The copy: `command` again and again in its clone until stopped."""

    def __init__(self, command: str, folder: Path, out: Path, record: Callable[[dict], None]):
        super().__init__(daemon=True)
        self.command, self.folder, self.out, self.record = command, folder, out, record
        self.stopping = threading.Event()
        self.current: Shell | None = None

    def run(self) -> None:
        index = 0
        while not self.stopping.is_set():
            index += 1
            self.current = Shell(self.command, self.folder, self.out / f"copy-pass-{index}.log")
            row = self.current.run()
            self.record({"kind": "copy", "pass": index, **row, "stopped": self.stopping.is_set()})

    def stop(self) -> None:
        """Its running pass stopped; a pass that was just starting is stopped too."""
        self.stopping.set()
        while self.is_alive():
            if self.current is not None:
                self.current.terminate()
            self.join(1.0)


def provenance(args: argparse.Namespace) -> dict[str, Any]:
    return {
        "kind": "provenance",
        "date": datetime.now(UTC).isoformat(timespec="seconds"),
        "commit": args.commit,
        "cpu": machine(),
        "cores": os.cpu_count(),
        "slowdown": args.slowdown,
        "suite_command": args.suite_command,
        "copy_command": args.copy_command,
    }


def table(rows: list[dict[str, Any]]) -> str:
    lines = ["| what | exit | wall | pytest |", "|---|---|---|---|"]
    for row in rows:
        if row["kind"] == "suite":
            what = f"suite {row['suite']}" + (" (stopped halfway)" if row["stopped"] else "")
        elif row["kind"] == "copy":
            what = f"copy pass {row['pass']}" + (" (stopped at the end)" if row["stopped"] else "")
        else:
            continue
        minutes = f"{row['wall_s']:,.0f} s ({row['wall_s'] / 60:.1f} min)"
        lines.append(f"| {what} | {row['rc']} | {minutes} | {row['summary']} |")
    return "\n".join(lines)


def resolve(commit: str) -> str:
    """The full hash `commit` names in this checkout."""
    found = subprocess.run(
        ["git", "-C", str(ROOT), "rev-parse", "--verify", "--quiet", f"{commit}^{{commit}}"],
        capture_output=True,
        text=True,
    )
    if found.returncode != 0:
        raise Refused(f"--commit {commit} names no commit of {ROOT}; give a hash or a branch")
    return found.stdout.strip()


def measure(args: argparse.Namespace, out: Path, work: Path, rows: list[dict[str, Any]]) -> None:
    """The suites beside the copy; each row appended to `rows` (and results.jsonl) as it
    comes, so a run stopped halfway keeps what it measured."""
    lock = threading.Lock()

    def record(row: dict[str, Any]) -> None:
        with lock:  # the progress line too: print() from two threads can join two lines
            rows.append(row)
            with (out / "results.jsonl").open("a") as file:
                file.write(json.dumps(row) + "\n")
            print(f"beside_copy: {json.dumps(row)}", flush=True)

    record(provenance(args))
    copy = Copy(args.copy_command, clone(args.commit, work / "copy"), out, record)
    copy.start()
    suite: Shell | None = None
    try:
        time.sleep(args.head_start)
        for index in range(1, args.suites + 1):
            junit = out / f"suite-{index}-junit.xml"
            suite = Shell(
                args.suite_command,
                clone(args.commit, work / f"suite-{index}"),
                out / f"suite-{index}.log",
                {"PYTEST_ADDOPTS": f"--junitxml={junit}"},
            )
            record({"kind": "suite", "suite": index, **suite.run(), "stopped": False})
            shutil.rmtree(work / f"suite-{index}", ignore_errors=True)
            suite = None
    finally:
        if suite is not None:  # stopped halfway: its row says so
            suite.terminate()
            record({"kind": "suite", "suite": index, **suite.row(), "stopped": True})
        copy.stop()


def stop_on_sigterm(signum: int, frame: object) -> None:
    raise KeyboardInterrupt(f"signal {signum}")  # unwinds: the runs are stopped, clones removed


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m bench.beside_copy", description=__doc__.split("\n\n")[0]
    )
    parser.add_argument("--suites", type=int, default=2, help="suites one after the other (2)")
    parser.add_argument("--slowdown", type=float, default=1.0, help="run on 1/F of the CPU (1)")
    parser.add_argument("--commit", default="HEAD", help="the commit to clone (HEAD)")
    parser.add_argument("--out", type=Path, help="results folder (runs/beside-copy-<time>)")
    parser.add_argument("--head-start", type=float, default=60.0, help="copy's lead, s (60)")
    parser.add_argument("--suite-command", default=SUITE, help=f"each suite ({SUITE!r})")
    parser.add_argument("--copy-command", default=COPY, help="each pass of the copy")
    args = parser.parse_args(argv)
    if args.suites < 1 or args.slowdown < 1.0:
        print(
            "bench.beside_copy: --suites must be 1 or more and --slowdown 1 or more",
            file=sys.stderr,
        )
        return 2
    stamp = datetime.now(UTC).strftime("%Y%m%d-%H%M%S")
    out = args.out or ROOT / "runs" / f"beside-copy-{stamp}"
    if out.exists():
        print(f"bench.beside_copy: {out} exists; name a new folder with --out", file=sys.stderr)
        return 2
    try:
        args.commit = resolve(args.commit)
        limit = CpuLimit.start(args.slowdown) if args.slowdown > 1.0 else None
    except Refused as err:
        print(f"bench.beside_copy: {err}", file=sys.stderr)
        return 2
    out.mkdir(parents=True)
    signal.signal(signal.SIGTERM, stop_on_sigterm)
    work = Path(tempfile.mkdtemp(prefix="fedstale-beside-"))
    rows: list[dict[str, Any]] = []
    stopped = None
    try:
        measure(args, out, work, rows)
    except KeyboardInterrupt as signalled:
        stopped = str(signalled) or "Ctrl-C"
    finally:
        shutil.rmtree(work, ignore_errors=True)
        if limit is not None:
            limit.stop()
    report = table(rows)
    (out / "summary.md").write_text(report + "\n")
    print(report)
    if stopped:
        print(
            f"bench.beside_copy: stopped by {stopped}; what it measured is in {out}",
            file=sys.stderr,
        )
        return 130
    return 0 if all(row["rc"] == 0 for row in rows if row["kind"] == "suite") else 1


if __name__ == "__main__":
    sys.exit(main())
