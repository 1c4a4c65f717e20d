"""The MAFSA paper's experiments (Table 2, the offline-rate sweep of Fig. 7, edge rounds) on
the data this machine has, regenerated.

    python -m bench.reproduce_mafsa                      # Table 2: linear, CNN, digits
    python -m bench.reproduce_mafsa --suite offline      # p = 0 ... 0.3, edges of 3 speeds
    python -m bench.reproduce_mafsa --suite edge-rounds  # T_e = 1, 2, 5 at p = 0.1
    python -m bench.reproduce_mafsa --suite all --data fmnist-linear   # one model only
    python -m bench.reproduce_mafsa --report             # tables of the runs already done

Protocol (paper Sec. 5.1; its data is MNIST and CIFAR-10, not available here): one cloud,
5 edges x 20 clients (seeded equal groups); Fashion-MNIST with the linear model and with
LeNet-5 (the paper's "Lenet"), and scikit-learn's digits with the MLP; labels IID, client
sizes from a Dirichlet(1) (`quantity-dirichlet`, HierFL's split); each local update is
T_c = 60 SGD steps of batch 20, lr 0.01 x 0.995 per local epoch the client has run (SGD:
docs/algorithms.md's rule; the paper's text names Adam); each client offline at a round's
start with probability p (seeded: the same pattern for both rules). A client's local
update takes U(1, 2) virtual units (drawn once per client), times its edge's slowdown.
Budget: 100 edge rounds of the slowest edge in virtual time (100 x 2 x slowest factor).
Table 2 uses edges of equal speed; the sweeps use slowdowns 1, 1, 2, 2, 4 so that the
cloud's asynchrony matters. The offline sweep also runs with non-IID labels (Hsu
Dirichlet 0.5, equal client sizes: docs/algorithms.md's non-IID setting). Metrics: final
accuracy of the cloud model on the test set, acc-std (population std of all the run's
evaluations), virtual time to the target (95% of ideal HierFedAvg's mean final accuracy in
the same setting).

Runs use the real engine, strategies and client code in-process, several at once on
separate cores; results.jsonl keeps each finished run, so an interrupted grid resumes.
Writes under --out: results.jsonl, <suite>.md and <suite>.png.
"""

from __future__ import annotations

import argparse
import statistics
from pathlib import Path
from typing import Any

from bench import reproduce
from bench.grid import Job, finals, matching, run_in_process, table_head
from bench.reproduce import Options, Paper, Suite, figure, mean_curve
from fedstale.launcher.analysis import mean_std

DATA = {
    "fmnist-linear": {"dataset": "fmnist", "model": "linear"},
    "fmnist-cnn": {"dataset": "fmnist", "model": "lenet"},
    "digits": {"dataset": "digits", "model": "mlp"},
    # labels non-IID too (docs/algorithms.md: label Dirichlet 0.5 for the non-IID runs)
    "fmnist-linear-dir0.5": {
        "dataset": "fmnist",
        "model": "linear",
        "partition": "dirichlet",
        "dirichlet-alpha": 0.5,
    },
}
P_TABLE2 = 0.03
METHODS = {  # Table 2's rows
    "hierfedavg": {"strategy": "hierfedavg", "mafsa-dropout-rate": 0.0},
    "hierfedavg-p": {"strategy": "hierfedavg", "mafsa-dropout-rate": P_TABLE2},
    "mafsa-p": {"strategy": "mafsa", "mafsa-dropout-rate": P_TABLE2},
}
SEEDED = ("hierfedavg-p", "mafsa-p")  # --seeds of these; --seeds-all of the ideal baseline
RATES = (0.0, 0.03, 0.1, 0.2, 0.3)
EDGE_ROUNDS = (1, 2, 5)
P_EDGE_ROUNDS = 0.1
SLOWDOWN = (1.0, 1.0, 2.0, 2.0, 4.0)
PAPER = {  # Table 2 (accuracy, acc-std, time in seconds): MNIST logistic / LeNet
    "fmnist-linear": {
        "hierfedavg": (0.902, 0.069, 6217),
        "hierfedavg-p": (0.898, 0.072, 6613),
        "mafsa-p": (0.900, 0.071, 6379),
    },
    "fmnist-cnn": {
        "hierfedavg": (0.894, 0.149, 6912),
        "hierfedavg-p": (0.878, 0.148, 7164),
        "mafsa-p": (0.884, 0.146, 7045),
    },
}
PROTOCOL = {
    "partition": "quantity-dirichlet",
    "dirichlet-alpha": 1.0,
    "num-clients": 100,
    "concurrency": 100,
    "mafsa-edges": 5,
    "local-steps": 60,
    "batch-size": 20,
    "lr": 0.01,
    "lr-decay": 0.995,
    "optimizer": "sgd",
    "latency": "uniform",
    "latency-min": 1.0,
    "latency-max": 2.0,
    "progress-interval": 3600.0,
    "checkpoint-every": 0,
}
ROUNDS = 100
EVALUATIONS = 50
TARGET_SHARE = 0.95


def budget(slowdown: tuple[float, ...] | None) -> float:
    """100 edge rounds of the slowest edge: rounds x the slowest local update."""
    return ROUNDS * PROTOCOL["latency-max"] * max(slowdown or (1.0,))


def setting(slowdown: tuple[float, ...] | None) -> dict[str, Any]:
    span = budget(slowdown)
    edges = {"mafsa-edge-slowdown": ",".join(f"{f:g}" for f in slowdown)} if slowdown else {}
    return {**edges, "max-virtual-time": span, "eval-interval": span / EVALUATIONS}


def table2_jobs(data: list[str], seeds: int, seeds_all: int) -> list[Job]:
    """Seed 0 of every cell first, so that an interrupted grid has a whole table soonest."""
    jobs = []
    cells = [(name, method) for name in data for method in METHODS]
    for seed, (name, method) in reproduce.seed_first(
        seeds, seeds_all, SEEDED, cells, lambda c: c[1]
    ):
        labels = {"suite": "table2", "data": name, "method": method, "seed": seed}
        settings = {**DATA[name], **METHODS[method], **setting(None), "seed": seed}
        jobs.append(Job(f"t2-{name}-{method}-s{seed}", labels, settings))
    return jobs


def sweep_jobs(suite: str, data: list[str], seeds: int) -> list[Job]:
    """Both rules at each offline rate (or T_e), on edges of different speeds."""
    values = RATES if suite == "offline" else EDGE_ROUNDS
    jobs = []
    for seed in range(seeds):
        for name in data:
            for value in values:
                for strategy in ("hierfedavg", "mafsa"):
                    if suite == "offline":
                        knobs = {"mafsa-dropout-rate": value}
                    else:
                        knobs = {"mafsa-dropout-rate": P_EDGE_ROUNDS, "mafsa-edge-rounds": value}
                    labels = {"suite": suite, "data": name, "value": value, "method": strategy}
                    settings = {**DATA[name], **knobs, **setting(SLOWDOWN), "seed": seed}
                    settings["strategy"] = strategy
                    tag = f"{suite}-{name}-{value:g}-{strategy}-s{seed}"
                    jobs.append(Job(tag, {**labels, "seed": seed}, settings))
    return jobs


def run_job(job: Job, runs_dir: str) -> dict[str, Any]:
    """One run in this (worker) process; its summary and accuracy curve."""
    result, folder = run_in_process(job, runs_dir, {**PROTOCOL, **job.config})
    return {**result, "curve": reproduce.curve(folder, "accuracy")}


def target_of(reference: list[dict[str, Any]]) -> float | None:
    """95% of the reference runs' mean final accuracy (None without reference runs)."""
    if not reference:
        return None
    return TARGET_SHARE * statistics.mean(r["summary"]["final_accuracy"] for r in reference)


def times_cell(rows: list[dict[str, Any]], target: float | None) -> str:
    """Mean ± std of the time to target, with how many runs reached it when not all."""
    if target is None or not rows:
        return "-"
    reached = [t for t in (reproduce.time_to(r, target) for r in rows) if t is not None]
    text = mean_std(reached, digits=1) if reached else "never"
    return text if len(reached) == len(rows) else f"{text} ({len(reached)}/{len(rows)})"


def stats(rows: list[dict[str, Any]]) -> tuple[str, str]:
    """(final accuracy %, acc-std %) as mean ± std over seeds."""
    accuracy = mean_std(finals(rows))
    spread = mean_std([100 * r["summary"]["acc_std"] for r in rows])
    return accuracy, spread


def table2(results: list[dict[str, Any]]) -> str:
    lines = table_head(
        "Table 2 on this machine's data (ours: accuracy %, acc-std %, virtual time to 95% of "
        "ideal HierFedAvg's final accuracy) beside the paper's (MNIST; time in seconds of "
        f"their testbed). p = {P_TABLE2}, edges of equal speed, {ROUNDS} edge rounds.",
        ["data", "method", "accuracy", "acc-std", "time to target", "paper acc / std / time"],
    )
    for name in DATA:
        target = target_of(matching(results, suite="table2", data=name, method="hierfedavg"))
        for method in METHODS:
            rows = matching(results, suite="table2", data=name, method=method)
            if not rows:
                continue
            accuracy, spread = stats(rows)
            paper = PAPER.get(name, {}).get(method)
            theirs = f"{paper[0]:.3f} / {paper[1]:.3f} / {paper[2]}" if paper else "-"
            row = [name, method, accuracy, spread, times_cell(rows, target), theirs]
            lines.append("| " + " | ".join(row) + " |")
    return "\n".join([*lines, "", *table2_claims(results)])


def table2_claims(results: list[dict[str, Any]]) -> list[str]:
    lines = []
    for name in DATA:
        cells = {m: matching(results, suite="table2", data=name, method=m) for m in METHODS}
        if not all(cells.values()):
            continue
        mean = {m: statistics.mean(finals(rows)) for m, rows in cells.items()}
        lines.append(
            f"- {name}: MAFSA(p) - ideal HierFedAvg {mean['mafsa-p'] - mean['hierfedavg']:+.2f} "
            f"points (claim: within 0.5), MAFSA(p) - HierFedAvg(p) "
            f"{mean['mafsa-p'] - mean['hierfedavg-p']:+.2f} (claim: >= 0)"
        )
    return lines


def sweep_table(results: list[dict[str, Any]], suite: str) -> str:
    knob = "p" if suite == "offline" else "T_e"
    fixed = "" if suite == "offline" else f", p = {P_EDGE_ROUNDS}"
    lines = table_head(
        f"{'Offline rate' if suite == 'offline' else 'Edge rounds per upload'} on edges of "
        f"slowdown {', '.join(f'{f:g}' for f in SLOWDOWN)}{fixed}: accuracy %, acc-std %, "
        "virtual time to 95% of HierFedAvg's final accuracy at p = 0 (T_e = 1 for the "
        "edge-round sweep: its first row).",
        ["data", knob, "HierFedAvg", "MAFSA", "MAFSA - HierFedAvg", "time HierFedAvg / MAFSA"],
    )
    claims = []
    for name in DATA:
        first = (RATES if suite == "offline" else EDGE_ROUNDS)[0]
        reference = matching(results, suite=suite, data=name, value=first, method="hierfedavg")
        target = target_of(reference)
        for value in RATES if suite == "offline" else EDGE_ROUNDS:
            cells = {
                m: matching(results, suite=suite, data=name, value=value, method=m)
                for m in ("hierfedavg", "mafsa")
            }
            if not all(cells.values()):
                continue
            hier, mafsa = (stats(cells[m]) for m in ("hierfedavg", "mafsa"))
            gap = statistics.mean(finals(cells["mafsa"])) - statistics.mean(
                finals(cells["hierfedavg"])
            )
            spread_gap = statistics.mean(
                100 * r["summary"]["acc_std"] for r in cells["mafsa"]
            ) - statistics.mean(100 * r["summary"]["acc_std"] for r in cells["hierfedavg"])
            times = " / ".join(times_cell(cells[m], target) for m in ("hierfedavg", "mafsa"))
            row = [name, f"{value:g}", " ".join(hier), " ".join(mafsa), f"{gap:+.2f}", times]
            lines.append("| " + " | ".join(row) + " |")
            claims.append(
                f"- {name} {knob} = {value:g}: accuracy {gap:+.2f} points, acc-std "
                f"{spread_gap:+.2f} points (MAFSA - HierFedAvg)"
            )
    return "\n".join([*lines, "", *claims])


def plot(results: list[dict[str, Any]], path: Path, key: str) -> None:
    """Mean accuracy over seeds against virtual time, one panel per data setting."""
    names = [n for n in DATA if matching(results, data=n)]
    with figure(path, len(names), 6, squeeze=False) as (_, axes):
        for ax, name in zip(axes[0], names, strict=True):
            groups: dict[str, list[dict[str, Any]]] = {}
            for result in matching(results, data=name):
                label = result["method"] + (f" {key}={result['value']:g}" if key else "")
                groups.setdefault(label, []).append(result)
            for label, rows in groups.items():
                style = "--" if label.startswith("hierfedavg") else "-"
                ax.plot(*mean_curve(rows), style, label=label, linewidth=1.0)
            ax.set_title(name)
            ax.set_xlabel("virtual time")
            ax.set_ylabel("test accuracy")
            ax.grid(alpha=0.3)
            ax.legend(fontsize=6)


DEFAULT_DATA = {
    "table2": ["fmnist-linear", "fmnist-cnn", "digits"],
    "offline": ["fmnist-linear", "fmnist-linear-dir0.5"],
    "edge-rounds": ["fmnist-linear"],
}


def data_of(args: Options, suite: str) -> list[str]:
    return args.data.split(",") if args.data else DEFAULT_DATA[suite]


def options(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--data",
        default="",
        help=f"a comma-separated subset of {','.join(DATA)} (default: per suite)",
    )
    reproduce.seed_flags(parser, "MAFSA and HierFedAvg(p)")


def check(args: Options, parser: argparse.ArgumentParser) -> None:
    reproduce.check_subsets(args, parser, {"data": DATA})


def sweep(suite: str) -> Suite:
    return Suite(
        lambda args: sweep_jobs(suite, data_of(args, suite), args.seeds),
        lambda results, _: sweep_table(results, suite),
        f"{suite}.md",
        lambda results, path: plot(results, path, "value"),
        f"{suite}.png",
    )


MAFSA = Paper(
    description=__doc__ or "",
    suites={
        "table2": Suite(
            lambda args: table2_jobs(data_of(args, "table2"), args.seeds, args.seeds_all),
            lambda results, _: table2(results),
            "table2.md",
            lambda results, path: plot(results, path, ""),
            "table2.png",
        ),
        "offline": sweep("offline"),
        "edge-rounds": sweep("edge-rounds"),
    },
    default_suite="table2",
    default_out=Path("runs/reproduce-mafsa"),
    runner=lambda _: run_job,
    options=options,
    check=check,
)


if __name__ == "__main__":
    reproduce.main(MAFSA)
