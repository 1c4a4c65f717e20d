"""Golden runs: a fixed-seed in-process run of a tenth of a virtual day per strategy must
write byte-identical metrics.jsonl (wall time aside) and updates.jsonl, so that a refactor
that changes results is caught at once.

After a deliberate change of results, rewrite the files and say so in the commit:
    FEDSTALE_UPDATE_GOLDEN=1 .venv/bin/python -m pytest tests/test_golden.py
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from client_app.local import local_transport
from server_app.experiment import run_experiment
from strategies.registry import load_config

GOLDEN = Path(__file__).resolve().parent / "golden"
STRATEGIES = ["fedavg", "fedasync", "fedbuff", "ca2fl", "fedfa", "fedpsa", "pace"]
STRATEGIES += ["pfedgraph-async", "fedqs-sgd", "fedqs-avg", "safl-fedsgd", "safl-fedavg"]
STRATEGIES += ["mafsa", "hierfedavg"]
# Fashion-MNIST, 50 clients, 10 in flight, latencies uniform 10-500: the defaults, for
# a tenth of a virtual day (about 340 updates).
CONFIG = {"max-virtual-time": 8640.0, "seed": 3, "partition": "dirichlet"}
# The hierarchical rules: every client at once, 20 steps of 20, 10% dropouts, 3,000 units.
HIERARCHY = {"concurrency": 50, "local-steps": 20, "batch-size": 20, "dropout-rate": 0.1}
OVERRIDES = {name: {**HIERARCHY, "max-virtual-time": 3000.0} for name in ("mafsa", "hierfedavg")}


def without_wall_time(path: Path) -> str:
    rows = [json.loads(line) for line in path.read_text().splitlines()]
    kept = [{k: v for k, v in row.items() if k != "wall_time"} for row in rows]
    return "".join(json.dumps(row) + "\n" for row in kept)


@pytest.fixture
def one_thread() -> Iterator[None]:
    """Torch's reductions round differently on 1 and 2 threads (per-client losses differed
    in the 8th digit), and earlier tests may leave either; the golden runs pin 1."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_golden_run_is_unchanged(strategy: str, tmp_path: Path, one_thread: None) -> None:
    run, params = load_config(
        {
            **CONFIG,
            **OVERRIDES.get(strategy, {}),
            "strategy": strategy,
            "run-name": strategy,
            "runs-dir": str(tmp_path),
        }
    )
    run_experiment(run, params, local_transport(run))
    produced = {
        "metrics.jsonl": without_wall_time(tmp_path / strategy / "metrics.jsonl"),
        "updates.jsonl": (tmp_path / strategy / "updates.jsonl").read_text(),
    }
    folder = GOLDEN / strategy
    if os.environ.get("FEDSTALE_UPDATE_GOLDEN") == "1":
        folder.mkdir(parents=True, exist_ok=True)
        for name, text in produced.items():
            (folder / name).write_text(text)
    for name, text in produced.items():
        assert text == (folder / name).read_text(), f"{strategy}: {name} differs from golden"
