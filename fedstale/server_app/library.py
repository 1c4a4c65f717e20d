"""fedstale's rules as Flower strategies: `fedstale.FedBuff(buffer_size=5)`.

Each class is its rule's own keys (the rule's `Params`, in its file under
fedstale/strategies/) and the library's arguments (`LibraryArguments`: every run-config
key a library run reads), in snake_case. Both are pydantic models, whose fields a type
checker, an IDE and `help()` read with their types and defaults (PEP 681): a misspelt
argument is flagged, with the name it is closest to. A class's docstring is its rule's
`about`. A rule from another installed package gets the same kind of class at run time
(library_classes.py).
"""

from __future__ import annotations

from typing import ClassVar

from fedstale.server_app.flower_strategy import (
    AsyncStrategy,
    ServerModelArguments,
    TopologyArguments,
)
from fedstale.strategies.base import NoParams
from fedstale.strategies.buffer import BufferParams
from fedstale.strategies.ca2fl import CA2FLParams
from fedstale.strategies.fedasync import FedAsyncParams
from fedstale.strategies.fedbuff import FedBuffParams
from fedstale.strategies.fedpsa import FedPSAParams
from fedstale.strategies.fedqs import FedQSParams, KFifoParams
from fedstale.strategies.hierarchy import HierarchyParams

__all__ = [
    "CA2FL",
    "MAFSA",
    "FedAsync",
    "FedAvg",
    "FedBuff",
    "FedFa",
    "FedPSA",
    "FedQSAvg",
    "FedQSSGD",
    "HierFedAvg",
    "SaflFedAvg",
    "SaflFedSGD",
]


class FedAvg(AsyncStrategy, NoParams):
    rule: ClassVar[str] = "fedavg"


class FedAsync(AsyncStrategy, FedAsyncParams):
    rule: ClassVar[str] = "fedasync"


class FedBuff(AsyncStrategy, FedBuffParams):
    rule: ClassVar[str] = "fedbuff"


class CA2FL(AsyncStrategy, CA2FLParams):
    rule: ClassVar[str] = "ca2fl"


class FedFa(AsyncStrategy, BufferParams):
    rule: ClassVar[str] = "fedfa"


class FedPSA(AsyncStrategy, FedPSAParams, ServerModelArguments):
    rule: ClassVar[str] = "fedpsa"


class SaflFedSGD(AsyncStrategy, KFifoParams):
    rule: ClassVar[str] = "safl-fedsgd"


class SaflFedAvg(AsyncStrategy, KFifoParams):
    rule: ClassVar[str] = "safl-fedavg"


class FedQSSGD(AsyncStrategy, FedQSParams):
    rule: ClassVar[str] = "fedqs-sgd"


class FedQSAvg(AsyncStrategy, FedQSParams):
    rule: ClassVar[str] = "fedqs-avg"


class MAFSA(AsyncStrategy, HierarchyParams, TopologyArguments):
    rule: ClassVar[str] = "mafsa"


class HierFedAvg(AsyncStrategy, HierarchyParams, TopologyArguments):
    rule: ClassVar[str] = "hierfedavg"
