"""Where `--local`'s time goes, per client update: the breakdown in docs/benchmarks.md
("Where the time goes").

    python -m bench.local_profile [--model linear] [--updates 1000] [--workers 1,2]
                                  [--trainer autograd] [--strategy fedavg]

One worker: the run under cProfile in this process, its time split into the local
training (`local_train`), the rest of the client's task (loading the model, the rules,
the reply) and the engine (everything else in the loop). Several workers: the engine's
process CPU per update (its loop plus sending and reading tasks) and the workers' CPU per
update against the compute they report, from the processes' own CPU clocks (no profiler
there). Then the local-training step itself, timed part by part on one thread: the batch's
rows gathered, forward and loss, backward, the parameter update; and what the model costs
on a worker's pipe (pickled there and back). The protocol is
bench.peers' (Fashion-MNIST, 50 IID clients, FedAvg of 10, 5 epochs, batch 64).
"""

from __future__ import annotations

import argparse
import cProfile
import pstats
import resource
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
from bench.peers import fedstale_config  # noqa: E402


def config_for(args: argparse.Namespace, runs: str) -> tuple[Any, Any]:
    from fedstale.launcher.launch import parse_pairs
    from fedstale.strategies.registry import load_config

    pairs = parse_pairs(fedstale_config(args.model, args.updates))
    pairs.update({"trainer": args.trainer, "strategy": args.strategy, "runs-dir": runs})
    pairs.update({"buffer-size": 10, "run-name": f"profile-{time.time_ns()}"})
    return load_config(pairs)


def cumulative(stats: pstats.Stats, suffix: str) -> float:
    """Seconds inside functions whose `file:line(name)` ends with `suffix`."""
    found = [
        value[3]
        for (file, line, name), value in stats.stats.items()  # type: ignore[attr-defined]
        if f"{file}:{line}({name})".endswith(suffix)
    ]
    return max(found, default=0.0)


def one_worker(args: argparse.Namespace) -> dict[str, float]:
    from fedstale.launcher.local import local_transport
    from fedstale.server_app.experiment import run_experiment

    with tempfile.TemporaryDirectory() as runs:
        run, params = config_for(args, runs)
        profile = cProfile.Profile()
        profile.enable()
        summary = run_experiment(run, params, local_transport(run))
        profile.disable()
    stats = pstats.Stats(profile)
    updates = summary["updates_accepted"]
    training = cumulative(stats, "(local_train)")
    task = cumulative(stats, "(train_task)")
    loop = summary["loop_seconds"]
    return {
        "updates/s (under the profiler)": updates / loop,
        "local training ms": 1000 * training / updates,
        "rest of the task ms": 1000 * (task - training) / updates,
        "engine ms": 1000 * (loop - task) / updates,
    }


def several_workers(args: argparse.Namespace, workers: int) -> dict[str, float]:
    from fedstale.launcher.local import pooled_transport
    from fedstale.server_app.experiment import run_experiment

    with tempfile.TemporaryDirectory() as runs:
        run, params = config_for(args, runs)
        with pooled_transport(run, workers) as transport:
            own = time.process_time()
            children = resource.getrusage(resource.RUSAGE_CHILDREN)
            summary = run_experiment(run, params, transport)
            own = time.process_time() - own
        after = resource.getrusage(resource.RUSAGE_CHILDREN)
    updates = summary["updates_accepted"]
    worker_cpu = (after.ru_utime + after.ru_stime) - (children.ru_utime + children.ru_stime)
    return {
        "updates/s": summary["updates_per_second"],
        "engine process CPU ms": 1000 * own / updates,
        "worker CPU ms": 1000 * worker_cpu / updates,
        "of which reported compute ms": 1000 * summary["client_compute_seconds"] / updates,
    }


def step_parts(args: argparse.Namespace, tasks: int = 20) -> dict[str, float]:
    """One task's minibatch steps, each part timed on its own (ms per task)."""
    from fedstale.common.federation import FederationKey
    from fedstale.common.models import build_model
    from fedstale.common.shares import client_data

    with tempfile.TemporaryDirectory() as runs:
        run, _ = config_for(args, runs)
    torch.set_num_threads(1)
    x, y = client_data(FederationKey.of(run), 0)
    model = build_model(run.model_name, tuple(x.shape[1:]), 10, 0)
    params = list(model.parameters())
    optimizer = torch.optim.SGD(params, lr=run.lr)
    parts = dict.fromkeys(["gather x[rows]", "gather index_select", "forward + loss"], 0.0)
    parts.update(dict.fromkeys(["backward", "torch.optim.SGD step", "in-place update"], 0.0))
    generator = torch.Generator().manual_seed(0)
    for _ in range(tasks):
        for _ in range(run.local_epochs):
            for rows in torch.randperm(len(y), generator=generator).split(run.batch_size):
                step_once(model, params, optimizer, x, y, rows, run.lr, parts)
    return {name: 1000 * seconds / tasks for name, seconds in parts.items()}


def step_once(model, params, optimizer, x, y, rows, lr, parts) -> None:  # type: ignore[no-untyped-def]
    clock = time.perf_counter
    start = clock()
    x[rows], y[rows]
    parts["gather x[rows]"] += clock() - start
    start = clock()
    xb, yb = x.index_select(0, rows), y.index_select(0, rows)
    parts["gather index_select"] += clock() - start
    start = clock()
    loss = torch.nn.functional.cross_entropy(model(xb), yb)
    parts["forward + loss"] += clock() - start
    start = clock()
    optimizer.zero_grad(set_to_none=True)
    loss.backward()
    parts["backward"] += clock() - start
    start = clock()
    optimizer.step()
    parts["torch.optim.SGD step"] += clock() - start
    loss = torch.nn.functional.cross_entropy(model(xb), yb)
    for param in params:
        param.grad = None
    loss.backward()
    start = clock()
    with torch.no_grad():
        for param in params:
            param.add_(param.grad, alpha=-lr)
    parts["in-place update"] += clock() - start


def pickle_cost(args: argparse.Namespace, rounds: int = 2000) -> dict[str, float]:
    """What a model costs on a worker's pipe: one pickle and unpickle of its arrays (us)."""
    import pickle

    from fedstale.client_app.task import client_model
    from fedstale.common.models import get_flat

    with tempfile.TemporaryDirectory() as runs:
        run, _ = config_for(args, runs)
    model, layout = client_model(run)
    arrays = layout.unflatten(get_flat(model))
    start = time.perf_counter()
    for _ in range(rounds):
        pickle.loads(pickle.dumps(arrays, protocol=pickle.HIGHEST_PROTOCOL))
    seconds = (time.perf_counter() - start) / rounds
    return {"parameters": float(layout.total), "pickle and unpickle us": 1e6 * seconds}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="linear")
    parser.add_argument("--updates", type=int, default=1000)
    parser.add_argument("--workers", default="1,2")
    parser.add_argument("--trainer", default="autograd")
    parser.add_argument("--strategy", default="fedavg")
    args = parser.parse_args(argv)
    rows: list[tuple[str, dict[str, float]]] = []
    for workers in (int(w) for w in args.workers.split(",")):
        if workers == 1:
            rows.append(("1 worker, in the engine's process", one_worker(args)))
        else:
            rows.append((f"{workers} worker processes", several_workers(args, workers)))
    rows.append(("one task's steps, by part (ms per task)", step_parts(args)))
    rows.append(("the model through a pipe", pickle_cost(args)))
    print(f"{args.model}, {args.strategy}, trainer={args.trainer}, {args.updates} updates")
    for title, values in rows:
        print(f"\n{title}")
        for name, value in values.items():
            print(f"  {name}: {value:.2f}")


if __name__ == "__main__":
    main()
