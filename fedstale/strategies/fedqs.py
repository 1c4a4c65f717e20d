"""FedQS: semi-asynchronous FL with client-type adaptation (NeurIPS 2025;
the exact rule is docs/algorithms.md's FedQS section, after the authors' `_multi` code).

The rule's pieces as plain functions: the similarity computed at dispatch, the four client
types, their lr / momentum actions and the feedback-weighted aggregation; each is
unit-tested against values worked by hand (tests/test_fedqs.py).
"""

from __future__ import annotations

import math
from abc import abstractmethod
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Any, ClassVar, Literal, TypeVar

import numpy as np
from pydantic import Field

from fedstale.common.config import RuleSettings
from fedstale.common.schema import ARRAYS, RETURN_MODEL, InvalidReply, SignalSpec, keys_of
from fedstale.strategies.base import (
    Assignment,
    InFlight,
    Outcome,
    Setup,
    Strategy,
    Update,
    View,
    update_record,
)
from fedstale.strategies.buffer import Buffer, BufferParams
from fedstale.strategies.client import ClientRule, LocalTask
from fedstale.strategies.privacy import LINEAR, Release
from fedstale.strategies.rule import Rule

if TYPE_CHECKING:  # torch where it is used: the registry loads without it
    import torch

FBC, SBC, FUC, SUC = "FBC", "SBC", "FUC", "SUC"  # fast/slow, misaligned ("biased")/aligned
TYPES = (FBC, SBC, FUC, SUC)
SIMILARITIES = ("angle", "l1", "l2")
Segments = Sequence[tuple[int, int]]  # (start, stop) of each parameter tensor in a flat vector


def minmax_angle(a: np.ndarray, b: np.ndarray) -> float | None:
    """Degrees between `a` and `b` after min-max normalising each to [0, 1] (so 0-90);
    None where either is constant (the authors skip such a tensor)."""
    a64, b64 = np.asarray(a, dtype=np.float64), np.asarray(b, dtype=np.float64)
    spans = (a64.max() - a64.min(), b64.max() - b64.min())
    if spans[0] == 0 or spans[1] == 0:
        return None
    na, nb = (a64 - a64.min()) / spans[0], (b64 - b64.min()) / spans[1]
    cosine = float(na @ nb / (np.linalg.norm(na) * np.linalg.norm(nb)))
    return math.degrees(math.acos(min(1.0, max(-1.0, cosine))))


def similarity(a: np.ndarray, b: np.ndarray, segments: Segments, kind: str) -> float | None:
    """Mean over parameter tensors of the min-max angle (`angle`), or of the L1 / L2 norm of
    the difference (`l1`, `l2`: the authors' simi1 / simi2 ablations); None if no tensor
    counts (angle: every tensor constant in a or b)."""
    values = []
    for start, stop in segments:
        x, y = a[start:stop], b[start:stop]
        if kind == "angle":
            value = minmax_angle(x, y)
        else:
            diff = np.asarray(x, dtype=np.float64) - np.asarray(y, dtype=np.float64)
            value = float(np.linalg.norm(diff, ord=1 if kind == "l1" else 2))
        if value is not None:
            values.append(value)
    return float(np.mean(values)) if values else None


def mean_nonzero(values: np.ndarray) -> float:
    """The thresholds' rule: the mean of the non-zero entries (0 when there are none)."""
    kept = values[values != 0]
    return float(kept.mean()) if kept.size else 0.0


def classify(speed: float, theta: float | None, speed_ths: float, theta_ths: float) -> str | None:
    """A client's type, or None when it cannot be classified yet (no speed, no thresholds,
    no angle)."""
    if speed <= 0 or speed_ths <= 0 or theta_ths <= 0 or theta is None:
        return None
    fast, misaligned = speed > speed_ths, theta > theta_ths
    if misaligned:
        return FBC if fast else SBC
    return FUC if fast else SUC


def aligned_momentum(theta: float, theta_ths: float, m0: float, k: float, cap: float) -> float:
    """FUC / SUC: m0 + min(k (m0 theta_ths / theta - m0), cap); m0 + cap at theta 0."""
    if theta == 0:
        return m0 + cap
    return m0 + min(k * (m0 * theta_ths / theta - m0), cap)


def new_lr(kind: str, lr: float, factor: float, a: float, bounds: tuple[float, float]) -> float:
    """FBC keeps its lr, FUC lowers it by a F, SBC and SUC raise it by a F; clipped."""
    step = {FBC: 0.0, SBC: a * factor, FUC: -a * factor, SUC: a * factor}[kind]
    return min(bounds[1], max(bounds[0], lr + step))


def refreshed_speeds(count: np.ndarray, num_clients: int) -> np.ndarray:
    """speed_i = f_i / (sum_j f_j / N) for every client aggregated at least once, after every
    aggregation (the authors' code refreshes all of them, not only the K just aggregated:
    the mean count moves for everyone); 0 for a client never aggregated."""
    total = float(count.sum())
    if total == 0:
        return np.zeros(len(count))
    return count / (total / num_clients)


def speed_factor(speed: float, speed_ths: float, cap: float = 9.0) -> float:
    """F = min(speed_ths / speed_i, 9)."""
    return min(speed_ths / speed, cap)


def aggregation_weights(
    examples: np.ndarray,
    counts: np.ndarray,
    total_count: float,
    flags: np.ndarray,
    thetas: np.ndarray,
    theta_bar: float,
    uniform: bool = False,
) -> np.ndarray:
    """p_i = n_i / sum n (`uniform`: 1/K); a flagged update's p_i *= (e/2)^(0.1 - f_i /
    sum_j f_j) * (1 + min(theta_i / theta_bar, 2)^2); then renormalised. `counts`: each
    update's client's f_i after this aggregation's increments; `total_count`: sum over all N."""
    sizes = np.ones(len(examples)) if uniform else np.asarray(examples, dtype=np.float64)
    p = sizes / float(np.sum(sizes))
    for i in np.flatnonzero(flags):
        ratio = min(thetas[i] / theta_bar, 2.0) if theta_bar > 0 else 0.0
        p[i] *= (math.e / 2) ** (0.1 - counts[i] / total_count) * (1 + ratio**2)
    return p / p.sum()


# ---------------------------------------------------------------------------- the rules


class KFifoParams(BufferParams):
    # Which update of a client a FIFO entry aggregates: the one it uploaded, or (the FedQS
    # authors' simulator, whose queue holds a file the client overwrites when it retrains)
    # the client's newest by the time the entry is aggregated.
    fedqs_fifo_update: Literal["uploaded", "newest"] = "uploaded"

    renamed: ClassVar[dict[str, str]] = {"fifo-update": "fedqs-fifo-update"}


class FedQSParams(KFifoParams):
    fedqs_a: float = Field(default=0.002, ge=0)  # lr step per unit of F
    fedqs_m0: float = Field(default=0.1, ge=0, lt=1)
    fedqs_momentum_gain: float = Field(default=20.0, ge=0)  # k of the aligned types' momentum
    fedqs_momentum_cap: float = Field(default=0.4, ge=0, lt=1)
    fedqs_lr_min: float = Field(default=1e-3, gt=0)
    fedqs_lr_max: float = Field(default=0.2, gt=0)
    fedqs_spread_limit: float = Field(default=30.0, ge=0)  # points of per-class accuracy spread
    fedqs_ablation: Literal["none", "no-feedback", "no-flag-weight", "no-momentum"] = "none"
    fedqs_similarity: Literal["angle", "l1", "l2"] = "angle"
    fedqs_pseudo_gradient: Literal["delta", "previous-global"] = "delta"
    # p_i before the feedback factor: n_i / sum n (the authors' code) or 1/K (the paper's
    # summary's (1 + G) / (2K) suggests it)
    fedqs_base_weights: Literal["examples", "uniform"] = "examples"


@dataclass
class Sent:
    """What a task carried: the client's type and theta at dispatch, the feedback flag, and
    the lr and momentum it trained with."""

    kind: str
    theta: float | None
    flag: bool
    lr: float
    momentum: float


@dataclass
class Queued(Sent):
    """An update waiting in the K-FIFO, with what its task carried."""

    update: Update


FifoParams = TypeVar("FifoParams", bound=KFifoParams)


class KFifo(Strategy[FifoParams]):
    """Semi-asynchronous: every arrival enters a FIFO; whenever it holds K (`buffer-size`)
    the first K are aggregated. Subclasses say how (`combine`) and may adapt each task."""

    Params = KFifoParams
    kept: tuple[str, ...] = ("fifo", "newest")

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.fifo: Buffer[Queued] = Buffer(self.params.buffer_size)
        self.newest: dict[int, np.ndarray] = {}  # fedqs-fifo-update=newest: each client's latest

    @classmethod
    def check(cls, run: RuleSettings, params: FifoParams) -> None:
        if run.clips and params.fedqs_fifo_update == "newest":
            raise ValueError(
                "fedqs-fifo-update=newest aggregates a client's newest update once per entry "
                "it has in the FIFO, so one update may enter a release more than once; "
                "differential privacy needs fedqs-fifo-update=uploaded"
            )

    def queued(self, update: Update) -> Queued:
        return Queued("", None, False, self.run.lr, self.run.momentum, update)

    def on_update(self, update: Update, view: View) -> Outcome:
        if self.params.fedqs_fifo_update == "newest":
            self.newest[update.client] = update.vector
        batch = self.fifo.add(self.queued(update))
        if batch is None:
            return Outcome()
        weights = self.combine(batch)
        records = [
            update_record(
                q.update,
                w,
                type=q.kind,
                theta=q.theta,
                lr=q.lr,
                momentum=q.momentum,
                flag=int(q.flag),
            )
            for q, w in zip(batch, weights, strict=True)
        ]
        return Outcome(changed=True, records=records)

    @abstractmethod
    def combine(self, batch: list[Queued]) -> np.ndarray:
        """Move the global model by the batch; the weights each update got."""

    def aggregated(self, queued: Queued) -> np.ndarray:
        """The update an entry aggregates (`fedqs-fifo-update`)."""
        if self.params.fedqs_fifo_update == "newest":
            return self.newest[queued.update.client]
        return queued.update.vector

    def apply(self, batch: list[Queued], weights: np.ndarray) -> None:
        stacked = np.stack([self.aggregated(q) for q in batch]).astype(np.float64)
        if self.returns == RETURN_MODEL:
            self.model = (weights @ stacked).astype(np.float32)
        else:
            self.model = (self.model + weights @ stacked).astype(np.float32)


class SaflFedSGD(KFifo[KFifoParams]):
    """SAFL FedSGD: w += (1/K) sum delta_i over the first K of the FIFO."""

    name = "safl-fedsgd"

    def combine(self, batch: list[Queued]) -> np.ndarray:
        weights = np.full(len(batch), 1.0 / len(batch))
        self.apply(batch, weights)
        return weights


class SaflFedAvg(SaflFedSGD):
    """SAFL FedAvg: w = (1/K) sum w_i over the first K of the FIFO."""

    name = "safl-fedavg"
    returns = RETURN_MODEL


# ---------------------------------------------------------------- the client half


SAMPLES_PER_CLASS = 20  # the spread looks at up to this many samples of each class
FEW = 10  # a class with fewer samples counts half


class FedQSKeys:
    """What FedQS adds to the wire: task-config entries, then reply metrics."""

    TYPE = "fedqs-type"  # the client's type at dispatch ("" when unclassified)
    M0 = "fedqs-m0"  # SBC: the momentum when its spread is narrow
    SPREAD_LIMIT = "fedqs-spread-limit"  # SBC: the spread (points) that flags it
    FLAG = "fedqs-flag"  # reply: the task's feedback flag (0 / 1)
    MOMENTUM = "fedqs-momentum"  # reply: the momentum the task trained with
    SPREAD = "fedqs-spread"  # reply: the per-class accuracy spread (-1: not asked)


def class_spread(model: torch.nn.Module, x: torch.Tensor, y: torch.Tensor) -> float:
    """max - min, in points, of `model`'s per-class accuracy on up to 20 samples of each
    class in (x, y) (halved for a class with fewer than 10)."""
    import torch

    device = next(model.parameters()).device
    accuracies = []
    model.eval()
    with torch.no_grad():
        for label in torch.unique(y):
            rows = torch.nonzero(y == label).flatten()
            picked = rows[:SAMPLES_PER_CLASS]
            guess = model(x[picked].to(device)).argmax(dim=1).cpu()
            accuracy = float((guess == label).float().mean())
            accuracies.append(accuracy / 2 if len(rows) < FEW else accuracy)
    return 100.0 * (max(accuracies) - min(accuracies))


def spread_signals(
    entries: Mapping[str, Any], momentum: float, spread: Callable[[], float]
) -> dict[str, float]:
    """FedQS's client half for one task, before training: the reply's flag, spread and
    the momentum to train with. `entries`: the task's FedQS entries; `momentum`: the
    task's; `spread()`: the received model's class spread, measured for an SBC task only
    (a wide one turns momentum off and raises the flag). ClassSpread and
    fedstale.fedqs_mod both use it."""
    kind = str(entries.get(FedQSKeys.TYPE, ""))
    signals = {FedQSKeys.FLAG: 1.0 if kind == FBC else 0.0, FedQSKeys.SPREAD: -1.0}
    if kind == SBC:
        measured = spread()
        wide = measured >= float(entries[FedQSKeys.SPREAD_LIMIT])
        momentum = 0.0 if wide else float(entries[FedQSKeys.M0])
        signals[FedQSKeys.FLAG] = float(wide)
        signals[FedQSKeys.SPREAD] = measured
    signals[FedQSKeys.MOMENTUM] = float(momentum)
    return signals


class ClassSpread(ClientRule):
    """FedQS: a slow, misaligned client (SBC) measures the received model's per-class
    accuracy spread on its own training data before it trains; a wide spread turns its
    momentum off and raises the feedback flag. Every FedQS reply carries the task's flag,
    the momentum it trained with and the spread (-1 where it was not asked for)."""

    name = "fedqs-class-spread"
    in_cohorts = True  # it sets the task's momentum, which cohorts train per member
    mod = "fedstale.client_app.mods:fedqs_mod(model_fn, data_fn)"

    def before(self, task: LocalTask) -> None:
        def spread() -> float:
            return class_spread(task.model, task.x, task.y)

        signals = spread_signals(task.spec.extra, task.spec.momentum, spread)
        task.spec = replace(task.spec, momentum=signals[FedQSKeys.MOMENTUM])
        task.signals.update(signals)


# ---------------------------------------------------------------- the server half


class FedQSSGD(KFifo[FedQSParams]):
    """FedQS-SGD: clients classified at dispatch adapt lr and momentum; flagged updates get
    the feedback weight; w += sum p_i delta_i."""

    name = "fedqs-sgd"
    client_rules = (ClassSpread(),)
    kept = (*KFifo.kept, "count", "speed", "theta", "lr", "momentum", "examples")
    kept += ("speed_ths", "theta_ths", "previous_model", "last_delta", "started_from", "pending")

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        n = self.run.num_clients
        self.count = np.zeros(n)  # f_i: times aggregated
        self.speed = np.zeros(n)
        self.theta = np.zeros(n)  # latest theta_i (0: none yet)
        self.lr = np.full(n, self.run.lr)
        self.momentum = np.full(n, self.run.momentum)  # as lr, from the run until classified
        self.examples = np.zeros(n)
        self.speed_ths = 0.0
        self.theta_ths = 0.0
        self.previous_model: np.ndarray | None = None  # w^(t-1)
        self.last_delta: dict[int, np.ndarray] = {}  # each client's previous update
        self.started_from: dict[int, np.ndarray] = {}  # FedQS-Avg: each task's start model
        self.pending: dict[int, Sent] = {}  # what each client's task in flight carries
        self.segments: list[tuple[int, int]] = [(0, self.model.size)]

    @classmethod
    def check(cls, run: RuleSettings, params: FedQSParams) -> None:
        super().check(run, params)
        if params.fedqs_lr_min > params.fedqs_lr_max:
            raise ValueError("fedqs-lr-min is above fedqs-lr-max")

    def bind(self, setup: Setup) -> None:
        self.bind_segments(list(setup.segments))

    def bind_segments(self, segments: list[tuple[int, int]]) -> None:
        """Where each parameter tensor lies in the flat vector (the angle is per tensor)."""
        self.segments = list(segments)

    # ------------------------------------------------------------ dispatch
    def similarity_of(self, client: int) -> float | None:
        if self.previous_model is None or client not in self.last_delta:
            return None
        pseudo = self.previous_model
        if self.params.fedqs_pseudo_gradient == "delta":
            pseudo = self.model - self.previous_model
        kind = self.params.fedqs_similarity
        return similarity(pseudo, self.last_delta[client], self.segments, kind)

    def assign(self, client: int, view: View) -> Assignment:
        p = self.params
        theta = self.similarity_of(client)
        if theta is not None:
            self.theta[client] = theta
        kind = classify(self.speed[client], theta, self.speed_ths, self.theta_ths) or ""
        flag = kind == FBC
        if kind:
            factor = speed_factor(self.speed[client], self.speed_ths)
            bounds = (p.fedqs_lr_min, p.fedqs_lr_max)
            self.lr[client] = new_lr(kind, self.lr[client], factor, p.fedqs_a, bounds)
            if kind == FBC:
                self.momentum[client] = 0.0
            elif kind in (FUC, SUC):
                self.momentum[client] = aligned_momentum(
                    theta or 0.0,
                    self.theta_ths,
                    p.fedqs_m0,
                    p.fedqs_momentum_gain,
                    p.fedqs_momentum_cap,
                )
        momentum = 0.0 if p.fedqs_ablation == "no-momentum" else float(self.momentum[client])
        self.pending[client] = Sent(kind, theta, flag, float(self.lr[client]), momentum)
        if self.returns == RETURN_MODEL:
            self.started_from[client] = self.model
        entries = {
            FedQSKeys.TYPE: kind,
            FedQSKeys.M0: 0.0 if p.fedqs_ablation == "no-momentum" else p.fedqs_m0,
            FedQSKeys.SPREAD_LIMIT: p.fedqs_spread_limit,
        }
        settings = {"lr": float(self.lr[client]), "momentum": momentum}
        return Assignment(client, {ARRAYS: self.model}, entries, settings)

    def refuses_late(self, task: InFlight) -> str:
        return "FedQS reset the client's task state when the task was lost"

    def on_task_lost(self, client: int) -> Outcome | None:
        self.pending.pop(client, None)
        self.started_from.pop(client, None)
        return None

    # ------------------------------------------------------------ replies
    def signals(self) -> dict[str, SignalSpec]:
        return {
            FedQSKeys.FLAG: SignalSpec(),
            FedQSKeys.MOMENTUM: SignalSpec(),
            FedQSKeys.SPREAD: SignalSpec(),
        }

    def validate(self, update: Update) -> None:
        sent = self.pending.get(update.client)
        if sent is None:
            raise InvalidReply(f"no FedQS task of client {update.client} is in flight")
        flag = update.signals[FedQSKeys.FLAG]
        if flag not in (0.0, 1.0):
            raise InvalidReply(f"'{FedQSKeys.FLAG}' is {flag}, not 0 or 1")
        if sent.kind != SBC and bool(flag) != sent.flag:
            raise InvalidReply(
                f"the flag of a {sent.kind or 'unclassified'} task is the server's "
                f"({int(sent.flag)}); the reply says {int(flag)}"
            )

    def queued(self, update: Update) -> Queued:
        sent = self.pending.pop(update.client)
        delta = update.vector
        if self.returns == RETURN_MODEL:
            delta = update.vector - self.started_from.pop(update.client)
        self.last_delta[update.client] = delta
        self.examples[update.client] = update.num_examples
        flag = bool(update.signals[FedQSKeys.FLAG])
        momentum = float(update.signals[FedQSKeys.MOMENTUM])
        if sent.kind == SBC:
            self.momentum[update.client] = momentum
        return Queued(sent.kind, sent.theta, flag, sent.lr, momentum, update)

    def combine(self, batch: list[Queued]) -> np.ndarray:
        clients = [q.update.client for q in batch]
        for client in clients:
            self.count[client] += 1
        total = float(self.count.sum())
        ignore_flags = self.params.fedqs_ablation == "no-flag-weight"
        if self.params.fedqs_ablation == "no-feedback":
            weights = np.full(len(batch), 1.0 / len(batch))
        else:
            weights = aggregation_weights(
                np.array([q.update.num_examples for q in batch]),
                self.count[clients],
                total,
                np.array([q.flag and not ignore_flags for q in batch]),
                np.array([q.theta or 0.0 for q in batch]),
                mean_nonzero(self.theta),
                uniform=self.params.fedqs_base_weights == "uniform",
            )
        self.previous_model = self.model
        self.apply(batch, weights)
        self.speed = refreshed_speeds(self.count, self.run.num_clients)
        self.speed_ths = mean_nonzero(self.speed)
        self.theta_ths = mean_nonzero(self.theta)
        return weights


class FedQSAvg(FedQSSGD):
    """FedQS-Avg: as FedQS-SGD, clients return models and w = sum p_i w_i."""

    name = "fedqs-avg"
    returns = RETURN_MODEL


FEDQS_WIRE = keys_of(FedQSKeys)
FEDQS_LABELS = "its clients score per-class accuracy"
FEDQS_NO_DP = (
    "its weights and each client's learning rate follow the updates' own directions "
    "(similarity to the global model), a sensitivity not worked out"
)
RULES = (
    Rule(
        SaflFedSGD,
        library="SaflFedSGD",
        about="""Semi-asynchronous FedSGD (the FedQS paper's baseline): w += (1/K) sum
    delta_i over the first K updates of a FIFO.""",
        dp=Release(LINEAR),
    ),
    Rule(
        SaflFedAvg,
        library="SaflFedAvg",
        about="""Semi-asynchronous FedAvg (the FedQS paper's baseline): w = (1/K) sum w_i
    over the first K models of a FIFO.""",
        dp=Release(LINEAR),
    ),
    Rule(
        FedQSSGD,
        library="FedQSSGD",
        about="""FedQS-SGD (NeurIPS 2025): a K-FIFO whose clients are classified at dispatch
    (fast or slow, aligned or not) and get their own lr and momentum; flagged updates
    weighted up, w += sum p_i delta_i with p_i from the replies' num-examples. Needs
    fedstale.fedqs_mod(model_fn, data_fn) in the ClientApp.""",
        no_dp=FEDQS_NO_DP,
        wire=FEDQS_WIRE,
        labels=FEDQS_LABELS,
    ),
    Rule(
        FedQSAvg,
        library="FedQSAvg",
        about="""FedQS-Avg: as FedQSSGD, clients' models averaged, w = sum p_i w_i.""",
        no_dp=FEDQS_NO_DP,
        wire=FEDQS_WIRE,
        labels=FEDQS_LABELS,
    ),
)
