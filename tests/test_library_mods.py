"""The client halves of MAFSA and FedQS as Flower mods (fedstale.mafsa_mod,
fedstale.fedqs_mod): what they add passes the server's own checks, their numbers are the
built-in client halves', other messages pass through, and the quickstart example runs
under each rule with its mod in Flower simulation."""

from __future__ import annotations

import json
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from flwr.app import Context, Message, MessageType, RecordDict

import fedstale
from fedstale.client_app.task import client_model, train_task
from fedstale.common.config import RunConfig
from fedstale.common.federation import FederationKey
from fedstale.common.layout import ParamLayout
from fedstale.common.records import from_array_record, message_content
from fedstale.common.run_model import data_shape
from fedstale.common.schema import STALE, TaskSpec, set_key
from fedstale.common.shares import client_data
from fedstale.common.threads import limited
from fedstale.common.training import local_train
from fedstale.server_app.contract import FlowerContract, MissingSignal
from fedstale.server_app.flower_strategy import AsyncStrategy
from fedstale.server_app.replies import Arrival
from fedstale.server_app.results import read_jsonl
from fedstale.server_app.transport import Reply
from fedstale.strategies.base import View
from fedstale.strategies.client import LocalTask
from fedstale.strategies.fedqs import ClassSpread, FedQSKeys, class_spread
from fedstale.strategies.mafsa import MAFSAKeys
from fedstale.strategies.registry import STRATEGIES
from tests.helpers import run_config
from tests.test_library import (  # noqa: F401 (fixtures)
    DTYPES,
    LAYOUT,
    QUICKSTART,
    flwr_run,
    link_in,
    names_untouched,
    new_run,
    task,
)

Train = Callable[[Message, Context], Message]
CONTEXT = Context(0, 0, {}, None, {})  # type: ignore[arg-type]


def train_message(
    rules: tuple[str, ...], extra: dict[str, Any], arrays: dict, sets: dict | None = None
) -> Message:
    spec = TaskSpec(7, 0, 0.05, 1, 8, 11, local_steps=3, rules=rules, extra=extra)
    content = message_content(spec.to_config(), arrays, sets)
    return Message(content, dst_node_id=1, message_type=MessageType.TRAIN)


def reply_of(message: Message, arrays: dict[str, np.ndarray], **metrics: Any) -> Message:
    content = message_content(None, arrays, metrics={"num-examples": 20, **metrics})
    return Message(content, reply_to=message)


def minus_lr(message: Message, context: Context) -> Message:
    """A deterministic train function: every array moves by -lr (the config's)."""
    lr = float(message.content["config"]["lr"])
    arrays = from_array_record(message.content["arrays"])
    return reply_of(message, {k: (v - lr).astype(v.dtype) for k, v in arrays.items()})


def as_reply(message: Message) -> Reply:
    sets = {
        key.split(".", 1)[1]: from_array_record(record)
        for key, record in message.content.array_records.items()
        if key.startswith("arrays.")
    }
    return Reply(
        "m0",
        metrics=dict(message.content["metrics"]),
        arrays=from_array_record(message.content["arrays"]),
        sets=sets,
    )


# ---------------------------------------------------------------- MAFSA


MAFSA_EXTRA = {MAFSAKeys.OFFLINE: 2, MAFSAKeys.STALE_LR: 0.2, MAFSAKeys.LR_STEP: 0.5}


def mafsa_rule() -> Any:
    run = run_config(strategy="mafsa", num_clients=3, concurrency=3, mafsa_edges=1)
    return STRATEGIES["mafsa"](run, STRATEGIES["mafsa"].Params(), np.zeros(5, np.float32))


def lab_arrays(w: float) -> dict[str, np.ndarray]:
    return {"w": np.full((2, 2), w, np.float32), "steps": np.array([3], np.int64)}


@pytest.mark.usefixtures("in_a_clientapp")
def test_the_mafsa_mod_trains_the_stale_model_through_the_offline_rounds() -> None:
    """Fresh model trained once; the stale one twice more, at lr 0.2 then 0.1; the reply
    passes MAFSA's checks with the stale set beside the model."""
    rule = mafsa_rule()
    msg = train_message(
        (rule.client_rules[0].name,), MAFSA_EXTRA, lab_arrays(1.0), {STALE: lab_arrays(2.0)}
    )
    reply = fedstale.mafsa_mod()(msg, CONTEXT, minus_lr)
    contract = FlowerContract({}, DTYPES)
    contract.sent(7, LAYOUT.flatten(lab_arrays(1.0)))
    sent = task(7)
    sent.sets = (STALE,)
    update = contract.update(Arrival(sent, 0, 0), as_reply(reply), rule, LAYOUT)
    np.testing.assert_allclose(update.vector[:4], 0.95, rtol=1e-6)  # the model
    np.testing.assert_allclose(update.sets[STALE][:4], 2.0 - 0.2 - 0.1, rtol=1e-6)
    assert reply.content[set_key(STALE)]["steps"].numpy().dtype == np.int64


@pytest.mark.usefixtures("in_a_clientapp")
def test_without_the_mod_a_returning_clients_reply_names_it() -> None:
    rule = mafsa_rule()
    msg = train_message(
        (rule.client_rules[0].name,), MAFSA_EXTRA, lab_arrays(1.0), {STALE: lab_arrays(2.0)}
    )
    contract = FlowerContract({}, DTYPES, {r.name: r.mod_hint() for r in rule.client_rules})
    contract.sent(7, LAYOUT.flatten(lab_arrays(1.0)))
    sent = task(7)
    sent.sets = (STALE,)
    with pytest.raises(MissingSignal, match=r"add fedstale.mafsa_mod\(\) to your ClientApp"):
        contract.update(Arrival(sent), as_reply(minus_lr(msg, CONTEXT)), rule, LAYOUT)


def fedstale_local_training(cfg: RunConfig, partition: int) -> Train:
    """A user's train function that trains as fedstale's own ClientApp does."""

    def train(message: Message, context: Context) -> Message:
        config = message.content["config"]
        model, _ = client_model(cfg)
        model.load_state_dict(message.content["arrays"].to_torch_state_dict())
        x, y = client_data(FederationKey.of(cfg), partition, "train")
        local_train(
            model,
            x,
            y,
            epochs=int(config["local-epochs"]),
            batch_size=int(config["batch-size"]),
            lr=float(config["lr"]),
            seed=int(config["seed"]),
            steps=int(config["local-steps"]),
        )
        trained = {k: v.numpy().copy() for k, v in model.state_dict().items()}
        return reply_of(message, trained)

    return train


@pytest.mark.usefixtures("in_a_clientapp")
def test_the_mafsa_mod_trains_the_same_stale_model_as_the_built_in_half() -> None:
    cfg = run_config(dataset="digits", model="mlp", num_clients=4, strategy="mafsa")
    model, layout = client_model(cfg)
    start = {k: v.numpy().copy() for k, v in model.state_dict().items()}
    stale = {k: v + 0.01 for k, v in start.items()}
    msg = train_message(("mafsa-stale-training",), MAFSA_EXTRA, start, {STALE: stale})
    config = dict(msg.content["config"])
    with limited(cfg.client_threads):
        _, _, built_in = train_task(cfg, 1, config, start, {STALE: stale})
        reply = fedstale.mafsa_mod()(msg, CONTEXT, fedstale_local_training(cfg, 1))
    ours = from_array_record(reply.content[set_key(STALE)])
    np.testing.assert_array_equal(layout.flatten(ours), layout.flatten(built_in[STALE]))
    assert not np.allclose(layout.flatten(ours), layout.flatten(stale))


@pytest.mark.usefixtures("in_a_clientapp")
def test_the_mafsa_mod_lets_other_messages_and_tasks_through() -> None:
    mod = fedstale.mafsa_mod()
    evaluate = Message(RecordDict(), dst_node_id=1, message_type=MessageType.EVALUATE)
    assert names_untouched(mod, evaluate)
    for rules, extra in [((), MAFSA_EXTRA), (("mafsa-stale-training",), {})]:
        sets = {STALE: lab_arrays(2.0)} if extra else None
        calls, counted = counting(minus_lr)
        reply = mod(train_message(rules, extra, lab_arrays(1.0), sets), CONTEXT, counted)
        assert len(calls) == 1
        assert set_key(STALE) not in reply.content.array_records


def counting(train: Train) -> tuple[list[Message], Train]:
    calls: list[Message] = []

    def counted(message: Message, context: Context) -> Message:
        calls.append(message)
        return train(message, context)

    return calls, counted


def test_mafsa_is_a_library_strategy_training_every_client_at_once() -> None:
    made = fedstale.MAFSA(num_clients=4, mafsa_edges=2, mafsa_dropout_rate=0.3)
    assert isinstance(made, AsyncStrategy) and made.rule == "mafsa"


# ---------------------------------------------------------------- FedQS


def fedqs_task(kind: str, limit: float, arrays: dict[str, np.ndarray]) -> Message:
    extra = {FedQSKeys.TYPE: kind, FedQSKeys.M0: 0.1, FedQSKeys.SPREAD_LIMIT: limit}
    return train_message(("fedqs-class-spread",), extra, arrays)


def seen_momentum(seen: list[float]) -> Train:
    """A train function that honours (and records) the config's momentum."""

    def train(message: Message, context: Context) -> Message:
        seen.append(float(message.content["config"]["momentum"]))
        return reply_of(message, from_array_record(message.content["arrays"]))

    return train


@pytest.mark.usefixtures("in_a_clientapp")
@pytest.mark.parametrize(("limit", "momentum"), [(1000.0, 0.1), (0.0, 0.0)])
def test_the_fedqs_mod_measures_the_built_in_spread_and_sets_the_momentum(
    limit: float, momentum: float
) -> None:
    """An SBC task: the same spread as ClassSpread's on the same model and data; a spread
    under the limit trains with fedqs-m0, one at or over it without momentum, flagged."""
    cfg = run_config(dataset="digits", model="mlp", num_clients=4, strategy="fedqs-sgd")
    model, layout = client_model(cfg)
    start = {k: v.numpy().copy() for k, v in model.state_dict().items()}
    msg = fedqs_task("SBC", limit, start)
    local = LocalTask(
        cfg,
        1,
        TaskSpec.from_config(dict(msg.content["config"])),
        model,
        layout,
        layout.flatten(start),
        *client_data(FederationKey.of(cfg), 1, "train"),
        *data_shape(cfg),
    )
    ClassSpread().before(local)
    seen: list[float] = []
    mod = fedstale.fedqs_mod(
        lambda: client_model(cfg)[0], lambda ctx: client_data(FederationKey.of(cfg), 1, "train")
    )
    reply = mod(msg, CONTEXT, seen_momentum(seen))
    metrics = {k: reply.content["metrics"][k] for k in local.signals}
    assert metrics == local.signals
    assert seen == [local.spec.momentum] == [momentum]
    assert metrics[FedQSKeys.FLAG] == float(momentum == 0.0)
    assert 0 < metrics[FedQSKeys.SPREAD] <= 100


def fedqs_rule(net: torch.nn.Module) -> Any:
    run = run_config(strategy="fedqs-sgd", num_clients=3, concurrency=2)
    layout = ParamLayout.of(net)
    return STRATEGIES["fedqs-sgd"](
        run, STRATEGIES["fedqs-sgd"].Params(), np.zeros(layout.total, np.float32)
    )


@pytest.mark.usefixtures("in_a_clientapp")
def test_the_fedqs_mods_reply_passes_fedqs_checks_and_without_it_the_reply_names_it() -> None:
    torch.manual_seed(0)
    net = torch.nn.Linear(2, 3)
    x, y = torch.randn(30, 2), torch.arange(30) % 3
    start = {k: v.numpy().copy() for k, v in net.state_dict().items()}
    rule, layout = fedqs_rule(net), ParamLayout.of(net)
    assignment = rule.assign(0, View(0, (0, 1, 2), (), 2))
    rule.pending[0].kind = "SBC"  # the server classified it slow and misaligned
    msg = train_message(
        ("fedqs-class-spread",), {**assignment.entries, FedQSKeys.TYPE: "SBC"}, start
    )
    contract = FlowerContract(
        {},
        {k: np.dtype(np.float32) for k in layout.names},
        {r.name: r.mod_hint() for r in rule.client_rules},
    )
    contract.sent(7, layout.flatten(start))
    plain = as_reply(seen_momentum([])(msg, CONTEXT))
    with pytest.raises(MissingSignal, match=r"add fedstale.fedqs_mod\(model_fn, data_fn\) to your"):
        contract.update(Arrival(task(7), 0, 0), plain, rule, layout)
    mod = fedstale.fedqs_mod(lambda: torch.nn.Linear(2, 3), lambda ctx: (x, y))
    reply = as_reply(mod(msg, CONTEXT, seen_momentum([])))
    update = contract.update(Arrival(task(7), 0, 0), reply, rule, layout)
    assert update.signals[FedQSKeys.SPREAD] == pytest.approx(class_spread(net, x, y))


@pytest.mark.usefixtures("in_a_clientapp")
def test_the_fedqs_mod_lets_other_messages_through_and_measures_only_sbc_tasks() -> None:
    def no_data(context: Context) -> tuple[torch.Tensor, torch.Tensor]:
        raise AssertionError("only an SBC task measures the spread")

    mod = fedstale.fedqs_mod(lambda: torch.nn.Linear(2, 3), no_data)
    evaluate = Message(RecordDict(), dst_node_id=1, message_type=MessageType.EVALUATE)
    assert names_untouched(mod, evaluate)
    plain = train_message((), {}, lab_arrays(1.0))
    config = dict(plain.content["config"])
    calls, counted = counting(minus_lr)
    reply = mod(plain, CONTEXT, counted)
    assert len(calls) == 1 and dict(plain.content["config"]) == config
    assert set(reply.content["metrics"]) == {"num-examples"}
    fast = mod(fedqs_task("FBC", 30.0, lab_arrays(1.0)), CONTEXT, minus_lr)
    assert fast.content["metrics"][FedQSKeys.FLAG] == 1.0
    assert fast.content["metrics"][FedQSKeys.SPREAD] == -1.0


def test_fedqs_is_a_library_strategy() -> None:
    for made in (fedstale.FedQSSGD(buffer_size=3), fedstale.FedQSAvg()):
        assert isinstance(made, AsyncStrategy) and made.rule.startswith("fedqs")


# ---------------------------------------------------------------- a real Flower run

NODE_DATA = '''

def node_data(context: Context) -> tuple[torch.Tensor, torch.Tensor]:
    """This node's training tensors, for FedQS's class spread."""
    loader, _ = load_data(
        context.node_config["partition-id"], context.node_config["num-partitions"], 32
    )
    return loader.dataset.tensors

'''
RULES = {
    "MAFSA": (
        "MAFSA(fraction_evaluate=fraction_evaluate, mafsa_edges=2, mafsa_dropout_rate=0.5, seed=2)",
        "fedstale.mafsa_mod()",
    ),
    "FedQSSGD": (
        "FedQSSGD(fraction_evaluate=fraction_evaluate, buffer_size=3, concurrency=4)",
        "fedstale.fedqs_mod(Net, node_data)",
    ),
}


def quickstart_with(tmp_path: Path, rule: str) -> Path:
    """The quickstart under `rule`, its ClientApp given the rule's mod (one line)."""
    strategy, mod = RULES[rule]
    app = tmp_path / QUICKSTART.name
    shutil.copytree(QUICKSTART, app, ignore=shutil.ignore_patterns("__pycache__"))
    server, client = (
        app / "asyncquickstart" / "server_app.py",
        app / "asyncquickstart" / "client_app.py",
    )
    text = server.read_text().replace(
        "from fedstale import FedBuff", f"from fedstale import {rule}"
    )
    server.write_text(
        text.replace(
            "FedBuff(fraction_evaluate=fraction_evaluate, buffer_size=3, concurrency=4)", strategy
        )
    )
    text = client.read_text().replace("import torch\n", "import fedstale\nimport torch\n")
    client.write_text(
        text.replace("app = ClientApp()", f"{NODE_DATA}app = ClientApp(mods=[{mod}])")
    )
    return app


@pytest.mark.integration
@pytest.mark.parametrize("rule", ["MAFSA", "FedQSSGD"])
def test_the_quickstart_with_the_rules_mod_in_simulation(
    rule: str, request: pytest.FixtureRequest, tmp_path: Path
) -> None:
    """MAFSA: clients back from dropping out bring their stale model trained by the mod;
    FedQS: every reply carries the mod's signals. No reply is rejected."""
    link, work = request.getfixturevalue("link_in")
    before = set((work / "runs").iterdir()) if (work / "runs").exists() else set()
    flwr_run(link.env, quickstart_with(tmp_path, rule), "num-server-rounds=6")
    run = new_run(work, before)
    summary = json.loads((run / "summary.json").read_text())
    rule_name = getattr(fedstale, rule).rule
    assert (summary["strategy"], summary["versions"]) == (rule_name, 6)
    assert summary["updates_rejected"] == 0
    updates = read_jsonl(run / "updates.jsonl")
    if rule == "MAFSA":
        assert any(row["E"] > 0 for row in updates), updates
    else:
        assert {row["type"] for row in updates} - {""}, updates
