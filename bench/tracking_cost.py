"""What experiment tracking costs a `--local` run (issue 77: at most 2% of its wall time
with MLflow's local store): the same run without tracking and with each tracker, in this
process, interleaved repetitions, the wall time of the whole run (its start, the loop, and
the end: the trackers catching up, the artifacts uploaded, the tracked runs closed).

    python -m bench.tracking_cost [--repeats 3] [--config "k=v ..."] [--out PATH]

One table: the median wall seconds per mode, its ratio to the run without tracking measured
in the same process, and the range of the ratios. A first, unmeasured run of each mode
makes the stores (MLflow's SQLite tables take about 2 s to create once per runs folder).
Writes results.jsonl and table.md to --out (default runs/tracking-cost-<UTC time>; an
existing folder is refused). bench/results/tracking-cost.jsonl is the recorded
results.jsonl of docs/benchmarks.md.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
from fedstale.launcher.launch import parse_pairs  # noqa: E402
from fedstale.launcher.local import local_transport  # noqa: E402
from fedstale.server_app.experiment import run_experiment  # noqa: E402
from fedstale.strategies.registry import load_config  # noqa: E402

# FedBuff on Fashion-MNIST with fedstale's defaults (50 clients, 10 in flight, K = 5, 5
# local epochs), 1 worker: about 100 versions, each sent to every tracker, 12 evaluations
CONFIG = (
    "dataset=fmnist max-updates=500 max-virtual-time=0 eval-interval=500 progress-interval=1000"
)
MODES = ("none", "mlflow", "tensorboard", "wandb")


def one_run(config: str, mode: str, runs: Path, name: str) -> float:
    values = {**parse_pairs(config), "run-name": name, "runs-dir": str(runs)}
    if mode != "none":
        values["tracking"] = mode
    run, params = load_config(values)
    started = time.perf_counter()
    summary = run_experiment(run, params, local_transport(run))
    seconds = time.perf_counter() - started
    missed = summary.get("tracking", {}).get("missed", {})
    if missed:
        raise SystemExit(f"{mode}: the tracker missed part of the run: {missed}")
    return seconds


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--config", default=CONFIG)
    parser.add_argument("--modes", default=",".join(MODES))
    stamp = datetime.now(UTC).strftime("%Y%m%dT%H%M%SZ")
    parser.add_argument("--out", type=Path, default=ROOT / "runs" / f"tracking-cost-{stamp}")
    args = parser.parse_args(argv)
    if args.out.exists():
        raise SystemExit(f"{args.out} exists; name another --out (nothing is overwritten)")
    os.environ.setdefault("WANDB_MODE", "offline")
    os.environ.setdefault("WANDB_SILENT", "true")
    modes = args.modes.split(",")
    runs = args.out / "runs"
    for mode in modes:  # the stores made, the imports done: not measured
        one_run(args.config, mode, runs, f"warm-{mode}")
    rows: list[dict[str, Any]] = []
    for repeat in range(args.repeats):
        for mode in modes:  # interleaved: a drift of the machine falls on every mode
            seconds = one_run(args.config, mode, runs, f"{mode}-{repeat}")
            rows.append({"mode": mode, "repeat": repeat, "seconds": seconds})
            print(f"{mode} #{repeat}: {seconds:.2f} s", file=sys.stderr)
    args.out.mkdir(parents=True, exist_ok=True)
    with (args.out / "results.jsonl").open("w") as handle:
        for row in rows:
            handle.write(json.dumps({**row, "config": args.config}) + "\n")
    table = render(rows, modes)
    (args.out / "table.md").write_text(table)
    print(table)


def render(rows: list[dict[str, Any]], modes: list[str]) -> str:
    base = {r["repeat"]: r["seconds"] for r in rows if r["mode"] == "none"}
    lines = ["| mode | wall s (median) | x no tracking | range |", "| --- | --- | --- | --- |"]
    for mode in modes:
        mine = [r for r in rows if r["mode"] == mode]
        ratios = [r["seconds"] / base[r["repeat"]] for r in mine]
        median = statistics.median(r["seconds"] for r in mine)
        lines.append(
            f"| {mode} | {median:.2f} | {statistics.median(ratios):.3f} | "
            f"{min(ratios):.3f}-{max(ratios):.3f} |"
        )
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    main()
