"""`fedstale run --local --seeds ... --grid ...`: a grid's runs in one process, their waiting
tasks trained as one cohort (fedstale/launcher/grid.py, inprocess.py CohortPool); each run
equal to its solo `trainer=cohort` run."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from fedstale.common.config import ConfigError
from fedstale.launcher.cli import main
from fedstale.launcher.grid import grid_runs, parse_axes
from fedstale.server_app.results import CHECKPOINT_FILE, read_jsonl
from tests import timing

ROOT = Path(__file__).resolve().parent.parent
WALL = {"wall_time", "compute_seconds"}  # what the wall clock measures differs run to run
BASE = "dataset=digits eval-interval=100 progress-interval=60"
SMALL = f"{BASE} max-updates=40"


def test_axes_are_read_from_seeds_and_grid_and_bad_ones_are_one_line() -> None:
    axes = parse_axes("strategy=fedbuff,fedasync lr=0.05,0.1", "0,1,2")
    assert axes == {"seed": [0, 1, 2], "strategy": ["fedbuff", "fedasync"], "lr": [0.05, 0.1]}
    for grid, seeds, said in [
        ("seed=3,4", "0,1", "'seed' is given twice"),
        ("strategy=", "", "cannot read"),
        ("run-name=a,b", "", "set per run by the grid"),
        ("strategy=fedbuff oops", "", "cannot read 'oops'"),
    ]:
        with pytest.raises(ConfigError, match=said):
            parse_axes(grid, seeds)


def test_each_combination_is_a_cohort_run_named_by_its_values() -> None:
    runs = grid_runs({"run-name": "paper", "lr": 0.1}, {"seed": [0, 1], "strategy": ["a", "b"]})
    names = [run["run-name"] for run in runs]
    assert names == [
        "paper-seed=0-strategy=a",
        "paper-seed=0-strategy=b",
        "paper-seed=1-strategy=a",
        "paper-seed=1-strategy=b",
    ]
    assert all(run["trainer"] == "cohort" and run["lr"] == 0.1 for run in runs)
    assert grid_runs({}, {"seed": [2]})[0]["run-name"] == "grid-seed=2"


def local(runs: Path, config: str, *flags: str) -> int:
    return main(["run", "--local", *flags, "--run-config", f"{SMALL} runs-dir={runs} {config}"])


def same_rows(left: list[dict], right: list[dict], tolerance: float = 1e-9) -> None:
    assert len(left) == len(right)
    for a, b in zip(left, right, strict=True):
        assert a.keys() == b.keys()
        for key, value in a.items():
            if key in WALL:
                continue
            if isinstance(value, float):
                assert value == pytest.approx(b[key], rel=tolerance, abs=tolerance), key
            else:
                assert value == b[key], key


def test_a_grid_trains_its_runs_together_and_each_equals_its_solo_run(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    grid_dir, solo_dir = tmp_path / "grid", tmp_path / "solo"
    assert local(grid_dir, "", "--seeds", "0,1", "--grid", "strategy=fedbuff,fedasync") == 0
    said = capsys.readouterr().err
    assert "fedstale: grid: 4 of 4 runs finished here" in said
    for seed in (0, 1):
        for strategy in ("fedbuff", "fedasync"):
            name = f"grid-seed={seed}-strategy={strategy}"
            config = f"seed={seed} strategy={strategy} trainer=cohort run-name={name}"
            assert local(solo_dir, config) == 0
            together, alone = grid_dir / name, solo_dir / name
            for rows in ("metrics.jsonl", "updates.jsonl"):
                same_rows(read_jsonl(together / rows), read_jsonl(alone / rows))
            grid_summary = json.loads((together / "summary.json").read_text())
            solo_summary = json.loads((alone / "summary.json").read_text())
            assert grid_summary["final_accuracy"] == pytest.approx(solo_summary["final_accuracy"])
            assert json.loads((together / "config.json").read_text())["trainer"] == "cohort"
            # four runs' waiting tasks in each cohort: larger than one run's
            cohorts, own = grid_summary["cohorts"], solo_summary["cohorts"]
            assert cohorts["largest"] == 40 and own["largest"] == 10, (cohorts, own)
            assert cohorts["mean"] > 2.5 * own["mean"]
            assert sum(cohorts["sizes"].values()) == cohorts["count"]
            # its own share of the pool's cohorts beside the pool's: its tasks, and only its
            mine = cohorts["own"]
            assert mine["largest"] == 10 and mine["mean"] < cohorts["mean"]
            trained = round(mine["mean"] * cohorts["count"])  # its tasks the cohorts trained
            accepted, sent = grid_summary["updates_accepted"], grid_summary["tasks_dispatched"]
            assert accepted <= trained <= sent, (mine, grid_summary)
            assert 0.15 < mine["share"] < 0.35, mine  # one of four runs
            assert "own" not in own  # a run alone: its cohorts are its own

    # The same command again: every run finished, none touched; another config is refused.
    stamps = {p: p.stat().st_mtime_ns for p in grid_dir.rglob("summary.json")}
    assert local(grid_dir, "", "--seeds", "0,1", "--grid", "strategy=fedbuff,fedasync") == 0
    assert capsys.readouterr().err.count("finished earlier, skipped") == 4
    assert {p: p.stat().st_mtime_ns for p in grid_dir.rglob("summary.json")} == stamps
    assert local(grid_dir, "lr=0.5", "--seeds", "0,1", "--grid", "strategy=fedbuff") == 2
    refusal = capsys.readouterr().err.strip().splitlines()
    assert len(refusal) == 1 and "holds a finished run with lr=" in refusal[0], refusal


def test_grid_flags_go_with_local_only(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exit_:
        main(["run", "--seeds", "0,1"])
    assert exit_.value.code == 2
    assert "--seeds and --grid go with --local" in capsys.readouterr().err


def test_a_grid_stopped_by_sigterm_resumes_from_its_checkpoints(tmp_path: Path) -> None:
    """SIGTERM stops every run at its next wait, each with its folder and checkpoint; the same
    command again resumes them and they finish."""
    runs = tmp_path / "runs"
    config = f"{BASE} max-updates=1500 max-virtual-time=0 checkpoint-every=5 runs-dir={runs}"
    command = [sys.executable, "-m", "fedstale.launcher.cli", "run", "--local"]
    command += ["--seeds", "0,1", "--grid", "strategy=fedbuff", "--run-config", config]
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    process = subprocess.Popen(command, cwd=ROOT, env=env, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 300
        while not all(
            (runs / f"grid-seed={s}-strategy=fedbuff" / CHECKPOINT_FILE).exists() for s in (0, 1)
        ):
            assert process.poll() is None and time.monotonic() < deadline
            time.sleep(0.2)
        process.send_signal(signal.SIGTERM)
        _, err = process.communicate(timeout=120)
    finally:
        process.kill()
    assert process.returncode == 1, err[-2000:]
    assert err.count("(rerun the same command to resume it)") == 2, err[-2000:]
    again = subprocess.run(
        command, cwd=ROOT, env=env, capture_output=True, text=True, timeout=timing.left()
    )
    assert again.returncode == 0, again.stderr[-2000:]
    for seed in (0, 1):
        summary = json.loads(
            (runs / f"grid-seed={seed}-strategy=fedbuff" / "summary.json").read_text()
        )
        assert summary["updates_accepted"] == 1500
        assert summary["stop_reason"] == "update budget 1500"


def tiny_job_runner(job: object, runs_dir: str) -> dict:
    from bench.grid import run_in_process

    result, _ = run_in_process(job, runs_dir, {**job.config})  # type: ignore[attr-defined]
    return result


def test_a_reproduction_grid_runs_together_and_resumes(tmp_path: Path) -> None:
    """`python -m bench.reproduce_* --together`: the jobs in threads of one process, on one
    CohortPool, every run trainer=cohort; results.jsonl keeps them, so a rerun runs none."""
    from bench.grid import grid, run_all

    def config(strategy: str, seed: int) -> dict:
        return {
            "strategy": strategy,
            "dataset": "digits",
            "max-updates": 30,
            "max-virtual-time": 0.0,
            "eval-interval": 1e9,
            "progress-interval": 600.0,
        }

    jobs = grid(
        "tiny",
        lambda strategy, seed: f"{strategy}-s{seed}",
        {"strategy": ["fedbuff", "fedasync"]},
        config,
        2,
    )
    results = run_all(jobs, tiny_job_runner, tmp_path, workers=1, together=True)
    assert [r["name"] for r in results] == [job.name for job in jobs]
    for result in results:
        assert result["summary"]["updates_accepted"] == 30
        folder = tmp_path / "runs" / result["name"]
        assert json.loads((folder / "config.json").read_text())["trainer"] == "cohort"
    largest = max(r["summary"]["cohorts"]["largest"] for r in results)
    assert largest > 10  # more than one run's tasks (concurrency 10) in a cohort
    again = run_all(jobs, tiny_job_runner, tmp_path, workers=1, together=True)
    assert again == results
