"""Every GPU figure in one command, for a machine with a CUDA GPU (about 5 minutes):
updates per second of each way fedstale trains clients, as a ratio against a bare loop on
the same GPU measured in the same run, and the peak GPU memory of each.

    python -m bench.gpu                   # on a CUDA machine
    python -m bench.gpu --smoke           # a tiny variant on CPU (the tests run it)

Rows, for LeNet and a wider CNN (cnn-mnist: 32/64 channels, 582,026 parameters) on
Fashion-MNIST (50 clients, Dirichlet 0.1, 5 local epochs, batch 64):

- bare loop: `local_train` (the function every client calls) one task after another in
  this process, no server, clients drawn at random: the reference;
- cohort: the same tasks 10 at a time as one batched computation (fedstale/common/cohort.py,
  `torch.func.vmap` over the clients' stacked parameters);
- `--local`, `device=cuda`, 1, 2 and 4 worker processes sharing the GPU (FedBuff, 10 tasks
  in flight; rates over the engine's loop), and `trainer=cohort` (the tasks waiting to be
  trained, together in the engine's process);
- Flower simulation (`fedstale run` on a SuperLink of its own, partitions assigned) with
  `client-resources-num-gpus` 1, 0.5 and 0.25 (1, 2 and 4 ClientApps on the GPU at once),
  and `trainer=cohort` at num-gpus 1 (the waiting tasks as one message to one ClientApp);
- the library: examples/async-quickstart (fedstale's FedBuff over Flower's plain PyTorch
  ClientApp, an MLP on 8x8 digits) in Flower simulation on the GPU: its own updates per
  second, no ratio (another model).

Peak GPU memory: in-process rows from torch's allocator; runs in other processes from
`nvidia-smi` sampled every 0.2 s (the device's used memory above what it was before the
run). `--smoke`: digits and the MLP on CPU, tiny budgets, one worker count, one simulation
row, so that every code path runs in about a minute.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
from bench.throughput import bare_rate, bare_setup, local_summary, synchronize  # noqa: E402
from fedstale.common.cohort import Member, cohort_train  # noqa: E402
from fedstale.common.config import parse_run_config  # noqa: E402
from fedstale.launcher.launch import parse_pairs, tool  # noqa: E402
from tests.flower_procs import CONNECTION, SimulationSuperLink  # noqa: E402

QUICKSTART = ROOT / "examples" / "async-quickstart"
COHORT = 10  # clients trained together


@dataclass(frozen=True)
class Plan:
    """What one invocation measures."""

    device: str
    models: tuple[str, ...]
    base: str  # run-config pairs every run shares
    tasks: int  # tasks of the bare loop and of the cohort rows
    budgets: dict[str, float]  # model -> virtual time of each run
    workers: tuple[int, ...]
    gpu_shares: tuple[float, ...]
    quickstart_rounds: int

    @classmethod
    def full(cls) -> Plan:
        return cls(
            device="cuda",
            models=("lenet", "cnn-mnist"),
            base="partition=dirichlet dirichlet-alpha=0.1 device=cuda",
            tasks=100,
            budgets={"lenet": 6_000.0, "cnn-mnist": 4_000.0},
            workers=(1, 2, 4),
            gpu_shares=(1.0, 0.5, 0.25),
            quickstart_rounds=30,
        )

    @classmethod
    def smoke(cls) -> Plan:
        return cls(
            device="cpu",
            models=("mlp",),
            base="dataset=digits num-clients=6 concurrency=2 local-epochs=1 device=cpu",
            tasks=6,
            budgets={"mlp": 400.0},
            workers=(1,),
            gpu_shares=(0.0,),
            quickstart_rounds=2,
        )


@dataclass
class Row:
    label: str
    rate: float
    peak_mib: float | None = None
    ratio: bool = True
    note: str = ""


@dataclass
class GpuMemory:
    """Peak used memory of the device (nvidia-smi) while a block runs, above its start."""

    samples: list[float] = field(default_factory=list)

    @contextmanager
    def watch(self, device: str) -> Iterator[GpuMemory]:
        if not device.startswith("cuda") or shutil.which("nvidia-smi") is None:
            yield self
            return
        stop = threading.Event()
        base = used_mib()

        def sample() -> None:
            while not stop.wait(0.2):
                self.samples.append(used_mib() - base)

        thread = threading.Thread(target=sample, daemon=True)
        thread.start()
        try:
            yield self
        finally:
            stop.set()
            thread.join()

    @property
    def peak(self) -> float | None:
        return max(self.samples) if self.samples else None


def used_mib() -> float:
    out = subprocess.run(
        ["nvidia-smi", "--query-gpu=memory.used", "--format=csv,noheader,nounits"],
        capture_output=True,
        text=True,
        check=True,
    )
    return float(out.stdout.split()[0])


def allocator_peak(device: str, measure: Callable[[], float]) -> tuple[float, float | None]:
    """`measure()`'s result and torch's peak allocation on `device` during it (MiB)."""
    if not device.startswith("cuda"):
        return measure(), None
    torch.cuda.reset_peak_memory_stats()
    value = measure()
    return value, torch.cuda.max_memory_allocated() / 2**20


def cohort_rate(config: dict[str, Any], tasks: int, device: str) -> float:
    """The bare loop's tasks, COHORT clients at a time as one batched computation."""
    run = parse_run_config(config)
    model, data = bare_setup(run, device)
    rng = np.random.default_rng(0)
    start_params = {n: p.detach() for n, p in model.named_parameters()}
    synchronize(device)
    started = time.perf_counter()
    for first in range(0, tasks, COHORT):
        members = []
        for task in range(first, min(first + COHORT, tasks)):
            x, y = data[int(rng.integers(run.num_clients))]
            members.append(
                Member(start_params, x, y, run.local_epochs, run.batch_size, run.lr, task)
            )
        cohort_train(model, members)
    synchronize(device)
    return tasks / (time.perf_counter() - started)


def simulation_rate(config: str, workdir: Path, share: float, link: SimulationSuperLink) -> float:
    """`fedstale run` in Flower simulation on `link` with `share` of a GPU per ClientApp (0:
    CPU); partitions assigned by the server, as `fedstale run` does on a SuperLink of its own."""
    name = f"sim-{share}-{time.monotonic_ns()}"
    federation = f"client-resources-num-cpus=1 client-resources-num-gpus={share}"
    command = [tool("fedstale"), "run", "--app", str(ROOT), "--superlink", CONNECTION]
    command += ["--federation-config", federation, "--run-config"]
    command += [f"{config} node-partitions=assign run-name={name} runs-dir={workdir / 'runs'}"]
    done = subprocess.run(command, env=link.env, capture_output=True, text=True, timeout=900)
    if done.returncode != 0:
        raise SystemExit(f"the simulation run failed:\n{done.stderr[-3000:]}")
    summary = json.loads((workdir / "runs" / name / "summary.json").read_text())
    return float(summary["updates_per_second"])


def quickstart_rate(workdir: Path, rounds: int, share: float) -> float:
    """examples/async-quickstart in Flower simulation: the library's FedBuff over a plain
    Flower ClientApp (4 nodes), its updates per second."""
    folder = workdir / f"quickstart-{share}"
    folder.mkdir()
    here = Path.cwd()
    os.chdir(folder)  # the ServerApp writes runs/ and final_model.pt where the link started
    try:
        link = SimulationSuperLink(folder / "flwr-home").start()
    finally:
        os.chdir(here)
    federation = f"num-supernodes=4 client-resources-num-cpus=1 client-resources-num-gpus={share}"
    command = [tool("flwr"), "run", str(QUICKSTART), CONNECTION, "--stream"]
    command += ["--run-config", f"num-server-rounds={rounds}", "--federation-config", federation]
    try:
        done = subprocess.run(
            command, env=link.env, cwd=folder, capture_output=True, text=True, timeout=900
        )
    finally:
        link.stop()
    runs = list((folder / "runs").glob("*/summary.json")) if done.returncode == 0 else []
    if not runs:
        raise SystemExit(f"the quickstart run failed:\n{(done.stdout + done.stderr)[-3000:]}")
    return float(json.loads(runs[0].read_text())["updates_per_second"])


def model_rows(plan: Plan, model: str, workdir: Path, link: SimulationSuperLink) -> list[Row]:
    budget = plan.budgets[model]
    config = (
        f"{plan.base} model={model} max-virtual-time={budget} eval-interval={budget / 2} "
        "progress-interval=60"
    )
    pairs = parse_pairs(config)
    device = plan.device
    rate, peak = allocator_peak(device, lambda: bare_rate(pairs, plan.tasks, device))
    rows = [Row("bare loop", rate, peak)]
    rate, peak = allocator_peak(device, lambda: cohort_rate(pairs, plan.tasks, device))
    rows.append(Row(f"cohort of {COHORT}", rate, peak))
    for workers in plan.workers:
        with GpuMemory().watch(device) as memory:
            rate = local_summary(config, workdir / model, workers)["updates_per_second"]
        rows.append(Row(f"--local, {workers} worker(s)", rate, memory.peak))
    with GpuMemory().watch(device) as memory:
        rate = local_summary(f"{config} trainer=cohort", workdir / model, 1)["updates_per_second"]
    rows.append(Row("--local, trainer=cohort", rate, memory.peak))
    for share in plan.gpu_shares:
        with GpuMemory().watch(device) as memory:
            rate = simulation_rate(config, workdir, share, link)
        rows.append(Row(f"Flower simulation, num-gpus {share:g}", rate, memory.peak))
    share = plan.gpu_shares[0]
    with GpuMemory().watch(device) as memory:
        rate = simulation_rate(f"{config} trainer=cohort", workdir, share, link)
    rows.append(Row(f"Flower simulation, trainer=cohort, num-gpus {share:g}", rate, memory.peak))
    return rows


def table(title: str, rows: list[Row]) -> str:
    reference = rows[0].rate
    lines = [
        f"| {title} | updates/s | x bare loop | peak GPU MiB |",
        "| --- | --- | --- | --- |",
    ]
    for row in rows:
        ratio = f"{row.rate / reference:.2f}" if row.ratio else "-"
        peak = f"{row.peak_mib:,.0f}" if row.peak_mib is not None else "-"
        lines.append(f"| {row.label} | {row.rate:.2f} | {ratio} | {peak} |")
    return "\n".join(lines)


def device_line(device: str) -> str:
    if device.startswith("cuda") and torch.cuda.is_available():
        props = torch.cuda.get_device_properties(0)
        return f"GPU: {props.name}, {props.total_memory / 2**30:.0f} GiB; torch {torch.__version__}"
    return f"CPU ({len(os.sched_getaffinity(0))} cores); torch {torch.__version__}"


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--smoke", action="store_true", help="a tiny variant on CPU")
    options = parser.parse_args(argv)
    plan = Plan.smoke() if options.smoke else Plan.full()
    if plan.device == "cuda" and not torch.cuda.is_available():
        print("bench.gpu: no CUDA device; run it on a GPU machine, or --smoke", file=sys.stderr)
        raise SystemExit(2)
    started = time.monotonic()
    print(device_line(plan.device), flush=True)
    with tempfile.TemporaryDirectory() as tmp:
        workdir = Path(tmp)
        link = SimulationSuperLink(workdir / "flwr-home").start()  # every simulation row's
        try:
            for model in plan.models:
                print(table(model, model_rows(plan, model, workdir, link)), flush=True)
        finally:
            link.stop()
        share = plan.gpu_shares[0]
        with GpuMemory().watch(plan.device) as memory:
            rate = quickstart_rate(workdir, plan.quickstart_rounds, share)
        library = [Row("library FedBuff, quickstart", rate, memory.peak, ratio=False)]
        print(table("quickstart (MLP, digits)", [*library]), flush=True)
    print(f"bench.gpu: done in {time.monotonic() - started:.0f} s", flush=True)


if __name__ == "__main__":
    main()
