"""bench/library_overhead.py's app variants: the quickstart with only the strategy changed,
the same warm-up, evaluate_fn and timer in every variant."""

from __future__ import annotations

import ast
import tomllib
from pathlib import Path

import pytest

from bench.library_overhead import VARIANTS, make_app, server_source

SERVER = Path(__file__).resolve().parent.parent / "examples/async-quickstart/asyncquickstart"


@pytest.mark.parametrize("variant", VARIANTS)
def test_each_variant_differs_only_in_its_strategy(variant: str) -> None:
    source = server_source((SERVER / "server_app.py").read_text(), variant, 4, "poll_interval=0.1")
    ast.parse(source)
    strategy_lines = [line for line in source.splitlines() if "strategy = " in line]
    assert len(strategy_lines) == 1
    assert "min_available_nodes=4" in strategy_lines[0]
    assert ("poll_interval=0.1" in strategy_lines[0]) == variant.startswith("fedstale")
    assert "fraction_evaluate=0" in strategy_lines[0]
    assert "evaluate_fn=constant_metrics" in source
    assert "global_evaluate," not in source
    assert "warm = warm_up(grid, arrays, lr)" in source
    assert "record_seconds(context, time.perf_counter() - started, warm)" in source


def test_the_copy_takes_a_bench_out_key(tmp_path: Path) -> None:
    app = make_app(tmp_path, "fedstale-fedbuff", 3)
    config = tomllib.loads((app / "pyproject.toml").read_text())["tool"]["flwr"]["app"]["config"]
    assert config["bench-out"] == ""
    server = (app / "asyncquickstart" / "server_app.py").read_text()
    assert "FedBuff(buffer_size=3, concurrency=3, fraction_evaluate=0" in server
    assert not list(app.rglob("__pycache__"))
