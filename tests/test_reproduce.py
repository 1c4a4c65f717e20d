"""The reproduction driver: each paper's report over the runs recorded in bench/results
(the published tables come from these), and the driver's own flow on a tiny paper."""

from __future__ import annotations

import json
import shutil
import signal
from pathlib import Path

import pytest

from bench import reproduce
from bench.grid import Job, eta_seconds, run_all
from bench.reproduce import Paper, Suite
from bench.reproduce_fedqs import FEDQS
from bench.reproduce_mafsa import MAFSA
from bench.reproduce_pace import PACE

RESULTS = Path(__file__).resolve().parent.parent / "bench" / "results"


@pytest.mark.parametrize(
    ("paper", "recorded", "sub", "flags", "row"),
    [
        (PACE, "reproduce-pace-2000u.jsonl", "2000u", (), "| pace | 93.94 ± 1.37 (n=3) | 95.90"),
        (MAFSA, "reproduce-mafsa.jsonl", "", ("--suite", "table2"), "| digits | mafsa-p | 85.74"),
        (FEDQS, "reproduce-fedqs-400agg.jsonl", "400agg", (), "| fedqs-sgd |"),
    ],
)
def test_a_paper_reports_its_recorded_runs(
    paper: Paper,
    recorded: str,
    sub: str,
    flags: tuple[str, ...],
    row: str,
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
) -> None:
    folder = tmp_path / sub if sub else tmp_path
    folder.mkdir(parents=True, exist_ok=True)
    shutil.copy(RESULTS / recorded, folder / "results.jsonl")
    reproduce.main(paper, ["--report", "--out", str(tmp_path), *flags])
    printed = capsys.readouterr().out
    assert row in printed
    written = {p.name for p in folder.iterdir()}
    assert {"results.jsonl"} < written and any(name.endswith(".md") for name in written)
    assert any(name.endswith(".png") for name in written)


def tiny_paper(ran: list[str]) -> Paper:
    def jobs(options: object) -> list[Job]:
        return [Job(f"job-{i}", {"suite": "only", "i": i}, {}) for i in range(3)]

    def table(results: list[dict], options: object) -> str:
        return "| " + " | ".join(r["name"] for r in results) + " |"

    return Paper(
        description="A tiny paper.",
        suites={"only": Suite(jobs, table, "only.md")},
        default_suite="only",
        default_out=Path("unused"),
        runner=lambda options: ran.append,  # never called with --report
        announce=lambda name, jobs, options: f"{name}: {len(jobs)} runs",
        tally=reproduce.run_hours,
        closing=lambda results, out, minutes: f"{len(results)} done in {out.name}",
    )


def test_report_tabulates_only_the_runs_results_jsonl_holds(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    done = [{"name": "job-2", "seconds": 1.0}, {"name": "job-0", "seconds": 2.0}]
    (tmp_path / "results.jsonl").write_text("".join(json.dumps(r) + "\n" for r in done))
    ran: list[str] = []
    reproduce.main(tiny_paper(ran), ["--report", "--out", str(tmp_path)])
    lines = capsys.readouterr().out.splitlines()
    assert lines == [
        "only: 3 runs",
        "| job-0 | job-2 |",
        "2 runs, 0.00 h of run time in all",
        f"2 done in {tmp_path.name}",
    ]
    assert (tmp_path / "only.md").read_text() == "| job-0 | job-2 |\n" and not ran


def runs_unless_named_bad(job: Job, runs_dir: str) -> dict[str, object]:
    """A grid runner (top level: the pool's spawned workers import it) whose job 'bad' fails
    as a run refused by its config does."""
    if job.name == "bad":
        raise ValueError("dirichlet-alpha too small for 200 clients")
    return {"name": job.name, "summary": {"final_accuracy": 0.5}, "seconds": 0.0}


def test_a_failed_job_costs_the_grid_only_itself(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(signal, "signal", lambda *_: None)  # keep pytest's SIGTERM handler
    jobs = [Job(name, {}, {}) for name in ("first", "bad", "last")]
    with pytest.raises(SystemExit) as stopped:
        run_all(jobs, runs_unless_named_bad, tmp_path, workers=1)
    assert stopped.value.code == 2
    recorded = (tmp_path / "results.jsonl").read_text().splitlines()
    assert [json.loads(line)["name"] for line in recorded] == ["first", "last"]
    out, err = capsys.readouterr()
    assert "[2/3] bad: failed: dirichlet-alpha too small for 200 clients" in out
    assert err.startswith("1 of 3 runs failed (bad)") and "rerun the same command" in err
    with pytest.raises(SystemExit):  # a rerun retries only the failed job
        run_all(jobs, runs_unless_named_bad, tmp_path, workers=1)
    assert capsys.readouterr().out.startswith("[1/1] bad: failed")


def test_a_curve_reaches_a_target_in_percent_or_as_a_fraction() -> None:
    result = {"curve": [(0.0, 0.1), (5.0, 0.5), (9.0, 0.8)]}
    assert reproduce.time_to(result, 0.5) == 5.0
    assert reproduce.time_to(result, 79.0, scale=100) == 9.0
    assert reproduce.time_to(result, 0.9) is None
    times, mean = reproduce.mean_curve([result, {"curve": [(0.0, 0.3), (5.0, 0.7)]}])
    assert times == [0.0, 5.0] and mean == pytest.approx([0.2, 0.6])


def test_fedqs_main_grid_runs_the_methods_asked_and_refuses_an_unknown_one(
    capsys: pytest.CaptureFixture[str],
) -> None:
    parser = reproduce.parser_for(FEDQS)
    options = parser.parse_args(["--methods", "fedqs-sgd,fedqs-avg"])
    FEDQS.check(options, parser)
    jobs = FEDQS.suites["main"].jobs(options)
    assert {job.labels["method"] for job in jobs} == {"fedqs-sgd", "fedqs-avg"}
    assert len(jobs) == 3 * 2 * 3  # alphas x methods x seeds
    assert len(FEDQS.suites["main"].jobs(parser.parse_args([]))) == 45
    with pytest.raises(SystemExit) as refused:
        FEDQS.check(parser.parse_args(["--methods", "fedqs"]), parser)
    assert refused.value.code == 2
    assert "unknown methods ['fedqs']" in capsys.readouterr().err


def test_fedqs_robustness_runs_the_methods_asked_of_its_three() -> None:
    parser = reproduce.parser_for(FEDQS)
    robustness = FEDQS.suites["robustness"]
    jobs = robustness.jobs(parser.parse_args(["--methods", "fedqs-sgd,fedavg,fedbuff"]))
    assert [job.name for job in jobs] == [
        "robust-50c-fedavg-s0",
        "robust-50c-fedqs-sgd-s0",
        "robust-200c-fedavg-s0",
        "robust-200c-fedqs-sgd-s0",
    ]  # FedBuff is no robustness method: nothing of it
    assert len(robustness.jobs(parser.parse_args([]))) == 6


def test_the_eta_counts_the_workers_slots_and_not_the_first_runs_finishing_together() -> None:
    # Two workers, the first two runs (1,200 s and 1,000 s of their own) ended at 1,210 s
    # of wall time: the 10 left take five turns of the two slots at 1,100 s each.
    assert eta_seconds(1210.0, [1200.0, 1000.0], 10, 2) == 5 * 1100.0
    # One of them finished, 11 left: six turns (the last one alone).
    assert eta_seconds(1200.0, [1200.0], 11, 2) == 6 * 1200.0
    # Together (workers 0) every run started at once: wall time per run finished.
    assert eta_seconds(900.0, [900.0, 850.0, 880.0], 9, 0) == 900.0 / 3 * 9
    assert eta_seconds(900.0, [900.0], 0, 2) == 0.0
