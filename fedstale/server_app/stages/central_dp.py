"""Central differential privacy as one stage of the engine, for a rule that declares how it
releases (`Rule(dp=Release(...))`, the math in fedstale/strategies/privacy.py):

- every accepted update's delta is clipped to `dp-clipping-norm` C before the rule sees it
  (`dp-clipping=server`), or checked to be within C (`client`: the ClientApp clipped it,
  e.g. Flower's `fixedclipping_mod`, told C by the task's `clipping_norm` entry); a node
  whose updates exceed C `dp-max-rejections` times is excluded from the run;
- every release (an Outcome that changes the global model) gets Gaussian noise of standard
  deviation z * S, S the release's sensitivity from the weights its updates got, summed
  per client; the noise source is in noise.py (the run's seed is in every ClientApp's
  config, so noise is never drawn from it unless `dp-noise-seed` asks for a replayable,
  non-private stream);
- every release is written to the lineage's ledger (ledger.py) and flushed to disk before
  the model leaves the server, and is one Gaussian event for the accountant (RDP, or PLD
  with `dp-accountant=pld`; accounting.py), which is rebuilt from the ledger on resume;
- the budget `dp-max-epsilon` is checked on the live accountant before every release: a
  release that would pass it is withheld (the rule's model goes back to the last one
  released) and the run stops; after every release the run stops when one more would not
  fit.

The relation accounted is zero-out of one client's updates (every update of one client, or
one data partition, replaced by nothing) under a public dispatch schedule, without
amplification by sampling; docs/privacy.md says what this covers and what it does not.
"""

from __future__ import annotations

import copy
import logging
import math
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import numpy as np

from fedstale.common.config import ConfigError, KebabModel, PrivacySettings, RunConfig, RunSettings
from fedstale.common.files import resume_folder
from fedstale.common.schema import CLIPPING_NORM, RETURN_MODEL, InvalidReply
from fedstale.server_app.stages.accounting import (
    Accountant,
    AccountingConfig,
    GaussianRelease,
    PldAccountant,
    RdpAccountant,
    prior_events,
)
from fedstale.server_app.stages.ledger import (
    EVENT_FIELDS,
    LEDGER_FILE,
    PRIOR,
    RELEASE,
    Ledger,
    entry,
)
from fedstale.server_app.stages.noise import noise_source, replayable_stream
from fedstale.server_app.stages.pipeline import Messages, Stage, Verdict
from fedstale.strategies.base import Outcome, Strategy, Update
from fedstale.strategies.privacy import LINEAR, Release, clip_to, noised, release_sensitivity
from fedstale.strategies.registry import rule_named

log = logging.getLogger("fedstale")
CLIENT_SLACK = 1e-4  # relative: a client's float32 clip may land a hair above C
REPLAYABLE = "replayable from dp-noise-seed: not private"
UNPREDICTABLE = "operating-system entropy"
PCG64 = "NumPy PCG64: not a cryptographically secure generator"
CHACHA20 = "ChaCha20 keystream, each draw the sum of 4 halved: cryptographically secure"


class NotClipped(InvalidReply):
    """An update longer than the clipping norm where the client clips."""


RELATION = "zero-out of one client's updates"
SCHEDULE = "public dispatch schedule"
SAMPLING = "no amplification"
UNIT = "one client: every update of one data partition"


@dataclass(frozen=True)
class Accounting:
    """The arithmetic of a run's privacy budget: its DP settings and the population an
    event is counted over (every client of the run)."""

    privacy: PrivacySettings
    population: int

    @classmethod
    def of(cls, run: RunConfig) -> Accounting:
        return cls(run, run.num_clients)

    def accountant(self) -> Accountant:
        """The RDP accountant (Flower's numbers), or with `dp-accountant=pld` the PLD
        accountant of the same events (fedstale/server_app/stages/accounting.py)."""
        kind = PldAccountant if self.privacy.dp_accountant == "pld" else RdpAccountant
        config = AccountingConfig(
            target_delta=self.privacy.dp_target_delta,
            population_size=self.population,
            max_epsilon=self.privacy.dp_max_epsilon or None,
        )
        return kind(config)

    def event(self, updates: int) -> GaussianRelease:
        return GaussianRelease(
            noise_multiplier=self.privacy.dp_noise_multiplier,
            sample_size=max(1, min(updates, self.population)),
            population_size=self.population,
        )

    def epsilon_after(self, releases: int) -> float:
        """Epsilon at `dp-target-delta` after `releases` releases (none: 0)."""
        if releases <= 0:
            return 0.0
        accountant = self.accountant()
        accountant.compose(self.event(1), releases)
        return float(accountant.get_epsilon(self.privacy.dp_target_delta))

    def releases_within(self, ceiling: int = 10**9) -> int:
        """The most releases whose epsilon stays within `dp-max-epsilon` (epsilon grows with
        every release: a doubling, then a bisection)."""
        limit = self.privacy.dp_max_epsilon
        if self.epsilon_after(1) > limit:
            return 0
        low, high = 1, 2
        while high < ceiling and self.epsilon_after(high) <= limit:
            low, high = high, high * 2
        while high - low > 1:
            middle = (low + high) // 2
            fits = self.epsilon_after(middle) <= limit
            low, high = (middle, high) if fits else (low, middle)
        return low

    def check_budget(self) -> None:
        """Refuse, before the run, a budget that not even one release fits in."""
        privacy = self.privacy
        first = self.epsilon_after(1) if privacy.dp_max_epsilon else 0.0
        if first > privacy.dp_max_epsilon:  # no release fits: releases_within would say 0
            raise ConfigError(
                f"run config: dp-max-epsilon {privacy.dp_max_epsilon:g} is below the epsilon "
                f"of one release ({first:.3g} at dp-target-delta {privacy.dp_target_delta:g} "
                f"with dp-noise-multiplier {privacy.dp_noise_multiplier:g}); raise either"
            )


SCHEDULE_FIELDS = ("client", "task", "staleness", "late")  # public: the dispatch schedule


def dominance_notes(run: RunConfig, params: KebabModel) -> list[str]:
    """Configurations under which one client holds several updates of a release: the noise
    follows that client's summed weights (the guarantee holds; the noise grows)."""
    release = rule_named(run.strategy).dp if run.clips else None
    if release is None:
        return []
    notes = []
    per_release, clients = release.per_release(run, params), run.num_clients
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


class CentralDP(Stage):
    """Clipping, noise, the ledger and the budget for one run (`for_run`: None when DP is
    off, and the run has no privacy stage)."""

    key = "privacy"

    def __init__(
        self,
        accounting: Accounting,
        release: Release,
        accountant: Any = None,
        folder: Path | None = None,
        name: str = "",
        resumed_from: Path | None = None,
    ) -> None:
        self.accounting = accounting
        self.privacy = run = accounting.privacy
        self.declared = release  # how the rule releases (strategies/privacy.py)
        self.noised = run.dp_noise_multiplier > 0
        self.accountant = accountant or (accounting.accountant() if self.noised else None)
        self.resumed_from = resumed_from  # the folder of the run a resume continues
        self.budget = run.dp_max_epsilon or None
        self.folder = folder  # where a new lineage's ledger goes (None: kept in memory)
        self.name = name
        self.ledger: Ledger | None = None  # made at the first use, or loaded on resume
        self.counted = 0  # ledger lines composed into the accountant
        self.releases = 0  # releases of the lineage (every branch, every resume)
        self.own = 0  # releases this run made
        self.withheld = 0
        self.clipped = 0  # updates the server scaled down (server-side clipping)
        self.unclipped: dict[int, int] = {}  # node -> updates rejected above the norm
        self.last_std = 0.0
        self.last_sensitivity = 0.0
        self.last_released: np.ndarray | None = None  # kept under a budget, to withhold
        self.replayable = run.dp_noise_seed >= 0
        self.fresh_noise = noise_source(run.dp_secure_noise)
        self.starts: dict[int, np.ndarray] = {}  # task -> model it began at (rules taking models)

    @classmethod
    def for_run(
        cls,
        run: RunConfig,
        params: KebabModel,
        accountant: Any = None,
        folder: Path | None = None,
        name: str = "",
    ) -> CentralDP | None:
        if not run.clips:
            return None
        release = rule_named(run.strategy).dp
        if release is None:  # load_config refuses this first; a door that skipped it
            raise ConfigError(f"run config: strategy {run.strategy} cannot take DP")
        for note in dominance_notes(run, params):
            log.warning("DP: %s", note)
        return cls(Accounting.of(run), release, accountant, folder, name, resumed_from(run))

    @property
    def norm(self) -> float:
        return self.privacy.dp_clipping_norm

    @property
    def keeps_client_values(self) -> bool:
        """`dp-client-values`; `auto` keeps them only where no noise promises anything."""
        choice = self.privacy.dp_client_values
        return choice == "keep" or (choice == "auto" and not self.noised)

    # ---------------------------------------------------------------- the update path
    def task_entries(self) -> dict[str, Any]:
        """What every task carries: the clipping norm, where the client clips."""
        return {CLIPPING_NORM: self.norm} if self.privacy.dp_clipping == "client" else {}

    def sent(self, task_id: int, start: np.ndarray, returns: str, carries: str) -> None:
        """A rule that takes models back clips their delta from the model the task began at."""
        if returns == RETURN_MODEL:
            self.starts[task_id] = np.array(start, dtype=np.float32, copy=True)

    def forget(self, task_id: int) -> None:
        self.starts.pop(task_id, None)

    def update(self, task_id: int, update: Update) -> Update:
        return self.clip(update, self.starts.get(task_id))

    def clip(self, update: Update, start: np.ndarray | None) -> Update:
        """`update` with its delta (its model minus `start`, for a rule that takes models)
        within the clipping norm: scaled down here, or checked when the client clips."""
        delta = update.vector if start is None else update.vector - start
        if self.privacy.dp_clipping == "client":
            length = float(np.linalg.norm(delta.astype(np.float64)))
            if length > self.norm * (1 + CLIENT_SLACK):
                # the norm itself is the client's data: never written anywhere
                raise NotClipped(
                    f"update exceeds dp-clipping-norm {self.norm:g}: the ClientApp does not "
                    "clip (add Flower's fixedclipping_mod)"
                )
            if length <= self.norm:
                return update
            # within the slack a float32 clip allows: scaled to C, nothing above C released
        clipped, factor = clip_to(delta, self.norm)
        if factor < 1.0 and self.privacy.dp_clipping == "server":
            self.clipped += 1
        vector = clipped if start is None else (start.astype(np.float64) + clipped)
        return replace(update, vector=vector.astype(np.float32))

    def excludes(self, node: int, client: int, err: InvalidReply) -> str:
        """Client-side clipping: a node whose updates exceeded the clipping norm
        `dp-max-rejections` times is excluded from the run."""
        if not isinstance(err, NotClipped):
            return ""
        count = self.unclipped[node] = self.unclipped.get(node, 0) + 1
        if count < self.privacy.dp_max_rejections:
            return ""
        log.error(
            "node %d (client %d) excluded from the run: %d of its updates exceeded "
            "dp-clipping-norm %g (dp-max-rejections); its ClientApp does not clip",
            node,
            client,
            count,
            self.norm,
        )
        return (
            "updates above dp-clipping-norm: add Flower's fixedclipping_mod to the ClientApp's "
            "train handler, or use dp-clipping=server"
        )

    def record(self, row: dict[str, Any]) -> dict[str, Any]:
        """An updates.jsonl row as the guarantee covers it: everything where client values
        are kept; else the dispatch schedule only, and the weight where it does not depend
        on the clients' data (a linear release)."""
        if self.keeps_client_values:
            return row
        kept = (*SCHEDULE_FIELDS, "weight") if self.declared.kind == LINEAR else SCHEDULE_FIELDS
        return {key: value for key, value in row.items() if key in kept}

    # ---------------------------------------------------------------- releases
    def opening(self, strategy: Strategy[Any]) -> str:
        """The ledger opened (the lineage's priors on it), the released model kept; why no
        release can be made at all ("" when one can)."""
        with self.book().held() as lines:
            self.take_in(lines)
        if self.budget is not None:
            self.last_released = strategy.model.copy()
        return self.spent_reason()

    def release(
        self, strategy: Strategy[Any], outcome: Outcome, version: int, messages: Messages
    ) -> Verdict:
        return self.release_of(strategy, outcome, version)

    def release_of(self, strategy: Strategy[Any], outcome: Outcome, version: int) -> Verdict:
        """Noise the new global model `version`, write it to the ledger (flushed) and account
        it, or withhold it when the budget allows no further release."""
        weights = [float(record["weight"]) for record in outcome.records]
        if not weights:
            raise RuntimeError(f"{strategy.name} released a model without its updates' weights")
        clients = [int(record["client"]) for record in outcome.records]
        sensitivity = release_sensitivity(self.declared.kind, weights, self.norm, clients)
        event = self.accounting.event(len(weights))
        with self.book().held() as lines:
            self.take_in(lines)
            if self.would_pass(event):
                return self.withhold(strategy)
            self.last_sensitivity = sensitivity
            if self.noised:
                z = self.privacy.dp_noise_multiplier
                stream = self.noise_stream(version)
                strategy.model = noised(strategy.model, z, sensitivity, stream)
                self.last_std = z * sensitivity
            line = entry(RELEASE, self.name, version, event)
            self.book().append(line)  # on the disk before the model leaves
            self.take_in([line])
        self.own += 1
        if self.last_released is not None:
            self.last_released = strategy.model.copy()
        return Verdict(released=True, stop=self.spent_reason())

    def withhold(self, strategy: Strategy[Any]) -> Verdict:
        if self.last_released is None:
            raise RuntimeError("a release was withheld before the stage started")
        strategy.model = self.last_released.copy()
        self.withheld += 1
        log.warning("privacy budget: a new model was withheld, never released")
        return Verdict(released=False, stop=self.spent_reason())

    def would_pass(self, event: GaussianRelease) -> bool:
        if not self.noised or self.budget is None:
            return False
        return bool(self.accountant.would_exceed(event, self.budget))

    def spent_reason(self) -> str:
        """Why the run stops: one more release would pass dp-max-epsilon ("" otherwise)."""
        if not self.would_pass(self.accounting.event(1)):
            return ""
        return (
            f"privacy budget: epsilon {self.epsilon():.3g} at delta "
            f"{self.privacy.dp_target_delta:g} "
            f"after {self.releases} releases; one more would pass dp-max-epsilon "
            f"{self.privacy.dp_max_epsilon:g}"
        )

    def book(self) -> Ledger:
        """The lineage's ledger: loaded on resume, else begun here (with the events an
        accountant passed in already holds, written once as its priors)."""
        if self.ledger is not None:
            return self.ledger
        on_disk = self.noised and self.folder is not None
        self.ledger = Ledger.at(self.folder / LEDGER_FILE, self.name) if on_disk else Ledger()
        with self.ledger.held() as lines:
            if lines:  # a file another run began: every line counts
                self.take_in(lines)
            elif self.accountant is not None:
                for event, count in prior_events(self.accountant):
                    self.ledger.append({**entry(PRIOR, self.name, 0, event), "count": count})
                    self.counted += 1  # the accountant holds it already
        return self.ledger

    def take_in(self, lines: list[dict[str, Any]]) -> None:
        """Compose ledger lines this stage has not counted yet (another branch's, or those
        of the lineage a resumed run continues)."""
        for line in lines:
            if self.noised:
                event = GaussianRelease(*(line[name] for name in EVENT_FIELDS))
                self.accountant.compose(event, int(line.get("count", 1)))
            self.releases += line.get("origin") == RELEASE
            self.counted += 1

    def noise_stream(self, version: int) -> Any:
        """Where release `version`'s noise comes from: the run's generator seeded from the
        operating system, or with `dp-noise-seed` a stream anyone with the seed can replay."""
        if self.replayable:
            return replayable_stream(self.privacy.dp_noise_seed, version)
        return self.fresh_noise

    def epsilon(self) -> float | None:
        """Epsilon of the lineage at `dp-target-delta` (None: no noise, no guarantee)."""
        if not self.noised:
            return None
        if not self.counted:
            return 0.0
        return float(self.accountant.get_epsilon(self.privacy.dp_target_delta))

    def figures(self) -> dict[str, float]:
        spent = self.epsilon()
        return {} if spent is None else {"privacy/epsilon": spent}

    def spent(self) -> Any:
        """Flower's PrivacySpent of the releases so far (None without noise)."""
        return self.accountant.get_privacy_spent() if self.noised else None

    def summary(self) -> dict[str, Any]:
        run = self.privacy
        values_kept = self.keeps_client_values
        return {
            "privacy": {
                "epsilon": self.epsilon(),
                "delta": run.dp_target_delta,
                "releases": self.releases,
                "releases_this_run": self.own,
                "withheld": self.withheld,
                "ledger": str(self.ledger.path) if self.ledger and self.ledger.path else None,
                "noise_multiplier": run.dp_noise_multiplier,
                "clipping_norm": run.dp_clipping_norm,
                "clipping": run.dp_clipping,
                "updates_clipped": self.clipped
                if values_kept and run.dp_clipping == "server"
                else None,
                "client_values": "kept" if values_kept else "omitted",
                "max_epsilon": run.dp_max_epsilon or None,
                "sensitivity": f"{self.declared.kind}, per client",
                "noise": REPLAYABLE if self.replayable else UNPREDICTABLE,
                "generator": CHACHA20 if self.privacy.dp_secure_noise else PCG64,
                "relation": f"{RELATION}, {SCHEDULE}",
                "unit": UNIT,
                "accounting": f"{run.dp_accountant}, {RELATION}, {SAMPLING}",
            }
        }

    def state(self) -> dict[str, Any]:
        """The ledger's place, lineage, length and head (its lines when in memory); the
        accountant is rebuilt from it. The clipped count only where client values are kept
        (how many updates were longer than C is data-dependent, and not noised)."""
        state = {"releases": self.releases, "ledger": self.book().state()}
        return {**state, "clipped": self.clipped} if self.keeps_client_values else state

    def load_state(self, state: dict[str, Any]) -> None:
        self.clipped = state.get("clipped", 0)
        if "ledger" not in state:
            if self.noised:
                raise ConfigError(PREDATES_LEDGER)
            return
        self.ledger = Ledger.resumed(state["ledger"], self.name, self.resumed_from)
        with self.ledger.held() as lines:
            self.take_in(lines)


def resumed_from(run: RunSettings) -> Path | None:
    return resume_folder(run.resume_from) if run.resume_from else None


PREDATES_LEDGER = (
    "resume-from: this checkpoint of a run with DP noise predates fedstale's privacy ledger, "
    "so releases made after it cannot be counted; start a new run"
)


def check_resume(run: RunConfig, privacy_state: dict[str, Any] | None, accountant: Any) -> None:
    """Before a resumed run touches any folder: its lineage's ledger is there, and its
    budget allows one more release (one ConfigError line otherwise: nothing released)."""
    if run.dp_noise_multiplier <= 0 or not run.clips:
        return
    if not privacy_state or "ledger" not in privacy_state:
        raise ConfigError(PREDATES_LEDGER)
    release = rule_named(run.strategy).dp or Release(LINEAR)
    accounting, copied = Accounting.of(run), copy.deepcopy(accountant)  # the user's untouched
    stage = CentralDP(accounting, release, copied, resumed_from=resumed_from(run))
    stage.load_state(privacy_state)
    reason = stage.spent_reason()
    if reason:
        where = stage.ledger.path if stage.ledger is not None else "the checkpoint"
        raise ConfigError(
            f"resume-from: {reason[len('privacy budget: ') :]} (ledger {where}): the run's "
            "privacy budget is spent, nothing was released"
        )


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
