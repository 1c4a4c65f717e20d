"""A rule's declaration: the one place that says what a rule is beyond its math.

Each rule's file ends with its `RULES`, one `Rule` a rule:

    RULES = (Rule(FedBuff, library="FedBuff", wire=(), about="FedBuff (Nguyen et al.) ..."),)

and everything else is derived from the declarations (fedstale/strategies/registry.py):
the registry by name, the run-config keys checked (the strategy's `Params`), the client
rules fedstale's ClientApp runs (`Strategy.client_rules`), the Flower mods `fedstale`
exports and the hint naming the one a ClientApp lacks (each client rule's `mod`), the library
classes `fedstale.<library>` and their docstrings, which rules need class labels, which take
a topology (nodes that name an edge; every client training at once), and the wire keys no
other rule may reuse (`wire`).

A rule from another installed package declares the same in its own module and names it
under the entry point group `fedstale.rules` (docs/architecture.md):

    [project.entry-points."fedstale.rules"]
    median-buffer = "mypackage.median_buffer:RULES"
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from fedstale.common.schema import common_keys
from fedstale.strategies.base import PerClientModels, ServerModel, Strategy, Topology
from fedstale.strategies.client import ClientRule
from fedstale.strategies.privacy import Release

MOD_CALL = re.compile(r"[\w.]+:\w+\([^()]*\)")


@dataclass(frozen=True)
class Rule:
    """`strategy`: the server half (its `name`, `Params` and `client_rules`).
    `library`: the class name under which `fedstale` offers it as a Flower strategy ("":
    only in fedstale's own app, e.g. a client half that has no Flower mod).
    `about`: that class's docstring (the paper, the rule in one line, what it needs).
    `wire`: the task-config entries and reply metrics it adds to the wire format; none may
    be a common key, nor another file's rule's (a package's rule that takes one is left out).
    `labels`: why it needs cross-entropy on class labels ("": it does not).
    `dp`: how it releases a model under central differential privacy (the sensitivity of
    one release, fedstale/strategies/privacy.py); None: it cannot take DP, `no_dp` says
    why (docs/privacy.md)."""

    strategy: type[Strategy]
    library: str = ""
    about: str = ""
    wire: tuple[str, ...] = ()
    labels: str = ""
    dp: Release | None = None
    no_dp: str = ""

    @property
    def name(self) -> str:
        return self.strategy.name

    @property
    def client_rules(self) -> tuple[ClientRule, ...]:
        return self.strategy.client_rules

    @property
    def mods(self) -> dict[str, str]:
        """The Flower mods of its client halves: function name -> module."""
        return {
            function: module
            for module, function in (r.mod_function() for r in self.client_rules)
            if function
        }

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
        for client_rule in self.client_rules:
            if client_rule.mod and not MOD_CALL.fullmatch(client_rule.mod):
                raise TypeError(
                    f"{self.name}: mod '{client_rule.mod}' of {client_rule.name} is not "
                    "'module:function(arguments)'"
                )
        shadowed = sorted(set(self.wire) & common_keys())
        if shadowed:
            raise TypeError(f"{self.name}: wire key '{shadowed[0]}' is one every task carries")
        if self.dp is not None and self.no_dp:
            raise TypeError(f"{self.name}: declares both `dp` and why it has none (`no_dp`)")
        missing = [r.name for r in self.client_rules if self.library and not r.mod]
        if missing:
            raise TypeError(
                f"{self.name}: offered in the library, but its client rules {missing} name no mod"
            )
