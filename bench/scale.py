"""Many clients: peak memory of the whole process tree and seconds per 1,000 updates,
in-process (`fedstale run --local --workers 1`) and in Flower simulation (`fedstale run` on a
SuperLink of this benchmark's own), at 1,000 and 10,000 clients, and how soon after the
launch the first update is accepted (`fedstale run` assigns partitions to simulated nodes:
no node is asked anything before its first task).

    python -m bench.scale [--clients 1000,10000] [--updates 1000] [--modes local,simulation]
    python -m bench.scale --clients 10000 --modes simulation --run-config node-partitions=ask

Each run is FedBuff on Fashion-MNIST with the linear model, 10 clients training at once, a
budget of `--updates` accepted updates. Memory is the sum of PSS (proportional set size:
shared pages split between the processes that map them, so torch's libraries in every Ray
worker count once in all) over every process of the run's tree, sampled every 0.2 s: the
fedstale process and, in simulation, the SuperLink with its SuperExec, the simulation
process and Ray's processes. Targets (issue 16): <= 1 GB in-process and <= 8 GB in Flower
simulation at 10,000 clients. Reference: the same run's figure at 1,000 clients.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
from fedstale.launcher.launch import flower_env, tool  # noqa: E402
from fedstale.launcher.ports import descendants  # noqa: E402
from tests.flower_procs import CONNECTION, SimulationSuperLink  # noqa: E402

GIB = 1024**3


def pss_bytes(pid: int) -> int:
    """A process's proportional set size (RSS where smaps_rollup is unreadable); 0 if gone."""
    try:
        text = Path(f"/proc/{pid}/smaps_rollup").read_text()
        field = "Pss:"
    except OSError:
        try:
            text = Path(f"/proc/{pid}/status").read_text()
        except OSError:
            return 0
        field = "VmRSS:"
    for line in text.splitlines():
        if line.startswith(field):
            return int(line.split()[1]) * 1024
    return 0


class TreeMemory:
    """Samples the summed PSS of some root processes and all their descendants."""

    def __init__(self, roots: list[int], interval: float = 0.2) -> None:
        self.roots = roots
        self.interval = interval
        self.peak = 0
        self.done = threading.Event()
        self.thread = threading.Thread(target=self.sample, daemon=True)

    def sample(self) -> None:
        while not self.done.is_set():
            pids = set(self.roots)
            for root in self.roots:
                pids |= {pid for pid, _ in descendants(root)}
            self.peak = max(self.peak, sum(pss_bytes(pid) for pid in pids))
            time.sleep(self.interval)

    def __enter__(self) -> TreeMemory:
        self.thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.done.set()
        self.thread.join()


EXTRA: list[str] = []  # --run-config: pairs every run adds


def run_config(clients: int, updates: int, runs: Path, name: str) -> str:
    return (
        f"strategy=fedbuff num-clients={clients} concurrency=10 max-updates={updates} "
        f"max-virtual-time=0 eval-interval=1000000 node-wait-seconds=1800 "
        f"progress-interval=30 run-name={name} runs-dir={runs} {' '.join(EXTRA)}"
    )


def measure(command: list[str], env: dict[str, str], extra_roots: list[int]) -> int:
    """Run `command`, return the peak PSS of its tree plus `extra_roots`' trees."""
    process = subprocess.Popen(command, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    with TreeMemory([process.pid, *extra_roots]) as memory:
        output, _ = process.communicate(timeout=3600)
    if process.returncode != 0:
        raise SystemExit(f"{' '.join(command)} failed:\n{output.decode()[-3000:]}")
    return memory.peak


def local_run(clients: int, updates: int, work: Path) -> dict[str, Any]:
    name = f"local-{clients}"
    command = [tool("fedstale"), "run", "--local", "--workers", "1", "--app", str(ROOT)]
    command += ["--run-config", run_config(clients, updates, work, name)]
    launched = time.time()
    peak = measure(command, flower_env(), [])
    return finished(work / name, peak, launched)


def simulation_run(clients: int, updates: int, work: Path) -> dict[str, Any]:
    name = f"sim-{clients}"
    link = SimulationSuperLink(work / f"flwr-home-{clients}").start()
    try:
        command = [tool("fedstale"), "run", "--app", str(ROOT), "--superlink", CONNECTION]
        # --superlink: fedstale run cannot tell this SuperLink simulates; say so.
        config = f"node-partitions=assign {run_config(clients, updates, work, name)}"
        command += ["--run-config", config]
        assert link.link.superlink is not None
        launched = time.time()
        peak = measure(command, link.env, [link.link.superlink.pid])
    finally:
        link.stop()
    return finished(work / name, peak, launched)


def finished(folder: Path, peak: int, launched: float) -> dict[str, Any]:
    """The run's summary, its peak memory and the seconds from launching `fedstale run` to
    the first accepted update."""
    summary = json.loads((folder / "summary.json").read_text())
    return {"peak": peak, "launch": summary["first_update_unix_time"] - launched, **summary}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--clients", default="1000,10000")
    parser.add_argument("--updates", type=int, default=1000)
    parser.add_argument("--modes", default="local,simulation")
    parser.add_argument(
        "--run-config", default="", help="pairs every run adds, e.g. node-partitions=ask"
    )
    args = parser.parse_args()
    EXTRA.append(args.run_config)
    runners = {"local": local_run, "simulation": simulation_run}
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for mode in args.modes.split(","):
            for clients in map(int, args.clients.split(",")):
                print(f"{mode}, {clients} clients ...", flush=True)
                result = runners[mode](clients, args.updates, Path(tmp))
                per_1000 = result["loop_seconds"] / max(result["updates_accepted"], 1) * 1000
                start = result["wall_seconds"] - result["loop_seconds"]
                first = (result["first_update_seconds"], result["launch"])
                rows.append((mode, clients, result["peak"] / GIB, per_1000, start, first))
    print(
        "| mode | clients | peak memory of the tree (GiB) | s per 1,000 updates | start-up s "
        "| first update s after the run's start / the launch |"
    )
    print("| --- | --- | --- | --- | --- | --- |")
    for mode, clients, peak, per_1000, start, (run, launch) in rows:
        print(
            f"| {mode} | {clients:,} | {peak:.2f} | {per_1000:.1f} | {start:.1f} "
            f"| {run:.1f} / {launch:.1f} |"
        )
    for mode in args.modes.split(","):
        mine = [r for r in rows if r[0] == mode]
        if len(mine) > 1:
            low, high = mine[0], mine[-1]
            print(
                f"{mode}: {high[1] // low[1]}x the clients cost {high[2] / low[2]:.2f}x the memory "
                f"and {high[3] / low[3]:.2f}x the seconds per 1,000 updates"
            )


if __name__ == "__main__":
    main()
