"""A transport that runs the clients' training in this process, without Flower.

For quick experiments and long paper reproductions on a small box: the engine, strategies
and client code (`client_app.task.train_task`) are the ones a Flower run uses, and on the
virtual clock a run gives the same metrics as in Flower simulation (tests check it), at
the speed of a bare PyTorch loop. Clients train with `client-threads` threads, as in a Ray actor.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

import numpy as np
import torch

from client_app.task import train_task
from common.config import RunConfig
from common.schema import MSG_QUERY, MSG_TRAIN, ReplyKeys
from server_app.transport import Reply

NODE_BASE = 1000


class InProcessTransport:
    def __init__(self, run: RunConfig) -> None:
        self.run = run
        self.replies: dict[str, Reply] = {}
        self.count = 0

    def node_ids(self) -> list[int]:
        return [NODE_BASE + client for client in range(self.run.num_clients)]

    def send(
        self,
        node_id: int,
        message_type: str,
        config: Mapping[str, Any],
        arrays: Mapping[str, np.ndarray] | None = None,
    ) -> str:
        self.count += 1
        msg_id = f"local-{self.count}"
        partition = node_id - NODE_BASE
        if message_type == MSG_QUERY:
            self.replies[msg_id] = Reply(msg_id, metrics={ReplyKeys.PARTITION_ID: partition})
        elif message_type == MSG_TRAIN:
            metrics, result = self.train(partition, config, dict(arrays or {}))
            self.replies[msg_id] = Reply(msg_id, metrics=metrics, arrays=result)
        else:
            raise ValueError(f"the in-process transport does not run '{message_type}' tasks")
        return msg_id

    def train(self, partition: int, config: Mapping[str, Any], arrays: dict) -> tuple[dict, dict]:
        """The client's work (which sets `client-threads`); the server keeps its threads."""
        server_threads = torch.get_num_threads()
        try:
            return train_task(self.run, partition, config, arrays)
        finally:
            torch.set_num_threads(server_threads)

    def receive(self, msg_ids: Iterable[str]) -> list[Reply]:
        return [self.replies.pop(m) for m in list(msg_ids) if m in self.replies]
