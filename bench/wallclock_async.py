"""Synchronous FedAvg against FedBuff on a real local deployment with heterogeneous injected
latencies, wall clock: the time each needs to reach FedAvg's final accuracy.

    python -m bench.wallclock_async [--nodes 4] [--delays 0,1,3,10] [--seconds 240]

Both runs use the same SuperLink and SuperNodes (node i sleeps delays[i] seconds after each
task), the same data (digits, IID) and the same wall-time budget. FedAvg waits for the
slowest sampled client every round; FedBuff aggregates every K = 2 arrivals. FedBuff's paper
reports 3.3x less time to a target accuracy. Prints the two times and their ratio.
"""

from __future__ import annotations

import argparse
import tempfile
from pathlib import Path

from fedstale.launcher.deploy import LocalDeployment, parse_delays
from fedstale.server_app.results import read_jsonl

ROOT = Path(__file__).resolve().parent.parent
RUN = {"dataset": "digits", "lr": 0.05, "local-epochs": 1, "eval-interval": 5.0}


def curve(deployment: LocalDeployment, work: Path, strategy: str, seconds: float) -> list[dict]:
    config = {
        **RUN,
        "strategy": strategy,
        "buffer-size": 2,
        "max-virtual-time": seconds,
        "runs-dir": str(work),
        "run-name": strategy,
    }
    result = deployment.run_app(ROOT, config, timeout=seconds + 600)
    metrics = work / strategy / "metrics.jsonl"
    if result.returncode != 0 or not metrics.is_file():
        raise RuntimeError(f"the {strategy} run failed:\n{result.stderr[-2000:]}")
    return read_jsonl(metrics)


def time_to(rows: list[dict], accuracy: float) -> float | None:
    return next((r["virtual_time"] for r in rows if r["accuracy"] >= accuracy), None)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--nodes", type=int, default=4)
    parser.add_argument("--delays", default="0,1,3,10", help="seconds per node, cycled")
    parser.add_argument("--seconds", type=float, default=240.0, help="wall budget per run")
    args = parser.parse_args()
    work = Path(tempfile.mkdtemp(prefix="fedstale-wallclock-"))
    delays = parse_delays(args.delays)
    with LocalDeployment(work / "home", args.nodes, delays) as deployment:
        fedavg = curve(deployment, work, "fedavg", args.seconds)
        fedbuff = curve(deployment, work, "fedbuff", args.seconds)
    target = fedavg[-1]["accuracy"]
    sync, buffered = time_to(fedavg, target), time_to(fedbuff, target)
    print(f"{args.nodes} SuperNodes, injected delays {delays} s, {args.seconds:g} s each")
    print(f"FedAvg final accuracy {target:.4f} (versions {fedavg[-1]['version']})")
    print(f"time to {target:.4f}: FedAvg {sync:.0f} s, FedBuff ", end="")
    if buffered is None:
        print(f"not reached (best {max(r['accuracy'] for r in fedbuff):.4f})")
    else:
        print(f"{buffered:.0f} s: {sync / max(buffered, 1e-9):.2f}x faster")


if __name__ == "__main__":
    main()
