"""bench.gpu: its tiny variant runs every row's code path on CPU; the full one refuses a
machine without CUDA in one line."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch

from tests import timing

ROOT = Path(__file__).resolve().parent.parent


def bench(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "bench.gpu", *args],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=timing.left(),
        check=False,
    )


@pytest.mark.integration
def test_the_smoke_variant_measures_every_row_on_cpu() -> None:
    done = bench("--smoke")
    assert done.returncode == 0, done.stderr[-3000:]
    rows = [line for line in done.stdout.splitlines() if line.startswith("| ")]
    labels = [row.split("|")[1].strip() for row in rows]
    for expected in (
        "bare loop",
        "cohort of 10",
        "--local, 1 worker(s)",
        "--local, trainer=cohort",
        "--local FedPSA, per task",
        "--local FedPSA, trainer=cohort",
        "grid of 4 runs, one after another (mean cohort",
        "grid of 4 runs, together (mean cohort",
        "Flower simulation, num-gpus 0",
        "Flower simulation, trainer=cohort, num-gpus 0",
        "library FedBuff, quickstart",
    ):
        assert any(label.startswith(expected) for label in labels), done.stdout
    rates = [float(row.split("|")[2]) for row in rows if row.split("|")[2].strip()[0].isdigit()]
    assert len(rates) == 11 and all(rate > 0 for rate in rates), done.stdout


@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has a GPU")
def test_the_full_run_refuses_a_machine_without_cuda() -> None:
    done = bench()
    assert done.returncode == 2
    assert done.stderr.strip() == ("bench.gpu: no CUDA device; run it on a GPU machine, or --smoke")


def test_the_default_plan_is_the_targets_rows_and_all_is_every_row(tmp_path: Path) -> None:
    """Sized for one call: by default only the rows the GPU targets are read from (the
    bare loop, FedPSA per task and in cohorts, the 12-run grid together, Flower simulation
    at num-gpus 1); `--all` adds both models' other rows."""
    from bench.gpu import Plan, model_measures

    targets = [label for label, *_ in model_measures(Plan.targets(), "lenet", tmp_path, None)]
    assert targets == [
        "bare loop",
        "cohort of 10",
        "--local, 1 worker(s)",
        "--local FedPSA, per task",
        "--local FedPSA, trainer=cohort",
        "grid of 12 runs, together",
        "Flower simulation, num-gpus 1",
    ]
    every = [label for label, *_ in model_measures(Plan.full(), "lenet", tmp_path, None)]
    assert set(targets) < set(every) and len(every) == 14
    assert Plan.full().models == ("lenet", "cnn-mnist") and Plan.targets().models == ("lenet",)


def test_the_bare_reference_is_timed_warm(monkeypatch: pytest.MonkeyPatch) -> None:
    """The bare loop's first task (a process's first optimizer step imports torch._dynamo)
    runs before the timer starts: one untimed task, then the timed ones."""
    import time
    import types

    import bench.throughput as throughput

    events: list[str] = []
    train = throughput.local_train

    def counted(*args: object, **kwargs: object) -> object:
        events.append("task")
        return train(*args, **kwargs)  # type: ignore[arg-type]

    def clock() -> float:
        events.append("clock")
        return time.perf_counter()

    monkeypatch.setattr(throughput, "local_train", counted)
    monkeypatch.setattr(throughput, "time", types.SimpleNamespace(perf_counter=clock))
    config = {"dataset": "digits", "model": "mlp", "num-clients": 4, "concurrency": 2}
    assert throughput.bare_rate({**config, "trainer": "autograd"}, 2) > 0
    assert events == ["task", "clock", "task", "task", "clock"]
