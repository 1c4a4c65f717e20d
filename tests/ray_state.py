"""What a running Ray cluster holds, as one JSON object on stdout, read by a driver of its
own that joins the cluster and leaves: its live nodes (id and resources), every
ClientAppActor it has held (alive or dead) with the node it lived on, and how many
ClientAppActor.run tasks (one per message a ClientApp handled) each node ran.

    python -m tests.ray_state ADDRESS [--nodes N] [--timeout S]

`--nodes N` first waits until N nodes are alive. Ray's state API (ray.util.state, `ray list
actors`) goes through the dashboard, which needs ray[default]; flwr[simulation] installs
ray without it, so this reads the GCS through ray's own GlobalState (ray._private.state:
the actor table, and the task events that `ray.timeline` reads too).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections import Counter
from typing import Any

import ray
from ray._private import state
from ray.core.generated import gcs_pb2

ACTOR = "ClientAppActor"


def live_nodes() -> list[dict[str, Any]]:
    return [
        {"id": node["NodeID"], "resources": node["Resources"]}
        for node in ray.nodes()
        if node["Alive"]
    ]


def run_tasks_per_node() -> dict[str, int]:
    """Distinct `ClientAppActor.run` task ids per node that ran them, from the GCS's task
    events (one task's events may come in several records: its info, its state updates)."""
    names: dict[bytes, str] = {}
    nodes: dict[bytes, str] = {}
    for raw in state.state._connect_and_get_accessor().get_task_events():
        event = gcs_pb2.TaskEvents.FromString(raw)
        if event.HasField("task_info"):
            names[event.task_id] = event.task_info.name
        if event.HasField("state_updates") and event.state_updates.HasField("node_id"):
            nodes[event.task_id] = event.state_updates.node_id.hex()
    return dict(Counter(node for task, node in nodes.items() if names.get(task) == f"{ACTOR}.run"))


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("address")
    parser.add_argument("--nodes", type=int, default=0)
    parser.add_argument("--timeout", type=float, default=60.0)
    args = parser.parse_args()
    ray.init(address=args.address, logging_level="ERROR", log_to_driver=False)
    deadline = time.monotonic() + args.timeout
    while len(live_nodes()) < args.nodes:
        if time.monotonic() > deadline:
            sys.exit(f"{len(live_nodes())} of {args.nodes} Ray nodes alive after {args.timeout} s")
        time.sleep(0.5)
    actors = [
        {"node": actor["Address"]["NodeID"], "state": actor["State"], "pid": actor["Pid"]}
        for actor in state.actors().values()
        if actor["ActorClassName"] == ACTOR
    ]
    report = {"nodes": live_nodes(), "actors": actors, "run_tasks": run_tasks_per_node()}
    ray.shutdown()
    print(json.dumps(report))


if __name__ == "__main__":
    main()
