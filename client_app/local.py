"""Local running: the clients' work called in this process, behind the engine's Transport
interface (server_app/inprocess.py), so that server_app never imports client_app."""

from __future__ import annotations

from client_app.task import evaluate_task, train_task
from common.config import RunConfig
from server_app.inprocess import InProcessTransport


def local_transport(run: RunConfig) -> InProcessTransport:
    return InProcessTransport(run, train_task, evaluate_task)
