"""fedstale `--local` beside pfl-research (Apple's simulator, PyPI `pfl`), on one protocol,
interleaved, in one sitting: the table of docs/benchmarks.md "Beside pfl-research".

    python -m bench.peers [--models linear,lenet] [--reps 3] [--updates linear=3000,lenet=100]
                          [--rows ROW,...] [--out runs/peers] [--pfl-venv .venv-pfl]

The protocol: Fashion-MNIST with fedstale's IID partition (50 clients of 1,080 images),
the model from fedstale's initial weights (seed 0), 5 local epochs, batch 64, lr 0.01 (no
decay), synchronous FedAvg with 10 clients an iteration, the updates given per model,
evaluation only at the end. pfl runs in a virtualenv of its own (`--pfl-venv`, made on
first use: this interpreter's Python, the same torch release, `pfl[pytorch]==0.6.0`, and
pydantic for fedstale's model module), from bench/peers_pfl.py, on one process and on
`torchrun --nproc_per_node=2`; fedstale runs as a user runs it, `fedstale run --local
--workers N`, its rate from summary.json (`updates_per_second`, over the engine's loop;
pfl's over `algorithm.run`: both without start-up). The reference is the bare loop,
`fedstale.common.training.local_train` on one thread in this process (bench.throughput).

Rows: `bare`, `pfl-1`, `pfl-2`, `fedstale-1`, `fedstale-2` (trainer=autograd, as pfl
trains), `fedbuff-1`, `fedbuff-2` (FedBuff, K = 10, autograd: the asynchronous rule at
FedAvg's protocol), and for the linear model `closed-1`, `closed-2` (the default trainer,
its closed-form gradient). Every repetition runs every row once, in an order rotated per
repetition. Each measurement is appended to OUT/results.jsonl as it ends; rerunning the
command skips what is there (a protocol that differs from OUT's is refused: name another
OUT). The table prints medians [min-max] and each row against the bare loop and against pfl
on as many processes.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
PFL = "pfl[pytorch]==0.6.0"
PROTOCOL = {
    "dataset": "fmnist",
    "partition": "iid",
    "num_clients": 50,
    "cohort": 10,
    "epochs": 5,
    "batch_size": 64,
    "lr": 0.01,
    "seed": 0,
    "eval_batch_size": 1024,
}
UPDATES = {"linear": 3000, "lenet": 100}
BARE_TASKS = {"linear": 300, "lenet": 20}
ROWS = ("bare", "pfl-1", "pfl-2", "fedstale-1", "fedstale-2", "fedbuff-1", "fedbuff-2")
ROWS_LINEAR = (*ROWS, "closed-1", "closed-2")
RUN_SECONDS = 1800


class PeersError(Exception):
    """A problem the user can fix: one line, exit 2."""


@dataclass(frozen=True)
class Row:
    name: str
    peer: str  # "bare", "pfl" or "fedstale"
    processes: int
    run_config: str = ""  # fedstale rows: over the protocol's keys


def row_of(name: str) -> Row:
    if name == "bare":
        return Row(name, "bare", 1)
    kind, processes = name.rsplit("-", 1)
    if kind == "pfl":
        return Row(name, "pfl", int(processes))
    configs = {
        "fedstale": "strategy=fedavg trainer=autograd",
        "fedbuff": "strategy=fedbuff buffer-size=10 trainer=autograd",
        "closed": "strategy=fedavg trainer=auto",
    }
    return Row(name, "fedstale", int(processes), configs[kind])


def fedstale_config(model: str, updates: int) -> str:
    """The protocol as fedstale run-config pairs (FedAvg's rounds of `cohort` clients)."""
    p = PROTOCOL
    return (
        f"dataset={p['dataset']} partition={p['partition']} num-clients={p['num_clients']} "
        f"concurrency={p['cohort']} local-epochs={p['epochs']} batch-size={p['batch_size']} "
        f"lr={p['lr']} lr-decay=1.0 seed={p['seed']} model={model} max-updates={updates} "
        f"max-virtual-time=0 eval-interval=1e12 eval-batch-size={p['eval_batch_size']} "
        "checkpoint-every=0 client-threads=1 progress-interval=60"
    )


def export_protocol(model: str, updates: int, folder: Path) -> dict[str, Any]:
    """fedstale's partition, test set and model description, for pfl's side; the protocol
    (refused when `folder` holds a different one)."""
    from fedstale.common.federation import FederationKey, federation_of, test_data
    from fedstale.common.shares import client_data
    from fedstale.launcher.launch import parse_pairs
    from fedstale.strategies.registry import load_config

    run, _ = load_config(parse_pairs(fedstale_config(model, updates)))
    fed = federation_of(FederationKey.of(run))
    protocol = {
        **PROTOCOL,
        "model": model,
        "updates": updates,
        "input_shape": list(fed.input_shape),
        "num_classes": fed.num_classes,
    }
    recorded = folder / "protocol.json"
    if recorded.is_file():
        if json.loads(recorded.read_text()) != protocol:
            raise PeersError(f"{folder} holds another protocol's results: name another --out")
        return protocol
    folder.mkdir(parents=True, exist_ok=True)
    arrays: dict[str, np.ndarray] = {}
    for client in range(run.num_clients):
        x, y = client_data(FederationKey.of(run), client)
        arrays[f"x{client}"], arrays[f"y{client}"] = x.numpy(), y.numpy()
    x_test, y_test = test_data(FederationKey.of(run))
    np.savez(folder / "data.npz", x_test=x_test.numpy(), y_test=y_test.numpy(), **arrays)
    recorded.write_text(json.dumps(protocol, indent=1) + "\n")
    return protocol


def ensure_pfl(venv: Path) -> Path:
    """pfl's virtualenv, made when it lacks pfl 0.6.0; its python."""
    import torch

    python = venv / "bin" / "python"
    probe = "from importlib.metadata import version; print(version('pfl'))"
    if python.exists() and run_quiet([str(python), "-c", probe]).stdout.strip() == "0.6.0":
        return python
    print(f"making pfl's virtualenv in {venv} (torch {torch.__version__}, {PFL})", flush=True)
    base = getattr(sys, "_base_executable", sys.executable)
    torch_pin = f"torch=={torch.__version__.split('+')[0]}"
    pip = [str(python), "-m", "pip", "install", "--quiet"]
    steps = {
        f"python -m venv {venv}": [base, "-m", "venv", str(venv)],
        f"pip install {torch_pin}": [*pip, torch_pin],
        f"pip install {PFL}": [*pip, PFL, "pydantic>=2"],
    }
    for step, command in steps.items():
        done = run_quiet(command, timeout=1200)
        if done.returncode != 0:
            tail = (done.stderr or done.stdout).strip().splitlines()[-1:] or ["no output"]
            raise PeersError(f"could not make pfl's virtualenv ({step}): {tail[0]}")
    return python


def run_quiet(
    command: list[str], timeout: float = 120, **kwargs: Any
) -> subprocess.CompletedProcess:
    return subprocess.run(command, capture_output=True, text=True, timeout=timeout, **kwargs)


def one_thread_env() -> dict[str, str]:
    return {**os.environ, "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}


def measure_pfl(python: Path, processes: int, folder: Path, tag: str) -> dict[str, Any]:
    out = folder / f"pfl-{tag}.json"
    script = str(ROOT / "bench" / "peers_pfl.py")
    command = [str(python), script, str(folder), str(out)]
    if processes > 1:
        torchrun = str(python.parent / "torchrun")
        command = [torchrun, "--standalone", f"--nproc_per_node={processes}", *command[1:]]
    done = run_quiet(command, timeout=RUN_SECONDS, env=one_thread_env())
    if done.returncode != 0:
        raise PeersError(f"pfl's run failed: {done.stderr.strip().splitlines()[-1:]}")
    result = json.loads(out.read_text())
    return {"rate": result["updates_per_second"], "accuracy": result["accuracy"]}


def measure_fedstale(row: Row, model: str, updates: int, folder: Path, tag: str) -> dict[str, Any]:
    config = f"{fedstale_config(model, updates)} {row.run_config} run-name={tag}"
    config += f" runs-dir={folder / 'runs'}"
    command = [
        str(Path(sys.executable).parent / "fedstale"),
        "run",
        "--local",
        f"--workers={row.processes}",
        "--run-config",
        config,
    ]
    done = run_quiet(command, timeout=RUN_SECONDS, env=one_thread_env(), cwd=folder)
    if done.returncode != 0:
        raise PeersError(f"fedstale's run failed: {done.stderr.strip().splitlines()[-1:]}")
    summary = json.loads((folder / "runs" / tag / "summary.json").read_text())
    return {"rate": summary["updates_per_second"], "accuracy": summary["final_accuracy"]}


def measure_bare(model: str, updates: int) -> dict[str, Any]:
    from bench.throughput import bare_rate
    from fedstale.launcher.launch import parse_pairs

    config = parse_pairs(f"{fedstale_config(model, updates)} trainer=autograd")
    return {"rate": bare_rate(config, BARE_TASKS.get(model, 20)), "accuracy": None}


def measure(
    row: Row, model: str, protocol: dict, folder: Path, rep: int, pfl: Path | None
) -> dict[str, Any]:
    tag = f"{row.name}-r{rep}"
    started = time.perf_counter()
    if row.peer == "bare":
        result = measure_bare(model, protocol["updates"])
    elif row.peer == "pfl":
        assert pfl is not None
        result = measure_pfl(pfl, row.processes, folder, tag)
    else:
        result = measure_fedstale(row, model, protocol["updates"], folder, tag)
    return {
        "model": model,
        "row": row.name,
        "rep": rep,
        **result,
        "command_seconds": time.perf_counter() - started,
        "unix_time": time.time(),
    }


def rotated(rows: list[str], rep: int) -> list[str]:
    shift = rep % len(rows)
    return rows[shift:] + rows[:shift]


def done_rows(results: Path) -> list[dict[str, Any]]:
    if not results.is_file():
        return []
    return [json.loads(line) for line in results.read_text().splitlines() if line.strip()]


def table(model: str, rows: Iterable[str], results: list[dict[str, Any]]) -> list[str]:
    """The markdown table of one model: median [min-max] updates/s, x bare, x pfl."""
    rates = {
        name: [r["rate"] for r in results if r["model"] == model and r["row"] == name]
        for name in rows
    }
    accuracy = {
        name: [r["accuracy"] for r in results if r["model"] == model and r["row"] == name]
        for name in rows
    }
    median = {name: statistics.median(v) for name, v in rates.items() if v}
    lines = [
        f"| {model} | updates/s, median [min-max] | x bare loop | x pfl, same processes "
        "| final accuracy |",
        "| --- | --- | --- | --- | --- |",
    ]
    for name, values in rates.items():
        if not values:
            continue
        row = row_of(name)
        bare = ratio(median[name], median.get("bare"))
        pfl = "" if row.peer == "pfl" else ratio(median[name], median.get(f"pfl-{row.processes}"))
        if row.peer == "bare":
            pfl = ""
        found = [a for a in accuracy[name] if a is not None]
        acc = f"{statistics.median(found):.4f}" if found else ""
        lines.append(
            f"| {label(row)} | {rate(median[name])} [{rate(min(values))}-{rate(max(values))}] "
            f"| {bare} | {pfl} | {acc} |"
        )
    return lines


def rate(value: float) -> str:
    return f"{value:.1f}" if value >= 10 else f"{value:.2f}"


def ratio(value: float, reference: float | None) -> str:
    return f"{value / reference:.2f}" if reference else ""


def label(row: Row) -> str:
    if row.peer == "bare":
        return "bare loop (`local_train`, autograd, one thread)"
    processes = f"{row.processes} process{'es' if row.processes > 1 else ''}"
    if row.peer == "pfl":
        return f"pfl 0.6.0, {processes}" + (" (`torchrun`)" if row.processes > 1 else "")
    what = {"fedstale": "FedAvg, autograd", "fedbuff": "FedBuff, autograd"}
    kind = row.name.rsplit("-", 1)[0]
    workers = f"`--local --workers {row.processes}`"
    return f"fedstale {workers}, {what.get(kind, 'FedAvg, default trainer (closed form)')}"


def parse_updates(text: str) -> dict[str, int]:
    pairs = dict(part.split("=", 1) for part in text.split(",") if part)
    return {**UPDATES, **{model: int(n) for model, n in pairs.items()}}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--models", default="linear,lenet")
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--updates", default="", help="per model, e.g. linear=3000,lenet=100")
    parser.add_argument("--rows", default="", help="a subset of the rows, comma-separated")
    parser.add_argument("--out", type=Path, default=ROOT / "runs" / "peers")
    parser.add_argument("--pfl-venv", type=Path, default=ROOT / ".venv-pfl")
    args = parser.parse_args(argv)
    try:
        run_all(args)
    except PeersError as err:
        print(f"bench.peers: {err}", file=sys.stderr)
        sys.exit(2)


def run_all(args: argparse.Namespace) -> None:
    updates = parse_updates(args.updates)
    wanted = [r for r in args.rows.split(",") if r]
    unknown = set(wanted) - set(ROWS_LINEAR)
    if unknown:
        raise PeersError(f"unknown rows {sorted(unknown)}; rows: {', '.join(ROWS_LINEAR)}")
    models = [m for m in args.models.split(",") if m]
    plans = {
        m: [r for r in (ROWS_LINEAR if m == "linear" else ROWS) if not wanted or r in wanted]
        for m in models
    }
    needs_pfl = any(r.startswith("pfl") for rows in plans.values() for r in rows)
    pfl = ensure_pfl(args.pfl_venv) if needs_pfl else None
    results_file = args.out / "results.jsonl"
    results = done_rows(results_file)
    done = {(r["model"], r["row"], r["rep"]) for r in results}
    for model in models:
        folder = args.out / model
        protocol = export_protocol(model, updates[model], folder)
        for rep in range(args.reps):
            for name in rotated(plans[model], rep):
                if (model, name, rep) in done:
                    continue
                result = measure(row_of(name), model, protocol, folder, rep, pfl)
                with results_file.open("a") as out:
                    out.write(json.dumps(result) + "\n")
                results.append(result)
                print(f"{model} rep {rep} {name}: {result['rate']:.2f} updates/s", flush=True)
    cores = len(os.sched_getaffinity(0))
    print(f"\n{cores} cores; updates per second, median of {args.reps} interleaved repetitions")
    for model in models:
        print("\n".join(["", *table(model, plans[model], results)]))


if __name__ == "__main__":
    main()
