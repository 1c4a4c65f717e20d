"""Local running: the clients' training called in this process, behind the engine's
Transport interface (server_app/inprocess.py), so that server_app never imports client_app."""

from __future__ import annotations

from common.config import RunConfig
from server_app.inprocess import InProcessTransport


def local_transport(run: RunConfig) -> InProcessTransport:
    return InProcessTransport(run)
