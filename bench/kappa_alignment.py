"""The FedPSA paper's Sec. 6.6 diagnostic: is kappa a behavioural-staleness signal?

    python -m bench.kappa_alignment                        # run FedPSA with the diagnostic
    python -m bench.kappa_alignment --calib-source real    # with a real calibration batch
    python -m bench.kappa_alignment --from-run runs/<name> # analyse a finished run

A run with `fedpsa-diagnostic=true` records, per update, kappa (eq. 12) and
align = cos(grad L(w_client; D_test), grad L(w_server; D_test)) (eq. 21-22) on a held-out
batch of 512 test samples, w_client = the update's base model + its delta, w_server = the
global model it is aggregated into. This script reports Pearson and Spearman correlations
of (kappa, align) over all updates and over kappa bins (width --bin-width, 0.1 in the
paper: bin centre against the bin's mean alignment), and plots the mean alignment per bin
with the number of updates in each (paper Fig. 6). Writes diagnostic.md, diagnostic.json
and diagnostic.png into the run folder.
"""

from __future__ import annotations

import argparse
import json
import math
from pathlib import Path
from typing import Any

import numpy as np
from scipy import stats

from bench.reproduce_fedpsa import DAY, Job, run_job
from fedstale.server_app.results import read_jsonl

PAPER = {"raw": (0.1908, 0.1338), "binned": (0.7620, 0.6833)}  # (Pearson, Spearman)


def correlations(x: np.ndarray, y: np.ndarray) -> tuple[float, float]:
    """(Pearson, Spearman); NaN where fewer than 3 points or a constant input."""
    if len(x) < 3 or np.ptp(x) == 0 or np.ptp(y) == 0:
        return math.nan, math.nan
    return float(stats.pearsonr(x, y)[0]), float(stats.spearmanr(x, y)[0])


def binned(kappa: np.ndarray, align: np.ndarray, width: float) -> list[dict[str, float]]:
    """One row per non-empty bin [k * width, (k + 1) * width): centre, mean align, count."""
    index = np.floor(kappa / width + 1e-9).astype(int)
    return [
        {
            "centre": (k + 0.5) * width,
            "mean_align": float(align[index == k].mean()),
            "count": int((index == k).sum()),
        }
        for k in np.unique(index)
    ]


def analyse(updates: list[dict[str, Any]], width: float) -> dict[str, Any]:
    scored = [u for u in updates if "align" in u]
    if not scored:
        raise SystemExit("no update carries 'align': run with fedpsa-diagnostic=true")
    kappa = np.array([u["kappa"] for u in scored])
    align = np.array([u["align"] for u in scored])
    bins = binned(kappa, align, width)
    centres = np.array([b["centre"] for b in bins])
    means = np.array([b["mean_align"] for b in bins])
    return {
        "updates": len(scored),
        "kappa_range": [float(kappa.min()), float(kappa.max())],
        "kappa_quartiles": [float(q) for q in np.quantile(kappa, [0.25, 0.5, 0.75])],
        "bin_width": width,
        "raw": correlations(kappa, align),
        "binned": correlations(centres, means),
        "bins": bins,
    }


def fmt(value: float) -> str:
    return "n/a" if math.isnan(value) else f"{value:.4f}"


def markdown(result: dict[str, Any], label: str) -> str:
    lo, hi = result["kappa_range"]
    q1, median, q3 = result["kappa_quartiles"]
    lines = [
        f"kappa against gradient alignment, {label}: {result['updates']} updates, kappa in "
        f"[{lo:.3f}, {hi:.3f}] (quartiles {q1:.3f} / {median:.3f} / {q3:.3f}).",
        "",
        "| | Pearson ours | Pearson paper | Spearman ours | Spearman paper |",
        "| --- | --- | --- | --- | --- |",
    ]
    for key, name in (("raw", "per update"), ("binned", f"bins of {result['bin_width']:g}")):
        (pearson, spearman), (paper_p, paper_s) = result[key], PAPER[key]
        lines.append(f"| {name} | {fmt(pearson)} | {paper_p} | {fmt(spearman)} | {paper_s} |")
    lines += ["", "| kappa bin centre | mean align | updates |", "| --- | --- | --- |"]
    lines += [
        f"| {b['centre']:.2f} | {b['mean_align']:.4f} | {b['count']} |" for b in result["bins"]
    ]
    return "\n".join(lines)


def plot(result: dict[str, Any], path: Path, label: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    bins = result["bins"]
    centres = [b["centre"] for b in bins]
    width = result["bin_width"]
    fig, ax = plt.subplots(figsize=(6, 4))
    ax.plot(centres, [b["mean_align"] for b in bins], "o-", color="tab:blue")
    ax.set_xlabel("kappa (bin centre)")
    ax.set_ylabel("mean alignment", color="tab:blue")
    counts = ax.twinx()
    counts.bar(centres, [b["count"] for b in bins], width=0.8 * width, alpha=0.25, color="gray")
    counts.set_ylabel("count")
    ax.set_title(f"kappa vs gradient alignment ({label})")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--from-run", type=Path, help="a finished run folder to analyse")
    parser.add_argument("--alpha", type=float, default=0.1, help="Dirichlet alpha")
    parser.add_argument("--days", type=float, default=0.25, help="virtual days")
    parser.add_argument("--calib-source", choices=("gaussian", "real"), default="gaussian")
    parser.add_argument("--server-step", choices=("spec", "client-lr"), default="spec")
    parser.add_argument("--bin-width", type=float, default=0.1)
    parser.add_argument("--out", type=Path, default=Path("runs/kappa-alignment"))
    args = parser.parse_args()
    folder = args.from_run
    if folder is None:
        name = f"a{args.alpha}-{args.calib_source}-{args.server_step}-{args.days:g}d"
        config = {
            "strategy": "fedpsa",
            "fedpsa-diagnostic": True,
            "fedpsa-calib-source": args.calib_source,
            "server-step": args.server_step,
            "dirichlet-alpha": args.alpha,
        }
        run_job(Job(name, {}, config), str(args.out), args.days * DAY)
        folder = args.out / name
    result = analyse(read_jsonl(folder / "updates.jsonl"), args.bin_width)
    label = folder.name
    (folder / "diagnostic.json").write_text(json.dumps(result, indent=1) + "\n")
    (folder / "diagnostic.md").write_text(markdown(result, label) + "\n")
    plot(result, folder / "diagnostic.png", label)
    print(markdown(result, label))
    print(f"written to {folder}/diagnostic.{{md,json,png}}")


if __name__ == "__main__":
    main()
