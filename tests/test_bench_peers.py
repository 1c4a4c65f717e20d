"""bench.peers: its table's arithmetic, and the command as a user runs it (fedstale's rows;
pfl's own rows need pfl's virtualenv, made from PyPI, in the last test)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from bench.peers import rotated, row_of, table
from tests import timing
from tests.wheel_env import link, requirement_closure, runners_torch_is_cpu_build

ROOT = Path(__file__).resolve().parent.parent


def result(row: str, rate: float, rep: int = 0, accuracy: float | None = 0.8) -> dict:
    return {"model": "linear", "row": row, "rep": rep, "rate": rate, "accuracy": accuracy}


def test_the_table_gives_medians_and_each_row_against_the_bare_loop_and_pfl() -> None:
    results = [
        result("bare", 40.0, 0, None),
        result("bare", 50.0, 1, None),
        result("bare", 60.0, 2, None),
        result("pfl-1", 30.0, 0, 0.84),
        result("pfl-2", 50.0, 0, 0.84),
        result("fedstale-1", 45.0, 0),
        result("fedstale-1", 55.0, 1),
        result("fedstale-2", 75.0, 0),
        result("linear-elsewhere", 1.0),  # not a row asked for: left out
    ]
    rows = table("linear", ["bare", "pfl-1", "pfl-2", "fedstale-1", "fedstale-2"], results)
    cells = [[c.strip() for c in line.strip("|").split("|")] for line in rows[2:]]
    assert cells[0][1:] == ["50.0 [40.0-60.0]", "1.00", "", ""]
    assert cells[1][1:] == ["30.0 [30.0-30.0]", "0.60", "", "0.8400"]
    assert cells[3][1:] == ["50.0 [45.0-55.0]", "1.00", "1.67", "0.8000"]  # 50 / 30
    assert cells[4][1:] == ["75.0 [75.0-75.0]", "1.50", "1.50", "0.8000"]  # 75 / 50
    assert len(rows) == 2 + 5


def test_rows_say_who_runs_them_on_how_many_processes_and_rotate_per_repetition() -> None:
    assert row_of("pfl-2").peer == "pfl" and row_of("pfl-2").processes == 2
    fedbuff = row_of("fedbuff-1")
    assert fedbuff.peer == "fedstale" and "strategy=fedbuff" in fedbuff.run_config
    assert "trainer=auto" in row_of("closed-2").run_config
    assert rotated(["a", "b", "c"], 0) == ["a", "b", "c"]
    assert rotated(["a", "b", "c"], 4) == ["b", "c", "a"]


def peers(*args: str, timeout: float = 600) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "bench.peers", *args],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=timeout,
    )


@pytest.mark.integration
def test_fedstales_rows_run_resume_and_refuse_another_protocol(tmp_path: Path) -> None:
    out = tmp_path / "peers"
    common = ["--models", "linear", "--reps", "1", "--out", str(out)]
    rows = ["--rows", "bare,fedstale-1,fedstale-2"]
    first = peers(*common, *rows, "--updates", "linear=20")
    assert first.returncode == 0, first.stderr[-2000:]
    results = [json.loads(line) for line in (out / "results.jsonl").read_text().splitlines()]
    assert sorted(r["row"] for r in results) == ["bare", "fedstale-1", "fedstale-2"]
    assert all(r["rate"] > 0 for r in results)
    accuracy = {r["row"]: r["accuracy"] for r in results}
    assert accuracy["fedstale-1"] == accuracy["fedstale-2"]  # one worker or two: one run
    assert "| fedstale `--local --workers 2`, FedAvg, autograd |" in first.stdout

    again = peers(*common, *rows, "--updates", "linear=20")
    assert again.returncode == 0
    assert len((out / "results.jsonl").read_text().splitlines()) == 3  # nothing rerun

    other = peers(*common, *rows, "--updates", "linear=30")
    assert other.returncode == 2
    assert other.stderr.strip().splitlines() == [
        f"bench.peers: {out / 'linear'} holds another protocol's results: name another --out"
    ]


@pytest.mark.integration
@pytest.mark.xdist_group("venvs")
@pytest.mark.skipif(sys.version_info >= (3, 13), reason="pfl 0.6.0 needs Python < 3.13")
def test_pfl_runs_the_same_protocol_from_its_own_virtualenv(tmp_path: Path) -> None:
    """pfl 0.6.0 from PyPI in a virtualenv of its own, on one process and under torchrun.
    The virtualenv starts with this one's torch hard-linked in (as the wheel's do): pip
    then finds the torch release bench.peers pins already there and installs only pfl."""
    venv = Path(os.environ.get("FEDSTALE_PFL_VENV", tmp_path / "venv-pfl"))
    if not venv.exists():
        subprocess.run([sys.executable, "-m", "venv", venv], check=True, timeout=timing.left())
        if runners_torch_is_cpu_build():
            link(requirement_closure("torch"), venv)
    out = tmp_path / "peers"
    done = peers(
        *["--models", "linear", "--reps", "1", "--out", str(out), "--pfl-venv", str(venv)],
        *["--rows", "pfl-1,pfl-2", "--updates", "linear=20"],
        timeout=timing.left(),
    )
    assert done.returncode == 0, done.stderr[-2000:]
    results = [json.loads(line) for line in (out / "results.jsonl").read_text().splitlines()]
    assert sorted(r["row"] for r in results) == ["pfl-1", "pfl-2"]
    # two iterations of ten clients from fedstale's initial weights: well above chance
    assert all(r["rate"] > 0 and r["accuracy"] > 0.5 for r in results)


@pytest.mark.integration
def test_the_profile_splits_an_update_into_training_task_and_engine() -> None:
    done = subprocess.run(
        [sys.executable, "-m", "bench.local_profile", "--updates", "20", "--workers", "1,2"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=timing.left(),
    )
    assert done.returncode == 0, done.stderr[-2000:]
    values = dict(line.strip().rsplit(": ", 1) for line in done.stdout.splitlines() if ": " in line)
    shares = ["local training ms", "rest of the task ms", "engine ms", "worker CPU ms"]
    assert all(float(values[name]) > 0 for name in shares)
    assert float(values["gather x[rows]"]) > 0 and float(values["in-place update"]) > 0
    assert float(values["parameters"]) == 7850 and float(values["pickle and unpickle us"]) > 0


def test_a_pfl_virtualenv_that_cannot_be_made_is_one_line_and_exit_2(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    import bench.peers as bench_peers

    def failing(command: list[str], **kwargs: object) -> subprocess.CompletedProcess:
        error = "ERROR: No matching distribution found for pfl==0.6.0"
        return subprocess.CompletedProcess(command, 1, stdout="", stderr=error)

    monkeypatch.setattr(bench_peers, "run_quiet", failing)
    venv = tmp_path / "v"
    with pytest.raises(SystemExit) as stopped:
        bench_peers.main(["--rows", "pfl-1", "--pfl-venv", str(venv)])
    assert stopped.value.code == 2
    assert capsys.readouterr().err.strip().splitlines() == [
        f"bench.peers: could not make pfl's virtualenv (python -m venv {venv}): "
        "ERROR: No matching distribution found for pfl==0.6.0"
    ]
