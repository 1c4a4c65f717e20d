"""The pooled in-process transport: a client's tasks run in the order sent, with its kept
state carried from one to the next, whichever worker runs them; client errors become error
replies. Equality with Flower simulation is checked in tests/test_simulation.py."""

from __future__ import annotations

import os
import time
from collections.abc import Mapping, MutableMapping
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from fedstale.common.config import RunConfig
from fedstale.common.schema import MSG_EVALUATE, MSG_TRAIN
from fedstale.launcher.inprocess import NODE_BASE
from fedstale.launcher.pool import PooledTransport
from tests.helpers import run_config


def counting_train(
    run: RunConfig,
    partition: int,
    config: Mapping[str, Any],
    arrays: dict[str, np.ndarray],
    sets: Any,
    state: MutableMapping[str, np.ndarray],
) -> tuple[dict[str, Any], dict[str, np.ndarray], dict]:
    """Counts this client's tasks in its kept state; slow on the first task so that a
    second worker would overtake it if the transport let it. A task's config may ask it to
    fail, to end its worker process (a crash, an out-of-memory kill), or to reply with
    `reply_floats` ones instead of w + 1."""
    if config.get("fail"):
        raise ValueError("boom")
    if config.get("die"):
        os._exit(3)
    seen = int(state.get("tasks", np.zeros(1))[0]) + 1
    time.sleep(0.5 if seen == 1 else 0.0)
    state["tasks"] = np.array([seen])
    size = int(config.get("reply_floats", 0))
    reply = np.ones(size, dtype=np.float32) if size else arrays["w"] + 1
    return {"seen": seen, "order": config.get("order")}, {"w": reply}, {}


def marking_warm_up(run: RunConfig) -> None:
    """Leaves a mark per worker in the directory the run names, then takes its time."""
    marks = Path(run.runs_dir)
    (marks / f"warm-{os.getpid()}").write_text("")
    time.sleep(0.5)


def scoring(run: RunConfig, partition: int, config: Mapping[str, Any], arrays: dict) -> dict:
    return {"partition": partition, "sum": float(arrays["w"].sum())}


def collect(transport: PooledTransport, msg_ids: list[str], timeout: float = 60) -> dict:
    replies: dict = {}
    deadline = time.monotonic() + timeout
    while len(replies) < len(msg_ids) and time.monotonic() < deadline:
        replies.update({r.msg_id: r for r in transport.receive(msg_ids)})
        transport.wait(0.1)
    return replies


def test_a_clients_tasks_run_in_order_with_its_state_on_two_workers() -> None:
    with PooledTransport(run_config(), counting_train, scoring, workers=2) as transport:
        w = {"w": np.zeros(3, dtype=np.float32)}
        sent = [
            transport.send(NODE_BASE + client, MSG_TRAIN, {"order": i, "fail": False}, w)
            for i, client in enumerate([0, 0, 1, 0])
        ]
        replies = collect(transport, sent)
    seen = [replies[m].metrics["seen"] for m in sent]
    assert seen == [1, 2, 1, 3]  # client 0's second task waited for its first
    assert all(np.array_equal(replies[m].arrays["w"], np.ones(3)) for m in sent)


def test_a_client_exception_is_an_error_reply_and_the_clients_next_task_runs() -> None:
    with PooledTransport(run_config(), counting_train, scoring, workers=2) as transport:
        w = {"w": np.ones(2, dtype=np.float32)}
        bad = transport.send(NODE_BASE, MSG_TRAIN, {"order": 0, "fail": True}, w)
        good = transport.send(NODE_BASE, MSG_TRAIN, {"order": 1, "fail": False}, w)
        score = transport.send(NODE_BASE + 2, MSG_EVALUATE, {}, w)
        replies = collect(transport, [bad, good, score])
    assert replies[bad].error_code == 1 and replies[bad].error == "ValueError: boom"
    assert replies[good].error_code is None and replies[good].metrics["seen"] == 1
    assert replies[score].metrics == {"partition": 2, "sum": 2.0}


def test_local_runs_on_a_gpu_train_in_this_process_unless_workers_are_asked_for(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """Worker processes sharing one GPU added nothing measured (bench.gpu): on a GPU,
    `--local` trains in its own process and says why; `--workers N` still spawns."""
    import os

    import torch

    import fedstale.common.models as models
    from fedstale.common.config import parse_run_config
    from fedstale.launcher.cli import local_workers

    run = parse_run_config({"concurrency": 10})
    monkeypatch.setattr(models, "resolve_device", lambda name: torch.device("cuda"))
    assert local_workers(run, None) == 1
    assert "clients train in this process" in capsys.readouterr().err
    assert local_workers(run, 4) == 4 and local_workers(run, 40) == 10
    monkeypatch.setattr(models, "resolve_device", lambda name: torch.device("cpu"))
    assert local_workers(run, None) == min(len(os.sched_getaffinity(0)), 10)
    assert capsys.readouterr().err == ""


def test_a_dead_worker_answers_its_task_with_an_error_and_a_fresh_worker_takes_over() -> None:
    w = {"w": np.ones(2, dtype=np.float32)}
    with PooledTransport(run_config(), counting_train, scoring, workers=2) as transport:
        dead = transport.send(NODE_BASE, MSG_TRAIN, {"die": True}, w)
        after = transport.send(NODE_BASE, MSG_TRAIN, {"die": False}, w)
        others = [transport.send(NODE_BASE + c, MSG_TRAIN, {"die": False}, w) for c in (1, 2)]
        replies = collect(transport, [dead, after, *others])
        alive = [worker.process.is_alive() for worker in transport.workers]
    assert replies[dead].error_code == 1
    assert replies[dead].error.startswith("WorkerDied:") and "exit code 3" in replies[dead].error
    assert all(replies[m].error_code is None for m in [after, *others])
    assert alive == [True, True]


def test_every_worker_is_warm_before_the_clients_count_as_connected(tmp_path: Path) -> None:
    run = run_config(runs_dir=str(tmp_path))
    with PooledTransport(
        run, counting_train, scoring, workers=2, warm=marking_warm_up
    ) as transport:
        nodes = transport.node_ids()
        marks = sorted(tmp_path.glob("warm-*"))
        pids = {worker.process.pid for worker in transport.workers}
    assert nodes == [NODE_BASE + c for c in range(run.num_clients)]
    assert {int(m.name.split("-")[1]) for m in marks} == pids
    assert all(not worker.process.is_alive() for worker in transport.workers)


def test_closing_ends_a_worker_blocked_on_a_reply_nobody_reads_at_once() -> None:
    """A run that stops with a task in flight: its reply (4 MB, more than a pipe holds) is
    never read, and closing does not wait for the worker to give up sending it."""
    w = {"w": np.ones(2, dtype=np.float32)}
    transport = PooledTransport(run_config(), counting_train, scoring, workers=1)
    transport.node_ids()
    transport.send(NODE_BASE, MSG_TRAIN, {"die": False, "reply_floats": 1_000_000}, w)
    time.sleep(2.0)  # the worker has trained (0.5 s) and is blocked sending its reply
    started = time.monotonic()
    transport.close()
    assert time.monotonic() - started < 5.0
    assert not transport.workers[0].process.is_alive()
