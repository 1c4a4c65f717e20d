"""What every paper reproduction in bench/ shares: a grid of runs, run a few at a time in
worker processes (one core each) and resumable (results.jsonl keeps every finished run),
and the table helpers."""

from __future__ import annotations

import itertools
import json
import math
import multiprocessing
import sys
import threading
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

Runner = Callable[["Job", str], dict[str, Any]]  # (job, runs dir) -> its result


@dataclass(frozen=True)
class Job:
    name: str
    labels: dict[str, Any]
    config: dict[str, Any]


def grid(
    suite: str,
    name: Callable[..., str],
    axes: dict[str, Iterable[Any]],
    config: Callable[..., dict],
    seeds: int,
) -> list[Job]:
    """One job per combination of the axes' values and seed; `name` and `config` see them."""
    jobs = []
    for values in itertools.product(*axes.values(), range(seeds)):
        labels = dict(zip([*axes, "seed"], values, strict=True))
        settings = {**config(**labels), "seed": labels["seed"]}
        jobs.append(Job(name(**labels), {"suite": suite, **labels}, settings))
    return jobs


def done_results(out: Path) -> dict[str, dict[str, Any]]:
    """Run name -> result, of every run results.jsonl already holds."""
    path = out / "results.jsonl"
    if not path.exists():
        return {}
    return {r["name"]: r for r in map(json.loads, path.read_text().splitlines())}


def finished(jobs: list[Job], out: Path) -> list[dict[str, Any]]:
    done = done_results(out)
    return [done[job.name] for job in jobs if job.name in done]


def one_core() -> None:
    """A worker's torch and BLAS threads: one, as the worker has one core."""
    import torch
    from threadpoolctl import threadpool_limits

    torch.set_num_threads(1)
    threadpool_limits(1)


_shared = threading.local()  # the CohortPool of `run_all(together=True)`'s threads


class Together:
    """`run_all(together=True)`'s stand-in for a process pool: each job in a thread of this
    process, every run on one CohortPool (fedstale/launcher/inprocess.py), so the waiting
    tasks of all of them train as one cohort (`fedstale run --local --grid`)."""

    def __init__(self) -> None:
        from fedstale.launcher.local import cohort_pool

        self.pool = cohort_pool()

    def __enter__(self) -> Together:
        return self

    def __exit__(self, *exc: object) -> None:
        if exc[0] is not None:
            self.pool.cancel()

    def apply_async(self, runner: Runner, args: tuple[Job, str]) -> Any:
        from concurrent.futures import Future

        future: Future = Future()

        def work() -> None:
            _shared.pool = self.pool
            try:
                future.set_result(runner(*args))
            except BaseException as err:
                future.set_exception(err)

        threading.Thread(target=work, name=args[0].name, daemon=True).start()
        future.get = future.result  # type: ignore[attr-defined]  # as AsyncResult.get
        return future


def run_all(
    jobs: list[Job], runner: Runner, out: Path, workers: int, together: bool = False
) -> list[dict[str, Any]]:
    """Run the jobs results.jsonl lacks with `runner` (a picklable top-level function or a
    functools.partial of one) on `workers` processes, or all in this process with their
    tasks trained together (`together`: every run with trainer=cohort); print progress with
    an ETA; every job's result, in order."""
    from fedstale.launcher.cli import stop_on_sigterm

    stop_on_sigterm()  # a `kill` unwinds through the pool's exit, which stops its workers
    done_path = out / "results.jsonl"
    done = done_results(out)  # resume: keep what an earlier invocation finished
    todo = [job for job in jobs if job.name not in done]
    started = time.monotonic()
    context = multiprocessing.get_context("spawn")
    failed: list[str] = []
    seconds: list[float] = []  # the own time of each run finished in this invocation
    runners = Together() if together else context.Pool(workers, initializer=one_core)
    with runners as pool, done_path.open("a") as sink:
        pending = [pool.apply_async(runner, (job, str(out / "runs"))) for job in todo]
        for index, (job, handle) in enumerate(zip(todo, pending, strict=True), 1):
            try:
                result = handle.get()
            except Exception as err:  # one job's failure must not cost the others' runs
                failed.append(job.name)
                print(f"[{index}/{len(pending)}] {job.name}: failed: {err}", flush=True)
                continue
            sink.write(json.dumps(result) + "\n")
            sink.flush()
            done[result["name"]] = result
            elapsed = time.monotonic() - started
            seconds.append(result["seconds"])
            eta = eta_seconds(elapsed, seconds, len(pending) - index, 0 if together else workers)
            print(
                f"[{index}/{len(pending)}] {result['name']}: final "
                f"{result['summary']['final_accuracy']:.4f} ({elapsed:.0f} s, eta {eta:.0f} s)",
                flush=True,
            )
    if failed:
        print(
            f"{len(failed)} of {len(pending)} runs failed ({', '.join(failed)}); the others are "
            f"in {done_path}: fix the cause and rerun the same command to run only those",
            file=sys.stderr,
        )
        raise SystemExit(2)
    return [done[job.name] for job in jobs]


def eta_seconds(elapsed: float, seconds: list[float], left: int, workers: int) -> float:
    """Seconds until the `left` runs still to finish are done. On `workers` processes the
    runs finished so far (their own `seconds`) give the mean length of the rest, which take
    the workers' slots `workers` at a time (the first runs all end near the same moment, so
    `elapsed` per run finished would count a run `workers` times over). Together
    (`workers` 0) every run started at once: `elapsed` per run finished."""
    if left <= 0 or not seconds:
        return 0.0
    if workers <= 0:
        return elapsed / len(seconds) * left
    return sum(seconds) / len(seconds) * math.ceil(left / workers)


def run_in_process(job: Job, runs_dir: str, values: dict[str, Any]) -> tuple[dict[str, Any], Path]:
    """Run `values` under the job's name with the real engine, strategies and client code in
    this (worker) process; the result's shared fields (name, labels, summary, seconds) and
    the run's folder, from which each reproduction reads its curves."""
    from fedstale.launcher.grid import on_pool
    from fedstale.launcher.local import cohort_transport, local_transport
    from fedstale.server_app.experiment import run_experiment
    from fedstale.strategies.registry import load_config

    # A job not in results.jsonl never finished: an earlier attempt's folder is moved aside.
    named = {**values, "run-name": job.name, "runs-dir": runs_dir, "overwrite": True}
    pool = getattr(_shared, "pool", None)  # run_all(together=True): this thread's grid
    if pool is not None:
        named["trainer"] = "cohort"
    run, params = load_config(named)
    started = time.monotonic()
    if pool is None:
        summary = run_experiment(run, params, local_transport(run))
    else:
        summary = on_pool(run, params, cohort_transport(run, pool), pool)
    seconds = time.monotonic() - started
    result = {"name": job.name, **job.labels, "summary": summary, "seconds": seconds}
    return result, Path(runs_dir) / job.name


def matching(results: list[dict[str, Any]], **labels: Any) -> list[dict[str, Any]]:
    """The results whose labels equal every one given."""
    return [r for r in results if all(r[key] == value for key, value in labels.items())]


def finals(rows: list[dict[str, Any]]) -> list[float]:
    """Final accuracies in percent."""
    return [100 * r["summary"]["final_accuracy"] for r in rows]


def table_head(title: str, columns: list[str]) -> list[str]:
    return [title, "", "| " + " | ".join(columns) + " |", "|" + " --- |" * len(columns)]
