"""node-partitions: the partition a node serves, asked of it (deployments) or assigned by
the server and named in every message (simulation)."""

from __future__ import annotations

import pytest
from flwr.app import Context, RecordDict

from fedstale.client_app.app import partition_of
from fedstale.common.schema import ASSIGNED_PARTITION
from fedstale.server_app.nodes import AssignedNodes
from tests.helpers import ScriptedTransport, delta_reply, run_config


def context(**node_config: object) -> Context:
    return Context(run_id=1, node_id=7, node_config=node_config, state=RecordDict(), run_config={})


def test_a_message_that_names_a_partition_is_served_for_it_else_the_nodes_own() -> None:
    cfg = run_config(num_clients=4)
    own = context(**{"partition-id": 2, "num-partitions": 4})
    assert partition_of(own, cfg, {}) == 2
    assert partition_of(own, cfg, {ASSIGNED_PARTITION: 3}) == 3
    assert partition_of(context(), cfg, {ASSIGNED_PARTITION: 0}) == 0  # no node config needed
    with pytest.raises(ValueError, match="assigns partition 4, not a client"):
        partition_of(own, cfg, {ASSIGNED_PARTITION: 4})
    with pytest.raises(ValueError, match="no partition-id given"):
        partition_of(context(), cfg, {})


def test_assigned_nodes_take_clients_in_node_order_and_name_them() -> None:
    transport = ScriptedTransport(3, delta_reply)
    nodes = AssignedNodes(3)
    assert nodes.refresh(transport) == []
    assert nodes.node_of == {0: 1000, 1: 1007, 2: 1014}
    assert nodes.entries(2) == {ASSIGNED_PARTITION: 2}
    assert not transport.sent  # nothing asked
