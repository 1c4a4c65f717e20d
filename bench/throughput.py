"""Client updates per second of the default experiment in Flower simulation, against a bare
single-process PyTorch loop doing the identical local training, from one run.

    python -m bench.throughput [--virtual-time 30000] [--tasks 400]

Reference: `client_app.training.local_train` (the function the ClientApp calls) on the same
clients' data, clients drawn uniformly at random, in this process with torch's default
threads and the run's `trainer` (`--run-config trainer=autograd` compares autograd on both
sides). Simulation: `fedstale run` with the default config (FedBuff, Fashion-MNIST, linear
model, 50 clients, concurrency 10) on a SuperLink of this benchmark's own, rate measured over
the engine's loop (after every node answered). Prints both rates, the ratio, and where the
simulation's time goes.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

from client_app.training import local_train
from common.config import parse_run_config
from common.federation import client_data, federation_of
from common.models import build_model

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
from tests.flower_procs import SimulationSuperLink  # noqa: E402


def bare_rate(config: dict, tasks: int) -> float:
    run = parse_run_config(config)
    fed = federation_of(run)
    for client in range(run.num_clients):
        client_data(run, client)
    model = build_model(run.model_name, fed.input_shape, fed.num_classes, run.seed)
    rng = np.random.default_rng(0)
    start = time.perf_counter()
    for task in range(tasks):
        x, y = client_data(run, int(rng.integers(run.num_clients)))
        local_train(
            model,
            x,
            y,
            epochs=run.local_epochs,
            batch_size=run.batch_size,
            lr=run.lr,
            seed=task,
            closed_form=run.trainer == "auto",
        )
    return tasks / (time.perf_counter() - start)


def simulation_summary(config: str, workdir: Path) -> dict:
    link = SimulationSuperLink(workdir / "flwr-home").start()
    try:
        result, run_dir = link.run_app(ROOT, workdir / "runs", "throughput", config, 1200)
    finally:
        link.stop()
    if result.returncode != 0:
        raise SystemExit(f"the simulation run failed:\n{result.stderr[-3000:]}")
    return json.loads((run_dir / "summary.json").read_text())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--virtual-time", type=float, default=30000.0)
    parser.add_argument("--tasks", type=int, default=400, help="tasks for the bare loop")
    parser.add_argument("--run-config", default="", help="extra key=value pairs for both")
    args = parser.parse_args()
    from server_app.launch import parse_pairs

    extra = parse_pairs(args.run_config)
    reference = bare_rate(extra, args.tasks)
    with tempfile.TemporaryDirectory() as tmp:
        config = f"max-virtual-time={args.virtual_time} {args.run_config}"
        summary = simulation_summary(config, Path(tmp))
    rate = summary["updates_per_second"]
    loop = summary["loop_seconds"]
    print(f"bare PyTorch loop    : {reference:7.2f} updates/s ({torch.get_num_threads()} threads)")
    print(f"Flower simulation    : {rate:7.2f} updates/s ({summary['updates_accepted']} updates)")
    print(f"ratio                : {rate / reference:7.3f}")
    print(f"final accuracy       : {summary['final_accuracy']:.4f}")
    busy = summary["client_compute_seconds"]
    print(f"loop wall seconds    : {loop:7.1f}")
    print(f"client handler time  : {busy:7.1f} s ({busy / loop:.2f} ClientApps busy on average)")
    for phase, seconds in summary["engine_seconds"].items():
        print(f"server {phase:<14}: {seconds:7.1f} s ({seconds / loop:.1%} of the loop)")


if __name__ == "__main__":
    main()
