"""Which node serves which client (partition), learned by asking each new node once.

Flower's node ids are random, so the engine addresses clients by partition id: a `query`
message to every node that appears tells its partition. A node that restarts comes back
with a new id and the same partition; the book then points the client at the new node.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Protocol

from fedstale.common.schema import ASSIGNED_PARTITION, MSG_QUERY, ReplyKeys
from fedstale.server_app.transport import Reply, Transport

QUERY_TRIES = 3  # a node's partition query, failed in transit, is sent this many times

log = logging.getLogger("fedstale")


class Nodes(Protocol):
    """Which node serves which client: the engine's view of the federation."""

    node_of: dict[int, int]  # client -> node
    edge_of: dict[int, int]  # client -> edge, where known

    @property
    def clients(self) -> list[int]: ...

    def refresh(self, transport: Transport) -> list[int]:
        """Take in nodes that appeared; forget those gone, and return them."""
        ...

    def forget(self, node: int) -> None: ...

    def exclude(self, node: int) -> None:
        """Drop a node for the rest of the run: no refresh takes it back."""
        ...

    def collect(self, transport: Transport) -> None: ...

    def entries(self, client: int) -> dict[str, int]:
        """What every message to `client`'s node carries for the node to serve it."""
        ...


@dataclass
class ClientBook:
    """Which node serves which client, both ways; what both kinds of book share."""

    num_clients: int
    client_of: dict[int, int] = field(default_factory=dict)  # node -> client
    node_of: dict[int, int] = field(default_factory=dict)  # client -> node
    edge_of: dict[int, int] = field(default_factory=dict)  # client -> edge, where known
    excluded: set[int] = field(default_factory=set)  # nodes dropped for the rest of the run

    @property
    def clients(self) -> list[int]:
        return sorted(self.node_of)

    def exclude(self, node: int) -> None:
        self.excluded.add(node)
        self.forget(node)

    def entries(self, client: int) -> dict[str, int]:
        return {}

    def forget(self, node: int) -> None:
        """Drop a node (gone, or no longer accepted by the SuperLink); a later refresh
        registers it again if it is still listed online."""
        client = self.client_of.pop(node, None)
        if client is not None and self.node_of.get(client) == node:
            del self.node_of[client]

    def forget_gone(self, online: set[int]) -> list[int]:
        """Forget the nodes no longer online, and return them."""
        lost = [n for n in self.client_of if n not in online]
        for node in lost:
            log.warning("node %d (client %d) went offline", node, self.client_of[node])
            self.forget(node)
        return lost


@dataclass
class NodeBook(ClientBook):
    """fedstale's own ClientApps, each asked once which partition it serves."""

    queries: dict[str, int] = field(default_factory=dict)
    refused: set[int] = field(default_factory=set)
    failed_queries: dict[int, int] = field(default_factory=dict)

    def refresh(self, transport: Transport) -> list[int]:
        """Query nodes seen for the first time; forget nodes gone, and return those."""
        online = set(transport.node_ids())
        lost = self.forget_gone(online)
        asked = set(self.queries.values())
        for node in sorted(online - set(self.client_of) - asked - self.refused - self.excluded):
            self.queries[transport.send(node, MSG_QUERY, {})] = node
        return lost

    def collect(self, transport: Transport) -> None:
        if self.queries:
            for reply in transport.receive(list(self.queries)):
                self._register(self.queries.pop(reply.msg_id), reply)

    def _register(self, node: int, reply: Reply) -> None:
        """Book the node's client, or refuse the node once, with one line, for the run (a
        restarted node comes back with a new id and is asked again). A query that failed in
        transit (an error reply: the node busy, its message expired) is asked again at the
        next refresh, up to QUERY_TRIES times."""
        client = reply.metrics.get(ReplyKeys.PARTITION_ID)
        if reply.problem:
            problem = reply.problem
        elif reply.error_code is not None or reply.invalid:
            problem = f"its query failed ({reply.error or reply.invalid}); check its log"
            tries = self.failed_queries[node] = self.failed_queries.get(node, 0) + 1
            if reply.error_code is not None and tries < QUERY_TRIES:
                log.warning(
                    "node %d: query %d of %d failed; asking again", node, tries, QUERY_TRIES
                )
                return
        elif not isinstance(client, int) or not 0 <= client < self.num_clients:
            problem = f"it reports partition-id {client!r}, outside 0..{self.num_clients - 1}"
        else:
            problem = ""
        if problem:
            log.error("node %d gets no work: %s", node, problem)
            self.refused.add(node)
            return
        assert isinstance(client, int)
        previous = self.node_of.get(client)
        if previous is not None and previous in self.client_of:
            log.warning("node %d also claims client %d (held by node %d)", node, client, previous)
        self.client_of[node] = client
        self.node_of[client] = node
        edge = reply.metrics.get(ReplyKeys.EDGE_ID)
        if isinstance(edge, int):
            self.edge_of[client] = edge
        log.info("node %d serves client %d", node, client)


@dataclass
class NodesInOrder(ClientBook):
    """Any Flower ClientApp's nodes, which cannot say which partition they serve: the nodes
    online take clients 0..num_clients-1 in the order they appear (by node id among those
    seen together), and a node that appears later takes the lowest client whose node left.
    Nodes beyond `num_clients` wait unused. `edge_of`: client -> edge, as the user maps it."""

    spare: set[int] = field(default_factory=set)

    def refresh(self, transport: Transport) -> list[int]:
        online = set(transport.node_ids())
        lost = self.forget_gone(online)
        self.spare &= online
        taken = []
        for node in sorted(online - set(self.client_of) - self.excluded):
            free = [c for c in range(self.num_clients) if c not in self.node_of]
            if not free:
                if node not in self.spare:
                    self.spare.add(node)
                    log.info("node %d waits: all %d clients have a node", node, self.num_clients)
                continue
            self.spare.discard(node)
            self.client_of[node], self.node_of[free[0]] = free[0], node
            taken.append((node, free[0]))
        self.announce(taken)
        return lost

    def announce(self, taken: list[tuple[int, int]]) -> None:
        for node, client in taken:
            log.info("node %d serves client %d", node, client)

    def collect(self, transport: Transport) -> None:
        """Nothing to collect: no node is asked anything."""


@dataclass
class AssignedNodes(NodesInOrder):
    """fedstale's own ClientApps where every node can load every partition (simulation):
    the server assigns clients to nodes in order, as NodesInOrder does, and names the
    partition in every message, so no node is asked anything before its first task."""

    def entries(self, client: int) -> dict[str, int]:
        return {ASSIGNED_PARTITION: client}

    def announce(self, taken: list[tuple[int, int]]) -> None:
        """One line however many nodes (10,000 in a large simulation)."""
        if taken:
            clients = sorted(client for _, client in taken)
            log.info(
                "%d nodes assigned clients %d..%d in node-id order (node-partitions=assign)",
                len(taken),
                clients[0],
                clients[-1],
            )
