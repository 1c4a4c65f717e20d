"""Client-side rules and the optimiser settings a task asks for."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest
import torch

import fedstale.common.training as training
from fedstale.client_app.task import client_model, train_task
from fedstale.common.models import build_model, get_flat
from fedstale.common.schema import ReplyKeys, ScoreKeys, SignalSpec, TaskSpec
from fedstale.common.training import Optimiser, local_train
from fedstale.launcher.local import local_transport
from fedstale.server_app.experiment import run_experiment
from fedstale.server_app.results import read_jsonl
from fedstale.strategies.base import Outcome, Update, View, update_record
from fedstale.strategies.client import ClientRule, LocalTask, UnknownClientRule
from fedstale.strategies.fedbuff import FedBuff
from fedstale.strategies.fedpsa import FedPSAKeys
from fedstale.strategies.registry import STRATEGIES, load_config
from fedstale.strategies.rule import Rule
from tests.helpers import rule_package, run_config

PROBE = "probe-norm"


class ProbeRule(ClientRule):
    """Adds a signal (||delta||), counts tasks in the client's kept state, and adds a loss
    term that pulls the weights to zero (so the closed-form trainer must step aside)."""

    name = "probe-rule"

    def before(self, task: LocalTask) -> None:
        seen = task.state.get("tasks", np.zeros(1, dtype=np.float32))
        task.state["tasks"] = seen + 1
        task.loss_terms.append(lambda model: 0.0 * sum(p.sum() for p in model.parameters()))

    def after(self, task: LocalTask, trained: np.ndarray, delta: np.ndarray) -> None:
        task.signals[PROBE] = float(np.linalg.norm(delta))
        task.signals["tasks-seen"] = float(task.state["tasks"][0])


class ProbeStrategy(FedBuff):
    name = "probe"
    client_rules = (ProbeRule(),)

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.probes: list[tuple[int, float, float, float]] = []

    def signals(self) -> dict[str, SignalSpec]:
        return {PROBE: SignalSpec(), "tasks-seen": SignalSpec()}

    def on_update(self, update: Update, view: View) -> Outcome:
        norm = float(np.linalg.norm(update.vector))
        seen = update.signals["tasks-seen"]
        self.probes.append((update.client, update.signals[PROBE], norm, seen))
        outcome = super().on_update(update, view)
        outcome.records = [update_record(update, 0.0, probe=update.signals[PROBE])]
        return outcome


RULES = (Rule(ProbeStrategy, wire=(PROBE, "tasks-seen")),)


@pytest.fixture
def probe_declared(tmp_path_factory: pytest.TempPathFactory) -> Iterator[None]:
    """ProbeStrategy declared by a package's entry point, as any rule outside fedstale."""
    with rule_package(tmp_path_factory.mktemp("package"), f"{__name__}:RULES", "probe"):
        yield


@pytest.mark.usefixtures("probe_declared")
def test_a_client_rule_adds_a_signal_keeps_state_and_changes_the_loss(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Any
) -> None:
    used: list[str] = []
    original = training.autograd_step
    monkeypatch.setattr(
        training, "autograd_step", lambda *a, **k: used.append("autograd") or original(*a, **k)
    )
    values = {
        "strategy": "probe",
        "dataset": "fmnist",
        "local-epochs": 1,
        "num-clients": 4,
        "concurrency": 2,
        "buffer-size": 2,
        "max-virtual-time": 0.0,
        "max-versions": 4,
        "run-name": "probe",
        "runs-dir": str(tmp_path),
    }
    run, params = load_config(values)
    summary = run_experiment(run, params, local_transport(run))
    rows = read_jsonl(tmp_path / "probe" / "updates.jsonl")
    assert len(rows) == 8 and all(row["probe"] > 0 for row in rows)
    # the loss term made every task of the linear model train with autograd (trainer=auto
    # would otherwise use the closed form); in-process, a task trains when it is sent
    assert len(used) == summary["tasks_dispatched"]


@pytest.mark.usefixtures("probe_declared")
def test_client_state_persists_per_client_in_process() -> None:
    cfg = run_config(dataset="digits", num_clients=2, concurrency=1)
    transport = local_transport(cfg)
    model, layout = client_model(cfg)
    arrays = layout.unflatten(get_flat(model))
    spec = TaskSpec(0, 0, lr=0.1, local_epochs=1, batch_size=16, seed=0, rules=("probe-rule",))
    seen = []
    for client in (0, 0, 1, 0):
        msg = transport.send(1000 + client, "train", spec.to_config(), arrays)
        seen.append(transport.receive([msg])[0].metrics["tasks-seen"])
    assert seen == [1.0, 2.0, 1.0, 3.0]


def test_fedpsa_sketch_comes_from_its_client_rule() -> None:
    cfg = run_config(dataset="digits", strategy="fedpsa")
    model, layout = client_model(cfg)
    extra = {
        FedPSAKeys.SKETCH_K: 4,
        FedPSAKeys.SKETCH_SEED: 0,
        FedPSAKeys.SKETCH_OF: "sensitivity",
        FedPSAKeys.CALIB_SIZE: 8,
        FedPSAKeys.CALIB_SEED: 0,
        FedPSAKeys.CALIB_SOURCE: "gaussian",
    }
    spec = TaskSpec(0, 0, lr=0.1, local_epochs=1, batch_size=16, seed=0, rules=("fedpsa-sketch",))
    config = {**spec.to_config(), **extra}
    metrics, delta, sets = train_task(cfg, 0, config, layout.unflatten(get_flat(model)))
    assert len(metrics[FedPSAKeys.SKETCH]) == 4 and sets == {}
    norm = sum(float(np.dot(v.ravel().astype(np.float64), v.ravel())) for v in delta.values())
    assert metrics[FedPSAKeys.UPDATE_NORM_SQ] == pytest.approx(norm, rel=1e-6)
    plain = {**config, "client-rules": ""}  # what a FedBuff task names: no rule
    metrics, _, _ = train_task(cfg, 0, plain, layout.unflatten(get_flat(model)))
    assert FedPSAKeys.SKETCH not in metrics


def data() -> tuple[torch.Tensor, torch.Tensor]:
    torch.manual_seed(0)
    return torch.randn(100, 1, 6, 6), torch.randint(0, 4, (100,))


def test_local_steps_train_exactly_that_many_minibatches(monkeypatch: pytest.MonkeyPatch) -> None:
    x, y = data()
    steps: list[int] = []
    original = training.softmax_regression_step

    def counting(*args: Any, **kwargs: Any) -> Any:
        step = original(*args, **kwargs)
        return lambda idx: steps.append(len(idx)) or step(idx)

    monkeypatch.setattr(training, "softmax_regression_step", counting)
    model = build_model("linear", (1, 6, 6), 4, seed=1)
    local_train(model, x, y, epochs=5, batch_size=32, lr=0.1, seed=0, steps=9)
    assert steps == [32, 32, 32, 4] * 2 + [32]  # 4 batches a pass, 9 steps over 3 passes


@pytest.mark.parametrize(
    "optimiser",
    [
        Optimiser(momentum=0.9),
        Optimiser(weight_decay=0.1),
        Optimiser(grad_clip=0.01),
        Optimiser(kind="adam"),
    ],
)
def test_optimiser_settings_change_training_and_skip_the_closed_form(
    optimiser: Optimiser,
) -> None:
    x, y = data()
    plain, tuned = (build_model("linear", (1, 6, 6), 4, seed=1) for _ in range(2))
    settings = {"epochs": 2, "batch_size": 16, "lr": 0.1, "seed": 3}
    local_train(plain, x, y, **settings)
    local_train(tuned, x, y, **settings, optimiser=optimiser)
    assert not torch.allclose(plain.fc.weight, tuned.fc.weight)
    reference = build_model("linear", (1, 6, 6), 4, seed=1)
    torch_optimizer = training.make_optimizer(list(reference.parameters()), 0.1, optimiser)
    generator = torch.Generator().manual_seed(3)
    for _ in range(2):
        for idx in torch.randperm(100, generator=generator).split(16):
            loss = torch.nn.functional.cross_entropy(reference(x[idx]), y[idx])
            torch_optimizer.zero_grad()
            loss.backward()
            if optimiser.grad_clip:
                torch.nn.utils.clip_grad_norm_(list(reference.parameters()), optimiser.grad_clip)
            torch_optimizer.step()
    torch.testing.assert_close(tuned.fc.weight, reference.fc.weight)


def test_task_settings_from_an_assignment_reach_the_client() -> None:
    values = {"dataset": "digits", "num-clients": 2, "concurrency": 1, "momentum": 0.5}
    run, _ = load_config(values)
    spec = TaskSpec.from_config(
        TaskSpec(
            task_id=1,
            version=0,
            lr=0.1,
            local_epochs=1,
            batch_size=8,
            seed=0,
            momentum=run.momentum,
            optimizer="adam",
            local_steps=3,
        ).to_config()
    )
    assert (spec.momentum, spec.optimizer, spec.local_steps) == (0.5, "adam", 3)


def test_a_task_naming_an_unknown_client_rule_is_refused_not_trained_plainly() -> None:
    cfg = run_config(dataset="digits", num_clients=2)
    model, layout = client_model(cfg)
    spec = TaskSpec(0, 0, lr=0.1, local_epochs=1, batch_size=16, seed=0, rules=("no-such",))
    with pytest.raises(UnknownClientRule, match="client rule 'no-such'"):
        train_task(cfg, 0, spec.to_config(), layout.unflatten(get_flat(model)))


def test_every_task_names_its_strategys_client_rules() -> None:
    from fedstale.strategies.registry import client_rules

    known = client_rules()
    assert set(known) == {"fedpsa-sketch", "cosine-to-start", "fedqs-class-spread"} | {
        "mafsa-stale-training"
    }
    for name, cls in STRATEGIES.items():
        declared = tuple(rule.name for rule in cls.client_rules)
        assert all(known[rule] is r for rule, r in zip(declared, cls.client_rules, strict=True))
        assert bool(declared) == (
            name in {"fedpsa", "pace", "pfedgraph-async", "fedqs-sgd", "fedqs-avg", "mafsa"}
        )


def test_a_task_asked_for_a_score_reports_the_model_it_was_sent_and_trains_the_same() -> None:
    """Per-client evaluation on a deployment: the train reply scores the model the task
    carried on the client's own held-out split (as an evaluate message would) before
    training, and the training is the same as without the ask."""
    from fedstale.client_app.task import evaluate_task

    cfg = run_config(dataset="digits", num_clients=3, test_split="local")
    model, layout = client_model(cfg)
    start = layout.unflatten(get_flat(model) + 0.01)
    spec = TaskSpec(4, 0, lr=0.1, local_epochs=1, batch_size=16, seed=0)
    asked, delta, _ = train_task(cfg, 1, {**spec.to_config(), ScoreKeys.ASK: 1}, start)
    plain, plain_delta, _ = train_task(cfg, 1, spec.to_config(), start)
    scored = evaluate_task(cfg, 1, {"task-id": 4}, start)
    assert asked[ScoreKeys.ACCURACY] == scored["accuracy"]
    assert asked[ScoreKeys.LOSS] == pytest.approx(scored["loss"])
    assert ScoreKeys.ACCURACY not in plain and ScoreKeys.LOSS not in plain
    assert asked[ReplyKeys.TRAIN_LOSS] == plain[ReplyKeys.TRAIN_LOSS]
    for name in delta:
        np.testing.assert_array_equal(delta[name], plain_delta[name])
