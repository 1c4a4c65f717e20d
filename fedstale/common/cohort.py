"""Cohort training: the local training of several clients (one model architecture, each
client its own parameters, data and minibatch plan) as one batched computation.

`torch.func.vmap` over the clients' stacked parameters runs a step of every client in one
call: at step t each client's own minibatch (the same seeded plan as `local_train`,
fedstale/common/training.py `batch_plan`) is gathered and padded to the largest batch with
a mask, so a short last batch keeps its own mean; a client whose plan has ended stays where
it is. The update is plain minibatch SGD with an optional proximal term, the arithmetic of
`local_train`'s autograd step, with what `torch.optim.SGD` adds where a task asks for it
(gradient clipping to a norm, weight decay, momentum: each member its own) and the extra
loss terms a client rule declares in batched form (`BatchedTerm`, e.g. PACE's cosine to the
start); the results equal per-task training up to float summation order.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Collection, Sequence
from dataclasses import dataclass
from typing import ClassVar, Protocol, TypeVar, runtime_checkable

import torch
from torch import nn
from torch.func import functional_call, grad_and_value, vmap

from fedstale.common.schema import TaskSpec
from fedstale.common.training import batch_plan

log = logging.getLogger("fedstale")
Task = TypeVar("Task")
_together_said: list[int] = []


@runtime_checkable
class BatchedTerm(Protocol):
    """A loss term (fedstale/common/training.py LossTerm) that cohorts can batch: `weight`
    times `flat(w, w_start)`, a pure function of the flat parameters and the flat start."""

    weight: float
    flat: ClassVar[Callable[[torch.Tensor, torch.Tensor], torch.Tensor]]

    def __call__(self, model: nn.Module) -> torch.Tensor: ...


def solo_reason(spec: TaskSpec, loss: str, cohort_rules: Collection[str] = ()) -> str:
    """Why a task trains alone rather than in a cohort ("" when it can join one): the
    server asks before it groups tasks, the ClientApp again once the task's client rules
    have prepared it. `cohort_rules`: the client rules whose work leaves local training
    batchable (fedstale/strategies/registry.py cohort_rules)."""
    alone = [rule for rule in spec.rules if rule not in cohort_rules]
    if alone:
        return f"client rules {alone} change local training"
    if spec.optimizer != "sgd":
        return f"optimizer '{spec.optimizer}' (cohorts train SGD)"
    if loss != "cross-entropy":
        return f"loss '{loss}' (cohorts train cross-entropy)"
    return ""


def unbatched_terms(terms: Sequence[Callable]) -> str:
    """Why a task whose rules added these loss terms trains alone ("" when cohorts batch
    them all)."""
    others = sorted({type(term).__name__ for term in terms if not isinstance(term, BatchedTerm)})
    return f"loss terms {others} have no batched form" if others else ""


def said_alone(why: str, said: set[str]) -> None:
    """Why some tasks train one at a time, logged the first time `said` has not seen it."""
    if why not in said:
        said.add(why)
        log.info("trainer=cohort: %s: those tasks train one at a time", why)


def first_of_each(
    tasks: list[Task], client_of: Callable[[Task], int]
) -> tuple[list[Task], list[Task]]:
    """The tasks waiting to train split into a cohort (each client's first, in order) and
    those that wait for a later one (a client's next task starts from its kept state)."""
    cohort, later, clients = [], [], set()
    for task in tasks:
        (later if client_of(task) in clients else cohort).append(task)
        clients.add(client_of(task))
    return cohort, later


def said_together(size: int, where: str) -> None:
    """The first cohort of more than one task, said once per process."""
    if size > 1 and not _together_said:
        _together_said.append(size)
        log.info("trainer=cohort: %d tasks train together %s", size, where)


@dataclass(frozen=True)
class Member:
    """One client's task in a cohort: its start parameters (by name), data, optimiser
    settings and minibatch plan's seed."""

    params: dict[str, torch.Tensor]
    x: torch.Tensor
    y: torch.Tensor
    epochs: int
    batch_size: int
    lr: float
    seed: int
    proximal_mu: float = 0.0
    steps: int = 0
    momentum: float = 0.0
    weight_decay: float = 0.0
    grad_clip: float = 0.0
    terms: tuple[BatchedTerm, ...] = ()


@dataclass(frozen=True)
class Schedule:
    """Every member's minibatches in order, and which of them belong to its last pass."""

    batches: list[list[torch.Tensor]]
    last_pass: list[int]  # index of each member's first step of its last pass

    @classmethod
    def of(cls, members: Sequence[Member]) -> Schedule:
        batches, last_pass = [], []
        for member in members:
            plan = batch_plan(
                len(member.y), member.epochs, member.batch_size, member.seed, member.steps
            )
            flat = [idx for one_pass in plan for idx in one_pass]
            batches.append(flat)
            last_pass.append(len(flat) - len(plan[-1]) if plan else 0)
        return cls(batches, last_pass)

    def in_last_pass(self, t: int) -> list[bool]:
        """Which members' step t belongs to their last pass."""
        pairs = zip(self.last_pass, self.batches, strict=True)
        return [first <= t < len(steps) for first, steps in pairs]

    @property
    def last_pass_steps(self) -> list[int]:
        return [
            len(steps) - first for first, steps in zip(self.last_pass, self.batches, strict=True)
        ]

    @property
    def length(self) -> int:
        return max((len(b) for b in self.batches), default=0)


def cohort_train(
    model: nn.Module, members: Sequence[Member]
) -> list[tuple[dict[str, torch.Tensor], float]]:
    """Train every member from its own start; each one's trained parameters and the mean
    cross-entropy of its last pass over the data (as `local_train` returns it). Everything
    stays on the parameters' device: the losses come back once, at the end."""
    names = [name for name, _ in model.named_parameters()]
    params = {n: torch.stack([m.params[n].detach() for m in members]) for n in names}
    starts = {n: p.clone() for n, p in params.items()}
    device, dtype = params[names[0]].device, params[names[0]].dtype
    per_member = PerMember.of(members, device, dtype)
    schedule = Schedule.of(members)
    width = max((len(idx) for b in schedule.batches for idx in b), default=1)
    step = vmap(grad_and_value(objective(model, per_member.kinds), has_aux=True))
    velocity: dict[str, torch.Tensor] = {}
    # the last pass's losses summed in float64, step by step, as local_train's Python sum
    loss_sums = torch.zeros(len(members), dtype=torch.float64, device=device)
    for t in range(schedule.length):
        active = torch.tensor([t < len(b) for b in schedule.batches], dtype=dtype, device=device)
        xb, yb, mask = gathered(members, schedule, t, width)
        grads, (_, losses) = step(params, starts, per_member.weights, xb, yb, mask)
        with torch.no_grad():
            directions = per_member.directions(grads, params, starts, velocity)
            scale = per_member.lrs * active
            for n in names:
                params[n] = params[n] - along(scale, params[n]) * directions[n]
            in_last = torch.tensor(schedule.in_last_pass(t), device=device)
            loss_sums += torch.where(in_last, losses.double(), 0.0)
    counts = schedule.last_pass_steps
    return [
        ({n: params[n][k].clone() for n in names}, total / max(count, 1))
        for k, (total, count) in enumerate(zip(loss_sums.tolist(), counts, strict=True))
    ]


def along(values: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    """One value per member, shaped to broadcast over a stacked parameter."""
    return values.view((-1,) + (1,) * (like.dim() - 1))


@dataclass(frozen=True)
class PerMember:
    """The members' optimiser settings as tensors (one entry per member), and the kinds of
    batched loss term any of them has with each member's weight for each (0: none)."""

    lrs: torch.Tensor
    mus: torch.Tensor
    momenta: torch.Tensor
    decays: torch.Tensor
    clips: torch.Tensor
    kinds: tuple[type, ...]
    weights: torch.Tensor  # (members, kinds)

    @classmethod
    def of(cls, members: Sequence[Member], device: torch.device, dtype: torch.dtype) -> PerMember:
        def column(values: list[float]) -> torch.Tensor:
            return torch.tensor(values, dtype=dtype, device=device)

        kinds = tuple(dict.fromkeys(type(term) for m in members for term in m.terms))
        weights = [[0.0] * len(kinds) for _ in members]
        for row, member in zip(weights, members, strict=True):
            for term in member.terms:
                row[kinds.index(type(term))] += term.weight
        return cls(
            column([m.lr for m in members]),
            column([m.proximal_mu for m in members]),
            column([m.momentum for m in members]),
            column([m.weight_decay for m in members]),
            column([m.grad_clip for m in members]),
            kinds,
            torch.tensor(weights, dtype=dtype, device=device).reshape(len(members), len(kinds)),
        )

    def directions(
        self,
        grads: dict[str, torch.Tensor],
        params: dict[str, torch.Tensor],
        starts: dict[str, torch.Tensor],
        velocity: dict[str, torch.Tensor],
    ) -> dict[str, torch.Tensor]:
        """Each member's step direction, in `autograd_step`'s order: the gradient, plus the
        proximal term, clipped to the member's norm, plus weight decay, through momentum
        (`velocity`, torch.optim.SGD's buffer, kept across steps). A setting no member uses
        is skipped, so plain SGD is the arithmetic it always was."""
        out = {n: g + along(self.mus, g) * (params[n] - starts[n]) for n, g in grads.items()}
        if bool(self.clips.any()):
            norms = torch.stack([d.flatten(1).norm(dim=1) for d in out.values()]).norm(dim=0)
            factor = (self.clips / (norms + 1e-6)).clamp(max=1.0)
            factor = torch.where(self.clips > 0, factor, torch.ones_like(factor))
            out = {n: d * along(factor, d) for n, d in out.items()}
        if bool(self.decays.any()):
            out = {n: d + along(self.decays, d) * params[n] for n, d in out.items()}
        if bool(self.momenta.any()):
            for n, d in out.items():
                kept = velocity.get(n)
                velocity[n] = d.clone() if kept is None else along(self.momenta, d) * kept + d
            out = dict(velocity)
        return out


def objective(model: nn.Module, kinds: tuple[type, ...]):  # type: ignore[no-untyped-def]
    """One client's mean cross-entropy over the unmasked rows of its padded batch, plus its
    weighted batched loss terms; returns (objective, cross-entropy)."""

    def loss(
        params: dict[str, torch.Tensor],
        starts: dict[str, torch.Tensor],
        weights: torch.Tensor,
        xb: torch.Tensor,
        yb: torch.Tensor,
        mask: torch.Tensor,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        out = functional_call(model, params, (xb,))
        per_row = nn.functional.cross_entropy(out, yb, reduction="none")
        cross_entropy = (per_row * mask).sum() / mask.sum().clamp(min=1.0)
        if not kinds:
            return cross_entropy, cross_entropy
        flat = torch.cat([p.reshape(-1) for p in params.values()])
        start = torch.cat([p.reshape(-1) for p in starts.values()])
        total = cross_entropy
        for index, kind in enumerate(kinds):
            total = total + weights[index] * kind.flat(flat, start)
        return total, cross_entropy.detach()

    return loss


def gathered(
    members: Sequence[Member], schedule: Schedule, t: int, width: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Step t's minibatch of every member, padded to `width` rows (row 0 repeated, masked
    out); a member with no step t contributes a fully masked batch. On the data's device."""
    xs, ys, masks = [], [], []
    for member, batches in zip(members, schedule.batches, strict=True):
        idx = batches[t] if t < len(batches) else torch.zeros(0, dtype=torch.long)
        rows = torch.zeros(width, dtype=torch.long)
        rows[: len(idx)] = idx
        mask = torch.zeros(width, dtype=member.x.dtype)
        mask[: len(idx)] = 1.0
        if len(member.y) == 0:  # a client without data: a masked batch of zeros
            xs.append(member.x.new_zeros((width, *member.x.shape[1:])))
            ys.append(member.y.new_zeros(width))
        else:
            rows = rows.to(member.x.device)
            xs.append(member.x[rows])
            ys.append(member.y[rows])
        masks.append(mask.to(member.x.device))
    return torch.stack(xs), torch.stack(ys), torch.stack(masks)
