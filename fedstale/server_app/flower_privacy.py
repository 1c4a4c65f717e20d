"""Flower's central-DP wrappers, with Flower's names and arguments, for fedstale's
asynchronous strategies:

    strategy = fedstale.DifferentialPrivacyClientSideFixedClipping(
        fedstale.FedBuff(buffer_size=5), noise_multiplier=1.0, clipping_norm=0.5,
        num_sampled_clients=5, accountant=RdpAccountant(PrivacyConfig(...)))
    result = strategy.start(grid=grid, initial_arrays=arrays, num_rounds=50)
    result.privacy.epsilon  # also strategy.privacy_spent()

Flower's own wrappers drive their strategy round by round (`configure_train` /
`aggregate_train`), which an asynchronous strategy has none of; these hand the settings to
fedstale's engine instead (the `dp-*` run-config keys, docs/privacy.md): each update's
delta clipped to `clipping_norm` (by the server, or by the ClientApp's
`flwr.clientapp.mod.fixedclipping_mod`, told the norm in every task's config and checked
by the server), Gaussian noise of `noise_multiplier` times the release's sensitivity on
every new global model. `num_sampled_clients` is Flower's "updates per release" and must
match the rule's (a FedBuff buffer's K, 1 for FedAsync, the round's clients for FedAvg).
`accountant`: Flower's accountant to compose every release into (no-amplification
sampling, its ADD_OR_REMOVE_ONE relation, which without sampling costs a Gaussian release
what the zero-out of one client's updates fedstale implements costs; `population_size`
the number of clients); releases it already holds are written to the run's privacy ledger
first and count against `max_epsilon`. Without one, the run still accounts at delta 1e-5
and reports the epsilon spent.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from flwr.app import ArrayRecord, ConfigRecord, Message, MetricRecord
from flwr.serverapp import Grid

from fedstale.common.config import ConfigError
from fedstale.server_app.flower_strategy import (
    AsyncResult,
    AsyncStrategy,
    EvaluateFn,
    ShouldStop,
)
from fedstale.server_app.stages.accounting import supported


class FixedClipping:
    """Central DP with fixed clipping around a fedstale strategy; `clipping` says where.
    Like the strategies it wraps, not a Flower `Strategy` (flower_strategy.AsyncStrategy
    says why): `start`, `summary` and federated evaluation as Flower's wrappers have them."""

    clipping = "server"

    def __init__(
        self,
        strategy: AsyncStrategy,
        noise_multiplier: float,
        clipping_norm: float,
        num_sampled_clients: int,
        *,
        accountant: Any = None,
    ) -> None:
        name = type(self).__name__
        if not isinstance(strategy, AsyncStrategy):
            raise ConfigError(
                f"{name} here wraps a fedstale strategy (fedstale.FedBuff, ...); for "
                f"{type(strategy).__name__} use flwr.serverapp.strategy.{name}"
            )
        check_arguments(noise_multiplier, clipping_norm, num_sampled_clients, accountant)
        self.noise_multiplier = noise_multiplier
        self.clipping_norm = clipping_norm
        self.num_sampled_clients = num_sampled_clients
        self.accountant = accountant
        # A copy: the user's object keeps its own settings; a rule that cannot take DP is
        # refused here.
        self.strategy = strategy.with_privacy(self.dp_settings(), num_sampled_clients, accountant)
        self.result: AsyncResult | None = None

    def dp_settings(self) -> dict[str, Any]:
        settings: dict[str, Any] = {
            "dp-clipping": self.clipping,
            "dp-noise-multiplier": float(self.noise_multiplier),
            "dp-clipping-norm": float(self.clipping_norm),
        }
        if self.accountant is not None:
            settings["dp-target-delta"] = self.accountant.config.target_delta
            settings["dp-max-epsilon"] = self.accountant.config.max_epsilon or 0.0
        return settings

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.strategy.rule})"

    def summary(self) -> None:
        self.strategy.summary()

    def privacy_spent(self) -> Any:
        """Flower's PrivacySpent of the last run (None before one, or without noise)."""
        return self.result.privacy if self.result is not None else None

    def start(
        self,
        grid: Grid,
        initial_arrays: ArrayRecord,
        num_rounds: int = 3,
        timeout: float = 3600,
        train_config: ConfigRecord | None = None,
        evaluate_config: ConfigRecord | None = None,
        evaluate_fn: EvaluateFn | None = None,
        should_stop: ShouldStop | None = None,
    ) -> AsyncResult:
        configs = (train_config, evaluate_config)
        result = self.strategy.start(
            grid, initial_arrays, num_rounds, timeout, *configs, evaluate_fn, should_stop
        )
        assert isinstance(result, AsyncResult)
        self.result = result
        return result

    def configure_evaluate(
        self, server_round: int, arrays: ArrayRecord, config: ConfigRecord, grid: Grid
    ) -> Iterable[Message]:
        return self.strategy.configure_evaluate(server_round, arrays, config, grid)

    def aggregate_evaluate(
        self, server_round: int, replies: Iterable[Message]
    ) -> MetricRecord | None:
        return self.strategy.aggregate_evaluate(server_round, replies)


def check_arguments(
    noise_multiplier: float, clipping_norm: float, num_sampled_clients: int, accountant: Any
) -> None:
    """Flower's checks of the same arguments, as one ConfigError line each."""
    if noise_multiplier < 0:
        raise ConfigError("noise_multiplier must be >= 0")
    if clipping_norm <= 0:
        raise ConfigError("clipping_norm must be > 0")
    if num_sampled_clients <= 0:
        raise ConfigError("num_sampled_clients must be > 0")
    if accountant is None:
        return
    if noise_multiplier <= 0:
        raise ConfigError("an accountant needs noise: noise_multiplier must be > 0")
    problem = supported(accountant.config)
    if problem == "sampling_method":
        raise ConfigError(
            "an asynchronous server does not sample its clients uniformly at random: make the "
            "accountant's PrivacyConfig(sampling_method=SamplingMethod.NO_AMPLIFICATION)"
        )
    if problem == "neighboring_relation":
        raise ConfigError(
            "fedstale accounts its Gaussian releases under Flower's add-or-remove-one relation: "
            "make the accountant's PrivacyConfig(neighboring_relation=ADD_OR_REMOVE_ONE)"
        )


class DifferentialPrivacyServerSideFixedClipping(FixedClipping):
    """Central DP, fixed clipping at the server: every arriving update's delta clipped to
    `clipping_norm`, Gaussian noise on every release (fedstale/server_app/flower_privacy.py)."""

    clipping = "server"


class DifferentialPrivacyClientSideFixedClipping(FixedClipping):
    """Central DP, fixed clipping at the client: the ClientApp clips (Flower's
    `fixedclipping_mod`, told `clipping_norm` in the task config), the server rejects an
    update past the norm and adds Gaussian noise on every release."""

    clipping = "client"
