"""A privacy-loss-distribution accountant with Flower's accountant interface
(`flwr.supercore.privacy_accounting.PrivacyAccountant`): the same Gaussian events as
Flower's `RdpAccountant`, composed by `dp_accounting.pld.PLDAccountant`, which bounds the
composition of Gaussian mechanisms tightly (numerically, within its discretisation) where
RDP's conversion to (epsilon, delta) is loose: 17.86 against 19.05 for 10 releases at
z = 1, delta 1e-5. Only what fedstale accounts is supported: no amplification by sampling,
add-or-remove-one neighbours (`dp-accountant=pld`).
"""

from __future__ import annotations

from typing import Any

STATE_SCHEMA = 1
METHOD = "pld"
DISCRETISATION = 1e-4  # dp_accounting's default value_discretization_interval


class PldAccountant:
    def __init__(self, config: Any) -> None:
        from flwr.supercore.privacy_accounting import NeighboringRelation, SamplingMethod

        if config.sampling_method != SamplingMethod.NO_AMPLIFICATION:
            raise ValueError("the PLD accountant here supports NO_AMPLIFICATION only")
        if config.neighboring_relation != NeighboringRelation.ADD_OR_REMOVE_ONE:
            raise ValueError("the PLD accountant here supports ADD_OR_REMOVE_ONE only")
        self._config = config
        self._compositions: list[tuple[Any, int]] = []
        self._backend = self._new_backend()

    @staticmethod
    def _new_backend() -> Any:
        import dp_accounting
        from dp_accounting.pld.pld_privacy_accountant import PLDAccountant

        relation = dp_accounting.NeighboringRelation.ADD_OR_REMOVE_ONE
        return PLDAccountant(relation, value_discretization_interval=DISCRETISATION)

    @property
    def config(self) -> Any:
        return self._config

    @property
    def num_releases(self) -> int:
        return sum(count for _, count in self._compositions)

    def compose(self, event: Any, count: int = 1) -> None:
        """`count` Gaussian releases of noise multiplier `event.noise_multiplier`."""
        import dp_accounting

        if count < 1:
            raise ValueError("count must be a positive integer")
        self._backend.compose(dp_accounting.GaussianDpEvent(event.noise_multiplier), count)
        self._compositions.append((event, count))

    def get_epsilon(self, delta: float) -> float:
        return float(self._backend.get_epsilon(delta))

    def get_delta(self, epsilon: float) -> float:
        return float(self._backend.get_delta(epsilon))

    def get_privacy_spent(self, delta: float | None = None) -> Any:
        from flwr.supercore.privacy_accounting import PrivacySpent

        target = self._config.target_delta if delta is None else delta
        epsilon = self.get_epsilon(target)
        return PrivacySpent(epsilon, target, self.num_releases, METHOD)

    def would_exceed(self, event: Any, max_epsilon: float | None = None, count: int = 1) -> bool:
        limit = self._config.max_epsilon if max_epsilon is None else max_epsilon
        if limit is None:
            raise ValueError("max_epsilon must be given in PrivacyConfig or here")
        projected = PldAccountant(self._config)
        for past, times in [*self._compositions, (event, count)]:
            projected.compose(past, times)
        return projected.get_epsilon(self._config.target_delta) > limit

    def state_dict(self) -> dict[str, object]:
        events = [
            {
                "noise_multiplier": event.noise_multiplier,
                "sample_size": event.sample_size,
                "population_size": event.population_size,
                "count": count,
            }
            for event, count in self._compositions
        ]
        return {"schema_version": STATE_SCHEMA, "backend": METHOD, "compositions": events}

    def load_state_dict(self, state: dict[str, object]) -> None:
        from flwr.supercore.privacy_accounting import GaussianPrivacyEvent

        if state.get("backend") != METHOD:
            raise ValueError(f"not a {METHOD} accountant's state: {state.get('backend')!r}")
        self._compositions, self._backend = [], self._new_backend()
        for entry in state["compositions"]:  # type: ignore[union-attr]
            values = dict(entry)
            count = int(values.pop("count"))
            self.compose(GaussianPrivacyEvent(**values), count)
