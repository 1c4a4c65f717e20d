"""Flower's floor: a ServerApp sending `tasks` messages one after another to the first node,
polling for each reply every 20 ms (as fedstale's engine does); the ClientApp imports torch
and replies. Writes the cycle times (push to reply, seconds) to the run config's `out`."""

from __future__ import annotations

import json
import time
from pathlib import Path

from flwr.app import ConfigRecord, Context, Message, RecordDict
from flwr.clientapp import ClientApp
from flwr.serverapp import Grid, ServerApp

server = ServerApp()
client = ClientApp()


@client.train()
def train(msg: Message, context: Context) -> Message:
    import torch  # the cost every real ClientApp pays

    return Message(RecordDict({"config": ConfigRecord({"torch": torch.__version__})}), reply_to=msg)


@server.main()
def main(grid: Grid, context: Context) -> None:
    while not grid.get_node_ids():
        time.sleep(0.1)
    node = sorted(grid.get_node_ids())[0]
    cycles = []
    for _ in range(int(context.run_config["tasks"])):
        started = time.monotonic()
        message = Message(RecordDict(), dst_node_id=node, message_type="train")
        ids = list(grid.push_messages([message]))
        while not list(grid.pull_messages(ids)):
            time.sleep(0.02)
        cycles.append(time.monotonic() - started)
    Path(str(context.run_config["out"])).write_text(json.dumps({"cycles": cycles}))
