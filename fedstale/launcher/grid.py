"""`fedstale run --local --seeds 0,1,2 --grid "strategy=fedbuff,fedasync"`: the runs of a
grid in one process, their waiting tasks trained together.

Each run keeps its own engine, virtual clock, folder and results; whenever every run still
going waits for replies it lacks, their waiting tasks train as one cohort (one batched
computation per model architecture: fedstale/launcher/inprocess.py `CohortPool`). A task's
inputs are fixed when it is sent, so each run's results are those of its solo run with
`trainer=cohort` (equal up to float summation order), and the cohorts are about as many
times larger as there are runs.

The runs are named `<run-name>-<key>=<value>...` (run-name defaults to `grid`), so the same
command finds them again: a run that finished with the same settings is skipped, one that
stopped with a checkpoint resumes from it, and the rest start. The command exits 0 when every
run has its summary.
"""

from __future__ import annotations

import itertools
import json
import re
import sys
import threading
import time
from pathlib import Path
from typing import Any

from fedstale.common.config import ConfigError, RunConfig
from fedstale.launcher.launch import (
    PAIR,
    app_defaults,
    parse_pairs,
    preflight,
    report,
    resolve,
)
from fedstale.server_app.checkpoint import CHECKPOINT_FILE, first_difference
from fedstale.server_app.results import runs_root

GRID_BASE = "grid"  # the runs' name prefix when the config names no run


def parse_axes(grid: str, seeds: str) -> dict[str, list[Any]]:
    """`--grid "k=v1,v2 k2=w1"` and `--seeds 0,1,2` as axes (key -> values, in order), or one
    ConfigError line."""
    axes: dict[str, list[Any]] = {}
    items = [*([("seed", seeds)] if seeds else []), *PAIR.findall(grid or "")]
    for key, raw in items:
        if key in axes:
            raise ConfigError(f"--grid: '{key}' is given twice; give each key's values once")
        values = [parse_pairs(f"{key}={part}")[key] for part in raw.split(",") if part]
        if not values:
            raise ConfigError(f"--grid: '{key}' has no values; write {key}=v1,v2")
        axes[key] = values
    leftover = PAIR.sub("", grid or "").strip()
    if leftover:
        raise ConfigError(f"--grid: cannot read '{leftover}'; write key=v1,v2 pairs")
    if "run-name" in axes or "resume-from" in axes:
        raise ConfigError("--grid: run-name and resume-from are set per run by the grid")
    return axes


def grid_runs(pairs: dict[str, Any], axes: dict[str, list[Any]]) -> list[dict[str, Any]]:
    """Each combination's pairs over `pairs`, with its run-name; the combinations in order
    (the last axis varying fastest), every one a `trainer=cohort` run."""
    base = str(pairs.get("run-name") or GRID_BASE)
    runs = []
    for values in itertools.product(*axes.values()):
        combination = dict(zip(axes, values, strict=True))
        label = "-".join(f"{key}={name_part(value)}" for key, value in combination.items())
        name = f"{base}-{label}" if label else base
        runs.append({**pairs, **combination, "trainer": "cohort", "run-name": name})
    return runs


def name_part(value: Any) -> str:
    """A value as it can stand in a folder name."""
    text = str(value).lower() if isinstance(value, bool) else str(value)
    return re.sub(r"[^A-Za-z0-9._:+=-]", "_", text)


def finished_alike(folder: Path, settings: dict[str, Any]) -> bool:
    """Whether `folder` holds a finished run of these settings (then the grid skips it); a
    finished run of other settings refuses the grid in one line."""
    if not (folder / "summary.json").is_file() or not (folder / "config.json").is_file():
        return False
    saved = json.loads((folder / "config.json").read_text(encoding="utf-8"))
    key = first_difference(saved, settings)
    if key is not None:
        raise ConfigError(
            f"--grid: {folder} holds a finished run with {key}={saved.get(key)!r}, this "
            f"grid's has {settings[key]!r}; give the grid another run-name, or pass "
            "--overwrite to move the earlier runs aside"
        )
    return True


def plan(app: Path, runs: list[dict[str, Any]]) -> tuple[list[tuple[RunConfig, Any]], list[str]]:
    """Every run preflighted (one ConfigError line naming the run that fails): the runs to
    start or resume, and the names of those already finished (skipped)."""
    from fedstale.server_app.experiment import settings_of
    from fedstale.strategies.registry import load_config

    todo, done = [], []
    for pairs in runs:
        name = pairs["run-name"]
        try:
            run, extra = resolve(app, pairs)
            folder = runs_root(run.runs_dir) / name
            _, params = load_config({**app_defaults(app), **pairs, **extra})
            if not run.overwrite and finished_alike(folder, settings_of(run, params, name)):
                done.append(name)
                continue
            if not run.overwrite and (folder / CHECKPOINT_FILE).is_file():
                pairs = {**pairs, "resume-from": str(folder)}
            run, params, _ = preflight(app, pairs)
        except ConfigError as err:
            raise ConfigError(f"grid run {name}: {err}") from err
        todo.append((run, params))
    return todo, done


def run_grid(app: Path, pairs: dict[str, Any], axes: dict[str, list[Any]]) -> int:
    """The grid's runs in this process, in threads taking turns (see the module's doc)."""
    from fedstale.launcher.local import cohort_pool
    from fedstale.server_app.app import setup_logging

    todo, done = plan(app, grid_runs(pairs, axes))
    setup_logging()
    for name in done:
        print(f"fedstale: {name}: finished earlier, skipped", file=sys.stderr)
    print(
        f"fedstale: {len(todo)} runs of the grid in this process, their waiting tasks trained "
        f"together ({len(done)} finished earlier)",
        file=sys.stderr,
    )
    pool = cohort_pool()
    started = time.time()
    failures = run_together(todo, pool)
    return grid_report([run for run, _ in todo], done, failures, started, pool.sizes)


def run_together(runs: list[tuple[RunConfig, Any]], pool: Any) -> dict[str, str]:
    """Each run (its config and rule keys) in a thread of its own, taking turns on `pool`
    (inprocess.py CohortPool); returns what failed, by run name. Ctrl-C or SIGTERM stops
    every run at its next wait, each with its folder and checkpoint."""
    from fedstale.launcher.local import cohort_transport

    failures: dict[str, str] = {}

    def one(run: RunConfig, params: Any, transport: Any) -> None:
        try:
            on_pool(run, params, transport, pool)
        except KeyboardInterrupt:
            failures[run.run_name] = "interrupted"
        except Exception as err:  # one run's failure ends that run, not the others
            failures[run.run_name] = f"{type(err).__name__}: {err}"

    threads = []
    for run, params in runs:
        transport = cohort_transport(run, pool)
        threads.append(
            threading.Thread(target=one, args=(run, params, transport), name=run.run_name)
        )
    for thread in threads:
        thread.start()
    try:
        for thread in threads:
            while thread.is_alive():
                thread.join(0.5)
    except (KeyboardInterrupt, SystemExit):  # Ctrl-C, or SIGTERM (cli.stop_on_sigterm)
        print("fedstale: interrupted: every run stops at its next wait", file=sys.stderr)
        pool.cancel()
        for thread in threads:
            thread.join()
    for thread in threads:
        wait_until_gone(thread)
    return failures


def wait_until_gone(thread: threading.Thread, limit: float = 5.0) -> None:
    """Wait until a joined thread's OS thread has ended (Linux). `join` returns once its Python
    code is done, while the thread may still run torch's thread-local destructors; a process
    that then exited raced them and aborted ("terminate called without an active exception")
    after a grid stopped by SIGTERM."""
    task = Path(f"/proc/self/task/{thread.native_id}")
    deadline = time.monotonic() + limit
    while thread.native_id is not None and task.exists() and time.monotonic() < deadline:
        time.sleep(0.01)


def on_pool(run: RunConfig, params: Any, transport: Any, pool: Any) -> dict[str, Any]:
    """One run of a grid, in its thread: its engine while it holds `pool`'s turn; its summary."""
    from fedstale.server_app.experiment import run_experiment

    with pool.turn(transport):
        return run_experiment(run, params, transport, label=run.run_name)


def grid_report(
    runs: list[RunConfig],
    done: list[str],
    failures: dict[str, str],
    started: float,
    sizes: list[int],
) -> int:
    """A closing line per run and one for the grid; 0 when every run has its summary."""
    failed = 0
    for run in runs:
        folder = runs_root(run.runs_dir) / run.run_name
        why = failures.get(run.run_name, "no summary.json")
        saved = (folder / CHECKPOINT_FILE).is_file()
        resume = " (rerun the same command to resume it)" if saved else ""
        failed += report(run, folder, started, f"fedstale: {run.run_name} failed: {why}{resume}")
    mean = sum(sizes) / len(sizes) if sizes else 0.0
    print(
        f"fedstale: grid: {len(runs) - failed} of {len(runs)} runs finished here, {len(done)} "
        f"earlier; {len(sizes)} cohorts, mean {mean:.1f} tasks, largest {max(sizes, default=0)}",
        file=sys.stderr,
    )
    return 1 if failed else 0
