"""Where the time of one message goes in Flower simulation, one ClientApp at a time, against
the bare loop on the same core (issue 48, part 3).

    python -m bench.sim_overhead [--model lenet] [--updates 60]

One config (FedBuff with K = 1 on Fashion-MNIST, 10 clients, one task in flight, one torch
thread per client, `max-updates` updates, one evaluation at the end), run three ways in one
invocation: the bare loop (`local_train` on the same clients' data, one task after another),
`fedstale run --local` on one worker, and `fedstale run` in Flower simulation with one
ClientApp (`client-resources-num-cpus=1`). For each run, per update: the wall time over the
engine's loop, the client's compute (what the ClientApp's train handler measured, from
loading the task to its reply), the engine's own parts (dispatch, pull, handle, aggregate,
evaluate: fedstale's server side) and the rest of the time the engine waited for the reply
(`idle` minus compute: in simulation, Flower's path from the ServerApp's push through the
SuperLink, the simulation engine and the ClientApp's message handling, and back).
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from math import isnan, nan
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
from bench.throughput import bare_rate, local_summary  # noqa: E402
from fedstale.launcher.launch import parse_pairs, tool  # noqa: E402
from tests.flower_procs import CONNECTION, SimulationSuperLink  # noqa: E402

PARTS = ("dispatch", "pull", "handle", "aggregate", "evaluate")


def config_for(model: str, updates: int) -> str:
    return (
        f"model={model} num-clients=10 concurrency=1 buffer-size=1 max-updates={updates} "
        "max-virtual-time=0 eval-interval=1e9 client-threads=1 progress-interval=600 "
        "node-partitions=assign"
    )


def simulation_summary(config: str, workdir: Path) -> dict[str, Any]:
    import subprocess

    link = SimulationSuperLink(workdir / "flwr-home").start()
    try:
        command = [tool("fedstale"), "run", "--app", str(ROOT), "--superlink", CONNECTION]
        command += ["--federation-config", "client-resources-num-cpus=1", "--run-config"]
        command += [f"{config} run-name=sim runs-dir={workdir / 'runs'}"]
        done = subprocess.run(command, env=link.env, capture_output=True, text=True, timeout=1800)
        if done.returncode != 0:
            raise SystemExit(f"the simulation run failed:\n{done.stderr[-3000:]}")
    finally:
        link.stop()
    return json.loads((workdir / "runs" / "sim" / "summary.json").read_text())


def breakdown(summary: dict[str, Any]) -> dict[str, float]:
    """Milliseconds per update of the run's loop: wall, client compute, the engine's parts,
    and the wait beyond the client's compute."""
    updates = max(summary["updates_accepted"], 1)
    parts = summary["engine_seconds"]
    row = {
        "wall": 1000 * summary["loop_seconds"] / updates,
        "client compute": 1000 * summary["client_compute_seconds"] / updates,
    }
    row.update({part: 1000 * parts.get(part, 0.0) / updates for part in PARTS})
    # In-process (`--local`) the client trains inside `dispatch` and the loop never waits:
    # no wait to split (nan, shown as "-").
    idle = parts.get("idle", 0.0)
    row["waited beyond compute"] = 1000 * idle / updates - row["client compute"] if idle else nan
    return row


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="lenet")
    parser.add_argument("--updates", type=int, default=60)
    options = parser.parse_args(argv)
    config = config_for(options.model, options.updates)
    with tempfile.TemporaryDirectory() as tmp:
        workdir = Path(tmp)
        bare = 1000 / bare_rate(parse_pairs(config), options.updates)
        rows = {
            "--local, 1 worker": breakdown(local_summary(config, workdir / "local", 1)),
            "Flower simulation, 1 ClientApp": breakdown(simulation_summary(config, workdir)),
        }
    columns = ["wall", "client compute", *PARTS, "waited beyond compute"]
    print(f"| {options.model}, ms per update | x bare loop | {' | '.join(columns)} |")
    print("| --- " * (len(columns) + 2) + "|")
    print(f"| bare loop | 1.00 | {bare:.1f} |" + " - |" * (len(columns) - 1))
    for label, row in rows.items():
        cells = " | ".join("-" if isnan(row[c]) else f"{row[c]:.1f}" for c in columns)
        print(f"| {label} | {bare / row['wall']:.2f} | {cells} |")


if __name__ == "__main__":
    main()
