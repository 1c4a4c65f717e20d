"""The contract between the engine and an aggregation rule (third edition).

A strategy is plain math over flat float32 parameter vectors. It knows nothing of time,
nodes or Flower; at each decision the engine shows it a `View` (the global version, the idle
clients, the tasks in flight and their staleness, how many tasks may start now).

The core, for every rule (docs/architecture.md sets it beside Flower's `Strategy`):
- `Strategy[P]`: `P` is the rule's run-config keys (`Params`), typed once.
- `check(run, params)`: refuse a combination of settings before the run.
- `bind(setup)`: take from the `Setup` what the rule needs (the parameter layout, the
  clients' data sizes, what the server can compute on the model), once and on resume.
- `plan(view, rng)` -> `Plan`: the `Assignment`s to make now, each complete (the models
  the client starts from, the rule's task entries, optimiser settings, the named array
  sets the reply must carry), and what changed while planning (a round that closed at
  once). Default: uniform among idle clients, up to the capacity, each `assign`ed.
- `on_dispatch(client)`: a task was sent.
- `signals()` / `validate(update)`: what every reply must carry for the rule, and checks on
  it; `on_update(update, view)` -> `Outcome`: consume one validated update (the model
  changed, one record per update whose weight became known, tasks to supersede).
- `on_task_lost(client)`, `refuses_late(task)`: a task written off (which may close a
  round), and whether its reply, should it still come, is taken late.
- Declared data: `returns` (delta or model), `client_rules` (the client half: what each
  task asks of the client; fedstale/strategies/client.py), `kept` (the attributes a
  checkpoint keeps beside the model).

Capabilities, for the rules that have them (mixins the engine tests for):
- `PerClientModels`: one model per client (`model_of`), scored on each client's split.
- `Topology`: edges; nodes may declare theirs (`bind_edges`), edges may be slower
  (`latency_factors`), and the topology adds entries to summary.json (`summary`).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, ClassVar, Generic, TypeVar, get_args, get_origin

import numpy as np

from fedstale.common.config import KebabModel, RuleSettings
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
    fields to override (lr, momentum, proximal_mu, ...); `reply_sets`: the named array sets
    the reply must carry beyond the main one (each checked against the model's layout)."""

    client: int
    models: dict[str, np.ndarray]
    entries: dict[str, Any] = field(default_factory=dict)
    settings: dict[str, Any] = field(default_factory=dict)
    reply_sets: tuple[str, ...] = ()


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


@dataclass(frozen=True)
class Setup:
    """What the server offers every rule before the run (`Strategy.bind`).

    segments: (start, stop) of each parameter tensor in the flat vector.
    client_sizes: every client's training-split size; uniform where the door cannot know
        them (`sizes_known` False: a library user's ClientApps report sizes only as they
        answer).
    """

    segments: tuple[tuple[int, int], ...]
    client_sizes: np.ndarray
    sizes_known: bool = True


@dataclass(frozen=True)
class TorchModel:
    """The run's model at the server: one torch `module` (a rule loads flat models into
    it), one sample's `input_shape` and the model's output width `num_classes`."""

    module: Any  # torch.nn.Module: this layer does not import torch
    input_shape: tuple[int, ...]
    num_classes: int


@dataclass(frozen=True)
class ModelServices:
    """What the server offers a rule that computes on the model itself (`ServerModel`),
    after `Strategy.bind`; each does its work only when the rule calls it, and a door
    that cannot offer one raises a ConfigError saying what the user gives instead.

    model(): the run's model (`TorchModel`), the same instance on every call.
    held_out(setting): the server's held-out samples (x, y) as tensors (fedstale's own
        app: the test split); `setting` names what needs them, for a door's refusal.
    """

    model: Callable[[], TorchModel]
    held_out: Callable[[str], tuple[Any, Any]]


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


P = TypeVar("P", bound=KebabModel)


def step_scale(run: RuleSettings, version: int) -> float:
    """Factor on a buffered rule's server step. `spec`: 1 (the papers' equations).
    `client-lr`: the current client learning rate lr0 * decay^version, as FLGo (the FedPSA
    paper's harness) applies a buffer: `w -= lr * mean(w_start - w_i)`."""
    if run.server_step == "spec":
        return 1.0
    return run.lr * run.lr_decay**version


class Strategy(ABC, Generic[P]):
    """A rule's server half. `class FedBuff(Strategy[FedBuffParams])` types `params` and
    sets `Params` (the rule's run-config keys) in one place."""

    name: ClassVar[str]
    Params: ClassVar[type[KebabModel]] = NoParams
    returns: ClassVar[str] = RETURN_DELTA
    client_rules: ClassVar[tuple[ClientRule, ...]] = ()  # what each task asks of the client
    kept: ClassVar[tuple[str, ...]] = ()  # attributes a checkpoint keeps beside the model

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        for base in getattr(cls, "__orig_bases__", ()):
            origin, args = get_origin(base), get_args(base)
            typed = isinstance(origin, type) and issubclass(origin, Strategy)
            if typed and args and isinstance(args[0], type):
                cls.Params = args[0]

    def __init__(self, run: RuleSettings, params: P, initial: np.ndarray) -> None:
        self.run = run
        self.params = params
        self.model = np.array(initial, dtype=np.float32, copy=True)

    @classmethod
    def check(cls, run: RuleSettings, params: P) -> None:
        """Raise ValueError on a combination of settings this rule cannot run with."""

    def bind(self, setup: Setup) -> None:
        """Take from `setup` what the rule needs before the run (once, and again on resume)."""

    # ------------------------------------------------------------ dispatch
    def plan(self, view: View, rng: np.random.Generator) -> Plan:
        """Uniformly random idle clients, up to the capacity (FLGo's asynchronous rule)."""
        return Plan([self.assign(c, view) for c in pick_uniform(view.idle, view.capacity, rng)])

    def assign(self, client: int, view: View) -> Assignment:
        """The complete task for `client`: the models it starts from, the rule's entries,
        the optimiser settings, the named sets its reply must carry."""
        return Assignment(client, {ARRAYS: self.model}, {}, {"proximal_mu": self.run.proximal_mu})

    def on_dispatch(self, client: int) -> None:
        """A task for `client` was sent."""

    # ------------------------------------------------------------ replies
    def signals(self) -> dict[str, SignalSpec]:
        """Metrics every train reply must carry for this rule, beyond the common ones."""
        return {}

    def validate(self, update: Update) -> None:
        """Raise fedstale.common.schema.InvalidReply when an update's signals do not hold up."""

    @abstractmethod
    def on_update(self, update: Update, view: View) -> Outcome:
        """Consume one update."""

    def on_task_lost(self, client: int) -> Outcome | None:
        """A task for `client` ended without a usable update (error, dead node, rejected).
        A rule whose round closes on it returns that round's Outcome."""
        return None

    def refuses_late(self, task: InFlight) -> str:
        """Why the rule cannot take the late reply of `task` (written off, `on_task_lost`
        told), or "" to take it through `validate` and `on_update` like any other."""
        return ""


class PerClientModels(ABC):
    """Capability: the rule keeps one model per client, each scored on that client's own
    split (per-client evaluation)."""

    @abstractmethod
    def model_of(self, client: int) -> np.ndarray:
        """The model scored on `client`'s own split."""


class ServerModel(ABC):
    """Capability: the rule computes on the model at the server (FedPSA sketches the global
    model on the clients' calibration batch); the door offers it `ModelServices`."""

    @abstractmethod
    def bind_services(self, services: ModelServices) -> None:
        """Take the services the rule needs before the run (once, and again on resume)."""


class Topology(ABC):
    """Capability: edges between the clients and the cloud. Nodes may name their edge;
    every client trains at once; the topology may slow whole edges. `edges_key`: the rule's
    run-config key holding the number of edges (`fedstale deploy --edges E` sets it)."""

    edges_key: ClassVar[str]

    @abstractmethod
    def bind_edges(self, declared: dict[int, int]) -> None:
        """Edges that nodes declared (client -> `edge-id` node config)."""

    @abstractmethod
    def latency_factors(self) -> np.ndarray | None:
        """Per-client factors on the simulated latency (slower edges); None: none."""

    @abstractmethod
    def summary(self) -> dict[str, Any]:
        """Entries the topology adds to summary.json."""


def declare_edges(strategy: Strategy[Any], declared: dict[int, int]) -> None:
    """Hand the edges nodes declared (client -> `edge-id`) to a rule with a topology."""
    if isinstance(strategy, Topology):
        strategy.bind_edges(declared)


def model_of(strategy: Strategy[Any], client: int) -> np.ndarray:
    """The model scored on `client`'s split: its own under a per-client rule, else the
    global model."""
    return strategy.model_of(client) if isinstance(strategy, PerClientModels) else strategy.model


def evaluates(strategy: Strategy[Any] | type[Strategy[Any]]) -> str:
    """What the rule's evaluation scores by default: one model per client, or the global one."""
    cls = strategy if isinstance(strategy, type) else type(strategy)
    return EVAL_PER_CLIENT if issubclass(cls, PerClientModels) else EVAL_GLOBAL


def state_of(strategy: Strategy[Any], only: Sequence[str] | None = None) -> dict[str, Any]:
    """Everything a rule needs to go on after a restart (picklable): the model and the
    attributes its `kept` names, or of those `only` the ones named (under DP: those its
    release declares public, so no update not yet released, no norm or signal of a
    client). What `bind` gave is bound again on resume."""
    names = [name for name in strategy.kept if only is None or name in only]
    return {"model": strategy.model, **{name: getattr(strategy, name) for name in names}}


def load_state(strategy: Strategy[Any], state: dict[str, Any]) -> None:
    """Put back what `state_of` kept; an attribute it left out keeps its fresh value."""
    for name in ("model", *strategy.kept):
        if name in state:
            setattr(strategy, name, state[name])


def pick_uniform(
    candidates: tuple[int, ...] | list[int], count: int, rng: np.random.Generator
) -> list[int]:
    """Up to `count` distinct clients, each drawn uniformly among those left."""
    left, picked = list(candidates), []
    while left and len(picked) < count:
        picked.append(left.pop(int(rng.integers(len(left)))))
    return picked
