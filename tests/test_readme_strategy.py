"""The README's "Writing a strategy" example is a working rule: run it in-process."""

from __future__ import annotations

import re
from pathlib import Path

import numpy as np
import pytest

from launcher.local import local_transport
from server_app.experiment import run_experiment
from server_app.results import read_jsonl
from strategies.base import View
from strategies.registry import STRATEGIES, load_config
from tests.helpers import run_config, update

README = Path(__file__).resolve().parent.parent / "README.md"


def readme_rule() -> type:
    text = README.read_text()
    section = text.split("## Writing a strategy", 1)[1]
    code = re.search(r"```python\n(.*?)```", section, re.S)
    assert code is not None, "the README's strategy example is gone"
    namespace: dict = {}
    exec(compile(code.group(1), "README.md", "exec"), namespace)
    return namespace["CappedMean"]


def test_the_readme_rule_does_what_its_docstring_says() -> None:
    rule = readme_rule()
    strategy = rule(run_config(buffer_size=2), rule.Params(), np.zeros(2))
    view = View(version=5)
    dropped = strategy.on_update(update([9.0, 9.0], staleness=5), view)
    assert not dropped.changed and dropped.records[0]["weight"] == 0.0
    assert not strategy.on_update(update([1.0, 2.0], staleness=4), view).changed
    outcome = strategy.on_update(update([3.0, 0.0], staleness=0), view)
    assert outcome.changed and [r["weight"] for r in outcome.records] == [0.5, 0.5]
    np.testing.assert_allclose(strategy.model, [2.0, 1.0])


def test_the_readme_rule_runs_end_to_end(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    rule = readme_rule()
    monkeypatch.setitem(STRATEGIES, rule.name, rule)
    values = {
        "strategy": "capped-mean",
        "capped-max-staleness": 1,
        "dataset": "digits",
        "num-clients": 6,
        "concurrency": 3,
        "buffer-size": 2,
        "lr": 0.1,
        "max-virtual-time": 2000.0,
        "eval-interval": 500.0,
        "run-name": "capped",
        "runs-dir": str(tmp_path),
    }
    run, params = load_config(values)
    summary = run_experiment(run, params, local_transport(run))
    rows = read_jsonl(tmp_path / "capped" / "updates.jsonl")
    assert any(r["weight"] == 0.0 and r["staleness"] > 1 for r in rows)
    assert all(r["weight"] == 0.5 for r in rows if r["staleness"] <= 1)
    assert summary["final_accuracy"] > 0.5
