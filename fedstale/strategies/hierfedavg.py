"""HierFedAvg (HierFL, Liu et al. 2020; MAFSA's baseline, the MAFSA paper's Sec. 5.1): the
client-edge-cloud hierarchy synchronous at both levels. Each edge runs `mafsa-edge-rounds`
FedAvg rounds over its online clients (a dropped client simply misses the round), uploads,
and waits; when every edge has uploaded, the cloud model is the data-weighted average
w = sum_k rho_k theta_k and every edge goes on from it. The edges' rounds and the dropout
schedule are fedstale/strategies/hierarchy.py's, so HierFedAvg(p) and MAFSA(p) see the same pattern.
"""

from __future__ import annotations

import numpy as np

from fedstale.strategies.hierarchy import Hierarchy
from fedstale.strategies.rule import Rule


class HierFedAvg(Hierarchy):
    name = "hierfedavg"

    def upload(self, k: int) -> bool:
        self.edges[k].waiting = True
        if not all(edge.waiting for edge in self.edges):
            return False
        shares = np.array([self.share(j) for j in range(len(self.edges))])
        models = np.stack([edge.model for edge in self.edges]).astype(np.float64)
        self.model = (shares @ models / shares.sum()).astype(np.float32)
        for edge in self.edges:
            edge.model, edge.base, edge.waiting = self.model.copy(), self.model.copy(), False
        self.cloud_updates += 1
        return True


RULES = (
    Rule(
        HierFedAvg,
        library="HierFedAvg",
        about="""HierFedAvg (Liu et al. 2020): clients average at their edge, edges at the
    cloud; every client trains at once. `edges` maps client -> edge (default: seeded equal
    groups of `mafsa_edges`).""",
        no_dp="edge models are re-released at every cloud step (a hierarchy of releases "
        "not worked out)",
    ),
)
