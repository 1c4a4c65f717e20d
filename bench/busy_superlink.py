"""Finished client work on a busy SuperLink: FedBuff on digits over 5 real SuperNodes
(`flower-superlink` + `flower-supernode` processes on 127.0.0.1, wall clock), 200 updates,
with and without a bounded CPU hog beside the SuperLink, at both ends of the flwr range.

    python -m bench.busy_superlink [--updates 200] [--nodes 5] [--hogs 2]
                                   [--lower-venv DIR] [--fresh]

The hog: `--hogs` processes spinning at normal priority from the moment the SuperLink is up
until the run ends (killed with it, and by `timeout` past the run's limit). Per run:
trainings lost (tasks written off, late replies refused), counted twice (a task id twice in
updates.jsonl), late replies taken, overlapping pulls whose error reply was dropped (the
race of a slow SuperLink), and training tasks dispatched per minute of the run's loop; the
table gives each hogged run's tasks per minute as a ratio of the same flwr's run without.
flwr 1.42 is this environment's; 1.41 runs from the virtualenv at --lower-venv (made there
with CPU torch, flwr 1.41.0, numpy 1.26.4 and this checkout, when it does not exist).
Resumable: each finished run is kept in bench/results/busy-superlink.json.
"""

from __future__ import annotations

import argparse
import json
import re
import subprocess
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path
from typing import Any

from fedstale.launcher.deploy import LocalDeployment, stop
from fedstale.server_app.results import read_jsonl

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "bench" / "results" / "busy-superlink.json"
LOWER_PINS = ["flwr[simulation]==1.41.0", "numpy==1.26.4"]
CONFIG = {"dataset": "digits", "lr": 0.1, "buffer-size": 5, "eval-interval": 30.0}
RUN_LIMIT = 3600.0
HOG = "while True: pass"


def ensure_lower_venv(venv: Path) -> Path:
    """The bin folder of a virtualenv with flwr 1.41.0 and this checkout, made if missing."""
    python = venv / "bin" / "python"
    if not python.exists():
        print(f"making {venv} (CPU torch, {', '.join(LOWER_PINS)}) ...", flush=True)
        subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True)
        pip = [str(python), "-m", "pip", "install", "-q"]
        subprocess.run([*pip, "torch==2.13.0"], check=True)
        subprocess.run([*pip, "-e", str(ROOT), *LOWER_PINS], check=True)
    return venv / "bin"


def flwr_version(bin_dir: Path | None) -> str:
    python = str(bin_dir / "python") if bin_dir else sys.executable
    code = "import importlib.metadata as m; print(m.version('flwr'))"
    return subprocess.run([python, "-c", code], capture_output=True, text=True).stdout.strip()


def hogs(count: int) -> list[subprocess.Popen]:
    limit = str(int(RUN_LIMIT + 60))
    command = ["timeout", limit, sys.executable, "-c", HOG]
    return [subprocess.Popen(command, start_new_session=True) for _ in range(count)]


def measure(bin_dir: Path | None, nodes: int, updates: int, hog_count: int) -> dict[str, Any]:
    """One run on a fresh deployment, with `hog_count` spinning processes beside it."""
    with tempfile.TemporaryDirectory(prefix="busy-superlink-") as work:
        runs, log = Path(work) / "runs", Path(work) / "run.log"
        values = {**CONFIG, "max-updates": updates, "max-virtual-time": RUN_LIMIT}
        values |= {"runs-dir": str(runs), "run-name": "busy"}
        spinning: list[subprocess.Popen] = []
        with LocalDeployment(Path(work) / "home", nodes, bin_dir=bin_dir) as deployment:
            try:
                spinning = hogs(hog_count)
                process = deployment.launch_app(ROOT, values, log)
                code = process.wait(RUN_LIMIT + 300)
            finally:
                for hog in spinning:
                    stop(hog, grace=2)
        output = log.read_text()
        if code != 0 or not (runs / "busy" / "summary.json").is_file():
            raise RuntimeError(f"run failed ({code}):\n{output[-2000:]}")
        summary = json.loads((runs / "busy" / "summary.json").read_text())
        tasks = [row["task"] for row in read_jsonl(runs / "busy" / "updates.jsonl")]
    minutes = summary["loop_seconds"] / 60
    refused = sum(summary["late_refused"].values())
    return {
        "nodes": nodes,
        "hogs": hog_count,
        "updates_accepted": summary["updates_accepted"],
        "tasks_dispatched": summary["tasks_dispatched"],
        "lost": summary["tasks_lost"] + refused,
        "counted_twice": sum(n - 1 for n in Counter(tasks).values()),
        "late": summary["updates_late"],
        "rejected": summary["updates_rejected"],
        "overlapping_pulls": len(re.findall(r"an overlapping pull's error reply", output)),
        "loop_seconds": round(summary["loop_seconds"], 1),
        "tasks_per_minute": round(summary["tasks_dispatched"] / minutes, 2),
        "final_accuracy": summary["final_accuracy"],
    }


def table(done: dict[str, Any]) -> str:
    head = "| flwr | hog | updates | lost | twice | late | overlaps | tasks/min | vs no hog |"
    lines = [head, "|" + " --- |" * 9]
    for key, row in sorted(done.items()):
        flwr = key.split("/")[0]
        calm = done.get(f"{flwr}/0")
        ratio = f"{row['tasks_per_minute'] / calm['tasks_per_minute']:.2f}x" if calm else "-"
        lines.append(
            f"| {flwr} | {row['hogs']} | {row['updates_accepted']} | {row['lost']} | "
            f"{row['counted_twice']} | {row['late']} | {row['overlapping_pulls']} | "
            f"{row['tasks_per_minute']:.1f} | {ratio} |"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--updates", type=int, default=200)
    parser.add_argument("--nodes", type=int, default=5)
    parser.add_argument("--hogs", type=int, default=2, help="spinning processes beside it")
    parser.add_argument("--lower-venv", type=Path, default=ROOT / "runs" / ".venv-flwr-1.41")
    parser.add_argument("--fresh", action="store_true", help="forget the stored runs")
    args = parser.parse_args(argv)
    done: dict[str, Any] = {}
    if RESULTS.is_file() and not args.fresh:
        done = json.loads(RESULTS.read_text())
    environments = {"newest": None, "lower": ensure_lower_venv(args.lower_venv.resolve())}
    for bin_dir in environments.values():
        version = flwr_version(bin_dir)
        for hog_count in (0, args.hogs):
            key = f"{version}/{hog_count}"
            if key in done:
                continue
            print(f"flwr {version}, {hog_count} hogs: {args.updates} updates ...", flush=True)
            started = time.monotonic()
            done[key] = measure(bin_dir, args.nodes, args.updates, hog_count)
            RESULTS.parent.mkdir(parents=True, exist_ok=True)
            RESULTS.write_text(json.dumps(done, indent=1, sort_keys=True) + "\n")
            print(f"  {done[key]} ({time.monotonic() - started:.0f} s)", flush=True)
    print(table(done))
    return 0


if __name__ == "__main__":
    sys.exit(main())
