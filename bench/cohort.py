"""Cohort training against per-task training on the same cores, measured in one run.

    python -m bench.cohort [--models lenet,linear] [--workers N] [--run-config "k=v"]
    python -m bench.cohort --profile    # where a LeNet step's time goes, per task and cohort
    python -m bench.cohort --grid [--seeds 3] [--models lenet] [--budget T]   # a grid together

For each model, one run config (the default experiment: FedBuff, Fashion-MNIST, 50 clients,
10 in flight, on a virtual-time budget of a few hundred updates), run five ways one after
another: `fedstale run --local` per task on 1 worker and on `--workers` (default: every
core), `--local` with `trainer=cohort` (the waiting tasks as one batched computation in the
engine's process), Flower simulation per task (one ClientApp per core) and Flower simulation
with `trainer=cohort` (the waiting tasks as one message to one ClientApp). Per-task rows
train with autograd (`trainer=autograd`, the arithmetic a cohort batches; for LeNet it is
what `auto` does). Printed: updates per second over the engine's loop, each cohort row as a
ratio against per-task training on the same cores (the target of issue 40: >= 1.5x), and
the final accuracy of every row (equal within float summation order).

`--grid`: the 12 runs of a small paper grid (3 seeds x FedBuff, FedAsync, FedAvg, FedPSA,
`trainer=cohort`) in one process, their waiting tasks trained as one cohort (`fedstale run
--local --grid`), against the same 12 runs one after another on the same cores: updates per
second over the whole wall time, the mean and largest cohort, and the largest difference of
a run's final accuracy between the two (float summation order only).
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
from bench.throughput import local_summary, simulation_summary  # noqa: E402

BUDGETS = {"linear": 20_000.0, "lenet": 4_000.0, "cnn-mnist": 1_000.0}  # virtual time per run


def rows_for(model: str, extra: str, workers: int) -> list[tuple[str, dict[str, Any]]]:
    budget = BUDGETS.get(model, 4_000.0)
    config = (
        f"model={model} max-virtual-time={budget} eval-interval={budget / 2} "
        f"progress-interval=60 {extra}"
    )
    per_task, cohort = f"{config} trainer=autograd", f"{config} trainer=cohort"
    simulated = "node-partitions=assign"  # what `fedstale run` sets on a simulation it starts
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        rows.append(("--local per task, 1 worker", local_summary(per_task, work, 1)))
        rows.append(
            (f"--local per task, {workers} workers", local_summary(per_task, work, workers))
        )
        rows.append(("--local trainer=cohort", local_summary(cohort, work, 1)))
    for label, pairs in (
        ("Flower simulation per task", f"{per_task} {simulated}"),
        ("Flower simulation trainer=cohort", f"{cohort} {simulated}"),
    ):
        with tempfile.TemporaryDirectory() as tmp:
            rows.append((label, simulation_summary(pairs, Path(tmp))))
    return rows


def table(model: str, rows: list[tuple[str, dict[str, Any]]], workers: int) -> str:
    rates = {label: summary["updates_per_second"] for label, summary in rows}
    same_cores = {
        "--local trainer=cohort": rates[f"--local per task, {workers} workers"],
        "Flower simulation trainer=cohort": rates["Flower simulation per task"],
    }
    lines = [
        f"| {model} | updates/s | cohort x per task, same cores | final accuracy |",
        "| --- | --- | --- | --- |",
    ]
    for label, summary in rows:
        ratio = f"{rates[label] / same_cores[label]:.2f}" if label in same_cores else "-"
        accuracy = summary["final_accuracy"]
        lines.append(f"| {label} | {rates[label]:.2f} | {ratio} | {accuracy:.4f} |")
    updates = rows[0][1]["updates_accepted"]
    lines.append(f"({updates} updates a run, {len(os.sched_getaffinity(0))} cores)")
    return "\n".join(lines)


def grid_table(model: str, extra: str, seeds: int, budget: float | None = None) -> str:
    from bench.throughput import GRID_STRATEGIES, grid_configs, grid_measure

    budget = budget or BUDGETS.get(model, 4_000.0)
    config = (
        f"model={model} max-virtual-time={budget} eval-interval={budget / 2} "
        f"progress-interval=600 {extra}"
    )
    configs = grid_configs(config, seeds)
    with tempfile.TemporaryDirectory() as tmp:
        alone = grid_measure(configs, Path(tmp), together=False)
        together = grid_measure(configs, Path(tmp), together=True)
    apart = max(
        abs(a["final_accuracy"] - b["final_accuracy"])
        for a, b in zip(together["summaries"], alone["summaries"], strict=True)
    )
    runs = f"{len(configs)} runs ({seeds} seeds x {', '.join(GRID_STRATEGIES)})"
    lines = [
        f"| {model}: {runs} | updates/s | x one after another | mean cohort | largest |",
        "| --- | --- | --- | --- | --- |",
    ]
    for label, row in (("one after another", alone), ("together (--grid)", together)):
        ratio = row["updates_per_second"] / alone["updates_per_second"]
        lines.append(
            f"| {label} | {row['updates_per_second']:.2f} | {ratio:.2f} | "
            f"{row['cohort_mean']:.1f} | {row['cohort_largest']} |"
        )
    updates = sum(s["updates_accepted"] for s in together["summaries"])
    lines.append(
        f"({updates} updates in all, {len(os.sched_getaffinity(0))} cores; final accuracies "
        f"differ by at most {apart:.2g})"
    )
    return "\n".join(lines)


def profile_lenet(clients: int = 10, samples: int = 640) -> None:
    """`torch.profiler` tables, on one thread, of `clients` LeNet clients' one pass of
    batches of 64 trained per task (local_train with autograd) and as one cohort."""
    import torch
    from torch.profiler import ProfilerActivity, profile

    from fedstale.common.cohort import Member, cohort_train
    from fedstale.common.models import LeNet
    from fedstale.common.training import local_train

    torch.set_num_threads(1)
    torch.manual_seed(0)
    model = LeNet((1, 28, 28), 10)
    data = [
        (torch.randn(samples, 1, 28, 28), torch.randint(0, 10, (samples,))) for _ in range(clients)
    ]
    start = {name: p.detach() for name, p in model.named_parameters()}
    members = [Member(start, x, y, 1, 64, 0.01, seed) for seed, (x, y) in enumerate(data)]

    def per_task() -> None:
        for seed, (x, y) in enumerate(data):
            local_train(model, x, y, epochs=1, batch_size=64, lr=0.01, seed=seed, closed_form=False)

    for label, work in (("per task", per_task), ("cohort", lambda: cohort_train(model, members))):
        work()  # warm-up
        with profile(activities=[ProfilerActivity.CPU]) as recorded:
            work()
        averages = recorded.key_averages()
        print(f"{label}:\n{averages.table(sort_by='self_cpu_time_total', row_limit=12)}")


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--models", default="lenet,linear")
    parser.add_argument("--workers", type=int, default=len(os.sched_getaffinity(0)))
    parser.add_argument("--run-config", default="", help="extra key=value pairs for every run")
    parser.add_argument("--profile", action="store_true", help="profile LeNet's steps only")
    parser.add_argument("--grid", action="store_true", help="a grid's runs together (see above)")
    parser.add_argument("--seeds", type=int, default=3, help="with --grid: seeds per rule")
    parser.add_argument("--budget", type=float, default=None, help="with --grid: virtual time")
    options = parser.parse_args(argv)
    if options.profile:
        profile_lenet()
        return
    if options.grid:
        for model in options.models.split(","):
            table = grid_table(model, options.run_config, options.seeds, options.budget)
            print(table, flush=True)
        return
    for model in options.models.split(","):
        rows = rows_for(model, options.run_config, options.workers)
        print(table(model, rows, options.workers), flush=True)


if __name__ == "__main__":
    main()
