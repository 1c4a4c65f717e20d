"""The PACE paper's experiments (Table II, Fig. 5, communication, time to accuracy) on
Fashion-MNIST, regenerated.

    python -m bench.reproduce_pace                 # 3 seeds of the personalised rules, 1 of others
    python -m bench.reproduce_pace --seeds-all 3   # 3 seeds of every method
    python -m bench.reproduce_pace --updates 4000  # a longer budget
    python -m bench.reproduce_pace --report        # tables of the runs already done
    python -m bench.reproduce_pace --latency proportional --partitions dir0.1  # the author's
                                                   # simulator's latency (below)
    python -m bench.reproduce_pace --methods local-only,pfedgraph-async-authors \
        --partitions dir0.1                        # the added baselines' Dir(0.1) cells

Protocol (paper Sec. V-A; its datasets are EMNIST / CIFAR / AGNews / HARBox, not available
here): Fashion-MNIST train and test merged, split over 100 clients by per-class Dirichlet
0.1 or pathologically with 2 classes each, each client's share 75/25 into local train and
test (the author's simulator); pFedGraph's CNN (LeNet-5, 61,706 parameters); 10 tasks in
flight (FedAvg: 10 clients a round); 30% of clients 5x slower (latency 100 or 500 units);
5 local epochs, batch 64, SGD lr 0.01 (no decay), momentum 0.9, weight decay 1e-4; a budget
of 2,000 arrivals (client updates; FedAvg's 200 rounds of 10). Every method is scored the
same way: each client's model (the global one for FedAsync, FedBuff, FedAvg) on its own
local test split, mean over clients; the paper's figure is the mean of the last 10
evaluations. Baselines as the paper sets them: FedAsync hinge a 1 b 4; FedBuff K 10 (the
paper's eta_g 10 in AFL-Lib's FedBuff, which divides the buffer mean by K again, is our
eta_g 1); FedAvg samples 10% a round. Two baselines the paper lacks: local-only (every
client trains only its own model: what PACE gains by collaborating at all) and
pFedGraph-Async as the authors' pFedGraph stores its models (pace-pfedgraph-style = authors:
each client's aggregate kept and compared, where ours keeps raw models and mixes at
dispatch).

`--latency proportional` replaces the fixed latencies by the PACE author's simulator's model:
a task takes its local steps (5 epochs of ceil(n_i / 64) batches) x 2 units x the client's
device factor (5 for 30% of clients, else 1), so a client of mean size (about 525 training
samples, 45 steps) takes about 90 units on a fast device, near the fixed profile's 100; its
runs go to a folder of their own (<updates>u-proportional).

Runs use the real engine, strategies and client code in-process, several at once on
separate cores; results.jsonl keeps each finished run, so an interrupted grid resumes.
Writes under --out: results.jsonl, table.md, fig5.md and accuracy.png.
"""

from __future__ import annotations

import argparse
import statistics
from functools import partial
from pathlib import Path
from typing import Any

from bench import reproduce
from bench.grid import Job, Runner, matching, run_in_process, table_head
from bench.reproduce import Options, Paper, Result, Suite, figure, mean_curve
from fedstale.launcher.analysis import mean_std

PARTITIONS = {
    "dir0.1": {
        "partition": "dirichlet",
        "dirichlet-convention": "per-class",
        "dirichlet-alpha": 0.1,
    },
    "c2": {"partition": "pathological", "classes-per-client": 2},
}
METHODS = {
    "pace": {"strategy": "pace"},
    "pfedgraph-async": {"strategy": "pfedgraph-async"},
    "pace-buffer": {"strategy": "pace", "pace-ablation": "buffer"},
    "pace-buffer-multicast": {"strategy": "pace", "pace-ablation": "buffer-multicast"},
    "fedasync": {
        "strategy": "fedasync",
        "fedasync-staleness": "hinge",
        "fedasync-hinge-a": 1.0,
        "fedasync-hinge-b": 4.0,
    },
    "fedbuff": {"strategy": "fedbuff", "buffer-size": 10},
    "fedavg": {"strategy": "fedavg"},
    "local-only": {"strategy": "local-only"},
    "pfedgraph-async-authors": {"strategy": "pfedgraph-async", "pace-pfedgraph-style": "authors"},
}
MAIN = ("pace", "pfedgraph-async", "fedasync", "fedbuff", "fedavg")
ADDED = ("pfedgraph-async-authors", "local-only")  # rows only once run; not in the paper
FIG5 = {  # Fig. 5's bars, left to right
    "pFedGraph-Async (naive)": "pfedgraph-async",
    "+ buffer": "pace-buffer",
    "+ buffer + multicast": "pace-buffer-multicast",
    "+ staleness decay (PACE)": "pace",
}
SEEDED = ("pace", "pfedgraph-async", *ADDED)  # --seeds of these; --seeds-all of the rest
PAPER = {  # Table II, mean client accuracy %: EMNIST (#C = 10, Dir 0.1), CIFAR-10 (#C = 2, Dir 0.1)
    "pace": ("91.97", "90.75", "79.98", "81.65"),
    "pfedgraph-async": ("72.64", "42.98", "59.90", "16.70"),
    "fedasync": ("80.62", "83.74", "40.76", "42.45"),
    "fedbuff": ("81.24", "84.47", "43.89", "47.83"),
    "fedavg": ("82.38", "84.98", "45.32", "49.40"),
}
PROTOCOL = {
    "dataset": "fmnist",
    "model": "lenet",
    "test-split": "local",
    "client-val-fraction": 0.25,
    "num-clients": 100,
    "concurrency": 10,
    "latency": "slow-fraction",
    "latency-min": 100.0,
    "latency-max": 100.0,
    "slow-fraction": 0.3,
    "slow-factor": 5.0,
    "local-epochs": 5,
    "batch-size": 64,
    "lr": 0.01,
    "lr-decay": 1.0,
    "momentum": 0.9,
    "weight-decay": 1e-4,
    "eval-target": "per-client",
    "max-virtual-time": 0.0,
    "eval-interval": 1000.0,
    "progress-interval": 3600.0,
    "checkpoint-every": 0,
}
LAST = 10  # the paper's figure: mean of the last 10 evaluations
# --latency proportional: the author's simulator (training time x device factor)
PROPORTIONAL = {"latency": "proportional", "latency-step-time": 2.0}


def jobs_for(methods: list[str], seeds: int, seeds_all: int, parts: list[str]) -> list[Job]:
    """Seed 0 of every cell first, so that an interrupted grid has a whole table soonest."""
    jobs = []
    cells = [(part, method) for part in parts for method in methods]
    for seed, (part, method) in reproduce.seed_first(
        seeds, seeds_all, SEEDED, cells, lambda c: c[1]
    ):
        config = {**PARTITIONS[part], **METHODS[method], "seed": seed}
        labels = {"suite": "pace", "partition": part, "method": method, "seed": seed}
        jobs.append(Job(f"{part}-{method}-s{seed}", labels, config))
    return jobs


def run_job(job: Job, runs_dir: str, updates: int, latency: str = "fixed") -> dict[str, Any]:
    """One run in this (worker) process; its summary and mean-client-accuracy curve."""
    timing = PROPORTIONAL if latency == "proportional" else {}
    values = {**PROTOCOL, **timing, **job.config, "max-updates": updates}
    result, folder = run_in_process(job, runs_dir, values)
    return {**result, "curve": reproduce.curve(folder, "accuracy", "accuracy_std")}


def cell(results: list[dict[str, Any]], method: str, part: str) -> list[float]:
    """The paper's accuracy of every seed of one method on one partition."""
    return [last_mean(r) for r in matching(results, method=method, partition=part)]


def last_mean(result: dict[str, Any]) -> float:
    """The paper's accuracy: mean client accuracy (%) averaged over the last 10 evaluations."""
    return 100 * statistics.mean(a for _, a, _ in result["curve"][-LAST:])


def communication(result: dict[str, Any]) -> int:
    summary = result["summary"]
    return summary["downlinks"] + summary["uplinks"]


def time_to(result: dict[str, Any], target: float) -> float | None:
    """Virtual time of the first evaluation at or above `target` (%), or None."""
    return reproduce.time_to(result, target, scale=100)


def main_table(results: list[dict[str, Any]], updates: int) -> str:
    lines = table_head(
        f"Mean client accuracy (%) on Fashion-MNIST after {updates} arrivals, mean of the last "
        f"{LAST} evaluations (ours), beside the paper's Table II (EMNIST / CIFAR-10: other "
        "data). Communication: (downlinks + uplinks) / FedAsync's.",
        [
            "method",
            "Dir(0.1) ours",
            "#C=2 ours",
            "EMNIST #C=10 / Dir(0.1)",
            "CIFAR-10 #C=2 / Dir(0.1)",
            "comm. Dir(0.1)",
            "comm. #C=2",
        ],
    )
    added = [m for m in ADDED if matching(results, method=m)]
    for method in (*MAIN, *added):
        cells = []
        for part in PARTITIONS:
            cells.append(
                mean_std([last_mean(r) for r in matching(results, method=method, partition=part)])
            )
        paper = PAPER.get(method, ("-",) * 4)
        cells += [f"{paper[0]} / {paper[1]}", f"{paper[2]} / {paper[3]}"]
        for part in PARTITIONS:
            ours = matching(results, method=method, partition=part)
            base = matching(results, method="fedasync", partition=part)
            if ours and base:
                ratio = statistics.mean(communication(r) for r in ours) / statistics.mean(
                    communication(r) for r in base
                )
                cells.append(f"{ratio:.3f}")
            else:
                cells.append("-")
        lines.append(f"| {method} | " + " | ".join(cells) + " |")
    lines += ["", *speed_lines(results)]
    return "\n".join(lines)


def speed_lines(results: list[dict[str, Any]]) -> list[str]:
    """Time for PACE to reach the accuracy of the best of the paper's baselines, as a share of
    that baseline's time (the added baselines are not the paper's claim)."""
    lines = []
    for part in PARTITIONS:
        pace = matching(results, method="pace", partition=part)
        others = [m for m in MAIN if m != "pace" and matching(results, method=m, partition=part)]
        if not pace or not others:
            continue
        best = max(
            others,
            key=lambda m: statistics.mean(
                last_mean(r) for r in matching(results, method=m, partition=part)
            ),
        )
        # The lowest of its seeds' accuracies: every run of the baseline reaches it (a run's
        # last-10 mean is at most its best evaluation), so both times exist for every seed.
        target = min(last_mean(r) for r in matching(results, method=best, partition=part))
        theirs = [time_to(r, target) for r in matching(results, method=best, partition=part)]
        ours = [time_to(r, target) for r in pace]
        if None in ours or None in theirs:
            lines.append(f"- {part}: PACE or {best} never reached {target:.2f}%")
            continue
        share = statistics.mean(ours) / statistics.mean(theirs)  # type: ignore[arg-type]
        lines.append(
            f"- {part}: the best of the paper's baselines is {best} (its lowest seed: "
            f"{target:.2f}%); PACE first reaches that at "
            f"virtual time {statistics.mean(ours):,.0f} against {statistics.mean(theirs):,.0f} "  # type: ignore[arg-type]
            f"({100 * share:.0f}% of its time; paper: 19-43%)"
        )
    return lines


def fig5_table(results: list[dict[str, Any]], updates: int) -> str:
    lines = table_head(
        f"Fig. 5 on Fashion-MNIST: mean client accuracy (%) after {updates} arrivals, adding "
        "PACE's components to pFedGraph-Async one at a time.",
        [
            "variant",
            *[f"{part} ours" for part in PARTITIONS],
            "tasks superseded by multicasts (Dir 0.1)",
            "downlinks / uplinks (Dir 0.1)",
        ],
    )
    for label, method in FIG5.items():
        cells = [mean_std(cell(results, method, part)) for part in PARTITIONS]
        runs = matching(results, method=method, partition="dir0.1")
        superseded = [float(r["summary"]["tasks_superseded"]) for r in runs]
        downlinks = [r["summary"]["downlinks"] / r["summary"]["uplinks"] for r in runs]
        cells.append(mean_std(superseded) if runs else "-")
        cells.append(mean_std(downlinks, digits=3) if runs else "-")
        lines.append(f"| {label} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def plot(results: list[dict[str, Any]], path: Path) -> None:
    with figure(path, len(PARTITIONS), 6, sharey=True) as (_, axes):
        for ax, part in zip(axes, PARTITIONS, strict=True):
            for method in (*MAIN, *ADDED, "pace-buffer", "pace-buffer-multicast"):
                rows = matching(results, method=method, partition=part)
                if rows:
                    style = "--" if method.startswith("pace-") else ":" if method in ADDED else "-"
                    ax.plot(*mean_curve(rows), style, label=method, linewidth=1.2)
            ax.set_title(f"Fashion-MNIST, {part}")
            ax.set_xlabel("virtual time")
            ax.grid(alpha=0.3)
        axes[0].set_ylabel("mean client accuracy")
        handles, labels = max(
            (ax.get_legend_handles_labels() for ax in axes), key=lambda h: len(h[0])
        )
        axes[-1].legend(handles, labels, fontsize=8)  # a partial grid may lack one partition


def options(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--updates", type=int, default=2000, help="arrivals per run")
    reproduce.seed_flags(parser, "PACE and the personalised baselines")
    reproduce.subset_flag(parser, "methods", METHODS)
    reproduce.subset_flag(parser, "partitions", PARTITIONS)
    parser.add_argument(
        "--latency",
        choices=("fixed", "proportional"),
        default="fixed",
        help="fixed: 100 or 500 units a task; proportional: local steps x 2 x device factor",
    )


def check(args: Options, parser: argparse.ArgumentParser) -> None:
    reproduce.check_subsets(args, parser, {"methods": METHODS, "partitions": PARTITIONS})


def tables(results: list[Result], args: Options) -> str:
    return main_table(results, args.updates) + "\n\n" + fig5_table(results, args.updates)


def closing(results: list[Result], out: Path, wall_minutes: float) -> str:
    run_minutes = sum(r["seconds"] for r in results) / 60
    return (
        f"{len(results)} runs, {run_minutes:.1f} min of run time in all "
        f"({wall_minutes:.1f} min wall in this invocation); results in {out}"
    )


def runner(args: Options) -> Runner:
    return partial(run_job, updates=args.updates, latency=args.latency)


PACE = Paper(
    description=__doc__ or "",
    suites={
        "main": Suite(
            lambda args: jobs_for(
                args.methods.split(","), args.seeds, args.seeds_all, args.partitions.split(",")
            ),
            tables,
            "table.md",
            plot,
            "accuracy.png",
            plot_empty=True,
        )
    },
    default_suite="main",
    default_out=Path("runs/reproduce-pace"),
    runner=runner,
    announce=lambda _, jobs, args: (
        f"{len(jobs)} runs of {args.updates} arrivals on {args.workers} workers"
    ),
    tally=None,
    closing=closing,
    options=options,
    out=lambda args: (
        args.out
        / (f"{args.updates}u" + ("-proportional" if args.latency == "proportional" else ""))
    ),
    check=check,
    suite_choice=False,
)


if __name__ == "__main__":
    reproduce.main(PACE)
