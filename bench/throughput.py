"""Client updates per second of Flower simulation and of `fedstale run --local` (one worker
and every core), each as a ratio against a bare PyTorch loop measured in the same run.

    python -m bench.throughput [--models linear,lenet] [--workers N] [--run-config "k=v"]

Reference: `fedstale.common.training.local_train` (the function every client calls) on one thread
in this process, on the same clients' data, clients drawn uniformly at random, with the
run's trainer; "per core" ratios divide by (reference x cores), the most that `cores`
one-thread clients can do. The runs: the default experiment (FedBuff, Fashion-MNIST, 50
clients, concurrency 10) with `model=` each model, on a virtual-time budget sized to a few
hundred updates, rates over the engine's loop (after every node answered). Targets (issue 16):
`--local` on 2 workers >= 1.8x one worker; Flower simulation with the CNN >= 0.9x the
reference per core.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch

from fedstale.common.config import parse_run_config
from fedstale.common.federation import FederationKey, federation_of
from fedstale.common.models import build_model
from fedstale.common.shares import client_data
from fedstale.common.training import local_train

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
from tests.flower_procs import SimulationSuperLink  # noqa: E402

BUDGETS = {"linear": 30_000.0, "lenet": 8_000.0, "cnn-mnist": 2_000.0}  # virtual time per run


def bare_rate(config: dict[str, Any], tasks: int, device: str = "cpu") -> float:
    """Local training tasks per second on one thread, no server, no transport; timed warm:
    one untimed task first (the first optimizer step of a process imports torch._dynamo,
    1.4 s of CPU, and a GPU's first kernels compile and load)."""
    run = parse_run_config(config)
    model, data = bare_setup(run, device)
    rng = np.random.default_rng(0)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)

    def train(x: Any, y: Any, seed: int) -> None:
        local_train(
            model,
            x,
            y,
            epochs=run.local_epochs,
            batch_size=run.batch_size,
            lr=run.lr,
            seed=seed,
            closed_form=run.trainer == "auto",
        )

    try:
        train(*data[0], seed=tasks)  # the warm-up: a seed no timed task uses
        synchronize(device)
        start = time.perf_counter()
        for task in range(tasks):
            train(*data[int(rng.integers(run.num_clients))], seed=task)
        synchronize(device)
        return tasks / (time.perf_counter() - start)
    finally:
        torch.set_num_threads(threads)


def bare_setup(run: Any, device: str) -> tuple[torch.nn.Module, list[tuple[torch.Tensor, ...]]]:
    """The run's model and every client's training data, on `device`."""
    fed = federation_of(FederationKey.of(run))
    data = [
        tuple(t.to(device) for t in client_data(FederationKey.of(run), c))
        for c in range(run.num_clients)
    ]
    model = build_model(run.model_name, fed.input_shape, fed.num_classes, run.seed).to(device)
    return model, data


def synchronize(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def simulation_summary(config: str, workdir: Path) -> dict[str, Any]:
    link = SimulationSuperLink(workdir / "flwr-home").start()
    try:
        result, run_dir = link.run_app(ROOT, workdir / "runs", "sim", config, 1800)
    finally:
        link.stop()
    if result.returncode != 0:
        raise SystemExit(f"the simulation run failed:\n{result.stderr[-3000:]}")
    return json.loads((run_dir / "summary.json").read_text())


def local_summary(config: str, workdir: Path, workers: int) -> dict[str, Any]:
    from fedstale.launcher.launch import parse_pairs
    from fedstale.launcher.local import cohort_transport, local_transport, pooled_transport
    from fedstale.server_app.experiment import run_experiment
    from fedstale.strategies.registry import load_config

    values = {**parse_pairs(config), "runs-dir": str(workdir / "runs")}
    values["run-name"] = f"local-{workers}-{values.get('trainer', 'auto')}"
    run, params = load_config(values)
    if run.trainer == "cohort":  # trains in this process, whatever `workers` says
        return run_experiment(run, params, cohort_transport(run))
    if workers == 1:
        return run_experiment(run, params, local_transport(run))
    with pooled_transport(run, workers) as transport:
        return run_experiment(run, params, transport)


GRID_STRATEGIES = ("fedbuff", "fedasync", "fedavg", "fedpsa")


def grid_configs(
    config: str, seeds: int, strategies: tuple[str, ...] = GRID_STRATEGIES
) -> list[str]:
    """A grid's run configs: `seeds` seeds x `strategies` over `config`, trainer=cohort."""
    return [
        f"{config} strategy={strategy} seed={seed} trainer=cohort run-name={strategy}-s{seed}"
        for strategy in strategies
        for seed in range(seeds)
    ]


def grid_measure(configs: list[str], workdir: Path, together: bool) -> dict[str, Any]:
    """The runs of `configs`, all together in one CohortPool (`fedstale run --local --grid`)
    or one after another (each its own trainer=cohort run): their updates per second over
    the whole wall time, the mean and largest cohort, and every run's summary."""
    from fedstale.launcher.grid import run_together
    from fedstale.launcher.launch import parse_pairs
    from fedstale.launcher.local import cohort_pool
    from fedstale.strategies.registry import load_config

    out = workdir / ("together" if together else "one-by-one")
    runs = [load_config({**parse_pairs(c), "runs-dir": str(out)}) for c in configs]
    started, sizes = time.monotonic(), []
    for batch in [runs] if together else [[run] for run in runs]:
        pool = cohort_pool()
        failed = run_together(batch, pool)
        assert not failed, failed
        sizes += pool.sizes
    seconds = time.monotonic() - started
    summaries = [json.loads((out / run.run_name / "summary.json").read_text()) for run, _ in runs]
    updates = sum(summary["updates_accepted"] for summary in summaries)
    return {
        "updates_per_second": updates / seconds,
        "seconds": seconds,
        "cohort_mean": sum(sizes) / max(len(sizes), 1),
        "cohort_largest": max(sizes, default=0),
        "summaries": summaries,
    }


def measure(model: str, extra: str, tasks: int, workers: int) -> dict[str, float]:
    from fedstale.launcher.launch import parse_pairs

    budget = BUDGETS.get(model, 8_000.0)
    config = (
        f"model={model} max-virtual-time={budget} eval-interval={budget / 2} "
        f"progress-interval=60 {extra}"
    )
    rates = {"bare loop, 1 thread": bare_rate(parse_pairs(config), tasks)}
    with tempfile.TemporaryDirectory() as tmp:
        sim = simulation_summary(config, Path(tmp))
        rates["Flower simulation"] = sim["updates_per_second"]
        rates["--local, 1 worker"] = local_summary(config, Path(tmp), 1)["updates_per_second"]
        local = local_summary(config, Path(tmp), workers)
        rates[f"--local, {workers} workers"] = local["updates_per_second"]
    same = sim["final_accuracy"] == local["final_accuracy"]
    print(
        f"  ({model}: {sim['updates_accepted']} updates a run; final accuracy "
        f"{'identical' if same else 'DIFFERS'} in simulation and --local)"
    )
    return rates


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--models", default="linear,lenet")
    parser.add_argument("--tasks", type=int, default=100, help="tasks of the bare loop")
    parser.add_argument("--workers", type=int, default=len(os.sched_getaffinity(0)))
    parser.add_argument("--run-config", default="", help="extra key=value pairs for every run")
    args = parser.parse_args()
    cores = len(os.sched_getaffinity(0))
    print(f"{cores} cores; updates per second and ratios against the bare loop on one thread")
    for model in args.models.split(","):
        rates = measure(model, args.run_config, args.tasks, args.workers)
        reference = rates["bare loop, 1 thread"]
        print(f"| {model} | updates/s | x bare loop | x bare loop per core |")
        print("| --- | --- | --- | --- |")
        for label, rate in rates.items():
            print(
                f"| {label} | {rate:.2f} | {rate / reference:.2f} | "
                f"{rate / (reference * cores):.2f} |"
            )
        one, many = rates["--local, 1 worker"], rates[f"--local, {args.workers} workers"]
        print(f"--local speed-up on {args.workers} workers: {many / one:.2f}x\n")


if __name__ == "__main__":
    main()
