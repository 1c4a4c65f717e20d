"""Cohort training (fedstale/common/cohort.py) against per-task training: the same
parameters and last-pass loss for clients of different sizes, learning rates, proximal
terms and step budgets, and a client without data left where it started."""

from __future__ import annotations

import copy
import logging
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest
import torch
from flwr.app import Context, Message, MetricRecord, RecordDict

from fedstale.common.cohort import Member, cohort_train
from fedstale.common.config import parse_run_config
from fedstale.common.models import LeNet
from fedstale.common.records import cohort_content, cohort_parts, message_content
from fedstale.common.schema import (
    ASSIGNED_PARTITION,
    METRICS,
    MSG_COHORT,
    MSG_TRAIN,
    ReplyKeys,
    TaskKeys,
    TaskSpec,
)
from fedstale.common.training import local_train
from fedstale.server_app.cohorts import CohortGridTransport, grid_transport, part_of
from fedstale.server_app.transport import GridTransport, Reply


def members(model: torch.nn.Module) -> list[Member]:
    torch.manual_seed(0)
    out = []
    settings = [
        (150, 2, 0, 0.0),
        (97, 2, 0, 0.01),
        (200, 1, 5, 0.0),
        (64, 3, 0, 0.0),
        (0, 2, 0, 0.0),
    ]
    for k, (n, epochs, steps, mu) in enumerate(settings):
        start = {name: p.detach() + 0.001 * k for name, p in model.named_parameters()}
        x, y = 0.1 * torch.randn(n, 1, 28, 28), torch.randint(0, 10, (n,))
        # small steps: a diverging run would magnify float summation order into the result
        out.append(Member(start, x, y, epochs, 64, 0.01 + 0.005 * k, k, mu, steps))
    return out


def trained_alone(model: torch.nn.Module, member: Member) -> tuple[torch.nn.Module, float]:
    """`member`'s task trained by itself (`local_train`, torch.optim.SGD, its loss terms on
    its own model): the trained model and its last-pass loss."""
    from fedstale.common.training import Optimiser
    from fedstale.strategies.pace import CosineToStartTerm

    alone = copy.deepcopy(model)
    with torch.no_grad():
        for name, p in alone.named_parameters():
            p.copy_(member.params[name])
    own = list(alone.parameters())
    terms = [CosineToStartTerm(term.weight, own, term.start) for term in member.terms]
    loss = local_train(
        alone,
        member.x,
        member.y,
        epochs=member.epochs,
        batch_size=member.batch_size,
        lr=member.lr,
        seed=member.seed,
        proximal_mu=member.proximal_mu,
        steps=member.steps,
        closed_form=False,
        optimiser=Optimiser("sgd", member.momentum, member.weight_decay, member.grad_clip),
        loss_terms=terms,
    )
    return alone, loss


def test_a_cohort_trains_each_client_as_its_own_task_would() -> None:
    model = LeNet((1, 28, 28), 10)
    cohort = members(model)
    trained = cohort_train(model, cohort)
    for member, (params, loss) in zip(cohort, trained, strict=True):
        alone, expected = trained_alone(model, member)
        for name, p in alone.named_parameters():
            torch.testing.assert_close(params[name], p.detach(), rtol=1e-5, atol=1e-5)
        if len(member.y):
            assert loss == pytest.approx(expected, rel=1e-5)
        else:
            assert all(torch.equal(params[n], member.params[n]) for n in params)


def test_a_golden_run_with_cohort_training_matches_its_golden_files(tmp_path: Path) -> None:
    """FedBuff's golden config with trainer=cohort in --local's cohort transport: the same
    events, floats within the golden tolerances of per-task training; cohorts of more than
    one task formed."""
    from fedstale.launcher.local import cohort_transport
    from fedstale.server_app.experiment import run_experiment
    from fedstale.strategies.registry import load_config
    from tests.goldens import differences, golden_values, one_thread, without_wall_time

    run, params = load_config({**golden_values("fedbuff", tmp_path), "trainer": "cohort"})
    transport = cohort_transport(run)
    with one_thread():
        run_experiment(run, params, transport)
    folder = tmp_path / "fedbuff"
    produced = {
        "metrics.jsonl": without_wall_time((folder / "metrics.jsonl").read_text()),
        "updates.jsonl": (folder / "updates.jsonl").read_text(),
    }
    assert differences("fedbuff", produced) == []
    assert max(transport.cohort_sizes) > 1 and sum(transport.cohort_sizes) >= 300


def test_momentum_weight_decay_clipping_and_a_batched_term_train_as_alone() -> None:
    """Each member its own momentum, weight decay, gradient clip and PACE cosine term (or
    none), against `local_train` with torch.optim.SGD and the term on the task's model."""
    from fedstale.strategies.pace import CosineToStartTerm

    model = LeNet((1, 28, 28), 10)
    settings = [
        (0.9, 0.0, 0.0, 0.0),
        (0.0, 5e-3, 0.0, 0.1),
        (0.5, 1e-3, 0.5, 0.0),
        (0.0, 0.0, 0.0, 0.0),
    ]
    cohort = []
    for member, (momentum, decay, clip, weight) in zip(members(model), settings, strict=False):
        start = torch.cat([p.reshape(-1) for p in member.params.values()])
        terms = (CosineToStartTerm(weight, [], start),) if weight else ()
        cohort.append(
            replace(member, momentum=momentum, weight_decay=decay, grad_clip=clip, terms=terms)
        )
    trained = cohort_train(model, cohort)
    for member, (params, loss) in zip(cohort, trained, strict=True):
        alone, expected = trained_alone(model, member)
        for name, p in alone.named_parameters():
            torch.testing.assert_close(params[name], p.detach(), rtol=1e-5, atol=1e-5)
        assert loss == pytest.approx(expected, rel=1e-5)


RULE_RUNS = {
    "fedpsa": {"buffer-size": 2},
    "pace": {},
    "pfedgraph-async": {},
    "fedqs-sgd": {"momentum": 0.5},
    "fedqs-avg": {"momentum": 0.5},
    "mafsa": {"mafsa-edges": 2, "local-steps": 4, "concurrency": 8, "mafsa-dropout-rate": 0.4},
    "fedbuff": {"momentum": 0.9, "weight-decay": 1e-3, "grad-clip": 5.0, "buffer-size": 2},
}


@pytest.mark.parametrize("strategy", sorted(RULE_RUNS))
def test_every_seed_rule_trains_in_cohorts_as_it_does_per_task(
    strategy: str, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """A seed system's run with trainer=cohort: its client half and optimiser settings
    join the cohorts (none trains alone), and the run's events equal those of per-task
    training (trainer=autograd), its floats within float summation order."""
    from fedstale.launcher.local import cohort_transport, local_transport
    from fedstale.server_app.experiment import run_experiment
    from fedstale.server_app.results import read_jsonl
    from fedstale.strategies.registry import load_config
    from tests.goldens import one_thread

    values = {
        "strategy": strategy,
        "dataset": "digits",
        "num-clients": 8,
        "concurrency": 4,
        "local-epochs": 1,
        "max-updates": 24,
        "max-virtual-time": 0.0,
        "eval-interval": 200.0,
        "runs-dir": str(tmp_path),
        **RULE_RUNS[strategy],
    }
    rows = {}
    for trainer in ("cohort", "autograd"):
        run, params = load_config({**values, "trainer": trainer, "run-name": trainer})
        transport = cohort_transport(run) if trainer == "cohort" else local_transport(run)
        with one_thread():
            run_experiment(run, params, transport)
        rows[trainer] = [
            read_jsonl(tmp_path / trainer / f) for f in ("updates.jsonl", "metrics.jsonl")
        ]
        if trainer == "cohort":
            assert max(transport.cohort_sizes) > 1, transport.cohort_sizes
    assert "train one at a time" not in caplog.text
    for together, alone in zip(rows["cohort"], rows["autograd"], strict=True):
        assert len(together) == len(alone) > 0
        for a, b in zip(together, alone, strict=True):
            assert a.keys() == b.keys()
            for key, value in a.items():
                if key in {"wall_time", "compute_seconds"}:
                    continue
                if isinstance(value, float):
                    assert value == pytest.approx(b[key], rel=1e-3, abs=1e-4), (key, a, b)
                else:
                    assert value == b[key], (key, a, b)


def test_a_task_with_an_optimiser_cohorts_do_not_batch_trains_alone_and_says_so(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    from fedstale.launcher.local import cohort_transport
    from fedstale.server_app.experiment import run_experiment
    from fedstale.strategies.registry import load_config

    values = {
        "strategy": "fedbuff",
        "trainer": "cohort",
        "optimizer": "adam",
        "dataset": "digits",
        "num-clients": 6,
        "concurrency": 3,
        "buffer-size": 2,
        "local-epochs": 1,
        "max-versions": 3,
        "max-virtual-time": 0.0,
        "runs-dir": str(tmp_path),
        "run-name": "adam",
    }
    run, params = load_config(values)
    summary = run_experiment(run, params, cohort_transport(run))
    assert summary["versions"] == 3 and summary["updates_rejected"] == 0
    assert "trainer=cohort: optimizer 'adam' (cohorts train SGD)" in caplog.text


class ClientAppGrid:
    """Flower's InMemoryGrid in miniature: pushed messages get ids and run fedstale's
    ClientApp at once (every node can load every partition); pulls hand their replies out."""

    def __init__(self, run_config: dict) -> None:
        self.run_config = run_config
        self.pushed: list[Message] = []
        self.replies: dict[str, Message] = {}

    def push_messages(self, messages: list[Message]) -> list[str]:
        from fedstale.client_app.app import app

        ids = []
        for message in messages:
            message.metadata.__dict__["_message_id"] = f"m{len(self.pushed)}"
            self.pushed.append(message)
            context = Context(1, message.metadata.dst_node_id, {}, RecordDict(), self.run_config)
            self.replies[message.metadata.message_id] = app(message, context)
            ids.append(message.metadata.message_id)
        return ids

    def pull_messages(self, msg_ids: list[str]) -> list[Message]:
        return [self.replies.pop(m) for m in list(msg_ids) if m in self.replies]


@pytest.mark.usefixtures("in_a_clientapp")
def test_cohort_messages_train_their_tasks_as_each_would_alone() -> None:
    """The server's cohort transport: tasks wait until the engine needs a reply, then go in
    one train.cohort message (a client's second task waits for the next one); a task that
    cannot join goes alone at once; each reply equals that task trained by itself."""
    from fedstale.client_app.task import client_model, train_task
    from fedstale.common.models import get_flat

    values = {"dataset": "digits", "num-clients": 4, "concurrency": 4, "trainer": "cohort"}
    cfg = parse_run_config(values)
    grid = ClientAppGrid(values)
    transport = CohortGridTransport(GridTransport(grid, ttl=60.0), cfg.loss)
    model, layout = client_model(cfg)
    arrays = layout.unflatten(get_flat(model))

    def task(task_id: int, partition: int, **spec: object) -> dict:
        config = TaskSpec(task_id, 0, 0.05, 1, 16, task_id, **spec).to_config()  # type: ignore[arg-type]
        return {**config, ASSIGNED_PARTITION: partition}

    configs = [task(0, 2), task(1, 3), task(2, 2), task(3, 1, optimizer="adam")]
    sent = [transport.send(1000 + c[ASSIGNED_PARTITION], MSG_TRAIN, c, arrays) for c in configs]
    assert [m.metadata.message_type for m in grid.pushed] == [MSG_TRAIN]  # the Adam task
    transport.wait(0.0)
    transport.wait(0.0)
    assert [m.metadata.message_type for m in grid.pushed] == [MSG_TRAIN, MSG_COHORT, MSG_COHORT]
    assert transport.cohort_sizes == [2, 1]
    replies = {r.msg_id: r for r in transport.receive(sent)}
    assert sorted(replies) == sorted(sent)
    for msg_id, config in zip(sent, configs, strict=True):
        reply = replies[msg_id]
        assert not reply.invalid and reply.error_code is None
        metrics, delta, _ = train_task(cfg, config[ASSIGNED_PARTITION], config, arrays)
        assert reply.metrics[ReplyKeys.TASK_ID] == config[TaskKeys.TASK_ID]
        assert reply.metrics[ReplyKeys.TRAIN_LOSS] == pytest.approx(
            metrics[ReplyKeys.TRAIN_LOSS], rel=1e-5
        )
        assert reply.arrays is not None
        for name, values_alone in delta.items():
            np.testing.assert_allclose(reply.arrays[name], values_alone, rtol=1e-4, atol=1e-6)


def test_a_malformed_or_failed_cohort_reply_answers_each_of_its_tasks() -> None:
    content = cohort_content([message_content(None, metrics={"loss": 1.0})])
    assert [dict(p[METRICS]) for p in cohort_parts(content) or []] == [{"loss": 1.0}]
    content["5/metrics"] = MetricRecord({})
    with pytest.raises(ValueError, match="of 1 parts holds the record '5/metrics'"):
        cohort_parts(content)
    assert cohort_parts(message_content({"a": 1})) is None  # a plain task's content
    short = Reply("m", parts=[Reply("", metrics={"loss": 1.0})])
    assert part_of(short, 1, 2, "t").invalid == "a cohort of 2 tasks answered 1"
    assert part_of(short, 0, 1, "t") == Reply("t", metrics={"loss": 1.0})
    failed = Reply("m", error_code=2, error="ClientApp raised")
    assert part_of(failed, 1, 2, "t") == Reply("t", error_code=2, error="ClientApp raised")
    assert part_of(Reply("m", invalid="bad"), 0, 1, "t").invalid == "its cohort's reply: bad"


class PushedOnly(ClientAppGrid):
    def push_messages(self, messages: list[Message]) -> list[str]:
        self.pushed += messages
        return [f"m{len(self.pushed)}"]


@pytest.mark.usefixtures("in_a_clientapp")
def test_cohorts_form_only_where_every_partition_is_on_the_box(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """A deployment (not Flower's InMemoryGrid) trains per task, and so does a simulation
    whose tasks name no partition (node-partitions=ask); each said in one line."""
    caplog.set_level(logging.INFO, logger="fedstale")
    cfg = parse_run_config({"trainer": "cohort", "num-clients": 10})
    assert type(grid_transport(ClientAppGrid({}), cfg)) is GridTransport  # type: ignore[arg-type]
    assert "a deployment's node holds only its own client's data" in caplog.text
    grid = PushedOnly({})
    transport = CohortGridTransport(GridTransport(grid, ttl=60.0), cfg.loss)
    config = TaskSpec(0, 0, 0.05, 1, 16, 0).to_config()
    assert transport.send(1000, MSG_TRAIN, config, {}) == "m1"  # sent alone, at once
    assert [m.metadata.message_type for m in grid.pushed] == [MSG_TRAIN]
    assert "the tasks name no partition (node-partitions=ask)" in caplog.text
    assert transport.waiting == []
