"""Golden runs: what they run, and how a run is compared with its recorded files.

A golden run is a fixed-seed in-process run of every strategy (tests/golden/<strategy>/:
metrics.jsonl without wall time, updates.jsonl). Its event sequence does not depend on the
numerics (the virtual clock, the seeded rng, the rules' counting), so every integer, string
and virtual time must match exactly: rows, keys, versions, clients, tasks, staleness, types,
flags. Floats computed from a model (losses, accuracies, weights, kappa, angles...) depend on
which kernels torch's MKL / oneDNN and numpy's OpenBLAS pick for the CPU, so they are
compared within a relative tolerance per strategy and field, measured by
`python -m bench.golden_drift` and kept in tests/golden/tolerances.json (how it is derived:
that module's docstring).
"""

from __future__ import annotations

import json
import math
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

GOLDEN = Path(__file__).resolve().parent / "golden"
TOLERANCES = GOLDEN / "tolerances.json"
FILES = ("metrics.jsonl", "updates.jsonl")
STRATEGIES = ["fedavg", "fedasync", "fedbuff", "ca2fl", "fedfa", "fedpsa", "pace"]
STRATEGIES += ["pfedgraph-async", "fedqs-sgd", "fedqs-avg", "safl-fedsgd", "safl-fedavg"]
STRATEGIES += ["mafsa", "hierfedavg", "fedbuff-proportional"]
STRATEGIES += ["local-only"]
# Fashion-MNIST, 50 clients, 10 in flight, latencies uniform 10-500: the defaults, for
# a tenth of a virtual day (about 340 updates).
CONFIG = {"max-virtual-time": 8640.0, "seed": 3, "partition": "dirichlet"}
# The hierarchical rules: every client at once, 20 steps of 20, 10% dropouts, 3,000 units.
HIERARCHY = {"concurrency": 50, "local-steps": 20, "batch-size": 20, "mafsa-dropout-rate": 0.1}
OVERRIDES = {name: {**HIERARCHY, "max-virtual-time": 3000.0} for name in ("mafsa", "hierfedavg")}
# Latency proportional to local work, on clients of unequal sizes (per-class Dirichlet).
OVERRIDES["fedbuff-proportional"] = {
    "strategy": "fedbuff",
    "latency": "proportional",
    "latency-network": 5.0,
    "latency-jitter": 0.1,
    "dirichlet-convention": "per-class",
    "max-virtual-time": 4320.0,
}
# Virtual times come from the seeded latency draws, never from a model: exact.
EXACT_FLOATS = {"time", "virtual_time"}
# A field that did not drift in any measured setting may still differ by a few ulps
# (numpy's SIMD loops for pow/exp differ between CPUs): this much, relative.
ULPS = 1e-12
Row = dict[str, Any]


def golden_values(name: str, runs_dir: Path) -> dict[str, Any]:
    """The run config of golden run `name` (a strategy's name unless its overrides name
    the strategy), its results under `runs_dir`."""
    return {
        **CONFIG,
        "strategy": name,
        **OVERRIDES.get(name, {}),
        "run-name": name,
        "runs-dir": str(runs_dir),
    }


@contextmanager
def one_thread() -> Iterator[None]:
    """Torch's reductions round differently on 1 and 2 threads (per-client losses differed
    in the 8th digit); the golden runs pin 1 whatever the caller left."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(threads)


def produce(strategy: str, runs_dir: Path, extra: dict[str, Any] | None = None) -> dict[str, str]:
    """Run `strategy`'s golden config (with `extra` keys over it) in this process; the
    text of its two files."""
    from fedstale.launcher.local import local_transport
    from fedstale.server_app.experiment import run_experiment
    from fedstale.strategies.registry import load_config

    run, params = load_config({**golden_values(strategy, runs_dir), **(extra or {})})
    with one_thread():
        run_experiment(run, params, local_transport(run))
    folder = runs_dir / strategy
    return {
        "metrics.jsonl": without_wall_time((folder / "metrics.jsonl").read_text()),
        "updates.jsonl": (folder / "updates.jsonl").read_text(),
    }


def without_wall_time(text: str) -> str:
    rows = [json.loads(line) for line in text.splitlines()]
    kept = [{k: v for k, v in row.items() if k != "wall_time"} for row in rows]
    return "".join(json.dumps(row) + "\n" for row in kept)


def recorded(strategy: str) -> dict[str, str]:
    return {name: (GOLDEN / strategy / name).read_text() for name in FILES}


def rows(text: str) -> list[Row]:
    return [json.loads(line) for line in text.splitlines()]


def relative(a: float, b: float) -> float:
    """|a - b| relative to the larger magnitude (0 when both are 0)."""
    if a == b or (math.isnan(a) and math.isnan(b)):
        return 0.0
    return abs(a - b) / max(abs(a), abs(b))


def is_float(value: Any) -> bool:
    return isinstance(value, float) and not isinstance(value, bool)


@dataclass(frozen=True)
class Drift:
    """The largest relative difference of one field, and where it was."""

    value: float
    row: int


def compare_rows(
    produced: list[Row], golden: list[Row], tolerance: dict[str, float]
) -> tuple[list[str], dict[str, Drift]]:
    """Differences beyond the rules above (as lines a reader can act on), and every float
    field's largest relative drift."""
    problems: list[str] = []
    drift: dict[str, Drift] = {}
    if len(produced) != len(golden):
        problems.append(f"{len(produced)} rows, golden has {len(golden)}")
    for index, (mine, theirs) in enumerate(zip(produced, golden, strict=False)):
        if mine.keys() != theirs.keys():
            problems.append(f"row {index}: keys {sorted(mine)} != golden {sorted(theirs)}")
            continue
        for key, value in mine.items():
            problems += _compare_value(index, key, value, theirs[key], tolerance, drift)
    return problems, drift


def _compare_value(
    index: int, key: str, mine: Any, theirs: Any, tolerance: dict[str, float], drift: dict
) -> list[str]:
    pairs = list(zip(mine, theirs, strict=False)) if isinstance(mine, list) else [(mine, theirs)]
    if isinstance(mine, list) and (not isinstance(theirs, list) or len(mine) != len(theirs)):
        return [f"row {index} '{key}': {mine!r} != golden {theirs!r}"]
    for a, b in pairs:
        numeric = is_float(a) and isinstance(b, (int, float)) and not isinstance(b, bool)
        if not numeric or key in EXACT_FLOATS:
            if a != b or type(a) is not type(b):
                return [f"row {index} '{key}': {mine!r} != golden {theirs!r} (must be exact)"]
            continue
        off = relative(a, b)
        if off > drift.get(key, Drift(-1.0, 0)).value:
            drift[key] = Drift(off, index)
        allowed = tolerance.get(key, ULPS)
        if off > allowed or math.isnan(off):
            return [
                f"row {index} '{key}': {a!r} != golden {b!r} "
                f"(relative {off:.2g} > tolerance {allowed:.2g})"
            ]
    return []


def load_tolerances() -> dict[str, dict[str, dict[str, float]]]:
    """strategy -> file -> field -> relative tolerance."""
    return json.loads(TOLERANCES.read_text())["tolerance"]


def differences(strategy: str, produced: dict[str, str]) -> list[str]:
    """Every way `produced` departs from `strategy`'s golden files beyond the tolerances."""
    tolerances = load_tolerances().get(strategy, {})
    golden = recorded(strategy)
    found = []
    for name in FILES:
        problems, _ = compare_rows(
            rows(produced[name]), rows(golden[name]), tolerances.get(name, {})
        )
        found += [f"{strategy} {name} {line}" for line in problems]
    return found
