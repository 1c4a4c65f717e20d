"""What central DP costs the server per release (issue 66): the noise (NumPy's PCG64
against `dp-secure-noise`'s ChaCha20), the ledger line written and flushed to disk, and the
accountant (RDP or PLD, with and without `dp-max-epsilon`), each release driven through the
privacy stage the engine calls (`CentralDP.release_of`), for models of the sizes fedstale's
tasks train.

    python -m bench.privacy_cost [--releases 200] [--repeats 3] [--out PATH]

One table, medians of `--repeats` interleaved repetitions, milliseconds per release and
the ratio to the reference measured in the same run (PCG64 noise, RDP, no budget, the same
model): the noise by model size, then the accountants on the smallest model. FedBuff, K = 10,
C = 1, z = 1; the budget, where set, is 200 (the 200 releases spend 166 under RDP, 159
under PLD: what is measured is the check, not the stop). The slowest release is shown too, and
the stage's start (the ledger opened, the budget checked once): under PLD the first budget
check builds the privacy loss distribution at the threshold.
The ledger is a file in a temporary folder (one fsync per release).
Writes results.jsonl and table.md to --out (default runs/privacy-cost-<UTC time>; an
existing folder is refused). bench/results/privacy-cost.jsonl is the recorded
results.jsonl of docs/privacy.md.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
from fedstale.common.config import KebabModel, RunConfig  # noqa: E402
from fedstale.server_app.stages.central_dp import CentralDP  # noqa: E402
from fedstale.strategies.base import Outcome  # noqa: E402
from fedstale.strategies.registry import load_config  # noqa: E402

SIZES = {  # parameters of fedstale's models (fedstale.common.models.build_model)
    "mlp (digits)": 4_810,
    "linear (Fashion-MNIST)": 7_850,
    "lenet (Fashion-MNIST)": 61_706,
    "cnn-mnist": 582_026,
}
BUFFER = 10
BUDGET = 200.0  # 200 releases at z = 1 spend 166 (RDP), 159 (PLD): every one fits


@dataclass(frozen=True)
class Cell:
    size: str
    secure: bool = False
    accountant: str = "rdp"
    budget: bool = False

    @property
    def name(self) -> str:
        noise = "chacha20" if self.secure else "pcg64"
        limit = f"max-eps {BUDGET:g}" if self.budget else "no budget"
        return f"{self.size} | {noise} | {self.accountant} | {limit}"

    @property
    def reference(self) -> Cell:
        return Cell(self.size)


class Model:
    """The one attribute of a rule the release touches."""

    def __init__(self, size: int) -> None:
        self.model = np.zeros(size, dtype=np.float32)


def run_for(cell: Cell) -> tuple[RunConfig, KebabModel]:
    values = {
        "strategy": "fedbuff",
        "num-clients": 2 * BUFFER,
        "buffer-size": BUFFER,
        "dp-clipping-norm": 1.0,
        "dp-noise-multiplier": 1.0,
        "dp-accountant": cell.accountant,
        "dp-secure-noise": cell.secure,
        "dp-max-epsilon": BUDGET if cell.budget else 0.0,
    }
    return load_config(values)


def per_release(cell: Cell, releases: int) -> dict[str, float]:
    """Milliseconds per release (median of the run's releases) and the epsilon's, asked once
    at the end as summary.json asks it."""
    outcome = Outcome(changed=True, records=[{"weight": 0.1, "client": c} for c in range(10)])
    rule = Model(SIZES[cell.size])
    with tempfile.TemporaryDirectory() as folder:
        run, params = run_for(cell)
        stage = CentralDP.for_run(run, params, folder=Path(folder), name="bench")
        assert stage is not None
        start = time.perf_counter()
        stage.opening(rule)  # type: ignore[arg-type]
        opened = time.perf_counter() - start
        times = []
        for version in range(1, releases + 1):
            start = time.perf_counter()
            verdict = stage.release_of(rule, outcome, version)  # type: ignore[arg-type]
            times.append(time.perf_counter() - start)
            assert verdict.released and not verdict.stop
        start = time.perf_counter()
        epsilon = stage.epsilon()
        asked = time.perf_counter() - start
    return {
        "ms": 1e3 * statistics.median(times),
        "max_ms": 1e3 * max(times),
        "start_ms": 1e3 * opened,
        "epsilon_ms": 1e3 * asked,
        "eps": epsilon or 0,
    }


def cells() -> list[Cell]:
    noise = [Cell(size, secure) for size in SIZES for secure in (False, True)]
    smallest = next(iter(SIZES))
    accounts = [
        Cell(smallest, False, accountant, budget)
        for accountant in ("rdp", "pld")
        for budget in (False, True)
    ]
    return list(dict.fromkeys([*noise, *accounts]))


def table(rows: dict[Cell, list[dict[str, float]]]) -> str:
    def median(cell: Cell, key: str) -> float:
        return statistics.median(row[key] for row in rows[cell])

    lines = [
        "| model (parameters) | noise | accountant | budget | ms/release | x reference | "
        "slowest release (ms) | start (ms) | epsilon asked (ms) | epsilon |",
        "| --- | --- | --- | --- | ---: | ---: | ---: | ---: | ---: | ---: |",
    ]
    for cell in rows:
        ms, reference = median(cell, "ms"), median(cell.reference, "ms")
        size = f"{cell.size} ({SIZES[cell.size]:,})"
        noise = "ChaCha20" if cell.secure else "PCG64"
        budget = f"{BUDGET:g}" if cell.budget else "none"
        lines.append(
            f"| {size} | {noise} | {cell.accountant} | {budget} | {ms:.3f} | "
            f"{ms / reference:.2f} | {median(cell, 'max_ms'):.1f} | "
            f"{median(cell, 'start_ms'):.1f} | "
            f"{median(cell, 'epsilon_ms'):.1f} | "
            f"{median(cell, 'eps'):.2f} |"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--releases", type=int, default=200)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args(argv)
    stamp = datetime.now(UTC).strftime("%Y%m%dT%H%M%SZ")
    out = args.out or ROOT / "runs" / f"privacy-cost-{stamp}"
    if out.exists():
        print(f"privacy_cost: {out} exists; name a new --out", file=sys.stderr)
        return 2
    out.mkdir(parents=True)
    rows: dict[Cell, list[dict[str, Any]]] = {cell: [] for cell in cells()}
    with (out / "results.jsonl").open("a") as results:
        for repeat in range(args.repeats):  # interleaved: each repetition runs every cell
            for cell in rows:
                row = per_release(cell, args.releases)
                rows[cell].append(row)
                results.write(json.dumps({"cell": cell.name, "repeat": repeat, **row}) + "\n")
                results.flush()
                print(f"[{repeat + 1}/{args.repeats}] {cell.name}: {row['ms']:.3f} ms/release")
    text = table(rows)
    (out / "table.md").write_text(text + "\n")
    print(text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
