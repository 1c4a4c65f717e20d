"""The privacy accountants of central DP, on Google's dp-accounting, with the interface of
Flower's accountants (`compose`, `get_epsilon`, `get_privacy_spent`, `would_exceed`,
`state_dict`), so that a library user may pass Flower's own `RdpAccountant` instead.

- `RdpAccountant`: Renyi DP, composed by `dp_accounting.rdp.RdpAccountant` with its default
  orders, as Flower's `RdpAccountant` composes it (the same epsilon to the last digit,
  tests/test_central_dp.py); its state has the layout of Flower's, so checkpoints written
  when fedstale used Flower's accountant resume.
- `PldAccountant` (`dp-accountant=pld`): the same Gaussian events composed by
  `dp_accounting.pld.PLDAccountant`, which bounds the composition of Gaussian mechanisms
  tightly (within its discretisation) where RDP's conversion to (epsilon, delta) is loose:
  17.86 against 19.05 for 10 releases at z = 1, delta 1e-5. Releases with multipliers
  z_i compose to one Gaussian mechanism of multiplier (sum_i 1/z_i^2)^(-1/2) (Dong, Roth
  and Su 2019, Corollary 3.3), which is what dp_accounting composes for n releases of one
  z; the distribution is built only when an epsilon is asked and kept for that ledger.

Only what fedstale accounts is supported: no amplification by sampling (an asynchronous
server does not sample its clients uniformly at random). dp_accounting's relation is named
add-or-remove-one, as Flower's is; without sampling a Gaussian release of sensitivity C
costs the same under it as under the zero-out relation fedstale implements (one client's
clipped updates replaced by zeros moves the sum by at most C).
The events and the relation are duck-typed: a Flower `GaussianPrivacyEvent` or
`PrivacyConfig` works wherever these take fedstale's, and the other way round.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

ADD_OR_REMOVE_ONE = "add-or-remove-one"  # Flower's NeighboringRelation values
NO_AMPLIFICATION = "no-amplification"  # Flower's SamplingMethod values
STATE_SCHEMA = 1
PLD_DISCRETISATION = 1e-4  # dp_accounting's default value_discretization_interval


@dataclass(frozen=True)
class AccountingConfig:
    """What Flower's `PrivacyConfig` holds, for the one model fedstale accounts."""

    target_delta: float
    population_size: int
    max_epsilon: float | None = None
    neighboring_relation: str = ADD_OR_REMOVE_ONE
    sampling_method: str = NO_AMPLIFICATION


@dataclass(frozen=True)
class GaussianRelease:
    """One release with Gaussian noise (Flower's `GaussianPrivacyEvent`): the sample sizes
    are kept for the record; without amplification they do not change the cost."""

    noise_multiplier: float
    sample_size: int
    population_size: int


@dataclass(frozen=True)
class Spent:
    """The privacy spent so far (Flower's `PrivacySpent`)."""

    epsilon: float
    delta: float
    num_releases: int
    accounting_method: str
    optimal_order: float | None = None


def supported(config: Any) -> str:
    """'' where fedstale can account under `config` (its or Flower's), else what is wrong."""
    if str(getattr(config.sampling_method, "value", config.sampling_method)) != NO_AMPLIFICATION:
        return "sampling_method"
    relation = getattr(config.neighboring_relation, "value", config.neighboring_relation)
    if str(relation) != ADD_OR_REMOVE_ONE:
        return "neighboring_relation"
    return ""


class Accountant:
    """The ledger of releases and the epsilon they compose to; subclasses name a backend."""

    method = ""

    def __init__(self, config: Any) -> None:
        problem = supported(config)
        if problem:
            raise ValueError(f"fedstale accounts {NO_AMPLIFICATION}, {ADD_OR_REMOVE_ONE} only")
        self._config = config
        self._compositions: list[tuple[Any, int]] = []

    @property
    def config(self) -> Any:
        return self._config

    @property
    def num_releases(self) -> int:
        return sum(count for _, count in self._compositions)

    def compose(self, event: Any, count: int = 1) -> None:
        """`count` Gaussian releases of noise multiplier `event.noise_multiplier`."""
        if count < 1:
            raise ValueError("count must be a positive integer")
        self._compositions.append((event, count))

    def get_epsilon(self, delta: float) -> float:
        raise NotImplementedError

    def get_privacy_spent(self, delta: float | None = None) -> Spent:
        target = self._config.target_delta if delta is None else delta
        return Spent(self.get_epsilon(target), target, self.num_releases, self.method)

    def limit(self, max_epsilon: float | None) -> float:
        limit = self._config.max_epsilon if max_epsilon is None else max_epsilon
        if limit is None:
            raise ValueError("max_epsilon must be given in the config or here")
        return float(limit)

    def would_exceed(self, event: Any, max_epsilon: float | None = None, count: int = 1) -> bool:
        """Whether `count` more releases of `event` would pass the limit (Flower's check)."""
        raise NotImplementedError

    def events(self) -> list[dict[str, Any]]:
        return [
            {
                "noise_multiplier": event.noise_multiplier,
                "sample_size": event.sample_size,
                "population_size": event.population_size,
                "count": count,
            }
            for event, count in self._compositions
        ]

    def state_dict(self) -> dict[str, object]:
        return {"schema_version": STATE_SCHEMA, "backend": self.method, "compositions": []}

    def load_state_dict(self, state: dict[str, object]) -> None:
        if state.get("backend") != self.method:
            raise ValueError(f"not a {self.method} accountant's state: {state.get('backend')!r}")
        self._forget()
        for entry in state["compositions"]:  # type: ignore[union-attr]
            count = int(entry["count"])
            event = entry.get("event", entry)  # Flower's layout nests the event
            values = {k: v for k, v in event.items() if k != "count"}
            self.compose(GaussianRelease(**values), count)

    def _forget(self) -> None:
        self._compositions = []


class RdpAccountant(Accountant):
    method = "rdp"

    def __init__(self, config: Any) -> None:
        super().__init__(config)
        self._backend = self._new_backend()

    @staticmethod
    def _new_backend() -> Any:
        import dp_accounting
        from dp_accounting import rdp

        return rdp.RdpAccountant(
            neighboring_relation=dp_accounting.NeighboringRelation.ADD_OR_REMOVE_ONE
        )

    def compose(self, event: Any, count: int = 1) -> None:
        import dp_accounting

        super().compose(event, count)
        self._backend.compose(dp_accounting.GaussianDpEvent(event.noise_multiplier), count)

    def _forget(self) -> None:
        super()._forget()
        self._backend = self._new_backend()

    def get_epsilon(self, delta: float) -> float:
        return float(self._backend.get_epsilon(delta))

    def get_delta(self, epsilon: float) -> float:
        return float(self._backend.get_delta(epsilon))

    def get_privacy_spent(self, delta: float | None = None) -> Spent:
        target = self._config.target_delta if delta is None else delta
        epsilon, order = self._backend.get_epsilon_and_optimal_order(target)
        return Spent(float(epsilon), target, self.num_releases, self.method, float(order))

    def would_exceed(self, event: Any, max_epsilon: float | None = None, count: int = 1) -> bool:
        """The ledger so far composed once per noise multiplier, not once per release."""
        import dp_accounting

        limit = self.limit(max_epsilon)
        totals: dict[float, int] = {}
        for past, times in [*self._compositions, (event, count)]:
            z = float(past.noise_multiplier)
            totals[z] = totals.get(z, 0) + times
        projected = self._new_backend()
        for z, times in totals.items():
            projected.compose(dp_accounting.GaussianDpEvent(z), times)
        return float(projected.get_epsilon(self._config.target_delta)) > limit

    def state_dict(self) -> dict[str, object]:
        """Flower's RdpAccountant's layout (its config, orders and events)."""
        config = self._config
        return {
            **super().state_dict(),
            "config": {
                "target_delta": config.target_delta,
                "population_size": config.population_size,
                "neighboring_relation": ADD_OR_REMOVE_ONE,
                "sampling_method": NO_AMPLIFICATION,
                "max_epsilon": config.max_epsilon,
            },
            "orders": [float(order) for order in self._backend.orders],
            "compositions": [
                {"event": {k: v for k, v in e.items() if k != "count"}, "count": e["count"]}
                for e in self.events()
            ],
        }


def precision(event: Any, count: int = 1) -> float:
    """What `count` Gaussian releases add to sum_i 1/z_i^2 (infinite for z = 0)."""
    z = float(event.noise_multiplier)
    return math.inf if z == 0 else count / z**2


class PldAccountant(Accountant):
    """Builds dp_accounting's privacy loss distribution (0.7 s at 10 releases of z = 1, 4 s
    at 100) only when an epsilon is asked, once per ledger; the budget check asks it at
    most twice per threshold, after the analytic Gaussian (a lower bound) has found where
    the threshold lies (tests/test_privacy_ledger.py measures both)."""

    method = "pld"

    def __init__(self, config: Any) -> None:
        super().__init__(config)
        self._precision = 0.0  # sum over releases of 1 / z^2
        self._epsilons: dict[tuple[float, float], float] = {}
        self._safe: dict[float, float] = {}  # limit -> largest precision checked within it
        self._unsafe: dict[float, float] = {}  # limit -> smallest precision checked past it

    def compose(self, event: Any, count: int = 1) -> None:
        super().compose(event, count)
        self._precision += precision(event, count)

    def _forget(self) -> None:
        super()._forget()
        self._precision = 0.0

    def get_epsilon(self, delta: float) -> float:
        return self._epsilon_at(self._precision, delta)

    def _epsilon_at(self, total: float, delta: float) -> float:
        key = (total, delta)
        if key not in self._epsilons:
            import dp_accounting
            from dp_accounting.pld.pld_privacy_accountant import PLDAccountant

            relation = dp_accounting.NeighboringRelation.ADD_OR_REMOVE_ONE
            pld = PLDAccountant(relation, value_discretization_interval=PLD_DISCRETISATION)
            if total > 0:
                pld.compose(dp_accounting.GaussianDpEvent(1.0 / math.sqrt(total)))
            self._epsilons[key] = float(pld.get_epsilon(delta))
        return self._epsilons[key]

    def _surely_past(self, total: float, limit: float) -> bool:
        """The exact Gaussian curve (which the discretised PLD only bounds from above)
        already passes `limit` at `total`."""
        if math.isinf(total):
            return True
        from dp_accounting.pld.privacy_loss_mechanism import GaussianPrivacyLoss

        exact = GaussianPrivacyLoss(standard_deviation=1.0 / math.sqrt(total))
        return float(exact.get_delta_for_epsilon(limit)) > self._config.target_delta

    def would_exceed(self, event: Any, max_epsilon: float | None = None, count: int = 1) -> bool:
        limit = self.limit(max_epsilon)
        after = self._precision + precision(event, count)
        if after <= self._safe.get(limit, -1.0):
            return False
        if after >= self._unsafe.get(limit, math.inf) or self._surely_past(after, limit):
            return True
        step = precision(event, count)
        beyond = self._last_within(after, step, limit)
        while beyond >= 0 and self._epsilon_at(after + beyond * step, self.delta) > limit:
            beyond -= 1  # the discretisation's pessimism costs a release or two
        self._unsafe[limit] = after + (beyond + 1) * step
        if beyond < 0:
            return True
        self._safe[limit] = after + beyond * step
        return False

    @property
    def delta(self) -> float:
        return float(self._config.target_delta)

    def _last_within(self, start: float, step: float, limit: float) -> int:
        """The last k >= 0 whose `start + k * step` the exact curve keeps within `limit`
        (`start` is within)."""
        low, high = 0, 1
        while not self._surely_past(start + high * step, limit):
            low, high = high, high * 2
        while high - low > 1:
            middle = (low + high) // 2
            if self._surely_past(start + middle * step, limit):
                high = middle
            else:
                low = middle
        return low

    def state_dict(self) -> dict[str, object]:
        return {**super().state_dict(), "compositions": self.events()}


def prior_events(accountant: Any) -> list[tuple[GaussianRelease, int]]:
    """The releases an accountant (fedstale's or Flower's) already holds, from its state."""
    state = accountant.state_dict()
    out = []
    for composition in state.get("compositions", []):
        event = composition.get("event", composition)
        values = {k: v for k, v in event.items() if k != "count"}
        out.append((GaussianRelease(**values), int(composition["count"])))
    return out
