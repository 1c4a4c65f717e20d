"""Central differential privacy in the engine, for a rule that declares how it releases
(`Rule(dp=Release(...))`, the math in fedstale/strategies/privacy.py):

- every accepted update's delta is clipped to `dp-clipping-norm` C before the rule sees it
  (`dp-clipping=server`), or checked to be within C (`client`: the ClientApp clipped it,
  e.g. Flower's `fixedclipping_mod`, told C by the task's `clipping_norm` entry); a node
  whose updates exceed C `dp-max-rejections` times is excluded from the run;
- every release (an Outcome that changes the global model) gets Gaussian noise of standard
  deviation z * S, S the release's sensitivity from the weights its updates got, summed
  per client. The noise comes from the operating system's entropy (a generator seeded
  from it per run, and again on resume): the run's seed is in the config every ClientApp
  receives, so noise drawn from it could be subtracted from every release. `dp-noise-seed`
  >= 0 replays the noise bit for bit (tests, debugging): not private, refused in a
  deployment, and said so in the log and summary.json;
- every release is one Gaussian event for the RDP accountant (Flower's numbers; or the PLD
  accountant of dp-accounting, `dp-accountant=pld`; fedstale/server_app/accounting.py),
  add-or-remove-one client, without amplification by sampling (an asynchronous server does
  not sample its clients uniformly at random);
  `dp-max-epsilon` ends the run at the last release within it.
"""

from __future__ import annotations

import logging
import math
from dataclasses import replace
from typing import Any

import numpy as np

from fedstale.common.config import ConfigError, RunConfig
from fedstale.common.schema import CLIPPING_NORM, InvalidReply
from fedstale.server_app.accounting import (
    Accountant,
    AccountingConfig,
    GaussianRelease,
    PldAccountant,
    RdpAccountant,
)
from fedstale.strategies.base import Outcome, Strategy, Update
from fedstale.strategies.privacy import LINEAR, Release, clip_to, noised, release_sensitivity
from fedstale.strategies.registry import rule_named

log = logging.getLogger("fedstale")
NOISE_STREAM = 0xD9
CLIENT_SLACK = 1e-4  # relative: a client's float32 clip may land a hair above C
REPLAYABLE = "replayable from dp-noise-seed: not private"
UNPREDICTABLE = "operating-system entropy"


class NotClipped(InvalidReply):
    """An update longer than the clipping norm where the client clips."""


RELATION = "add-or-remove-one client"
SAMPLING = "no amplification"


def accountant_for(run: RunConfig) -> Accountant:
    """The RDP accountant for this run (Flower's numbers), or with `dp-accountant=pld` the
    PLD accountant of the same events (fedstale/server_app/accounting.py)."""
    kind = PldAccountant if run.dp_accountant == "pld" else RdpAccountant
    config = AccountingConfig(
        target_delta=run.dp_target_delta,
        population_size=run.num_clients,
        max_epsilon=run.dp_max_epsilon or None,
    )
    return kind(config)


def event_for(run: RunConfig, updates: int) -> GaussianRelease:
    return GaussianRelease(
        noise_multiplier=run.dp_noise_multiplier,
        sample_size=max(1, min(updates, run.num_clients)),
        population_size=run.num_clients,
    )


def epsilon_after(run: RunConfig, releases: int) -> float:
    """Epsilon at `dp-target-delta` after `releases` releases (none: 0)."""
    if releases <= 0:
        return 0.0
    accountant = accountant_for(run)
    accountant.compose(event_for(run, 1), releases)
    return float(accountant.get_epsilon(run.dp_target_delta))


def releases_within(run: RunConfig, ceiling: int = 10**9) -> int:
    """The most releases whose epsilon stays within `dp-max-epsilon` (epsilon grows with
    every release: a doubling, then a bisection)."""
    limit = run.dp_max_epsilon
    if epsilon_after(run, 1) > limit:
        return 0
    low, high = 1, 2
    while high < ceiling and epsilon_after(run, high) <= limit:
        low, high = high, high * 2
    while high - low > 1:
        middle = (low + high) // 2
        low, high = (middle, high) if epsilon_after(run, middle) <= limit else (low, middle)
    return low


def check_budget(run: RunConfig) -> None:
    """Refuse, before the run, a budget that not even one release fits in."""
    first = epsilon_after(run, 1) if run.dp_max_epsilon else 0.0
    if first > run.dp_max_epsilon:  # no release fits: releases_within would say 0
        raise ConfigError(
            f"run config: dp-max-epsilon {run.dp_max_epsilon:g} is below the epsilon of one "
            f"release ({first:.3g} at dp-target-delta {run.dp_target_delta:g} with "
            f"dp-noise-multiplier {run.dp_noise_multiplier:g}); raise either"
        )


SCHEDULE_FIELDS = ("client", "task", "staleness", "late")  # public: the dispatch schedule


def dominance_notes(run: RunConfig) -> list[str]:
    """Configurations under which one client holds several updates of a release: the noise
    follows that client's summed weights (the guarantee holds; the noise grows)."""
    release = rule_named(run.strategy).dp if run.clips else None
    if release is None:
        return []
    notes = []
    per_release, clients = release.per_release(run), run.num_clients
    if release.kind == LINEAR and per_release > clients:
        notes.append(
            f"{per_release} updates per release from {clients} clients: some client holds at "
            f"least {math.ceil(per_release / clients)} updates of every release, and its "
            "noise follows that client's summed weights (use more clients than buffer-size)"
        )
    if run.prefetch:
        notes.append(
            "prefetch gives a client a second task while it trains: both of its updates can "
            "fall in one release, whose noise then follows their summed weights"
        )
    return notes


class CentralDP:
    """Clipping, noise and accounting for one run (`for_run`: None when DP is off)."""

    def __init__(self, run: RunConfig, release: Release, accountant: Any = None) -> None:
        self.run = run
        self.release = release
        self.noised = run.dp_noise_multiplier > 0
        self.accountant = accountant or (accountant_for(run) if self.noised else None)
        self.allowed = releases_within(run) if run.dp_max_epsilon else None
        self.releases = 0
        self.clipped = 0  # updates the server scaled down (server-side clipping)
        self.last_std = 0.0
        self.last_sensitivity = 0.0
        self.replayable = run.dp_noise_seed >= 0
        # No seed: NumPy draws the generator's seed from the operating system's entropy.
        self.fresh_noise = np.random.default_rng()

    @classmethod
    def for_run(cls, run: RunConfig, accountant: Any = None) -> CentralDP | None:
        if not run.clips:
            return None
        release = rule_named(run.strategy).dp
        if release is None:  # load_config refuses this first; a door that skipped it
            raise ConfigError(f"run config: strategy {run.strategy} cannot take DP")
        for note in dominance_notes(run):
            log.warning("DP: %s", note)
        return cls(run, release, accountant)

    @property
    def norm(self) -> float:
        return self.run.dp_clipping_norm

    def public_record(self, record: dict[str, Any]) -> dict[str, Any]:
        """An updates.jsonl row as the guarantee covers it: everything with
        `dp-client-values=keep`; with `omit`, the dispatch schedule only, and the weight
        where it does not depend on the clients' data (a linear release)."""
        if self.run.dp_client_values == "keep":
            return record
        kept = (*SCHEDULE_FIELDS, "weight") if self.release.kind == LINEAR else SCHEDULE_FIELDS
        return {key: value for key, value in record.items() if key in kept}

    def task_entries(self) -> dict[str, Any]:
        """What every task carries: the clipping norm, where the client clips."""
        return {CLIPPING_NORM: self.norm} if self.run.dp_clipping == "client" else {}

    def clip(self, update: Update, start: np.ndarray | None) -> Update:
        """`update` with its delta (its model minus `start`, for a rule that takes models)
        within the clipping norm: scaled down here, or checked when the client clips."""
        delta = update.vector if start is None else update.vector - start
        if self.run.dp_clipping == "client":
            length = float(np.linalg.norm(delta.astype(np.float64)))
            if length > self.norm * (1 + CLIENT_SLACK):
                raise NotClipped(
                    f"update norm {length:.4g} exceeds dp-clipping-norm {self.norm:g}: the "
                    "ClientApp does not clip (add Flower's fixedclipping_mod)"
                )
            if length <= self.norm:
                return update
            # within the slack a float32 clip allows: scaled to C, nothing above C released
        clipped, factor = clip_to(delta, self.norm)
        if factor < 1.0 and self.run.dp_clipping == "server":
            self.clipped += 1
        vector = clipped if start is None else (start.astype(np.float64) + clipped)
        return replace(update, vector=vector.astype(np.float32))

    def release_of(self, strategy: Strategy[Any], outcome: Outcome, version: int) -> str:
        """Noise the new global model `version` and account it; the reason to stop the run
        when the budget allows no further release ("" otherwise)."""
        weights = [float(record["weight"]) for record in outcome.records]
        if not weights:
            raise RuntimeError(f"{strategy.name} released a model without its updates' weights")
        clients = [int(record["client"]) for record in outcome.records]
        sensitivity = release_sensitivity(self.release.kind, weights, self.norm, clients)
        self.releases += 1
        self.last_sensitivity = sensitivity
        if not self.noised:
            return ""
        z = self.run.dp_noise_multiplier
        strategy.model = noised(strategy.model, z, sensitivity, self.noise_stream(version))
        self.last_std = z * sensitivity
        self.accountant.compose(event_for(self.run, len(weights)))
        if self.allowed is not None and self.releases >= self.allowed:
            return (
                f"privacy budget: epsilon {self.epsilon():.3g} at delta "
                f"{self.run.dp_target_delta:g} after {self.releases} releases; one more "
                f"would pass dp-max-epsilon {self.run.dp_max_epsilon:g}"
            )
        return ""

    def noise_stream(self, version: int) -> np.random.Generator:
        """Where release `version`'s noise comes from: the run's generator seeded from the
        operating system, or with `dp-noise-seed` a stream anyone with the seed can replay."""
        if self.replayable:
            return np.random.default_rng([self.run.dp_noise_seed, NOISE_STREAM, version])
        return self.fresh_noise

    def epsilon(self) -> float | None:
        """Epsilon spent at `dp-target-delta` (None: no noise, no guarantee)."""
        if not self.noised:
            return None
        if not self.releases:
            return 0.0
        return float(self.accountant.get_epsilon(self.run.dp_target_delta))

    def spent(self) -> Any:
        """Flower's PrivacySpent of the releases so far."""
        return self.accountant.get_privacy_spent()

    def summary(self) -> dict[str, Any]:
        run = self.run
        return {
            "privacy": {
                "epsilon": self.epsilon(),
                "delta": run.dp_target_delta,
                "releases": self.releases,
                "noise_multiplier": run.dp_noise_multiplier,
                "clipping_norm": run.dp_clipping_norm,
                "clipping": run.dp_clipping,
                "updates_clipped": self.clipped if run.dp_clipping == "server" else None,
                "max_epsilon": run.dp_max_epsilon or None,
                "sensitivity": f"{self.release.kind}, per client",
                "noise": REPLAYABLE if self.replayable else UNPREDICTABLE,
                "accounting": f"{self.run.dp_accountant}, {RELATION}, {SAMPLING}",
            }
        }

    def state(self) -> dict[str, Any]:
        accountant = self.accountant.state_dict() if self.accountant is not None else None
        return {"releases": self.releases, "clipped": self.clipped, "accountant": accountant}

    def load_state(self, state: dict[str, Any]) -> None:
        self.releases, self.clipped = state["releases"], state["clipped"]
        if self.accountant is not None and state["accountant"] is not None:
            self.accountant.load_state_dict(state["accountant"])


def privacy_words(summary: dict[str, Any]) -> str:
    """`epsilon 2.31 at delta 1e-05 over 40 releases` for a closing line ("" without DP or
    noise)."""
    privacy = summary.get("privacy") or {}
    if privacy.get("epsilon") is None:
        return ""
    return (
        f"epsilon {privacy['epsilon']:.3g} at delta {privacy['delta']:g} over "
        f"{privacy['releases']} releases"
    )
