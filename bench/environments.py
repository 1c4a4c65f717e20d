"""fedstale where its users are, as one command: each environment of tests/environments.py
made as a user makes it (their Python, their torch and numpy from PyPI first, then the
wheel), and every door run there; and, with --flwr-nightly, the engine, both doors and
the deployment path against Flower's next release.

    python -m bench.environments [--only py312-torch2.11,...] [--out runs/environments]
    python -m bench.environments --flwr-nightly [--nightly 1.43.0.dev20261026]

Per environment, one row: the versions found, what installing the wheel changed (nothing,
for torch and numpy), and the seconds of each step: the user's torch, the wheel, `fedstale
run --local`, `fedstale run` in Flower simulation, the quickstart's library door (and
`model=resnet18` where torchvision is installed). Rows go to OUT/results.jsonl and a
markdown table to OUT/summary.md; each virtualenv is removed after its row (about 5 GB).

--flwr-nightly makes a virtualenv from this checkout (the CPU torch 2.13.0, fedstale
editable), puts flwr-nightly in place of flwr, and runs the tests that drive Flower's API
against it: the paused-SuperLink test, the deployments (TLS and auth, killed nodes, MAFSA's
edges), both library doors, simulation, central DP. It prints pytest's closing line; its
log goes to OUT/nightly.log.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
from tests.environments import (  # noqa: E402
    ENVIRONMENTS,
    make,
    run_local,
    run_quickstart,
    run_simulation,
    versions,
)
from tests.wheel_env import build_wheel, run  # noqa: E402

NIGHTLY = "1.43.0.dev20261026"
NIGHTLY_TESTS = (
    "tests/test_slow_superlink.py",
    "tests/test_deployment.py",
    "tests/test_library.py",
    "tests/test_library_mods.py",
    "tests/test_simulation.py",
    "tests/test_mafsa.py",
    "tests/test_central_dp.py",
    "tests/test_architecture.py",
)


def timed(seconds: dict[str, float], step: str, work: Any) -> Any:
    start = time.monotonic()
    result = work()
    seconds[step] = round(time.monotonic() - start, 1)
    return result


def measure(name: str, wheel: Path, work: Path) -> dict[str, Any]:
    environment = ENVIRONMENTS[name]
    if environment.interpreter() is None:
        return {"environment": name, "skipped": f"no Python {environment.python}"}
    folder = work / name
    here = folder / "elsewhere"
    try:
        made = make(environment, wheel, folder / "venv")
        seconds = {k: round(v, 1) for k, v in made.seconds.items()}
        here.mkdir(parents=True)
        bin_dir = made.bin_dir
        local = timed(seconds, "--local", lambda: run_local(bin_dir, here))
        sim = timed(seconds, "simulation", lambda: run_simulation(bin_dir, here, folder / "h"))
        door = folder / "door"
        door.mkdir()
        quickstart = ROOT / "examples" / "async-quickstart"
        library = timed(
            seconds, "library", lambda: run_quickstart(bin_dir, quickstart, door, folder / "hd")
        )
        row: dict[str, Any] = {
            "environment": name,
            "found": versions(bin_dir),
            "changed": made.changed(),
            "seconds": seconds,
            "accepted": [local["updates_accepted"], sim["updates_accepted"]],
            "same_result": local["final_accuracy"] == sim["final_accuracy"],
            "library_versions": library["versions"],
        }
        if "torchvision" in " ".join(environment.pins):
            extra = "model=resnet18 local-steps=1 max-updates=4"
            resnet = timed(seconds, "resnet18", lambda: run_local(bin_dir, here, extra, "rn"))
            row["resnet18_accepted"] = resnet["updates_accepted"]
        return row
    finally:
        shutil.rmtree(folder, ignore_errors=True)


def table(rows: list[dict[str, Any]]) -> str:
    lines = [
        "| environment | python | torch (CUDA build) | numpy | flwr | changed by the wheel "
        "| user's torch s | wheel s | --local s | simulation s | library s |",
        "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for row in rows:
        if "skipped" in row:
            lines.append(f"| {row['environment']} | {row['skipped']} |" + " |" * 9)
            continue
        found, seconds = row["found"], row["seconds"]
        changed = ", ".join(f"{k} {a}->{b}" for k, (a, b) in row["changed"].items()) or "nothing"
        cuda = "yes" if found["cuda_build"] else "no"
        users_torch = seconds["user's torch"]
        lines.append(
            f"| {row['environment']} | {found['python']} | {found['torch']} ({cuda}) | "
            f"{found['numpy']} | {found['flwr']} | {changed} | {users_torch} | "
            f"{seconds['fedstale wheel']} | {seconds['--local']} | {seconds['simulation']} | "
            f"{seconds['library']} |"
        )
    return "\n".join(lines) + "\n"


def nightly(out: Path, version: str) -> int:
    """The tests that drive Flower, against flwr-nightly `version`; pytest's exit code."""
    venv = out / "venv-nightly"
    python = venv / "bin" / "python"
    run([sys.executable, "-m", "venv", venv], 120)
    run([python, "-m", "pip", "install", "-q", "torch==2.13.0"], 1200)
    run([python, "-m", "pip", "install", "-q", "-e", f"{ROOT}[dev]"], 1200)
    # flwr-nightly installs the same `flwr` package under another name: flwr's files first go
    run([python, "-m", "pip", "uninstall", "-q", "-y", "flwr"], 300)
    run([python, "-m", "pip", "install", "-q", f"flwr-nightly[simulation]=={version}"], 1200)
    path = f"{venv / 'bin'}:{os.environ.get('PATH', '')}"
    env = {**os.environ, "PATH": path, "FLWR_DISABLE_RUNTIME_DEPENDENCY_INSTALLATION": "1"}
    command = [python, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-n", "2"]
    command += ["--dist", "loadgroup", "-k", "not lower", *NIGHTLY_TESTS]
    with open(out / "nightly.log", "w") as log:
        done = subprocess.run(
            [str(c) for c in command],
            cwd=ROOT,
            env=env,
            stdout=log,
            stderr=subprocess.STDOUT,
            timeout=5400,
            check=False,
        )
    closing = (out / "nightly.log").read_text().strip().splitlines()[-1:]
    print(f"flwr-nightly {version}: {closing[0] if closing else '(no output)'}")
    shutil.rmtree(venv, ignore_errors=True)
    return done.returncode


def main(argv: list[str] | None = None) -> int:
    parse = argparse.ArgumentParser(prog="python -m bench.environments", description=__doc__)
    parse.add_argument("--only", default=",".join(ENVIRONMENTS), help="environments, by name")
    parse.add_argument("--out", type=Path, default=ROOT / "runs" / "environments")
    parse.add_argument("--flwr-nightly", action="store_true", help="run against the nightly")
    parse.add_argument("--nightly", default=NIGHTLY, help="flwr-nightly version (%(default)s)")
    args = parse.parse_args(argv)
    names = [n for n in args.only.split(",") if n]
    unknown = [n for n in names if n not in ENVIRONMENTS]
    if unknown:
        print(
            f"bench.environments: unknown environment {unknown[0]!r}; choose from "
            f"{', '.join(ENVIRONMENTS)}",
            file=sys.stderr,
        )
        return 2
    args.out.mkdir(parents=True, exist_ok=True)
    if args.flwr_nightly:
        return nightly(args.out, args.nightly)
    rows = []
    with tempfile.TemporaryDirectory(prefix="fedstale-env-") as work:
        wheel = build_wheel(Path(work) / "dist")
        for name in names:
            row = measure(name, wheel, Path(work))
            rows.append(row)
            with open(args.out / "results.jsonl", "a") as results:
                results.write(json.dumps(row) + "\n")
            print(json.dumps(row), flush=True)
    summary = table(rows)
    (args.out / "summary.md").write_text(summary)
    print(summary)
    return 0


if __name__ == "__main__":
    sys.exit(main())
