"""Local running: the clients' work called in this process (or in worker processes), behind
the engine's Transport interface (launcher/inprocess.py, launcher/pool.py), so that
server_app never imports client_app."""

from __future__ import annotations

from client_app.task import evaluate_task, train_task
from common.config import RunConfig
from launcher.inprocess import InProcessTransport
from launcher.pool import PooledTransport


def local_transport(run: RunConfig) -> InProcessTransport:
    return InProcessTransport(run, train_task, evaluate_task)


def pooled_transport(run: RunConfig, workers: int) -> PooledTransport:
    """Clients trained in `workers` processes; close it (or use `with`) when the run ends."""
    return PooledTransport(run, train_task, evaluate_task, workers)
