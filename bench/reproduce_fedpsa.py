"""The FedPSA paper's Fashion-MNIST experiments, regenerated.

    python -m bench.reproduce_fedpsa                      # Table 1, a quarter virtual day, 1 seed
    python -m bench.reproduce_fedpsa --full               # Table 1 as the paper: 10 days, 3 seeds
    python -m bench.reproduce_fedpsa --suite ablation     # Table 6 (full / w/o T / w/o S / w/o T&S)
    python -m bench.reproduce_fedpsa --suite latency      # Table 4's latency settings
    python -m bench.reproduce_fedpsa --suite calibration  # Table 5: real vs Gaussian D_b
    python -m bench.reproduce_fedpsa --full --alphas 0.1 --methods fedpsa --calib-labels self
                                                          # FedPSA at alpha 0.1, self labels

Protocol (paper Sec. 6.1, FLGo's harness): linear model, 50 clients, concurrency 20%,
latency uniform 10-500 per client, lr 0.01 decayed x0.999 per version, 5 local epochs,
batch 64, buffer 5, Dirichlet (Hsu, FLGo's convention) alpha 0.1 / 0.5 / 1.0, the standard
test split. Every run uses the real engine, strategies and client code through the
in-process transport (identical results to Flower simulation on the virtual clock, at the
bare loop's speed), several at once on separate cores. Writes, under --out:
results.jsonl (one line per run), table.md (ours beside the paper's) and accuracy.png
(paper Fig. 3 style).
"""

from __future__ import annotations

import argparse
import statistics
from dataclasses import replace
from functools import partial
from pathlib import Path
from typing import Any

from bench import reproduce
from bench.grid import Job, Runner, finals, grid, matching, run_in_process, table_head
from bench.reproduce import Options, Paper, Result, Suite, figure
from fedstale.launcher.analysis import Group, Run, mean_std
from fedstale.launcher.plots import plot_accuracy

DAY = 86_400.0
METHODS = ("fedavg", "fedasync", "fedbuff", "ca2fl", "fedfa", "fedpsa")
ALPHAS = (0.1, 0.5, 1.0)
PAPER_TABLE1 = {  # FMNIST final accuracy (%), alpha 0.1 / 0.5 / 1.0, after 10 virtual days
    "fedbuff": (84.03, 83.87, 84.06),
    "fedavg": (80.77, 78.38, 82.46),
    "fedasync": (82.59, 82.82, 83.00),
    "ca2fl": (83.26, 83.60, 83.78),
    "fedfa": (82.19, 82.73, 83.25),
    "fedpsa": (83.84, 83.93, 84.14),
}
ABLATIONS = {
    "full": "none",
    "w/o T": "no-thermometer",
    "w/o S": "no-sensitivity",
    "w/o T&S": "no-both",
}
PAPER_TABLE6 = {  # CIFAR-10 in the paper, concurrency 0.1 / 0.2 / 0.3
    (1.0, "w/o T"): (62.8, 63.54, 64.98),
    (1.0, "w/o S"): (61.43, 61.77, 63.97),
    (1.0, "w/o T&S"): (61.51, 61.68, 62.74),
    (1.0, "full"): (63.22, 64.30, 65.76),
    (0.1, "w/o T"): (53.30, 56.90, 59.15),
    (0.1, "w/o S"): (54.07, 56.71, 58.56),
    (0.1, "w/o T&S"): (44.08, 51.09, 55.16),
    (0.1, "full"): (59.78, 61.22, 62.39),
}
LATENCIES = ((10, 500), (20, 1000), (50, 2500))
LATENCY_KINDS = ("uniform", "long-tail")
CALIB_SIZES = (16, 32, 128, 512)
PAPER_TABLE5 = {  # CIFAR-10 in the paper: (real, Gaussian) per batch size
    0.1: ((63.30, 63.68), (63.91, 63.67), (63.84, 63.24), (63.76, 63.61)),
    1.0: ((66.15, 66.11), (66.16, 66.35), (66.42, 66.42), (66.13, 66.65)),
}
PROTOCOL = {
    "dataset": "fmnist",
    "model": "linear",
    "partition": "dirichlet",
    "dirichlet-convention": "hsu",
    "test-split": "standard",
    "num-clients": 50,
    "concurrency": 10,
    "buffer-size": 5,
    "local-epochs": 5,
    "batch-size": 64,
    "lr": 0.01,
    "lr-decay": 0.999,
    "latency": "uniform",
    "latency-min": 10.0,
    "latency-max": 500.0,
}


def table1_jobs(budget: float, seeds: int) -> list[Job]:
    return grid(
        "table1",
        "t1-{method}-a{alpha}-s{seed}".format,
        {"alpha": ALPHAS, "method": METHODS},
        lambda alpha, method, seed: {"strategy": method, "dirichlet-alpha": alpha},
        seeds,
    )


def ablation_jobs(budget: float, seeds: int) -> list[Job]:
    return grid(
        "ablation",
        lambda alpha, variant, rate, seed: f"t6-{ABLATIONS[variant]}-a{alpha}-p{rate}-s{seed}",
        {"alpha": (0.1, 1.0), "variant": ABLATIONS, "rate": (0.1, 0.2, 0.3)},
        lambda alpha, variant, rate, seed: {
            "strategy": "fedpsa",
            "fedpsa-ablation": ABLATIONS[variant],
            "dirichlet-alpha": alpha,
            "concurrency": round(rate * 50),
        },
        seeds,
    )


def latency_config(setting: str) -> dict[str, Any]:
    """'long-tail 20-1000' -> the run-config keys of that latency profile."""
    kind, span = setting.split()
    low, high = span.split("-")
    return {"latency": kind, "latency-min": float(low), "latency-max": float(high)}


def latency_jobs(budget: float, seeds: int) -> list[Job]:
    settings = [f"{kind} {low}-{high}" for low, high in LATENCIES for kind in LATENCY_KINDS]
    return grid(
        "latency",
        lambda latency, method, seed: f"t4-{method}-{latency.replace(' ', '-')}-s{seed}",
        {"latency": settings, "method": ("fedbuff", "ca2fl", "fedpsa")},
        lambda latency, method, seed: {
            "strategy": method,
            **latency_config(latency),
            "dirichlet-alpha": 0.1,
        },
        seeds,
    )


def calibration_jobs(budget: float, seeds: int) -> list[Job]:
    return grid(
        "calibration",
        "t5-{source}-b{size}-a{alpha}-s{seed}".format,
        {"alpha": PAPER_TABLE5, "size": CALIB_SIZES, "source": ("real", "gaussian")},
        lambda alpha, size, source, seed: {
            "strategy": "fedpsa",
            "fedpsa-calib-source": source,
            "fedpsa-calib-size": size,
            "dirichlet-alpha": alpha,
        },
        seeds,
    )


SUITES = {
    "table1": table1_jobs,
    "ablation": ablation_jobs,
    "latency": latency_jobs,
    "calibration": calibration_jobs,
}


def run_job(job: Job, runs_dir: str, budget: float) -> dict[str, Any]:
    """One run in this (worker) process; returns its summary, run time and accuracy curve."""
    from fedstale.server_app.results import read_jsonl

    values = {
        **PROTOCOL,
        **job.config,
        "max-virtual-time": budget,
        "eval-interval": budget / 50,
        "progress-interval": 3600.0,
    }
    result, folder = run_in_process(job, runs_dir, values)
    curve = reproduce.curve(folder, "accuracy")
    kappas = [u["kappa"] for u in read_jsonl(folder / "updates.jsonl") if "kappa" in u]
    return {
        **result,
        "curve": curve,
        "mean_kappa": statistics.mean(kappas) if kappas else None,
    }


def methods_in(results: list[dict[str, Any]]) -> list[str]:
    return sorted({r["method"] for r in results}, key=METHODS.index)


def table1_markdown(results: list[dict[str, Any]], budget: float) -> str:
    columns = [f"a={a} {what}" for a in ALPHAS for what in ("ours", "paper", "AULC")]
    lines = table_head(
        f"Final accuracy (%) and AULC (accuracy x days) on Fashion-MNIST after {budget / DAY:g} "
        "virtual days (paper: 10 days). Dirichlet: Hsu et al. (FLGo's convention).",
        ["method", *columns],
    )
    for method in methods_in(results):
        cells = []
        for column, alpha in enumerate(ALPHAS):
            rows = matching(results, method=method, alpha=alpha)
            aulcs = [r["summary"]["aulc_days"] for r in rows]
            paper = f"{PAPER_TABLE1[method][column]:.2f}"
            cells += [mean_std(finals(rows)), paper, mean_std(aulcs)]
        lines.append(f"| {method} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def ablation_markdown(results: list[dict[str, Any]], budget: float) -> str:
    lines = table_head(
        f"FedPSA ablations on Fashion-MNIST after {budget / DAY:g} virtual days; final "
        "accuracy (%) ours / paper (the paper's Table 6 is on CIFAR-10).",
        ["alpha", "variant", "p=0.1", "p=0.2", "p=0.3"],
    )
    for alpha in (0.1, 1.0):
        for label in ABLATIONS:
            cells = []
            for column, rate in enumerate((0.1, 0.2, 0.3)):
                rows = matching(results, alpha=alpha, variant=label, rate=rate)
                ours = mean_std(finals(rows))
                cells.append(f"{ours} / {PAPER_TABLE6[(alpha, label)][column]:.2f}")
            lines.append(f"| {alpha} | {label} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def latency_markdown(results: list[dict[str, Any]], budget: float) -> str:
    settings = [f"{kind} {low}-{high}" for low, high in LATENCIES for kind in LATENCY_KINDS]
    lines = table_head(
        f"Final accuracy (%) on Fashion-MNIST, alpha 0.1, after {budget / DAY:g} virtual days "
        "under the latency settings of the paper's Table 4 (which is on CIFAR-100).",
        ["method", *settings],
    )
    for method in methods_in(results):
        cells = []
        for setting in settings:
            cells.append(mean_std(finals(matching(results, method=method, latency=setting))))
        lines.append(f"| {method} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def calibration_markdown(results: list[dict[str, Any]], budget: float) -> str:
    lines = table_head(
        f"FedPSA calibration batch D_b on Fashion-MNIST after {budget / DAY:g} virtual days; "
        "final accuracy (%) ours (paper, on CIFAR-10).",
        [
            "alpha",
            "batch size",
            "real D_b",
            "Gaussian D_b",
            "abs. delta",
            "mean kappa real / Gauss.",
        ],
    )
    for alpha, paper in PAPER_TABLE5.items():
        for size, (paper_real, paper_gauss) in zip(CALIB_SIZES, paper, strict=True):
            accuracy, kappas = {}, {}
            for source in ("real", "gaussian"):
                rows = matching(results, alpha=alpha, size=size, source=source)
                accuracy[source] = finals(rows)
                kappas[source] = statistics.mean(r["mean_kappa"] for r in rows) if rows else 0.0
            if not (accuracy["real"] and accuracy["gaussian"]):
                continue
            delta = statistics.mean(accuracy["real"]) - statistics.mean(accuracy["gaussian"])
            lines.append(
                f"| {alpha} | {size} | {mean_std(accuracy['real'])} ({paper_real:.2f}) | "
                f"{mean_std(accuracy['gaussian'])} ({paper_gauss:.2f}) | {delta:+.2f} "
                f"({paper_real - paper_gauss:+.2f}) | "
                f"{kappas['real']:.3f} / {kappas['gaussian']:.3f} |"
            )
    return "\n".join(lines)


MARKDOWN = {
    "table1": table1_markdown,
    "ablation": ablation_markdown,
    "latency": latency_markdown,
    "calibration": calibration_markdown,
}


def as_run(result: dict[str, Any]) -> Run:
    """A grid result (summary and curve) as fedstale compare's Run."""
    times, accuracies = zip(*result["curve"], strict=True)
    return Run(Path(result["name"]), dict(result), result["summary"], list(times), list(accuracies))


def plot_curves(results: list[dict[str, Any]], path: Path) -> None:
    with figure(path, len(ALPHAS), 5, sharey=True) as (_, axes):
        for ax, alpha in zip(axes, ALPHAS, strict=True):
            groups = [
                Group(method, [as_run(r) for r in rows])
                for method in METHODS
                if (rows := matching(results, method=method, alpha=alpha))
            ]
            plot_accuracy(ax, groups)
            ax.set_title(f"Fashion-MNIST, Dir({alpha})")
        axes[0].set_ylabel("test accuracy")
        axes[-1].legend(*axes[0].get_legend_handles_labels())  # a partial grid may lack 1.0


def options(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--days", type=float, default=0.25, help="virtual days per run")
    parser.add_argument("--seeds", type=int, default=1)
    parser.add_argument("--full", action="store_true", help="the paper's budget: 10 days, 3 seeds")
    parser.add_argument(
        "--methods", default=",".join(METHODS), help=f"a comma-separated subset of {METHODS}"
    )
    parser.add_argument(
        "--server-step",
        choices=("spec", "client-lr"),
        default="spec",
        help="buffered rules' server step: as the papers write it, or FLGo's (x client lr)",
    )
    parser.add_argument(
        "--alphas", default=",".join(map(str, ALPHAS)), help="a comma-separated subset of alphas"
    )
    parser.add_argument(
        "--calib-labels",
        choices=("random", "self"),
        default="random",
        help="FedPSA's Gaussian calibration labels (fedpsa-calib-labels); table1 and latency",
    )


def check(args: Options, parser: argparse.ArgumentParser) -> None:
    if unknown := set(args.methods.split(",")) - set(METHODS):
        parser.error(f"unknown methods {sorted(unknown)}; choose from {','.join(METHODS)}")
    args.alpha_set = {float(a) for a in args.alphas.split(",")}
    if unknown := args.alpha_set - set(ALPHAS):
        parser.error(f"unknown alphas {sorted(unknown)}; choose from {ALPHAS}")
    if args.calib_labels == "self" and args.suite not in ("table1", "latency"):
        parser.error(
            "--calib-labels self: table1 and latency only (the ablation and calibration "
            "grids hold raw-parameter and real-batch runs, which keep their own labels)"
        )
    if args.full:
        args.days, args.seeds = 10.0, 3
    args.budget = args.days * DAY


def output(args: Options) -> Path:
    step = "" if args.server_step == "spec" else f"-{args.server_step}"
    labels = "" if args.calib_labels == "random" else f"-{args.calib_labels}-labels"
    return args.out / f"{args.days:g}d-{args.seeds}seeds{step}{labels}"


def suite(name: str) -> Suite:
    def jobs(args: Options) -> list[Job]:
        methods = args.methods.split(",")
        return [
            replace(job, config={**job.config, **variant(job, args)})
            for job in SUITES[name](args.budget, args.seeds)
            if job.labels.get("method", "fedpsa") in methods
            and job.config["dirichlet-alpha"] in args.alpha_set
        ]

    plot = plot_curves if name == "table1" else None
    return Suite(
        jobs,
        lambda results, args: MARKDOWN[name](results, args.budget),
        f"{name}.md",
        plot,
        "accuracy.png",
        plot_empty=True,
    )


def variant(job: Job, args: Options) -> dict[str, Any]:
    """The run-config keys the command line sets on `job`."""
    keys: dict[str, Any] = {"server-step": args.server_step}
    if job.config["strategy"] == "fedpsa" and args.calib_labels != "random":
        keys["fedpsa-calib-labels"] = args.calib_labels
    return keys


def runner(args: Options) -> Runner:
    return partial(run_job, budget=args.budget)


def announce(name: str, jobs: list[Job], args: Options) -> str:
    return f"{name}: {len(jobs)} runs of {args.days:g} virtual days on {args.workers} workers"


def closing(results: list[Result], out: Path, wall_minutes: float) -> str:
    return f"results in {out}"


FEDPSA = Paper(
    description=__doc__ or "",
    suites={name: suite(name) for name in SUITES},
    default_suite="table1",
    default_out=Path("runs/reproduce-fedpsa"),
    runner=runner,
    announce=announce,
    tally=None,
    closing=closing,
    options=options,
    out=output,
    check=check,
)


if __name__ == "__main__":
    reproduce.main(FEDPSA)
