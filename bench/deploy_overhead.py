"""Per-task overhead of a real deployment (one SuperLink, one SuperNode on 127.0.0.1), from
one run of this benchmark, on one deployment:

  (a) Flower's floor: bench/floor_app, a ClientApp that only imports torch and replies,
      sent one task at a time (push, then pull every 20 ms);
  (b) fedstale: the app with one client, concurrency 1, FedBuff with K = 1 (one task at a
      time, each handled before the next is sent); overhead = cycle - client compute;
  (c) fedstale with `prefetch=true` (a second task queued on the node), with the staleness
      it costs.

    python -m bench.deploy_overhead [--tasks 12] [--poll 0.1] [--execs flower,fork]

Each row set on its own deployment: `flower`, Flower's SuperExec (a fresh `flwr-clientapp`
per task); `fork`, fedstale's warm SuperExec (fedstale/launcher/warm_exec.py: each task
forked from a process that imported Flower and torch once).

The SuperNode runs with FLWR_SUPEREXEC_TASK_POLL_INTERVAL=--poll. Cycles skip the first task
(process caches warming). Prints the medians and fedstale's overhead above the floor.
"""

from __future__ import annotations

import argparse
import itertools
import json
import statistics
import subprocess
import tempfile
from pathlib import Path

from fedstale.launcher.deploy import CONNECTION, LocalDeployment
from fedstale.launcher.launch import to_flower, tool
from fedstale.server_app.results import read_jsonl

ROOT = Path(__file__).resolve().parent.parent
RUN = {"dataset": "digits", "buffer-size": 1, "max-virtual-time": 0.0, "eval-interval": 1e6}


def floor_cycles(deployment: LocalDeployment, tasks: int, work: Path) -> list[float]:
    out = work / "floor.json"
    command = [tool("flwr"), "run", str(ROOT / "bench" / "floor_app"), CONNECTION, "--stream"]
    command += ["--run-config", to_flower({"tasks": tasks, "out": str(out)})]
    subprocess.run(command, env=deployment.env, capture_output=True, check=False, timeout=900)
    if not out.is_file():
        raise RuntimeError(f"the floor app wrote no result; see {deployment.home}")
    return json.loads(out.read_text())["cycles"][1:]


def fedstale_cycles(
    deployment: LocalDeployment, tasks: int, work: Path, name: str, **extra: object
) -> tuple[list[float], float, float]:
    """(cycles between handled updates, mean client compute, mean staleness)."""
    config = {**RUN, "max-versions": tasks, "runs-dir": str(work), "run-name": name, **extra}
    result = deployment.run_app(ROOT, config, timeout=900)
    summary_file = work / name / "summary.json"
    if result.returncode != 0 or not summary_file.is_file():
        raise RuntimeError(f"the fedstale run failed:\n{result.stderr[-2000:]}")
    summary = json.loads(summary_file.read_text())
    rows = read_jsonl(work / name / "updates.jsonl")
    times = [row["time"] for row in rows]
    cycles = [b - a for a, b in itertools.pairwise(times)][1:]
    compute = summary["client_compute_seconds"] / summary["updates_accepted"]
    staleness = statistics.mean(row["staleness"] for row in rows)
    return cycles, compute, staleness


def measure(work: Path, tasks: int, poll: float, clientapp_exec: str) -> None:
    """Rows (a)-(c) on one deployment whose SuperNode starts its tasks the given way."""
    home = work / f"home-{clientapp_exec}"
    deployment = LocalDeployment(home, 1, task_poll_interval=poll, clientapp_exec=clientapp_exec)
    with deployment:
        floor = statistics.median(floor_cycles(deployment, tasks, work))
        cycles, compute, _ = fedstale_cycles(deployment, tasks, work, f"plain-{clientapp_exec}")
        ahead, ahead_compute, staleness = fedstale_cycles(
            deployment, tasks, work, f"prefetch-{clientapp_exec}", prefetch=True
        )
    plain = statistics.median(cycles) - compute
    prefetched = statistics.median(ahead) - ahead_compute
    print(f"--clientapp-exec {clientapp_exec}:")
    print(f"(a) Flower floor (import torch, reply):   {floor:.2f} s per task")
    print(
        f"(b) fedstale overhead (cycle - compute):  {plain:.2f} s per task "
        f"(cycle {statistics.median(cycles):.2f} s, compute {compute:.2f} s)"
    )
    print(
        f"    fedstale above the floor:             {plain - floor:+.2f} s "
        f"(ratio {plain / floor:.3f})"
    )
    print(
        f"(c) with prefetch:                        {prefetched:.2f} s per task "
        f"(cycle {statistics.median(ahead):.2f} s), mean staleness {staleness:.2f} "
        f"versions (0 without)",
        flush=True,
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tasks", type=int, default=12)
    parser.add_argument("--poll", type=float, default=0.1, help="SuperExec task poll, seconds")
    parser.add_argument(
        "--execs", default="flower,fork", help="how the SuperNode starts tasks, one row set each"
    )
    args = parser.parse_args()
    work = Path(tempfile.mkdtemp(prefix="fedstale-deploy-bench-"))
    print(f"SuperExec task poll {args.poll:g} s, {args.tasks} tasks each, 1 SuperNode")
    for clientapp_exec in args.execs.split(","):
        measure(work, args.tasks, args.poll, clientapp_exec)


if __name__ == "__main__":
    main()
