"""Everything a rule author imports, from one public module (docs/architecture.md, "Write a
rule as a package"). A rule in your own package needs nothing else of fedstale:

    from pydantic import Field
    from fedstale.rules import Buffer, BufferParams, Outcome, Rule, Strategy, Update, View
    from fedstale.rules import update_record

    class MedianParams(BufferParams):        # the rule's own keys, and buffer-size
        median_scale: float = Field(default=1.0, gt=0)

    class MedianBuffer(Strategy):
        name = "median-buffer"
        Params = MedianParams
        kept = ("buffer",)                   # checkpointed with the run
        ...

    RULES = (Rule(MedianBuffer, library="MedianBuffer", about="..."),)

and its entry point, `[project.entry-points."fedstale.rules"] median-buffer =
"mypackage.median_buffer:RULES"`. What each name is:

- `Strategy`: the base of every rule (`on_update(update, view) -> Outcome`, `model`, `run`,
  `params`); `Update` (one client's delta, its staleness and metrics), `View` (what the
  engine knows when an update arrives), `Outcome` (whether the model changed and the rows
  recorded), `update_record` (one such row).
- `Rule`: the declaration (`wire=keys_of(MyKeys)`: the task entries and reply metrics the
  rule adds, a class of string constants in its file); `ClientRule` a client half (its
  `LocalTask`: the client's training, where it adds signals; its `mod`, the Flower mod that
  runs it in any ClientApp, as "module:function(arguments)"); `SignalSpec` a signal the
  server checks on every reply,
  `InvalidReply` what a rule's `validate` raises to reject one; `Release` how a rule's model
  is released under central DP (with `LINEAR`, `CONVEX`).
- Helpers of the built-in rules: `Buffer` (K updates, then a batch; `BufferParams`
  declares its key `buffer-size`, shared by every buffered rule), `Staleness` (the
  staleness weights s(tau)), `step_scale` (the server learning-rate schedule), `mean_model`.
- Capabilities a rule may declare by subclassing: `PerClientModels`, `Topology`,
  `ServerModel` (with the `ModelServices` it is bound: the run's model as a `TorchModel`,
  the server's held-out samples).
- `KebabModel`: the base of a rule's `Params` (snake_case fields are kebab-case keys);
  `RuleSettings` what a rule reads of the run (`self.run`, `check(run, params)`; a
  `RunConfig` is one); `ConfigError` what a refused setting raises.

These names are kept stable; the modules they live in are not a public interface.
"""

from __future__ import annotations

from fedstale.common.config import ConfigError, KebabModel, RuleSettings, RunConfig
from fedstale.common.schema import InvalidReply, SignalSpec, keys_of
from fedstale.strategies.base import (
    ModelServices,
    Outcome,
    PerClientModels,
    ServerModel,
    Strategy,
    Topology,
    TorchModel,
    Update,
    View,
    mean_model,
    step_scale,
    update_record,
)
from fedstale.strategies.buffer import Buffer, BufferParams
from fedstale.strategies.client import ClientRule, LocalTask
from fedstale.strategies.privacy import CONVEX, LINEAR, Release
from fedstale.strategies.rule import Rule
from fedstale.strategies.staleness import Staleness

__all__ = [
    "CONVEX",
    "LINEAR",
    "Buffer",
    "BufferParams",
    "ClientRule",
    "ConfigError",
    "InvalidReply",
    "KebabModel",
    "LocalTask",
    "ModelServices",
    "Outcome",
    "PerClientModels",
    "Release",
    "Rule",
    "RuleSettings",
    "RunConfig",
    "ServerModel",
    "SignalSpec",
    "Staleness",
    "Strategy",
    "Topology",
    "TorchModel",
    "Update",
    "View",
    "keys_of",
    "mean_model",
    "step_scale",
    "update_record",
]
