"""The README's "Writing a strategy" example is a working rule with a client-side signal:
saved as a module of its own and declared to fedstale by a package's entry point, it runs
end to end."""

from __future__ import annotations

import importlib
import re
import sys
from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path
from types import ModuleType

import numpy as np
import pytest

from fedstale.common.schema import InvalidReply
from fedstale.launcher.local import local_transport
from fedstale.server_app.experiment import run_experiment
from fedstale.server_app.results import read_jsonl
from fedstale.strategies.base import Update, View
from fedstale.strategies.registry import STRATEGIES, client_rules, load_config
from tests.helpers import rule_package, run_config, update

README = Path(__file__).resolve().parent.parent / "README.md"


@pytest.fixture
def capped_mean(tmp_path: Path) -> Iterator[ModuleType]:
    """The README's block, saved as strategies-to-be `capped_mean.py` in a folder of its own."""
    section = README.read_text().split("## Writing a strategy", 1)[1]
    code = re.search(r"```python\n(.*?)```", section, re.S)
    assert code is not None, "the README's strategy example is gone"
    (tmp_path / "capped_mean.py").write_text(code.group(1))
    try:
        with rule_package(tmp_path, "capped_mean:RULES", "capped-mean"):
            yield importlib.import_module("capped_mean")
    finally:
        sys.modules.pop("capped_mean", None)


def noted(vector: list[float], staleness: int = 0) -> Update:
    """An update whose client reported its true norm."""
    plain = update(vector, staleness=staleness)
    norm = float(np.linalg.norm(np.asarray(vector, dtype=np.float64)))
    return replace(plain, signals={"delta-norm": norm})


def test_the_readme_rule_does_what_its_docstring_says(capped_mean: ModuleType) -> None:
    rule = capped_mean.CappedMean
    strategy = rule(run_config(), rule.Params(buffer_size=2), np.zeros(2))
    view = View(version=5)
    dropped = strategy.on_update(noted([9.0, 9.0], staleness=5), view)
    assert not dropped.changed and dropped.records[0]["weight"] == 0.0
    assert not strategy.on_update(noted([1.0, 2.0], staleness=4), view).changed
    outcome = strategy.on_update(noted([3.0, 0.0]), view)
    assert outcome.changed and [r["weight"] for r in outcome.records] == [0.5, 0.5]
    assert [r["norm"] for r in outcome.records] == pytest.approx([5**0.5, 3.0])
    np.testing.assert_allclose(strategy.model, [2.0, 1.0])
    with pytest.raises(InvalidReply, match="reported"):
        strategy.validate(replace(noted([3.0, 4.0]), signals={"delta-norm": 4.0}))


def test_the_readme_rule_and_its_client_signal_run_end_to_end(
    capped_mean: ModuleType, monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    # Found through its package's entry point: no edit to fedstale.
    assert STRATEGIES["capped-mean"] is capped_mean.CappedMean
    assert isinstance(client_rules()["delta-norm"], capped_mean.DeltaNorm)
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
    assert all(r["norm"] > 0 for r in rows)  # every client sent its signal
    assert summary["updates_rejected"] == 0 and summary["final_accuracy"] > 0.5
