"""Privacy as one stage of the update path (validate, clip, rule, release, record): the
engine calls the same methods whether DP is on (central_dp.CentralDP) or off (NoPrivacy).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Protocol

import numpy as np

from fedstale.common.schema import InvalidReply
from fedstale.strategies.base import Outcome, Strategy, Update


@dataclass(frozen=True)
class Verdict:
    """What became of a new global model: released (noised, on the ledger) or withheld
    (the budget allows no further release: the strategy's model is the last released one);
    `stop`: why the run must stop now ("" goes on)."""

    released: bool = True
    stop: str = ""


class PrivacyStage(Protocol):
    def task_entries(self) -> dict[str, Any]:
        """What every task's config carries (the clipping norm, where the client clips)."""

    def start_of(self, returns: str, model: np.ndarray) -> np.ndarray | None:
        """The copy of a task's start model kept to clip a returned model's delta."""

    def clip(self, update: Update, start: np.ndarray | None) -> Update:
        """The update the rule may see (raises InvalidReply when it cannot take it)."""

    def excludes(self, node: int, client: int, err: InvalidReply) -> bool:
        """Whether this rejection excludes the node from the run."""

    def started(self, strategy: Strategy[Any]) -> str:
        """The loop is about to start from the strategy's model; why it cannot ("")."""

    def release_of(self, strategy: Strategy[Any], outcome: Outcome, version: int) -> Verdict:
        """The rule changed its model into `version`: release it, or withhold it."""

    def public_record(self, record: dict[str, Any]) -> dict[str, Any]:
        """An updates.jsonl row as the guarantee allows it to be written."""

    def epsilon(self) -> float | None: ...

    def spent(self) -> Any: ...

    def summary(self) -> dict[str, Any]: ...

    def state(self) -> dict[str, Any]: ...

    @property
    def keeps_client_values(self) -> bool:
        """Whether checkpoints and outputs may hold per-client, data-dependent values."""

    def load_state(self, state: dict[str, Any]) -> None: ...


class NoPrivacy:
    keeps_client_values = True
    """DP off: every update as it came, every model released as the rule made it."""

    def task_entries(self) -> dict[str, Any]:
        return {}

    def start_of(self, returns: str, model: np.ndarray) -> np.ndarray | None:
        return None

    def clip(self, update: Update, start: np.ndarray | None) -> Update:
        return update

    def excludes(self, node: int, client: int, err: InvalidReply) -> bool:
        return False

    def started(self, strategy: Strategy[Any]) -> str:
        return ""

    def release_of(self, strategy: Strategy[Any], outcome: Outcome, version: int) -> Verdict:
        return Verdict()

    def public_record(self, record: dict[str, Any]) -> dict[str, Any]:
        return record

    def epsilon(self) -> float | None:
        return None

    def spent(self) -> Any:
        return None

    def summary(self) -> dict[str, Any]:
        return {}

    def state(self) -> dict[str, Any]:
        return {}

    def load_state(self, state: dict[str, Any]) -> None:
        """Nothing to restore."""
