"""Does per-client evaluation starve training on a real network? Training tasks per minute
of PACE (every client's personalised model scored on its own held-out split) against
FedBuff's (the global model scored on the server), each on its own local deployment of 5
SuperNodes (`flower-superlink` + `flower-supernode` processes on 127.0.0.1), wall clock,
digits, an evaluation every 10 s.

    python -m bench.eval_starvation [--seconds 300] [--nodes 5] [--fresh]

Target: PACE's tasks per minute >= 0.8x FedBuff's. Before per-client scores came back in
train replies, every evaluation sent an evaluate message to every client (each a new
ClientApp process of about 5.5 s here), and PACE dispatched 31 training tasks in 405 s
against FedBuff's 105 in 420 s (0.30x). Resumable: each finished run is kept in
bench/results/eval-starvation.json (`--fresh` runs both again).
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from pathlib import Path
from typing import Any

from fedstale.launcher.deploy import LocalDeployment
from fedstale.server_app.results import read_jsonl

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "bench" / "results" / "eval-starvation.json"
COMMON = {"dataset": "digits", "lr": 0.1, "test-split": "local", "client-val-fraction": 0.25}
STRATEGIES = {"fedbuff": {"strategy": "fedbuff"}, "pace": {"strategy": "pace"}}


def measure(name: str, config: dict[str, Any], nodes: int, seconds: float) -> dict[str, Any]:
    """One run on a fresh deployment; what it dispatched and evaluated per wall minute."""
    with tempfile.TemporaryDirectory(prefix="eval-starvation-") as work:
        runs = Path(work) / "runs"
        values = {**COMMON, **config, "eval-interval": 10.0, "max-virtual-time": seconds}
        values |= {"runs-dir": str(runs), "run-name": name}
        started = time.monotonic()
        with LocalDeployment(Path(work) / "home", nodes) as deployment:
            result = deployment.run_app(ROOT, values, timeout=seconds + 600)
        elapsed = time.monotonic() - started
        summary_file = runs / name / "summary.json"
        if result.returncode != 0 or not summary_file.is_file():
            raise RuntimeError(f"{name} failed:\n{result.stderr[-2000:]}")
        summary = json.loads(summary_file.read_text())
        rows = read_jsonl(runs / name / "metrics.jsonl")
    minutes = summary["wall_seconds"] / 60
    return {
        "nodes": nodes,
        "budget_seconds": seconds,
        "wall_seconds": summary["wall_seconds"],
        "elapsed_seconds": round(elapsed, 1),
        "tasks_dispatched": summary["tasks_dispatched"],
        "tasks_superseded": summary.get("tasks_superseded", 0),
        "updates_accepted": summary["updates_accepted"],
        "tasks_per_minute": summary["tasks_dispatched"] / minutes,
        "updates_per_minute": summary["updates_accepted"] / minutes,
        "evaluations": len(rows),
        "scores_from_train_replies": sum(row.get("from_train_replies", 0) for row in rows),
        "scores": sum(row.get("clients", 0) for row in rows),
        "final_accuracy": summary["final_accuracy"],
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seconds", type=float, default=300.0, help="wall budget of a run")
    parser.add_argument("--nodes", type=int, default=5)
    parser.add_argument("--fresh", action="store_true", help="forget the stored runs")
    args = parser.parse_args(argv)
    done: dict[str, Any] = {}
    if RESULTS.is_file() and not args.fresh:
        done = json.loads(RESULTS.read_text())
    for name, config in STRATEGIES.items():
        if name not in done:
            print(f"{name}: {args.nodes} SuperNodes, {args.seconds:g} s ...", flush=True)
            done[name] = measure(name, config, args.nodes, args.seconds)
            RESULTS.write_text(json.dumps(done, indent=1) + "\n")
        row = done[name]
        print(
            f"{name:8} {row['tasks_dispatched']:4d} tasks in {row['wall_seconds']:.0f} s: "
            f"{row['tasks_per_minute']:.1f} tasks/min, {row['updates_per_minute']:.1f} "
            f"updates/min; {row['scores_from_train_replies']} of {row['scores']} client "
            f"scores from train replies"
        )
    if {"pace", "fedbuff"} <= set(done):
        ratio = done["pace"]["tasks_per_minute"] / done["fedbuff"]["tasks_per_minute"]
        print(f"PACE / FedBuff tasks per minute: {ratio:.2f}x (target >= 0.8x)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
