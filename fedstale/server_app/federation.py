"""The clients as the engine reaches them: the transport to their nodes, which node serves
which client, the message contract the ClientApp speaks, the model's parameter layout,
and how long each client takes (the latency profile the virtual clock uses)."""

from __future__ import annotations

from dataclasses import dataclass, field

from fedstale.common.latency import LatencyProfile
from fedstale.common.layout import ParamLayout
from fedstale.server_app.contract import Contract, FedstaleContract
from fedstale.server_app.nodes import Nodes
from fedstale.server_app.transport import Transport


@dataclass
class Federation:
    transport: Transport
    nodes: Nodes
    layout: ParamLayout
    latency: LatencyProfile
    contract: Contract = field(default_factory=FedstaleContract)
