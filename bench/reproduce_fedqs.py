"""The FedQS paper's experiments (accuracy per alpha, oscillation, time to FedAvg's accuracy,
robustness, ablations) on Fashion-MNIST, regenerated.

    python -m bench.reproduce_fedqs                     # main grid: 3 alphas, every method
    python -m bench.reproduce_fedqs --suite ablation    # FedQS-SGD without its parts
    python -m bench.reproduce_fedqs --suite robustness  # 50 clients at 1:20, 200 at 1:100
    python -m bench.reproduce_fedqs --suite regimes     # ours vs the authors' simulator
    python -m bench.reproduce_fedqs --suite regimes --settings a0.1   # one of its settings
    python -m bench.reproduce_fedqs --methods fedqs-sgd,fedqs-avg   # some of the main grid
    python -m bench.reproduce_fedqs --report            # tables of the runs already done

Protocol (the FedQS paper, NeurIPS 2025, and the authors' conf: their data is CIFAR-10 with
ResNet-18, not trainable here at their budget): Fashion-MNIST, per-class Dirichlet 0.1 /
0.5 / 1.0 over 100 clients, all training at once, each with a fixed period uniform in
[1, 50] virtual units (1:50); K = 10; pFedGraph's CNN (LeNet-5); 2 local epochs, batch 50,
SGD lr 0.1 (no decay), momentum 0 (FedQS sets its own), gradient clip 20; a budget of 400
aggregations of K, i.e. 4,000 client updates for every method (FedAvg: 400 rounds of 10
clients, FedBuff K 10, FedAsync one version per update). Accuracy: the global model on the
test set, about 50 times a run (eval-interval from the run's expected virtual length).
Oscillation: std of the evaluations over the last 20% of the run.

The regimes suite (3 seeds of FedQS-SGD and SAFL FedSGD per cell) runs alpha 0.1 and the
robustness settings with K = 10% of N in our regime (each FIFO entry aggregates the update
its client uploaded, `fedqs-fifo-update=uploaded`, with every client in flight) and in the
authors' simulator's, two ways: `fedqs-fifo-update=newest` (each entry aggregates its client's
newest update by then, as their queue holds a file the client overwrites when it retrains;
in our engine a batch is aggregated the moment its K-th update arrives, so an entry's client
has a newer update only when it is twice in that batch) and "concurrency K" (K clients in
flight, for about the authors' effective staleness of ~1.2 versions). It adds the authors'
own "1:20" (integer resources in [1, 19], period r + 1: periods 2-20, i.e. 1:10) beside ours
(periods 1-20), and FedQS-SGD with uniform base weights (`fedqs-base-weights=uniform`) at
alpha 0.1.

Runs use the real engine, strategies and client code in-process, several at once on
separate cores; results.jsonl keeps each finished run, so an interrupted grid resumes.
Writes under --out: results.jsonl, <suite>.md and <suite>.png (accuracy; FedQS-SGD's type
mix and mean lr over time).
"""

from __future__ import annotations

import argparse
import math
import re
import statistics
from collections.abc import Callable, Collection
from functools import partial
from pathlib import Path
from typing import Any

from bench import reproduce
from bench.grid import Job, Runner, finals, matching, run_in_process, table_head
from bench.reproduce import Options, Paper, Suite, figure, mean_curve
from fedstale.launcher.analysis import mean_std

ALPHAS = (0.1, 0.5, 1.0)
METHODS = {
    "fedqs-sgd": {"strategy": "fedqs-sgd"},
    "fedqs-avg": {"strategy": "fedqs-avg"},
    "safl-fedsgd": {"strategy": "safl-fedsgd"},
    "safl-fedavg": {"strategy": "safl-fedavg"},
    "fedavg": {"strategy": "fedavg", "concurrency": 10},
    "fedbuff": {"strategy": "fedbuff"},
    "fedasync": {"strategy": "fedasync"},
}
SEEDED = ("fedqs-sgd", "fedqs-avg", "safl-fedsgd", "safl-fedavg")  # --seeds; others --seeds-all
PAIRS = (("fedqs-sgd", "safl-fedsgd"), ("fedqs-avg", "safl-fedavg"))
ABLATIONS = {
    "full": {},
    "no-feedback": {"fedqs-ablation": "no-feedback"},
    "no flag weight (diagnostic)": {"fedqs-ablation": "no-flag-weight"},
    "no-momentum": {"fedqs-ablation": "no-momentum"},
    "similarity l1": {"fedqs-similarity": "l1"},
    "similarity l2": {"fedqs-similarity": "l2"},
    "pseudo-gradient w^(t-1)": {"fedqs-pseudo-gradient": "previous-global"},
    # The authors' l1 / l2 ablations ran with their pseudo-gradient, w^(t-1) itself.
    "similarity l1, pseudo-gradient w^(t-1)": {
        "fedqs-similarity": "l1",
        "fedqs-pseudo-gradient": "previous-global",
    },
    "similarity l2, pseudo-gradient w^(t-1)": {
        "fedqs-similarity": "l2",
        "fedqs-pseudo-gradient": "previous-global",
    },
    # Diagnostics, not the paper's: every update 20 local steps (a median client's 2 epochs)
    # instead of 2 epochs, so the n_i / sum n weights no longer favour the updates that took
    # the most steps; with and without the weighting.
    "full, 20 local steps (diagnostic)": {"local-steps": 20},
    "no-feedback, 20 local steps (diagnostic)": {
        "fedqs-ablation": "no-feedback",
        "local-steps": 20,
    },
}
ROBUSTNESS = {"50 clients 1:20": (50, 20.0), "200 clients 1:100": (200, 100.0)}
PAPER = {  # CIFAR-10 ResNet-18, final accuracy % at alpha 0.1 / 0.5 / 1.0
    "fedavg": (56.05, 73.71, 77.86),
    "safl-fedsgd": (65.71, 83.87, 85.42),
    "fedqs-avg": (63.91, 80.26, 82.74),
    "fedqs-sgd": (68.88, 86.11, 86.79),
}
PAPER_ROBUSTNESS = {  # final accuracy %; the paper has no SAFL FedSGD here
    "50 clients 1:20": {"fedavg": 70.1, "fedqs-sgd": 80.7},
    "200 clients 1:100": {"fedavg": 49.4, "fedqs-sgd": 80.1},
}
ROBUSTNESS_METHODS = ("fedavg", "fedqs-sgd", "safl-fedsgd")  # the paper's two, and our baseline
REGIMES: dict[str, dict[str, Any]] = {
    "ours": {"fedqs-fifo-update": "uploaded"},
    "authors'": {"fedqs-fifo-update": "newest"},
    # The authors' effective staleness (~1.2 versions) by concurrency instead: K in flight.
    "concurrency K": {"concurrency": None},  # None: the setting's buffer-size
}
REGIME_SLUGS = {"ours": "uploaded", "authors'": "newest", "concurrency K": "concurrency-k"}
REGIME_SETTINGS: dict[str, dict[str, Any]] = {  # K = 10% of N throughout
    "alpha 0.1, 100 clients 1:50, K 10": {},
    "50 clients 1:20 (periods 1-20), K 5": {
        "num-clients": 50,
        "concurrency": 50,
        "buffer-size": 5,
        "latency-max": 20.0,
    },
    "50 clients, the authors' 1:20 (periods 2-20), K 5": {
        "num-clients": 50,
        "concurrency": 50,
        "buffer-size": 5,
        "latency-min": 2.0,
        "latency-max": 20.0,
    },
    "200 clients 1:100, K 20": {
        "num-clients": 200,
        "concurrency": 200,
        "buffer-size": 20,
        "latency-max": 100.0,
    },
}
REGIME_METHODS = {
    "FedQS-SGD": {"strategy": "fedqs-sgd"},
    "SAFL FedSGD": {"strategy": "safl-fedsgd"},
    "FedQS-SGD, uniform base weights": {
        "strategy": "fedqs-sgd",
        "fedqs-base-weights": "uniform",
    },
}
UNIFORM_ONLY_AT = "alpha 0.1, 100 clients 1:50, K 10"  # where the uniform weights are measured
SETTING_KEYS = dict(zip(("a0.1", "50c", "50c-authors", "200c"), REGIME_SETTINGS, strict=True))
PROTOCOL = {
    "dataset": "fmnist",
    "model": "lenet",
    "partition": "dirichlet",
    "dirichlet-convention": "per-class",
    "test-split": "standard",
    "num-clients": 100,
    "concurrency": 100,
    "buffer-size": 10,
    "latency": "uniform",
    "latency-min": 1.0,
    "latency-max": 50.0,
    "local-epochs": 2,
    "batch-size": 50,
    "lr": 0.1,
    "lr-decay": 1.0,
    "grad-clip": 20.0,
    "max-virtual-time": 0.0,
    "progress-interval": 3600.0,
    "checkpoint-every": 0,
}
AGGREGATIONS = 400
EVALUATIONS = 50  # per run, whatever its virtual length: the oscillation needs ~10 in the tail


def expected_length(values: dict[str, Any]) -> float:
    """Virtual time a run of `max-updates` updates takes on average with periods uniform in
    [a, b]: synchronous FedAvg waits for the slowest of its C clients each round (E max =
    a + (b - a) C / (C + 1)); every other method keeps its C (`concurrency`) clients busy,
    whose updates arrive at about C E[1 / period] = C ln(b / a) / (b - a) per unit."""
    low, high, updates = values["latency-min"], values["latency-max"], values["max-updates"]
    if values["strategy"] == "fedavg":
        clients = values["concurrency"]
        return updates / clients * (low + (high - low) * clients / (clients + 1))
    busy = values.get("concurrency", values["num-clients"])
    return updates / (busy * math.log(high / low) / (high - low))


def main_jobs(seeds: int, seeds_all: int, methods: Collection[str] = tuple(METHODS)) -> list[Job]:
    jobs = []
    cells = [(alpha, method) for alpha in ALPHAS for method in METHODS if method in methods]
    for seed, (alpha, method) in reproduce.seed_first(
        seeds, seeds_all, SEEDED, cells, lambda c: c[1]
    ):
        labels = {"suite": "main", "alpha": alpha, "method": method, "seed": seed}
        settings = {**METHODS[method], "dirichlet-alpha": alpha, "seed": seed}
        jobs.append(Job(f"a{alpha}-{method}-s{seed}", labels, settings))
    return jobs


def ablation_jobs(seeds: int, seeds_all: int) -> list[Job]:
    jobs = []
    for seed in range(seeds_all):
        for variant, config in ABLATIONS.items():
            labels = {"suite": "ablation", "variant": variant, "seed": seed}
            settings = {"strategy": "fedqs-sgd", "dirichlet-alpha": 0.1, **config, "seed": seed}
            slug = re.sub(r"[^a-z0-9]+", "-", variant).strip("-")
            jobs.append(Job(f"ablation-{slug}-s{seed}", labels, settings))
    return jobs


def robustness_jobs(
    seeds: int, seeds_all: int, methods: Collection[str] = ROBUSTNESS_METHODS
) -> list[Job]:
    jobs = []
    for seed in range(seeds_all):
        for setting, (clients, ratio) in ROBUSTNESS.items():
            for method in (m for m in ROBUSTNESS_METHODS if m in methods):
                labels = {"suite": "robustness", "setting": setting, "method": method}
                settings = {
                    **METHODS[method],
                    "num-clients": clients,
                    "latency-max": ratio,
                    "dirichlet-alpha": 0.1,
                    "seed": seed,
                }
                if method != "fedavg":
                    settings["concurrency"] = clients
                name = f"robust-{clients}c-{method}-s{seed}"
                jobs.append(Job(name, {**labels, "seed": seed}, settings))
    return jobs


def measured(method: str, regime: str) -> bool:
    """Uniform base weights are measured in our regime only."""
    return "uniform" not in method or regime == "ours"


def regime_jobs(seeds: int, seeds_all: int, settings: str = ",".join(SETTING_KEYS)) -> list[Job]:
    """Setting by setting (every seed of one before the next), those `settings` names."""
    chosen = {SETTING_KEYS[key] for key in settings.split(",")}
    jobs = []
    for s, (setting, config) in enumerate(REGIME_SETTINGS.items()):
        if setting not in chosen:
            continue
        for seed in range(seeds):
            for m, (method, strategy) in enumerate(REGIME_METHODS.items()):
                if "uniform" in method and setting != UNIFORM_ONLY_AT:
                    continue
                for regime, reading in REGIMES.items():
                    if not measured(method, regime):
                        continue
                    labels = {"suite": "regimes", "setting": setting, "method": method}
                    labels |= {"regime": regime, "seed": seed}
                    values = {**strategy, "dirichlet-alpha": 0.1, **config, **reading}
                    if "concurrency" in reading:
                        values["concurrency"] = values.get("buffer-size", PROTOCOL["buffer-size"])
                    name = f"regime-{s}-{m}-{REGIME_SLUGS[regime]}-s{seed}"
                    jobs.append(Job(name, labels, {**values, "seed": seed}))
    return jobs


# Each suite's jobs from the command line's options (--methods and --settings pick a subset).
SUITES: dict[str, Callable[[Options], list[Job]]] = {
    "main": lambda args: main_jobs(args.seeds, args.seeds_all, reproduce.subset(args, "methods")),
    "ablation": lambda args: ablation_jobs(args.seeds, args.seeds_all),
    "robustness": lambda args: robustness_jobs(
        args.seeds, args.seeds_all, reproduce.subset(args, "methods")
    ),
    "regimes": lambda args: regime_jobs(args.seeds, args.seeds_all, args.settings),
}


def run_job(job: Job, runs_dir: str, aggregations: int) -> dict[str, Any]:
    """One run in this (worker) process; its summary, curve and FedQS's per-update records."""
    from fedstale.server_app.results import read_jsonl

    values = {**PROTOCOL, **job.config}
    values["max-updates"] = aggregations * values["buffer-size"]
    values["eval-interval"] = expected_length(values) / EVALUATIONS
    result, folder = run_in_process(job, runs_dir, values)
    updates = [u for u in read_jsonl(folder / "updates.jsonl") if "type" in u]
    return {
        **result,
        "curve": reproduce.curve(folder, "accuracy"),
        "types": [(u["time"], u["type"], u["lr"]) for u in updates],
    }


def final(result: dict[str, Any]) -> float:
    return 100 * result["summary"]["final_accuracy"]


def oscillation(result: dict[str, Any]) -> float:
    """Std (points) of the evaluations over the last 20% of the run's virtual time."""
    end = result["curve"][-1][0]
    tail = [100 * a for t, a in result["curve"] if t >= 0.8 * end]
    return statistics.pstdev(tail) if len(tail) > 1 else 0.0


def time_to(result: dict[str, Any], target: float) -> float | None:
    """Virtual time of the first evaluation at or above `target` (%), or None."""
    return reproduce.time_to(result, target, scale=100)


def main_table(results: list[dict[str, Any]], aggregations: int) -> str:
    columns = [f"a={a} {w}" for a in ALPHAS for w in ("ours", "paper", "osc.")]
    lines = table_head(
        f"Final accuracy (%) on Fashion-MNIST after {aggregations} aggregations of K = 10 "
        "(ours; LeNet) beside the paper's (CIFAR-10, ResNet-18); osc.: std of the evaluations "
        "over the last 20% of the run (points).",
        ["method", *columns],
    )

    def cells(method: str, alpha: float) -> list[str]:
        rows = matching(results, method=method, alpha=alpha)
        paper = PAPER.get(method)
        return [
            mean_std(finals(rows)),
            f"{paper[ALPHAS.index(alpha)]:.2f}" if paper else "-",
            mean_std([oscillation(r) for r in rows]),
        ]

    lines += reproduce.pivot(METHODS, ALPHAS, cells)
    return "\n".join([*lines, "", *claim_lines(results)])


def claim_lines(results: list[dict[str, Any]]) -> list[str]:
    """The issue's claims, each with its numbers."""
    lines = []
    for alpha in ALPHAS:
        for ours, baseline in PAIRS:
            mine = matching(results, method=ours, alpha=alpha)
            theirs = matching(results, method=baseline, alpha=alpha)
            if mine and theirs:
                acc = statistics.mean(finals(mine)) - statistics.mean(finals(theirs))
                osc = statistics.mean(map(oscillation, mine)) - statistics.mean(
                    map(oscillation, theirs)
                )
                lines.append(
                    f"- alpha {alpha}: {ours} - {baseline}: final {acc:+.2f} points, "
                    f"oscillation {osc:+.2f}{per_seed(mine, theirs)}"
                )
        fedavg = matching(results, method="fedavg", alpha=alpha)
        fedqs = matching(results, method="fedqs-sgd", alpha=alpha)
        if fedavg and fedqs:
            target = statistics.mean(finals(fedavg))
            end = mean_end(fedavg)
            reached = [time_to(r, target) for r in fedqs]
            if None in reached:
                lines.append(short_of(alpha, fedqs, fedavg, target, end))
            else:
                mean = statistics.mean(reached)  # type: ignore[arg-type]
                lines.append(
                    f"- alpha {alpha}: FedQS-SGD reaches FedAvg's final {target:.2f}% at virtual "
                    f"time {mean:,.0f}, {100 * mean / end:.0f}% of FedAvg's {end:,.0f}"
                )
    return lines


def per_seed(mine: list[dict[str, Any]], theirs: list[dict[str, Any]]) -> str:
    """Final-accuracy differences of the seeds both methods ran, where there are two or more
    (whether a mean's sign holds seed by seed)."""
    baseline = {r["seed"]: final(r) for r in theirs}
    paired = [(r["seed"], final(r) - baseline[r["seed"]]) for r in mine if r["seed"] in baseline]
    if len(paired) < 2:
        return ""
    return "; per seed " + ", ".join(f"s{seed} {gap:+.2f}" for seed, gap in sorted(paired))


def short_of(
    alpha: float,
    fedqs: list[dict[str, Any]],
    fedavg: list[dict[str, Any]],
    target: float,
    end: float,
) -> str:
    """What a FedQS-SGD that missed FedAvg's final did reach, and what FedAvg needed for it."""
    mine = statistics.mean(finals(fedqs))
    mine_end = mean_end(fedqs)
    theirs = [time_to(r, mine) for r in fedavg]
    if None in theirs:
        answer = f"FedAvg never reached its final {mine:.2f}%"
    else:
        took = statistics.mean(theirs)  # type: ignore[arg-type]
        answer = f"FedAvg reached FedQS-SGD's final {mine:.2f}% at {took:,.0f}"
    return (
        f"- alpha {alpha}: FedQS-SGD did not reach FedAvg's {target:.2f}% in its budget "
        f"(best {statistics.mean(best(r) for r in fedqs):.2f}%; its runs end at "
        f"{mine_end:,.0f}, {100 * mine_end / end:.1f}% of FedAvg's {end:,.0f}); {answer}"
    )


def best(result: dict[str, Any]) -> float:
    return 100 * result["summary"]["best_accuracy"]


def mean_end(rows: list[dict[str, Any]]) -> float:
    """Mean virtual time of the runs' last evaluations."""
    return statistics.mean(r["curve"][-1][0] for r in rows)


def ablation_table(results: list[dict[str, Any]], aggregations: int) -> str:
    lines = table_head(
        f"FedQS-SGD ablations on Fashion-MNIST, alpha 0.1, {aggregations} aggregations: final "
        "accuracy (%) and oscillation.",
        ["variant", "final", "oscillation", "vs full"],
    )
    full = finals(matching(results, variant="full"))
    for variant in ABLATIONS:
        rows = matching(results, variant=variant)
        ours = finals(rows)
        delta = statistics.mean(ours) - statistics.mean(full) if ours and full else None
        gap = f"{delta:+.2f}" if delta is not None else "-"
        osc = mean_std([oscillation(r) for r in rows])
        lines.append(f"| {variant} | {mean_std(ours)} | {osc} | {gap} |")
    return "\n".join(lines)


def robustness_table(results: list[dict[str, Any]], aggregations: int) -> str:
    lines = table_head(
        f"Robustness on Fashion-MNIST, alpha 0.1, {aggregations} aggregations: final accuracy "
        "(%) ours / paper (CIFAR-10; the paper has no SAFL FedSGD here).",
        ["setting", "FedAvg", "FedQS-SGD", "SAFL FedSGD"],
    )

    def cells(setting: str, method: str) -> list[str]:
        rows = matching(results, setting=setting, method=method)
        theirs = PAPER_ROBUSTNESS[setting].get(method)
        return [f"{mean_std(finals(rows))} / " + (f"{theirs:.1f}" if theirs else "-")]

    return "\n".join(lines + reproduce.pivot(PAPER_ROBUSTNESS, ROBUSTNESS_METHODS, cells))


def regimes_table(results: list[dict[str, Any]], aggregations: int) -> str:
    columns = [(m, r) for m in REGIME_METHODS for r in REGIMES if measured(m, r)]
    lines = table_head(
        f"FedQS-SGD and SAFL FedSGD on Fashion-MNIST, alpha 0.1, {aggregations} aggregations "
        "of K = 10% of N: final accuracy (%) when each FIFO entry aggregates the update its "
        "client uploaded with every client in flight (ours), its client's newest (authors'), "
        "or with K clients in flight (concurrency K: about the authors' staleness).",
        ["setting", *[f"{m}, {r}" for m, r in columns]],
    )

    def cells(setting: str, column: tuple[str, str]) -> list[str]:
        method, regime = column
        return [mean_std(finals(matching(results, setting=setting, method=method, regime=regime)))]

    return "\n".join(lines + reproduce.pivot(REGIME_SETTINGS, columns, cells))


TABLES = {
    "main": main_table,
    "ablation": ablation_table,
    "robustness": robustness_table,
    "regimes": regimes_table,
}


def plot(results: list[dict[str, Any]], path: Path, key: str) -> None:
    """Accuracy per run group (by `key`), one panel per alpha, and FedQS's type mix and mean
    lr over time."""
    alphas = sorted({r.get("alpha", 0.1) for r in results})
    with figure(path, len(alphas) + 2, 5.5) as (_, axes):
        for acc, alpha in zip(axes, alphas, strict=False):
            plot_accuracy(acc, [r for r in results if r.get("alpha", 0.1) == alpha], key)
            acc.set_title(f"alpha {alpha}")
        typed = next((r for r in results if r["types"]), None)
        if typed is not None:
            plot_types(axes[-2], axes[-1], typed)
        for ax in axes:
            ax.grid(alpha=0.3)


def plot_accuracy(acc: Any, results: list[dict[str, Any]], key: str) -> None:
    """Mean accuracy over seeds of each group; a log time axis where runs differ in length
    (FedAvg's runs are ~36x longer in virtual time than the asynchronous ones)."""
    groups: dict[str, list[dict[str, Any]]] = {}
    for result in results:
        groups.setdefault(str(result[key]), []).append(result)
    for label, rows in groups.items():
        acc.plot(*mean_curve(rows), linewidth=1.0, label=f"{label} (n={len(rows)})")
    ends = [r["curve"][-1][0] for r in results]
    if max(ends) > 3 * min(ends):
        acc.set_xscale("symlog", linthresh=10)
    acc.set_xlabel("virtual time")
    acc.set_ylabel("test accuracy")
    acc.legend(fontsize=6)


def plot_types(mix: Any, rate: Any, result: dict[str, Any], bins: int = 40) -> None:
    """Share of each client type and mean lr per time bin, for one FedQS run."""
    import numpy as np

    times = np.array([t for t, _, _ in result["types"]])
    edges = np.linspace(0, times.max(), bins + 1)
    which = np.clip(np.digitize(times, edges) - 1, 0, bins - 1)
    middle = (edges[:-1] + edges[1:]) / 2
    for kind in ("FBC", "SBC", "FUC", "SUC", ""):
        mine = np.array([k == kind for _, k, _ in result["types"]])
        share = [mine[which == b].mean() if (which == b).any() else np.nan for b in range(bins)]
        mix.plot(middle, share, label=kind or "unclassified", linewidth=1.0)
    mix.set_title(f"client types, {result['name']}")
    mix.set_xlabel("virtual time")
    mix.set_ylabel("share of updates")
    mix.legend(fontsize=7)
    lrs = np.array([lr for _, _, lr in result["types"]])
    mean_lr = [lrs[which == b].mean() if (which == b).any() else np.nan for b in range(bins)]
    rate.plot(middle, mean_lr, linewidth=1.0)
    rate.set_title("mean lr of the aggregated updates")
    rate.set_xlabel("virtual time")
    rate.set_ylabel("lr")


def options(parser: argparse.ArgumentParser) -> None:
    reproduce.seed_flags(parser, "FedQS and SAFL")
    parser.add_argument("--aggregations", type=int, default=AGGREGATIONS, help="budget (of K)")
    reproduce.subset_flag(parser, "settings", SETTING_KEYS)  # of the regimes suite
    reproduce.subset_flag(parser, "methods", METHODS)  # of the main and robustness suites


def check(args: Options, parser: argparse.ArgumentParser) -> None:
    reproduce.check_subsets(args, parser, {"settings": SETTING_KEYS, "methods": METHODS})


def runner(args: Options) -> Runner:
    return partial(run_job, aggregations=args.aggregations)


def suite(name: str, key: str) -> Suite:
    return Suite(
        SUITES[name],
        lambda results, args: TABLES[name](results, args.aggregations),
        f"{name}.md",
        lambda results, path: plot(results, path, key),
        f"{name}.png",
    )


FEDQS = Paper(
    description=__doc__ or "",
    suites={
        "main": suite("main", "method"),
        "ablation": suite("ablation", "variant"),
        "robustness": suite("robustness", "setting"),
        "regimes": suite("regimes", "setting"),
    },
    default_suite="main",
    default_out=Path("runs/reproduce-fedqs"),
    runner=runner,
    options=options,
    check=check,
    out=lambda args: args.out / f"{args.aggregations}agg",
)


if __name__ == "__main__":
    reproduce.main(FEDQS)
