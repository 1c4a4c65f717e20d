"""Golden runs: a fixed-seed in-process run of a tenth of a virtual day per strategy must
reproduce its recorded metrics.jsonl (wall time aside) and updates.jsonl on any CPU: the
event sequence exactly, floats within the tolerances measured across kernel settings
(tests/goldens.py, bench/golden_drift.py), so that a change of results is caught at once.

After a deliberate change of results, rewrite the files (on one machine, then remeasure the
tolerances against them) and say so in the commit:
    FEDSTALE_UPDATE_GOLDEN=1 .venv/bin/python -m pytest tests/test_golden.py
    .venv/bin/python -m bench.golden_drift --write [--only the rewritten runs]
"""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np
import pytest

from fedstale.strategies.base import Strategy
from fedstale.strategies.registry import STRATEGIES as RULES
from fedstale.strategies.registry import declarations, is_built_in
from tests.goldens import FILES, GOLDEN, STRATEGIES, compare_rows, differences, produce, rows


def test_every_built_in_rule_has_a_golden_run() -> None:
    """A rule added to the registry without golden files fails here, not silently."""
    built_in = {name for name, rule in declarations().items() if is_built_in(rule)}
    assert built_in <= set(STRATEGIES), sorted(built_in - set(STRATEGIES))
    for name in STRATEGIES:
        for file in FILES:
            assert (GOLDEN / name / file).is_file(), (name, file)


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_golden_run_is_unchanged(strategy: str, tmp_path: Path) -> None:
    produced = produce(strategy, tmp_path)
    if os.environ.get("FEDSTALE_UPDATE_GOLDEN") == "1":
        (GOLDEN / strategy).mkdir(parents=True, exist_ok=True)
        for name, text in produced.items():
            (GOLDEN / strategy / name).write_text(text)
    found = differences(strategy, produced)
    assert not found, "\n".join([f"{strategy} differs from its golden run:", *found[:10]])


def scale_server_step(monkeypatch: pytest.MonkeyPatch, rule: type[Strategy], factor: float):
    """A one-line change of a rule's math: every change it makes to the global model is
    `factor` times as large."""
    original = rule.on_update

    def on_update(self: Strategy, update, view):  # type: ignore[no-untyped-def]
        before = self.model.copy()
        outcome = original(self, update, view)
        if outcome.changed:
            step = self.model.astype(np.float64) - before
            self.model = (before + factor * step).astype(np.float32)
        return outcome

    monkeypatch.setattr(rule, "on_update", on_update)


@pytest.mark.parametrize("strategy", ["fedbuff", "fedqs-avg"])
def test_a_one_percent_change_of_the_server_step_fails_the_golden_test(
    strategy: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """FedBuff (the tightest tolerances) and FedQS-Avg (the loosest: its angles feed back
    into the learning rates) with the step scaled by 1.01: the comparison must fail on the
    floats, beyond their tolerances. FedBuff's event sequence does not depend on them; FedQS's
    client types do (an angle against its threshold), and a 1% step flips some of them."""
    scale_server_step(monkeypatch, RULES[strategy], 1.01)
    produced = produce(strategy, tmp_path)
    found = differences(strategy, produced)
    assert found, f"{strategy}: a step scaled by 1.01 passed the golden comparison"
    beyond = [line for line in found if "tolerance" in line]
    assert beyond, found[:3]
    if strategy == "fedbuff":
        assert beyond == found, found[:3]
    else:
        exact = {line.split("'")[1] for line in found if "must be exact" in line}
        assert exact <= {"type", "flag"}, found[:3]


def test_the_comparison_is_exact_where_the_numerics_do_not_enter() -> None:
    golden = rows((GOLDEN / "fedbuff" / "updates.jsonl").read_text())
    assert compare_rows(golden, golden, {})[0] == []
    moved = [dict(row) for row in golden]
    moved[7]["client"] += 1
    assert "must be exact" in compare_rows(moved, golden, {"weight": 1.0})[0][0]
    later = [dict(row) for row in golden]
    later[3]["time"] += 1e-9
    assert "row 3 'time'" in compare_rows(later, golden, {"time": 1.0})[0][0]
    assert "golden has" in compare_rows(golden[:-1], golden, {})[0][0]
    drifted = [dict(row) for row in golden]
    drifted[5]["weight"] *= 1 + 1e-6
    assert compare_rows(drifted, golden, {"weight": 1e-5})[0] == []
    assert (
        "relative 1e-06 > tolerance 1e-07" in compare_rows(drifted, golden, {"weight": 1e-7})[0][0]
    )


def test_golden_bytes_names_each_file_that_changed(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """bench.golden_bytes, the before/after check of a structural change: the same code
    gives the same bytes, and one changed byte is named."""
    from bench import golden_bytes

    golden_bytes.main(["--out", str(tmp_path / "a"), "--only", "fedfa"])
    golden_bytes.main(
        ["--out", str(tmp_path / "b"), "--only", "fedfa", "--against", str(tmp_path / "a")]
    )
    assert "2 of 2 files byte-identical" in capsys.readouterr().out
    updates = tmp_path / "a" / "fedfa.updates.jsonl"
    updates.write_text(updates.read_text().replace('"client": ', '"client":  ', 1))
    with pytest.raises(SystemExit, match="1"):
        golden_bytes.main(
            ["--out", str(tmp_path / "c"), "--only", "fedfa", "--against", str(tmp_path / "a")]
        )
    assert "differs: fedfa.updates.jsonl" in capsys.readouterr().out
