"""The contract between the engine and an aggregation rule (second edition).

A strategy is plain math over flat float32 parameter vectors. It knows nothing of time,
nodes or Flower; at each decision the engine shows it a `View` (the global version, the idle
clients, the tasks in flight and their staleness, how many tasks may start now).

- Binding: before the run the engine calls `bind(setup)` once; a rule takes from the
  `Setup` what it needs (the parameter layout, the clients' data sizes, a real calibration
  batch, a sketcher of the global model, a gradient aligner). Nothing else is handed over.
- Client half: `client_rules` are the rule's `ClientRule`s (fedstale/strategies/client.py); every
  task names them, and a client that lacks one refuses the task.
- Dispatch: `plan(view, rng)` returns a `Plan`: the `Assignment`s to make now (the client,
  the model or models it starts from, its task entries and optimiser settings) and what
  changed while planning (a round that closed at once). The default plan is uniform among
  idle clients, up to the capacity; a synchronous rule plans per round (FedAvg), per edge,
  or every client at once.
- Replies: `on_update(update, view)` consumes one validated update and returns an
  `Outcome`: whether the global model changed, one record per update whose weight became
  known, and optionally tasks in flight to supersede with the replacements to dispatch.
- Evaluation: `evaluates` says whether the global model or one model per client
  (`model_of`) is scored; per client, each on that client's own split.
- Replies may carry named array sets beyond the main one (`reply_sets`, or per task
  `expected_sets`), each checked against the model's layout.
- A lost task is reported by `on_task_lost`, which may close a round (an `Outcome`). Its
  reply may still come (a timed-out task, a node that went away after uploading): the
  engine then offers it as a late update, which the rule takes unless `refuses_late` says
  why not (a closed synchronous round, a client whose state was reset).
- Checkpoints: `kept` names the attributes the rule must keep across a restart (beside
  the model); `state()` / `load_state()` save and restore them.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, ClassVar

import numpy as np

from fedstale.common.config import KebabModel, RunConfig
from fedstale.common.schema import ARRAYS, RETURN_DELTA, SignalSpec

if TYPE_CHECKING:
    from fedstale.strategies.client import ClientRule

EVAL_GLOBAL = "global"
EVAL_PER_CLIENT = "per-client"


class NoParams(KebabModel):
    """A strategy without keys of its own."""


@dataclass(frozen=True)
class Update:
    """One validated client result. `vector` is the delta or the model, per `returns`;
    `sets` holds the reply's other named array sets, flattened."""

    client: int
    task_id: int
    base_version: int
    staleness: int
    num_examples: int
    vector: np.ndarray
    signals: dict[str, Any] = field(default_factory=dict)
    compute_seconds: float = 0.0
    sets: dict[str, np.ndarray] = field(default_factory=dict)
    arrivals: int = 0  # updates accepted between this task's dispatch and its arrival
    late: bool = False  # its task had been written off (lost, timed out) before it came


@dataclass(frozen=True)
class InFlight:
    """A task in flight: `staleness` in global versions, `arrivals` in updates the server
    has accepted since the task was dispatched."""

    task_id: int
    client: int
    base_version: int
    staleness: int
    arrivals: int


@dataclass(frozen=True)
class View:
    """What the engine shows a strategy at a decision."""

    version: int = 0
    idle: tuple[int, ...] = ()
    in_flight: tuple[InFlight, ...] = ()
    capacity: int = 0


@dataclass
class Assignment:
    """A task to dispatch. `models`: named flat vectors the client starts from (the main
    set under `ARRAYS`); `entries`: the rule's task-config entries; `settings`: TaskSpec
    fields to override (lr, momentum, proximal_mu, ...)."""

    client: int
    models: dict[str, np.ndarray]
    entries: dict[str, Any] = field(default_factory=dict)
    settings: dict[str, Any] = field(default_factory=dict)


@dataclass
class Outcome:
    """`changed`: the global model moved (the engine bumps the version).
    `records`: one dict per update whose aggregation weight became known now.
    `supersede`: ids of tasks in flight whose replies must be discarded;
    `dispatch`: assignments to send at once (replacements for superseded tasks)."""

    changed: bool = False
    records: list[dict[str, Any]] = field(default_factory=list)
    supersede: list[int] = field(default_factory=list)
    dispatch: list[Assignment] = field(default_factory=list)


@dataclass
class Plan:
    """What `plan` decides: the tasks to dispatch now, and what changed while planning (a
    round with nobody to wait for closed at once), which the engine applies first."""

    assignments: list[Assignment] = field(default_factory=list)
    closed: Outcome | None = None

    def __iter__(self) -> Iterator[Assignment]:
        return iter(self.assignments)

    def __len__(self) -> int:
        return len(self.assignments)

    def __getitem__(self, index: int) -> Assignment:
        return self.assignments[index]


Sketcher = Callable[[np.ndarray], np.ndarray]  # flat global model -> its sketch
Aligner = Callable[[list[np.ndarray], np.ndarray], list[float]]  # clients, server -> cosines


@dataclass(frozen=True)
class Setup:
    """What the server offers a rule before the run (`Strategy.bind`). The callables do
    their work only when a rule calls them.

    segments: (start, stop) of each parameter tensor in the flat vector.
    client_sizes: every client's training-split size.
    calibration(n): a real batch of n held-out samples, as (task entries that carry it,
        the batch itself for `sketcher`).
    sketcher(settings, batch): the sketch of a flat model, computed exactly as a client
        computes its own from the task entries `settings` (and the real `batch`, or None).
    aligner(): cos(grad L(w_client), grad L(w_server)) on a held-out batch.
    """

    segments: tuple[tuple[int, int], ...]
    client_sizes: np.ndarray
    calibration: Callable[[int], tuple[dict[str, Any], Any]]
    sketcher: Callable[[dict[str, Any], Any], Sketcher]
    aligner: Callable[[], Aligner]


def update_record(update: Update, weight: float, **signals: Any) -> dict[str, Any]:
    """An updates.jsonl row; `late` appears (true) only on a late reply's row."""
    return {
        "client": update.client,
        "task": update.task_id,
        "staleness": update.staleness,
        "weight": float(weight),
        **({"late": True} if update.late else {}),
        **signals,
    }


def mean_model(models: np.ndarray) -> np.ndarray:
    """The mean of stacked flat models (float64 sums, float32 result)."""
    return models.mean(axis=0, dtype=np.float64).astype(np.float32)


class Strategy(ABC):
    name: ClassVar[str]
    returns: ClassVar[str] = RETURN_DELTA
    Params: ClassVar[type[KebabModel]] = NoParams
    evaluates: ClassVar[str] = EVAL_GLOBAL
    reply_sets: ClassVar[tuple[str, ...]] = ()  # named array sets beyond the main one
    client_rules: ClassVar[tuple[ClientRule, ...]] = ()  # what each task asks of the client
    kept: ClassVar[tuple[str, ...]] = ()  # attributes a checkpoint keeps beside the model

    def __init__(self, run: RunConfig, params: KebabModel, initial: np.ndarray) -> None:
        self.run = run
        self.params = params
        self.model = np.array(initial, dtype=np.float32, copy=True)

    def step_scale(self, version: int) -> float:
        """Factor on a buffered rule's server step. `spec`: 1 (the papers' equations).
        `client-lr`: the current client learning rate lr0 * decay^version, as FLGo (the
        FedPSA paper's harness) applies a buffer: `w -= lr * mean(w_start - w_i)`."""
        if self.run.server_step == "spec":
            return 1.0
        return self.run.lr * self.run.lr_decay**version

    @classmethod
    def check(cls, run: RunConfig, params: KebabModel) -> None:
        """Raise ValueError on a combination of settings this rule cannot run with."""

    def bind(self, setup: Setup) -> None:
        """Take from `setup` what the rule needs before the run (once, and again on resume)."""

    # ------------------------------------------------------------ dispatch
    def plan(self, view: View, rng: np.random.Generator) -> Plan:
        """Uniformly random idle clients, up to the capacity (FLGo's asynchronous rule)."""
        return Plan([self.assign(c, view) for c in pick_uniform(view.idle, view.capacity, rng)])

    def assign(self, client: int, view: View) -> Assignment:
        return Assignment(
            client,
            {ARRAYS: self.model_for(client)},
            self.task_extra(client),
            {"proximal_mu": self.proximal_mu(client)},
        )

    def model_for(self, client: int) -> np.ndarray:
        """The parameters a task for `client` starts from."""
        return self.model

    def proximal_mu(self, client: int) -> float:
        return self.run.proximal_mu

    def task_extra(self, client: int) -> dict[str, Any]:
        """Strategy-specific entries of the task's ConfigRecord."""
        return {}

    def on_dispatch(self, client: int) -> None:
        """A task for `client` was sent."""

    def on_task_lost(self, client: int) -> Outcome | None:
        """A task for `client` ended without a usable update (error, dead node, rejected).
        A rule whose round closes on it returns that round's Outcome."""
        return None

    # ------------------------------------------------------------ replies
    def signals(self) -> dict[str, SignalSpec]:
        """Metrics every train reply must carry for this rule, beyond the common ones."""
        return {}

    def expected_sets(self, sent: tuple[str, ...]) -> tuple[str, ...]:
        """The named sets a reply must carry, given those its task carried beyond the main
        one: `reply_sets` for most rules; a rule whose reply mirrors its task overrides."""
        return self.reply_sets

    def validate(self, update: Update) -> None:
        """Raise fedstale.common.schema.InvalidReply when an update's signals do not hold up."""

    @abstractmethod
    def on_update(self, update: Update, view: View) -> Outcome:
        """Consume one update."""

    def refuses_late(self, task: InFlight) -> str:
        """Why the rule cannot take the late reply of `task` (written off, `on_task_lost`
        told), or "" to take it through `validate` and `on_update` like any other."""
        return ""

    # ------------------------------------------------------------ topology
    def latency_factors(self) -> np.ndarray | None:
        """Per-client factors on the simulated latency that the rule's topology implies
        (MAFSA's slower edges); None: none."""
        return None

    def bind_edges(self, declared: dict[int, int]) -> None:
        """Edges that nodes declared (client -> `edge-id` node config), for a hierarchical
        rule; others ignore them."""

    def summary(self) -> dict[str, Any]:
        """Entries the rule adds to summary.json."""
        return {}

    # ------------------------------------------------------------ evaluation
    def model_of(self, client: int) -> np.ndarray:
        """The model scored on `client`'s own split under per-client evaluation."""
        return self.model

    # ------------------------------------------------------------ checkpoints
    def state(self) -> dict[str, Any]:
        """Everything the rule needs to go on after a restart (picklable): the model and
        the attributes `kept` names. What `bind` gave is bound again on resume."""
        return {"model": self.model, **{name: getattr(self, name) for name in self.kept}}

    def load_state(self, state: dict[str, Any]) -> None:
        for name in ("model", *self.kept):
            setattr(self, name, state[name])


def pick_uniform(
    candidates: tuple[int, ...] | list[int], count: int, rng: np.random.Generator
) -> list[int]:
    """Up to `count` distinct clients, each drawn uniformly among those left."""
    left, picked = list(candidates), []
    while left and len(picked) < count:
        picked.append(left.pop(int(rng.integers(len(left)))))
    return picked
