"""Every GPU figure in one command, for a machine with a CUDA GPU: updates per second of
each way fedstale trains clients, as a ratio against a bare loop on the same GPU measured in
the same run, and the peak GPU memory of each. Every rate is timed warm: the in-process rows
after an untimed task (or cohort), the runs over their engine's loop.

    python -m bench.gpu                   # the targets' rows, sized for one 9-minute call
    python -m bench.gpu --all             # every row below (about 20 minutes of an H200)
    python -m bench.gpu --smoke           # every row, tiny, on CPU (the tests run it)

Rows, for LeNet and a wider CNN (cnn-mnist: 32/64 channels, 582,026 parameters) on
Fashion-MNIST (50 clients, Dirichlet 0.1, 5 local epochs, batch 64):

- bare loop: `local_train` (the function every client calls) one task after another in
  this process, no server, clients drawn at random: the reference;
- cohort: the same tasks 10 at a time as one batched computation (fedstale/common/cohort.py,
  `torch.func.vmap` over the clients' stacked parameters);
- `--local`, `device=cuda`, 1, 2 and 4 worker processes sharing the GPU (FedBuff, 10 tasks
  in flight; rates over the engine's loop), and `trainer=cohort` (the tasks waiting to be
  trained, together in the engine's process);
- for LeNet: FedPSA in `--local` per task and with `trainer=cohort` (its sketch joins the
  cohorts), and the grid rows: 12 runs (3 seeds x FedBuff, FedAsync, FedAvg, FedPSA) one
  after another and together in one process (`fedstale run --local --grid`: every run's
  waiting tasks trained as one cohort), with the mean and largest cohort in the label;
- Flower simulation (`fedstale run` on a SuperLink of its own, partitions assigned) with
  `client-resources-num-gpus` 1, 0.5 and 0.25 (1, 2 and 4 ClientApps on the GPU at once),
  and `trainer=cohort` at num-gpus 1 (the waiting tasks as one message to one ClientApp);
- the library: examples/async-quickstart (fedstale's FedBuff over Flower's plain PyTorch
  ClientApp, an MLP on 8x8 digits) in Flower simulation on the GPU: its own updates per
  second, no ratio (another model).

Peak GPU memory: in-process rows from torch's allocator; runs in other processes from
`nvidia-smi` sampled every 0.2 s (the device's used memory above what it was before the
run). `--smoke`: digits and the MLP on CPU, tiny budgets, one worker count, one simulation
row, one ClientApp at a time (Ray given one CPU), so that every code path runs in about a
minute.

Each row is printed as soon as it is measured and needs no other row: a run cut short keeps
what it printed, and a row that fails says so in its own line. Without flwr the command
stops in one line; without ray the Flower rows say they are skipped.
"""

from __future__ import annotations

import argparse
import importlib.util
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
from dataclasses import dataclass, field, replace
from functools import partial
from pathlib import Path
from typing import Any

import numpy as np
import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
if __name__ == "__main__" and importlib.util.find_spec("flwr") is None:  # fedstale needs it
    sys.exit("bench.gpu: no flwr here: install flwr (and ray, for the Flower rows) first")
from bench.throughput import (  # noqa: E402
    bare_rate,
    bare_setup,
    grid_configs,
    grid_measure,
    local_summary,
    synchronize,
)
from fedstale.common.cohort import Member, cohort_train  # noqa: E402
from fedstale.common.config import parse_run_config  # noqa: E402
from fedstale.launcher.launch import parse_pairs, tool  # noqa: E402
from tests.flower_procs import CONNECTION, ONE_CLIENTAPP, SimulationSuperLink  # noqa: E402

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
    grid_seeds: int  # the grid rows: this many seeds x FedBuff, FedAsync, FedAvg, FedPSA
    grid_budget: float  # virtual time of each grid run
    ray_init: str = ""  # Flower federation keys sizing the simulation's Ray
    everything: bool = True  # False: only the rows the GPU targets are measured on

    def clientapps(self, share: float) -> str:
        """The federation config of a simulation with `share` of a GPU per ClientApp."""
        resources = f"client-resources-num-cpus=1 client-resources-num-gpus={share}"
        return f"{resources} {self.ray_init}".strip()

    @classmethod
    def targets(cls) -> Plan:
        """The rows the GPU targets are read from, sized for one 9-minute call on an H200
        (at the rates the CPU smoke and the last GPU run showed, 216 updates a LeNet run and
        576 for the grid took about 20 minutes for every row): LeNet only; the bare loop,
        the cohort and one worker; FedPSA per task and in cohorts (>= 2x); the 12-run grid
        together (>= 10x the bare loop); Flower simulation at num-gpus 1 (>= 0.9x)."""
        return replace(
            cls.full(),
            models=("lenet",),
            tasks=60,
            budgets={"lenet": 3_000.0},
            workers=(1,),
            gpu_shares=(1.0,),
            grid_budget=750.0,
            everything=False,
        )

    @classmethod
    def full(cls) -> Plan:
        """Every row (`--all`): both models, 1-4 workers, three GPU shares (~20 minutes)."""
        return cls(
            device="cuda",
            models=("lenet", "cnn-mnist"),
            base="partition=dirichlet dirichlet-alpha=0.1 device=cuda",
            tasks=100,
            budgets={"lenet": 6_000.0, "cnn-mnist": 4_000.0},
            workers=(1, 2, 4),
            gpu_shares=(1.0, 0.5, 0.25),
            quickstart_rounds=30,
            grid_seeds=3,
            grid_budget=1_500.0,
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
            grid_seeds=1,
            grid_budget=400.0,
            # One ClientApp at a time on CPU, as num-gpus 1 on a GPU: one Ray worker to start.
            ray_init=ONE_CLIENTAPP,
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
    """The bare loop's tasks, COHORT clients at a time as one batched computation; timed
    warm, after one untimed cohort (as the bare loop after one untimed task)."""
    run = parse_run_config(config)
    model, data = bare_setup(run, device)
    rng = np.random.default_rng(0)
    start_params = {n: p.detach() for n, p in model.named_parameters()}

    def member(client: int, seed: int) -> Member:
        x, y = data[client]
        return Member(start_params, x, y, run.local_epochs, run.batch_size, run.lr, seed)

    cohort_train(model, [member(c % run.num_clients, tasks + c) for c in range(COHORT)])
    synchronize(device)
    started = time.perf_counter()
    for first in range(0, tasks, COHORT):
        cohort = range(first, min(first + COHORT, tasks))
        cohort_train(model, [member(int(rng.integers(run.num_clients)), t) for t in cohort])
    synchronize(device)
    return tasks / (time.perf_counter() - started)


def simulation_rate(
    config: str, workdir: Path, federation: str, link: SimulationSuperLink
) -> float:
    """`fedstale run` in Flower simulation on `link` with `federation` (its ClientApps' share
    of a GPU); partitions assigned by the server, as `fedstale run` does on a SuperLink of its
    own."""
    name = f"sim-{time.monotonic_ns()}"
    command = [tool("fedstale"), "run", "--app", str(ROOT), "--superlink", CONNECTION]
    command += ["--federation-config", federation, "--run-config"]
    command += [f"{config} node-partitions=assign run-name={name} runs-dir={workdir / 'runs'}"]
    done = subprocess.run(command, env=link.env, capture_output=True, text=True, timeout=900)
    if done.returncode != 0:
        raise SystemExit(f"the simulation run failed:\n{done.stderr[-3000:]}")
    summary = json.loads((workdir / "runs" / name / "summary.json").read_text())
    return float(summary["updates_per_second"])


def quickstart_rate(workdir: Path, rounds: int, federation: str) -> float:
    """examples/async-quickstart in Flower simulation: the library's FedBuff over a plain
    Flower ClientApp (4 nodes), its updates per second."""
    folder = workdir / "quickstart"
    folder.mkdir()
    here = Path.cwd()
    os.chdir(folder)  # the ServerApp writes runs/ and final_model.pt where the link started
    try:
        link = SimulationSuperLink(folder / "flwr-home").start()
    finally:
        os.chdir(here)
    command = [tool("flwr"), "run", str(QUICKSTART), CONNECTION, "--stream"]
    command += ["--run-config", f"num-server-rounds={rounds}"]
    command += ["--federation-config", f"num-supernodes=4 {federation}"]
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


Measure = tuple[str, Callable[[], tuple[float, float | None]], bool]  # label, rate+peak, Flower?


def model_measures(plan: Plan, model: str, workdir: Path, link: Any) -> list[Measure]:
    """Each row of a model's table: its label, how to measure it (updates per second and
    peak GPU MiB) and whether it needs Flower; no row needs another's result."""
    budget = plan.budgets[model]
    config = (
        f"{plan.base} model={model} max-virtual-time={budget} eval-interval={budget / 2} "
        "progress-interval=60"
    )
    pairs = parse_pairs(config)
    device = plan.device

    def watched(work: Callable[[], float]) -> Callable[[], tuple[float, float | None]]:
        def measure() -> tuple[float, float | None]:
            with GpuMemory().watch(device) as memory:
                rate = work()
            return rate, memory.peak

        return measure

    def local(extra: str, workers: int) -> Callable[[], float]:
        folder = workdir / model / f"{workers}-{extra.replace(' ', '-') or 'plain'}"
        return lambda: local_summary(f"{config} {extra}", folder, workers)["updates_per_second"]

    measures: list[Measure] = [
        (
            "bare loop",
            lambda: allocator_peak(device, lambda: bare_rate(pairs, plan.tasks, device)),
            False,
        ),
        (
            f"cohort of {COHORT}",
            lambda: allocator_peak(device, lambda: cohort_rate(pairs, plan.tasks, device)),
            False,
        ),
    ]
    for workers in plan.workers:
        measures.append((f"--local, {workers} worker(s)", watched(local("", workers)), False))
    if plan.everything:
        measures.append(("--local, trainer=cohort", watched(local("trainer=cohort", 1)), False))
    if model == plan.models[0]:
        fedpsa = "strategy=fedpsa buffer-size=5"
        measures.append(
            ("--local FedPSA, per task", watched(local(f"{fedpsa} trainer=autograd", 1)), False)
        )
        measures.append(
            ("--local FedPSA, trainer=cohort", watched(local(f"{fedpsa} trainer=cohort", 1)), False)
        )
        measures += grid_measures(plan, model, workdir / f"{model}-grid")
    for share in plan.gpu_shares:
        work = partial(simulation_rate, config, workdir, plan.clientapps(share), link)
        measures.append((f"Flower simulation, num-gpus {share:g}", watched(work), True))
    if plan.everything:
        share = plan.gpu_shares[0]
        cohort = f"{config} trainer=cohort"
        work = partial(simulation_rate, cohort, workdir, plan.clientapps(share), link)
        label = f"Flower simulation, trainer=cohort, num-gpus {share:g}"
        measures.append((label, watched(work), True))
    return measures


def grid_measures(plan: Plan, model: str, workdir: Path) -> list[Measure]:
    """The grid rows: 3 seeds x FedBuff, FedAsync, FedAvg and FedPSA (12 runs) together in
    one process (`fedstale run --local --grid`), and the same runs one after another; the
    label carries the mean cohort."""
    budget = plan.grid_budget
    config = (
        f"{plan.base} model={model} max-virtual-time={budget} eval-interval={budget / 2} "
        "progress-interval=600"
    )
    configs = grid_configs(config, plan.grid_seeds)
    measures: list[Measure] = []
    ways = ((False, "one after another"), (True, "together"))
    for together, how in ways if plan.everything else ways[1:]:

        def measure(together: bool = together, how: str = how) -> tuple[float, float | None]:
            with GpuMemory().watch(plan.device) as memory:
                found = grid_measure(configs, workdir / how, together)
            labels[how] = (
                f" (mean cohort {found['cohort_mean']:.1f}, largest {found['cohort_largest']})"
            )
            return found["updates_per_second"], memory.peak

        measures.append((f"grid of {len(configs)} runs, {how}", measure, False))
    return measures


labels: dict[str, str] = {}  # what a grid row learns while it runs, added to its label


def missing_modules() -> list[str]:
    """What the Flower rows need beside flwr and this machine lacks."""
    return [name for name in ("ray",) if importlib.util.find_spec(name) is None]


def print_rows(title: str, measures: list[Measure], lacking: list[str]) -> None:
    """The table's rows, each printed as soon as it is measured; a row that fails (or needs
    what is missing) says so in its own line and the others go on."""
    print(
        f"| {title} | updates/s | x bare loop | peak GPU MiB |\n| --- | --- | --- | --- |",
        flush=True,
    )
    reference = None
    for label, measure, flower in measures:
        if flower and lacking:
            print(f"| {label} | skipped: no {', '.join(lacking)} | - | - |", flush=True)
            continue
        try:
            rate, peak = measure()
        except Exception as err:  # one row's failure costs only that row
            print(
                f"| {label} | failed: {type(err).__name__}: {str(err)[:200]} | - | - |", flush=True
            )
            continue
        reference = reference or rate
        label += next((extra for how, extra in labels.items() if label.endswith(how)), "")
        shown = f"{peak:,.0f}" if peak is not None else "-"
        print(f"| {label} | {rate:.2f} | {rate / reference:.2f} | {shown} |", flush=True)


def device_line(device: str) -> str:
    if device.startswith("cuda") and torch.cuda.is_available():
        props = torch.cuda.get_device_properties(0)
        return f"GPU: {props.name}, {props.total_memory / 2**30:.0f} GiB; torch {torch.__version__}"
    return f"CPU ({len(os.sched_getaffinity(0))} cores); torch {torch.__version__}"


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--smoke", action="store_true", help="a tiny variant on CPU")
    parser.add_argument(
        "--all", action="store_true", help="every row, not only the targets' (~20 min)"
    )
    options = parser.parse_args(argv)
    plan = Plan.smoke() if options.smoke else Plan.full() if options.all else Plan.targets()
    if plan.device == "cuda" and not torch.cuda.is_available():
        print("bench.gpu: no CUDA device; run it on a GPU machine, or --smoke", file=sys.stderr)
        raise SystemExit(2)
    started = time.monotonic()
    print(device_line(plan.device), flush=True)
    lacking = missing_modules()
    if lacking:
        print(f"bench.gpu: no {', '.join(lacking)} here: the Flower rows are skipped", flush=True)
    with tempfile.TemporaryDirectory() as tmp:
        workdir = Path(tmp)
        link = None if lacking else SimulationSuperLink(workdir / "flwr-home").start()
        try:
            for model in plan.models:
                print_rows(model, model_measures(plan, model, workdir, link), lacking)
        finally:
            if link is not None:
                link.stop()
        share = plan.gpu_shares[0]

        def quickstart() -> tuple[float, float | None]:
            with GpuMemory().watch(plan.device) as memory:
                rate = quickstart_rate(workdir, plan.quickstart_rounds, plan.clientapps(share))
            return rate, memory.peak

        if plan.everything:
            library = [("library FedBuff, quickstart", quickstart, True)]
            print_rows("quickstart (MLP, digits)", library, lacking)
    print(f"bench.gpu: done in {time.monotonic() - started:.0f} s", flush=True)


if __name__ == "__main__":
    main()
