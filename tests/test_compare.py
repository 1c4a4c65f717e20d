"""`fedstale compare`: grouping by config-but-seed, the table's figures, lookups, errors."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from fedstale.launcher.analysis import Run, find_runs, group_runs, table
from fedstale.launcher.cli import main


def fake_run(root: Path, name: str, strategy: str, seed: int, accuracies: list[float]) -> Path:
    folder = root / name
    folder.mkdir(parents=True)
    config = {"strategy": strategy, "seed": seed, "run-name": name, "lr": 0.01}
    (folder / "config.json").write_text(json.dumps(config))
    rows = [{"virtual_time": 43200.0 * i, "accuracy": a} for i, a in enumerate(accuracies)]
    (folder / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    updates = [{"time": 10.0, "version": 1, "staleness": s, "weight": 0.5} for s in (0, 1, 1)]
    (folder / "updates.jsonl").write_text("".join(json.dumps(u) + "\n" for u in updates))
    summary = {
        "final_accuracy": accuracies[-1],
        "best_accuracy": max(accuracies),
        "updates_accepted": 100 + seed,
        "updates_rejected": seed,
        "time_to_target": None,
    }
    (folder / "summary.json").write_text(json.dumps(summary))
    return folder


@pytest.fixture
def runs(tmp_path: Path) -> Path:
    fake_run(tmp_path, "buff-s0", "fedbuff", 0, [0.1, 0.5, 0.7])
    fake_run(tmp_path, "buff-s1", "fedbuff", 1, [0.1, 0.7, 0.9])
    fake_run(tmp_path, "psa-s0", "fedpsa", 0, [0.1, 0.6, 0.8])
    (tmp_path / "unfinished").mkdir()
    return tmp_path


def test_seeds_of_one_config_form_a_group_with_mean_and_std(runs: Path) -> None:
    groups = group_runs([Run.load(f) for f in find_runs(["buff-*", "psa-s0"], runs)])
    assert [(g.label, len(g.runs)) for g in groups] == [("fedbuff", 2), ("fedpsa", 1)]
    rows = table(groups, last=2, target=0.6).splitlines()
    # fedbuff: finals 70, 90 -> 80 ± 14.14; last-2 means 60, 80 -> 70 ± 14.14; AULC over
    # half-day steps: (0.3 + 0.6) / 2 = 0.45 and (0.4 + 0.8) / 2 = 0.6 -> 0.525 ± 0.106;
    # first evaluation >= 0.6: t = 86400 and 43200 -> 64800 ± 30547
    assert rows[2] == (
        "| fedbuff | 0,1 | 80.00 ± 14.14 (n=2) | 80.00 ± 14.14 (n=2) | 70.00 ± 14.14 (n=2) | "
        "0.525 ± 0.106 (n=2) | 64800 ± 30547 (n=2) | 100 ± 1 (n=2) | 0 ± 1 (n=2) |"
    )
    assert rows[3] == "| fedpsa | 0 | 80.00 | 80.00 | 70.00 | 0.525 | 43200 | 100 | 0 |"


def test_the_command_finds_run_names_writes_plot_and_table(
    runs: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "cmp"
    argv = ["compare", "buff-s0", str(runs / "psa-*"), "--runs-dir", str(runs), "--out", str(out)]
    assert main(argv) == 0
    assert (out / "compare.png").stat().st_size > 10_000
    assert (out / "compare.md").read_text().count("\n") == 4
    assert "| fedpsa |" in capsys.readouterr().out


def test_a_run_that_is_not_there_is_one_line(
    runs: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["compare", "unfinished", "--runs-dir", str(runs)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "'unfinished' names no finished run" in err[0]
