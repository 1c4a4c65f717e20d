"""FedPSA's calibration labels (`fedpsa-calib-labels`): random, or each sketched model's own
argmax on the Gaussian batch, the same in fedstale's ClientApp, the mod and the server."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
import torch
from flwr.app import Context, Message

import fedstale
from fedstale.client_app.task import client_model, train_task
from fedstale.common.calibration import gaussian_batch
from fedstale.common.config import ConfigError, RunConfig
from fedstale.common.models import build_model, get_flat, set_flat
from fedstale.common.records import from_array_record, message_content
from fedstale.common.run_model import run_model
from fedstale.common.schema import TaskSpec
from fedstale.common.sensitivity import model_sketch, self_labelled
from fedstale.strategies.fedpsa import FedPSA, FedPSAKeys, FedPSAParams, sketch_for_task
from fedstale.strategies.registry import load_config
from tests.helpers import bind_server, run_config

SHAPE = (1, 8, 8)


def settings(labels: str) -> dict[str, Any]:
    return FedPSA(run_config(), FedPSAParams(fedpsa_calib_labels=labels), np.zeros(1)).task_extra(0)


@pytest.mark.parametrize("name", ["mlp", "linear"])
def test_the_self_labelled_batch_is_the_models_argmax(name: str) -> None:
    model = build_model(name, SHAPE, 10, seed=4)
    model.train()
    x, y = gaussian_batch(7, SHAPE, 10, 64)
    x_self, y_self = self_labelled(model, (x, y))
    assert x_self is x and model.training  # inputs kept, mode restored
    with torch.no_grad():
        expected = model.eval()(x).argmax(dim=1)
    assert torch.equal(y_self, expected)
    assert not torch.equal(y_self, y)  # the seed's uniform labels are something else


@pytest.mark.parametrize("name", ["mlp", "linear"])
def test_self_sketches_are_of_the_argmax_batch_and_differ_from_random_ones(name: str) -> None:
    model = build_model(name, SHAPE, 10, seed=4)
    random, own = settings("random"), settings("self")
    assert (random[FedPSAKeys.CALIB_LABELS], own[FedPSAKeys.CALIB_LABELS]) == ("random", "self")
    x, y = gaussian_batch(own[FedPSAKeys.CALIB_SEED], SHAPE, 10, own[FedPSAKeys.CALIB_SIZE])
    with torch.no_grad():
        argmax = model(x).argmax(dim=1)
    k, seed = own[FedPSAKeys.SKETCH_K], own[FedPSAKeys.SKETCH_SEED]
    by_hand = model_sketch(model, (x, argmax), k, seed)
    np.testing.assert_array_equal(sketch_for_task(model, own, SHAPE, 10), by_hand)
    np.testing.assert_array_equal(
        sketch_for_task(model, random, SHAPE, 10), model_sketch(model, (x, y), k, seed)
    )
    assert np.abs(by_hand - model_sketch(model, (x, y), k, seed)).max() > 1e-3


def test_a_task_without_labels_means_random_and_an_unknown_mode_is_refused() -> None:
    model = build_model("mlp", SHAPE, 10, seed=4)
    old = {k: v for k, v in settings("random").items() if k != FedPSAKeys.CALIB_LABELS}
    np.testing.assert_array_equal(
        sketch_for_task(model, old, SHAPE, 10),
        sketch_for_task(model, settings("random"), SHAPE, 10),
    )
    with pytest.raises(ValueError, match="calibration labels 'mine'"):
        sketch_for_task(model, {**old, FedPSAKeys.CALIB_LABELS: "mine"}, SHAPE, 10)


def self_run() -> RunConfig:
    return run_config(dataset="digits", num_clients=10, strategy="fedpsa")


def test_the_server_labels_the_global_model_as_a_client_labels_its_own() -> None:
    strategy = FedPSA(self_run(), FedPSAParams(fedpsa_calib_labels="self"), np.zeros(1))
    bind_server(self_run(), strategy)
    flat = get_flat(build_model("mlp", SHAPE, 10, seed=11))
    client_side = build_model("mlp", SHAPE, 10, seed=0)
    set_flat(client_side, flat)
    assert strategy.sketch_global is not None
    np.testing.assert_array_equal(
        strategy.sketch_global(flat), sketch_for_task(client_side, settings("self"), SHAPE, 10)
    )


def client_app_task(labels: str) -> tuple[dict[str, Any], dict[str, np.ndarray], dict]:
    """One task of fedstale's own ClientApp with the strategy's task config: (its config,
    the model sent, the reply's metrics and delta)."""
    cfg = self_run()
    layout = client_model(cfg)[1]
    start = layout.unflatten(get_flat(run_model(cfg)))  # the app's model holds its last task
    strategy = FedPSA(cfg, FedPSAParams(fedpsa_calib_labels=labels), np.zeros(layout.total))
    spec = TaskSpec(0, 0, 0.1, 1, 16, 0, rules=("fedpsa-sketch",), extra=strategy.task_extra(0))
    metrics, delta, _ = train_task(cfg, 0, spec.to_config(), start)
    return spec.to_config(), start, {"metrics": metrics, "delta": delta}


def test_the_option_reaches_the_client_app_through_the_task_config() -> None:
    config, start, own = client_app_task("self")
    assert config[FedPSAKeys.CALIB_LABELS] == "self"
    _, _, random = client_app_task("random")
    for name in start:  # the labels change the sketch only, never the training
        np.testing.assert_array_equal(own["delta"][name], random["delta"][name])
    trained = run_model(self_run())
    trained.load_state_dict({k: torch.from_numpy(start[k] + own["delta"][k]) for k in start})
    expected = sketch_for_task(trained, settings("self"), SHAPE, 10)
    sent = np.asarray(own["metrics"][FedPSAKeys.SKETCH])
    np.testing.assert_allclose(sent, expected, rtol=1e-4, atol=1e-7)
    assert np.abs(sent - np.asarray(random["metrics"][FedPSAKeys.SKETCH])).max() > 1e-3


@pytest.mark.usefixtures("in_a_clientapp")
def test_the_mod_and_the_client_app_sketch_the_same_model_alike() -> None:
    config, start, app = client_app_task("self")
    trained = {k: start[k] + app["delta"][k] for k in start}
    msg = Message(message_content(config, start), dst_node_id=1, message_type="train")

    def user_train(message: Message, context: Context) -> Message:
        content = message_content(None, trained, metrics={"num-examples": 8})
        return Message(content, reply_to=message)

    mod = fedstale.fedpsa_mod(lambda: run_model(self_run()), SHAPE)
    reply = mod(msg, Context(0, 0, {}, None, {}), user_train)  # type: ignore[arg-type]
    metrics = dict(reply.content["metrics"])
    assert from_array_record(reply.content["arrays"]).keys() == trained.keys()
    np.testing.assert_allclose(
        metrics[FedPSAKeys.SKETCH], app["metrics"][FedPSAKeys.SKETCH], rtol=1e-4, atol=1e-7
    )
    assert metrics[FedPSAKeys.UPDATE_NORM_SQ] == pytest.approx(
        app["metrics"][FedPSAKeys.UPDATE_NORM_SQ], rel=1e-4
    )


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        ({"fedpsa-calib-source": "real"}, "a real batch (fedpsa-calib-source=real) keeps its own"),
        ({"fedpsa-ablation": "no-sensitivity"}, "no effect with fedpsa-ablation=no-sensitivity"),
        ({"fedpsa-ablation": "no-both"}, "no effect with fedpsa-ablation=no-both"),
        ({"loss": "mse", "metric": "neg-mse"}, "strategy fedpsa needs loss=cross-entropy"),
        ({"fedpsa-calib-labels": "model"}, "'fedpsa-calib-labels' = 'model'"),
    ],
)
def test_meaningless_label_settings_are_one_line(extra: dict[str, Any], message: str) -> None:
    with pytest.raises(ConfigError) as err:
        load_config({"strategy": "fedpsa", "fedpsa-calib-labels": "self", **extra})
    assert message in str(err.value) and "\n" not in str(err.value)


def test_self_labels_alone_and_random_labels_with_anything_load() -> None:
    assert load_config({"strategy": "fedpsa", "fedpsa-calib-labels": "self"})[1] == FedPSAParams(
        fedpsa_calib_labels="self"
    )
    for extra in ({"fedpsa-calib-source": "real"}, {"fedpsa-ablation": "no-both"}):
        load_config({"strategy": "fedpsa", "fedpsa-calib-labels": "random", **extra})


def table1_jobs(*argv: str) -> tuple[list[Any], Any]:
    from bench.reproduce import parser_for
    from bench.reproduce_fedpsa import FEDPSA

    parser = parser_for(FEDPSA)
    args = parser.parse_args(list(argv))
    FEDPSA.check(args, parser)
    return FEDPSA.suites[args.suite].jobs(args), FEDPSA.out(args)


def test_the_table1_grid_runs_self_labels_at_one_alpha_in_a_folder_of_its_own() -> None:
    jobs, out = table1_jobs(
        "--full", "--alphas", "0.1", "--methods", "fedbuff,fedpsa", "--calib-labels", "self"
    )
    assert out.name == "10d-3seeds-self-labels" and len(jobs) == 6
    assert {j.config["dirichlet-alpha"] for j in jobs} == {0.1}
    labels = {j.config["strategy"]: j.config.get("fedpsa-calib-labels") for j in jobs}
    assert labels == {"fedbuff": None, "fedpsa": "self"}
    jobs, out = table1_jobs("--full", "--methods", "fedpsa")
    assert out.name == "10d-3seeds" and len(jobs) == 9
    assert all("fedpsa-calib-labels" not in j.config for j in jobs)
    with pytest.raises(SystemExit):
        table1_jobs("--suite", "ablation", "--calib-labels", "self")
