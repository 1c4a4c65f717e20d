"""A rule's declaration: the one place that says what a rule is beyond its math.

Each rule's file ends with its `RULES`, one `Rule` a rule:

    RULES = (Rule(FedBuff, library="FedBuff", wire=(), about="FedBuff (Nguyen et al.) ..."),)

and everything else is derived from the declarations (fedstale/strategies/registry.py):
the registry by name, the run-config keys checked (the strategy's `Params`), the client
rules fedstale's ClientApp runs (`Strategy.client_rules`) and the hint naming the Flower mod
a ClientApp lacks (`ClientRule.mod`), the library classes `fedstale.<library>` and their
docstrings, the exports of the mods, which rules need class labels, and which take a
topology (nodes that name an edge; every client training at once).

A rule from another installed package declares the same in its own module and names it
under the entry point group `fedstale.rules` (docs/architecture.md):

    [project.entry-points."fedstale.rules"]
    median-buffer = "mypackage.median_buffer:RULES"
"""

from __future__ import annotations

from dataclasses import dataclass

from fedstale.strategies.base import PerClientModels, ServerModel, Strategy, Topology
from fedstale.strategies.client import ClientRule
from fedstale.strategies.privacy import Release


@dataclass(frozen=True)
class Rule:
    """`strategy`: the server half (its `name`, `Params` and `client_rules`).
    `library`: the class name under which `fedstale` offers it as a Flower strategy ("":
    only in fedstale's own app, e.g. a client half that has no Flower mod).
    `about`: that class's docstring (the paper, the rule in one line, what it needs).
    `wire`: the task-config entries and reply metrics it adds to the wire format.
    `labels`: why it needs cross-entropy on class labels ("": it does not).
    `mod`: its client half's Flower mod, as `module:function`, if it has one; `fedstale`
    exports it under the function's name.
    `dp`: how it releases a model under central differential privacy (the sensitivity of
    one release, fedstale/strategies/privacy.py); None: it cannot take DP, `no_dp` says
    why (docs/privacy.md)."""

    strategy: type[Strategy]
    library: str = ""
    about: str = ""
    wire: tuple[str, ...] = ()
    labels: str = ""
    mod: str = ""
    dp: Release | None = None
    no_dp: str = ""

    @property
    def name(self) -> str:
        return self.strategy.name

    @property
    def client_rules(self) -> tuple[ClientRule, ...]:
        return self.strategy.client_rules

    @property
    def per_client_models(self) -> bool:
        """Whether it keeps one model per client (each scored on its client's own split)."""
        return issubclass(self.strategy, PerClientModels)

    @property
    def topology(self) -> bool:
        """Edges between the clients and the cloud: nodes may name their edge, and every
        client trains at once (the library's concurrency is the number of clients)."""
        return issubclass(self.strategy, Topology)

    @property
    def server_model(self) -> bool:
        """Whether it computes on the model at the server (it takes `ModelServices`)."""
        return issubclass(self.strategy, ServerModel)

    def check(self) -> None:
        """Raise TypeError where the declaration cannot hold (a package's rule is checked
        when it is found)."""
        if not (isinstance(self.strategy, type) and issubclass(self.strategy, Strategy)):
            raise TypeError(f"Rule({self.strategy!r}): not a fedstale Strategy class")
        if not getattr(self.strategy, "name", ""):
            raise TypeError(f"{self.strategy.__name__} has no `name`")
        if self.library and not self.library.isidentifier():
            raise TypeError(f"{self.name}: library name '{self.library}' is not a class name")
        if self.mod and ":" not in self.mod:
            raise TypeError(f"{self.name}: mod '{self.mod}' is not 'module:function'")
        if self.dp is not None and self.no_dp:
            raise TypeError(f"{self.name}: declares both `dp` and why it has none (`no_dp`)")
        missing = [r.name for r in self.client_rules if self.library and not r.mod]
        if missing:
            raise TypeError(
                f"{self.name}: offered in the library, but its client rules {missing} name no mod"
            )
