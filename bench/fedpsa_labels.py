"""FedPSA's calibration labels: kappa's spread and the weights, `fedpsa-calib-labels` random
against self, on the linear model and on LeNet.

    python -m bench.fedpsa_labels                       # 4 cells, about 7 min of CPU here
    python -m bench.fedpsa_labels --models linear --days 0.25

Each cell is one FedPSA run of the Table 1 protocol (bench/reproduce_fedpsa.py: Fashion-MNIST,
50 clients, concurrency 10, buffer 5, alpha 0.1, seed 0) with the Sec. 6.6 diagnostic, for
`--days` virtual days. From its updates.jsonl: kappa min / median / max; the weights once
the thermometer's queue has filled (before, they are 1/K by definition): min / median / max
and the largest max/min ratio within one aggregation; kappa's Spearman correlation with the
gradient alignment (bench/kappa_alignment.py); the final accuracy. Results: one entry per
cell in bench/results/fedpsa-labels.json; a cell already there is not run again (delete it
from the file to rerun it).
"""

from __future__ import annotations

import argparse
import json
import statistics
from itertools import groupby
from pathlib import Path
from typing import Any

from bench.grid import Job
from bench.kappa_alignment import analyse
from bench.reproduce_fedpsa import DAY, run_job
from fedstale.server_app.results import read_jsonl

RESULTS = Path("bench/results/fedpsa-labels.json")
QUEUE = 50  # fedpsa-queue's default: rows past the first 50 arrivals have softmax weights


def spread(values: list[float]) -> dict[str, float]:
    return {"min": min(values), "median": statistics.median(values), "max": max(values)}


def summarise(rows: list[dict[str, Any]]) -> dict[str, Any]:
    """kappa over every update; weights past the queue's first filling, and per
    aggregation (the rows of one aggregation share its time and version)."""
    kappas = [r["kappa"] for r in rows]
    late = rows[QUEUE:]
    ratios = [
        max(w) / min(w)
        for _, group in groupby(late, key=lambda r: (r["time"], r["version"]))
        if (w := [r["weight"] for r in group])
    ]
    return {
        "updates": len(rows),
        "kappa": spread(kappas),
        "weight": spread([r["weight"] for r in late]),
        "max_weight_ratio_in_an_aggregation": max(ratios),
        "spearman_kappa_align": analyse(rows, 0.1)["raw"][1],
    }


def run_cell(model: str, labels: str, days: float, runs: Path) -> dict[str, Any]:
    config = {
        "strategy": "fedpsa",
        "model": model,
        "dirichlet-alpha": 0.1,
        "fedpsa-calib-labels": labels,
        "fedpsa-diagnostic": True,
    }
    job = Job(f"{model}-{labels}-{days:g}d", {}, config)
    result = run_job(job, str(runs), days * DAY)
    rows = read_jsonl(runs / job.name / "updates.jsonl")
    return {
        "model": model,
        "labels": labels,
        "days": days,
        "seconds": round(result["seconds"], 1),
        "final_accuracy": result["summary"]["final_accuracy"],
        **summarise(rows),
    }


def line(cell: dict[str, Any]) -> str:
    k, w = cell["kappa"], cell["weight"]
    return (
        f"{cell['model']:>6} {cell['labels']:>6}: {cell['updates']} updates, kappa "
        f"{k['min']:.3f} / {k['median']:.3f} / {k['max']:.3f}, weight {w['min']:.4f} / "
        f"{w['median']:.4f} / {w['max']:.4f} (max ratio "
        f"{cell['max_weight_ratio_in_an_aggregation']:.3f}), Spearman(kappa, align) "
        f"{cell['spearman_kappa_align']:.3f}, final accuracy {cell['final_accuracy']:.4f}, "
        f"{cell['seconds']:.0f} s"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--models", default="linear,lenet", help="comma-separated")
    parser.add_argument("--labels", default="random,self", help="comma-separated")
    parser.add_argument("--days", type=float, default=0.03, help="virtual days per run")
    parser.add_argument("--runs", type=Path, default=Path("runs/fedpsa-labels"))
    args = parser.parse_args()
    done = json.loads(RESULTS.read_text()) if RESULTS.exists() else {}
    for model in args.models.split(","):
        for labels in args.labels.split(","):
            key = f"{model}-{labels}-{args.days:g}d"
            if key not in done:
                done[key] = run_cell(model, labels, args.days, args.runs)
                RESULTS.parent.mkdir(parents=True, exist_ok=True)
                RESULTS.write_text(json.dumps(done, indent=1) + "\n")
            print(line(done[key]), flush=True)
    print(f"results in {RESULTS}")


if __name__ == "__main__":
    main()
