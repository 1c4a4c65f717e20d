"""bench.beside_copy, the driver of the suite-beside-a-copy measurement, on stand-in commands:
the suites run one after the other while the copy loops, every row is written, the copy is
stopped when the last suite ends, and nothing it started is left (docs/testing.md)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from bench.beside_copy import CGROUP_V1, CGROUP_V2, cpu_quota

ROOT = Path(__file__).resolve().parent.parent
SUITE = "sleep 1; echo '2 passed in 1.00s'"
COPY = "sleep 0.3; echo '1 passed in 0.30s'"


def driver(tmp_path: Path, *args: str) -> subprocess.Popen:
    """The driver in its own process, its temporary clones under tmp_path/tmp."""
    (tmp_path / "tmp").mkdir(exist_ok=True)
    command = [sys.executable, "-m", "bench.beside_copy", *args]
    env = {**os.environ, "TMPDIR": str(tmp_path / "tmp")}
    return subprocess.Popen(
        command, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
    )


def rows(out: Path) -> list[dict]:
    return [json.loads(line) for line in (out / "results.jsonl").read_text().splitlines()]


def test_the_quota_leaves_the_cores_their_time_divided_by_the_slowdown() -> None:
    assert cpu_quota(2, 1.8, 20_000) == 22_222  # 2 cores x 20 ms / 1.8
    assert cpu_quota(2, 1.0, 20_000) == 40_000
    assert cpu_quota(1, 100.0, 20_000) == 1_000  # the kernel's smallest quota


def test_suites_run_one_after_another_while_the_copy_loops(tmp_path: Path) -> None:
    out = tmp_path / "out"
    args = ["--suites", "2", "--head-start", "0.5", "--out", str(out)]
    done = driver(tmp_path, *args, "--suite-command", SUITE, "--copy-command", COPY)
    stdout, stderr = done.communicate(timeout=120)
    assert done.returncode == 0, stderr

    found = rows(out)
    assert found[0]["kind"] == "provenance" and found[0]["cores"] == os.cpu_count()
    suites = [row for row in found if row["kind"] == "suite"]
    assert [row["suite"] for row in suites] == [1, 2]
    assert all(row["rc"] == 0 and row["summary"] == "2 passed in 1.00s" for row in suites)
    passes = [row for row in found if row["kind"] == "copy"]
    assert len(passes) >= 3  # 2.5 s of suites against 0.3 s passes
    assert [row["pass"] for row in passes] == list(range(1, len(passes) + 1))
    assert not any(row["stopped"] for row in passes[:-1])
    assert "| suite 2 | 0 |" in (out / "summary.md").read_text()
    assert (out / "suite-1.log").read_text().strip() == "2 passed in 1.00s"
    assert list((tmp_path / "tmp").iterdir()) == []  # the clones are removed
    progress = [line for line in stdout.splitlines() if line.startswith("beside_copy: ")]
    assert len(progress) == len(found)  # a line as each suite and pass ends


def test_an_existing_results_folder_is_refused(tmp_path: Path) -> None:
    (tmp_path / "out").mkdir()
    (tmp_path / "out" / "results.jsonl").write_text("earlier\n")
    done = driver(tmp_path, "--out", str(tmp_path / "out"))
    _, stderr = done.communicate(timeout=60)
    assert done.returncode == 2
    assert stderr.strip().splitlines() == [
        f"bench.beside_copy: {tmp_path / 'out'} exists; name a new folder with --out"
    ]
    assert (tmp_path / "out" / "results.jsonl").read_text() == "earlier\n"


def test_a_sigterm_stops_the_running_suite_and_the_copy(tmp_path: Path) -> None:
    marker = f"{time.time_ns() % 10**6}.{os.getpid()}"  # sleeps no other process runs
    out = tmp_path / "out"
    done = driver(
        tmp_path,
        *["--suites", "1", "--head-start", "0", "--out", str(out)],
        *["--suite-command", f"sleep 600{marker}1", "--copy-command", f"sleep 600{marker}2"],
    )
    deadline = time.monotonic() + 60
    while len(sleepers(marker)) < 2 and time.monotonic() < deadline:
        time.sleep(0.2)
    assert len(sleepers(marker)) == 2
    done.send_signal(signal.SIGTERM)
    _, stderr = done.communicate(timeout=60)
    assert sleepers(marker) == []
    assert list((tmp_path / "tmp").iterdir()) == []
    assert done.returncode == 130 and "Traceback" not in stderr, stderr
    assert stderr.strip().splitlines()[-1] == (
        f"bench.beside_copy: stopped by signal 15; what it measured is in {out}"
    )
    rows = [json.loads(line) for line in (out / "results.jsonl").read_text().splitlines()]
    suite = next(row for row in rows if row["kind"] == "suite")
    assert suite["stopped"] and suite["rc"] is not None  # its row kept, with how it ended
    assert "| suite 1 (stopped halfway) |" in (out / "summary.md").read_text()


def sleepers(marker: str) -> list[str]:
    found = subprocess.run(["pgrep", "-f", f"^sleep 600{marker}"], capture_output=True, text=True)
    return found.stdout.split()


def cgroup_writable() -> bool:
    if (CGROUP_V1 / "cpu.cfs_quota_us").exists():
        return os.access(CGROUP_V1, os.W_OK)
    controls = CGROUP_V2 / "cgroup.subtree_control"
    return os.access(CGROUP_V2, os.W_OK) and controls.exists() and "cpu" in controls.read_text()


@pytest.mark.skipif(not cgroup_writable(), reason="no writable cgroup cpu controller here")
def test_a_slowdown_runs_the_suites_and_the_copy_in_a_limited_group(tmp_path: Path) -> None:
    out = tmp_path / "out"
    show = "cat /proc/self/cgroup; echo '1 passed in 0.01s'"
    done = driver(
        tmp_path,
        *["--suites", "1", "--head-start", "0.5", "--slowdown", "2", "--out", str(out)],
        *["--suite-command", show, "--copy-command", f"sleep 0.2; {show}"],
    )
    _, stderr = done.communicate(timeout=120)
    assert done.returncode == 0, stderr
    group = f"fedstale-beside-{done.pid}"
    assert group in (out / "suite-1.log").read_text()
    assert group in (out / "copy-pass-1.log").read_text()
    assert not (CGROUP_V1 / group).exists() and not (CGROUP_V2 / group).exists()


def test_a_commit_that_does_not_exist_is_refused_in_one_line(tmp_path: Path) -> None:
    done = driver(tmp_path, "--commit", "no-such-commit", "--out", str(tmp_path / "out"))
    _, stderr = done.communicate(timeout=60)
    assert done.returncode == 2
    assert len(stderr.strip().splitlines()) == 1 and "--commit no-such-commit" in stderr
    assert not (tmp_path / "out").exists()
