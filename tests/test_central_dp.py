"""Central DP in the engine (fedstale/server_app/central_dp.py): clipping before the rule,
noise of the declared deviation on every release, seeded for replay, accounted with
Flower's RdpAccountant, and a budget that ends the run."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from flwr.supercore.privacy_accounting import (
    GaussianPrivacyEvent,
    NeighboringRelation,
    PrivacyConfig,
    SamplingMethod,
)
from flwr.supercore.privacy_accounting.rdp_accountant import RdpAccountant

from fedstale.common.config import ConfigError
from fedstale.common.latency import profile_for
from fedstale.common.models import ParamLayout
from fedstale.common.schema import CLIPPING_NORM, TaskKeys
from fedstale.server_app.central_dp import (
    NOISE_STREAM,
    CentralDP,
    check_budget,
    epsilon_after,
    releases_within,
)
from fedstale.server_app.engine import Engine
from fedstale.strategies.fedasync import FedAsync, FedAsyncParams
from fedstale.strategies.fedavg import FedAvg
from fedstale.strategies.fedbuff import FedBuff, FedBuffParams
from fedstale.strategies.registry import load_config
from tests.helpers import ListRecorder, ScriptedTransport, delta_reply, run_config

LAYOUT = ParamLayout(names=("w",), shapes=((3,),))
STEP = 1.0  # every client's delta: (1, 1, 1), norm sqrt(3)
ROOT = Path(__file__).resolve().parents[1]


def dp_engine(strategy_cls: type, params: Any, train_fn: Any = None, **overrides: Any) -> Engine:
    settings = {
        "num-clients": 6,
        "concurrency": 3,
        "buffer-size": 2,
        "max-versions": 12,
        "max-virtual-time": 0.0,
        "eval-interval": 250.0,
        "poll-interval": 0.0001,
        "node-wait-seconds": 2.0,
        "progress-interval": 1000.0,
        "dp-clipping-norm": 0.5,
        **overrides,
    }
    run = run_config(**settings)
    strategy = strategy_cls(run, params, np.zeros(3, dtype=np.float32))
    transport = ScriptedTransport(6, train_fn or delta_reply, seed=1)
    return Engine(
        run,
        strategy,
        transport,
        LAYOUT,
        profile_for(run),
        lambda flat: (0.0, 0.0),
        ListRecorder(),
        privacy=CentralDP.for_run(run),
    )


def ran(engine: Engine) -> Engine:
    engine.run_loop()
    return engine


def per_version_weights(engine: Engine) -> dict[int, list[float]]:
    rows = engine.recorder.updates  # type: ignore[attr-defined]
    out: dict[int, list[float]] = {}
    for row in rows:
        out.setdefault(row["version"], []).append(row["weight"])
    return out


def test_server_clipping_scales_each_delta_to_the_norm_before_the_rule_sees_it() -> None:
    """FedBuff, clipping only: each (1,1,1) delta arrives as 0.5 / sqrt(3) per coordinate,
    so the model is sum over releases of sum_i w_i * 0.5 / sqrt(3)."""
    engine = ran(dp_engine(FedBuff, FedBuffParams()))
    weights = per_version_weights(engine)
    expected = sum(sum(w) for w in weights.values()) * 0.5 / np.sqrt(3)
    np.testing.assert_allclose(engine.strategy.model, np.full(3, expected), rtol=1e-5)
    assert engine.privacy is not None and engine.privacy.clipped == engine.counters.accepted
    assert engine.privacy.epsilon() is None  # clipping without noise: no guarantee


def test_every_release_gets_noise_of_z_times_its_sensitivity_from_a_seeded_stream() -> None:
    """The noised model minus the clip-only model is, release by release, the draw of
    rng([seed, NOISE_STREAM, version]) with standard deviation z * max_i w_i * C (the
    deltas do not depend on the model here, so the two runs see the same updates)."""
    clean = ran(dp_engine(FedBuff, FedBuffParams()))
    z, norm = 1.5, 0.5
    noisy = ran(dp_engine(FedBuff, FedBuffParams(), **{"dp-noise-multiplier": z}))
    weights = per_version_weights(noisy)
    assert weights == per_version_weights(clean)
    noise = sum(
        np.random.default_rng([0, NOISE_STREAM, version]).normal(0, z * max(w) * norm, size=3)
        for version, w in weights.items()
    )
    np.testing.assert_allclose(noisy.strategy.model - clean.strategy.model, noise, atol=1e-5)
    again = ran(dp_engine(FedBuff, FedBuffParams(), **{"dp-noise-multiplier": z}))
    np.testing.assert_array_equal(again.strategy.model, noisy.strategy.model)  # bit for bit
    other = ran(dp_engine(FedBuff, FedBuffParams(), seed=1, **{"dp-noise-multiplier": z}))
    assert not np.array_equal(other.strategy.model, noisy.strategy.model)


def test_the_epsilon_spent_is_flowers_rdp_accountant_over_one_event_per_release() -> None:
    engine = ran(dp_engine(FedBuff, FedBuffParams(), **{"dp-noise-multiplier": 1.1}))
    assert engine.privacy is not None
    releases = engine.version
    assert engine.privacy.releases == releases == 12
    flower = RdpAccountant(
        PrivacyConfig(
            target_delta=1e-5,
            population_size=6,
            neighboring_relation=NeighboringRelation.ADD_OR_REMOVE_ONE,
            sampling_method=SamplingMethod.NO_AMPLIFICATION,
        )
    )
    for _ in range(releases):
        flower.compose(GaussianPrivacyEvent(1.1, sample_size=2, population_size=6))
    assert engine.privacy.epsilon() == pytest.approx(flower.get_epsilon(1e-5), rel=1e-12)
    summary = engine.privacy.summary()["privacy"]
    assert summary["releases"] == 12 and summary["delta"] == 1e-5
    assert summary["epsilon"] == pytest.approx(flower.get_epsilon(1e-5), rel=1e-12)


def test_max_epsilon_ends_the_run_at_the_last_release_within_it() -> None:
    z, budget = 2.0, 6.0
    engine = ran(
        dp_engine(
            FedBuff,
            FedBuffParams(),
            **{"dp-noise-multiplier": z, "dp-max-epsilon": budget, "max-versions": 1000},
        )
    )
    allowed = releases_within(engine.run)
    assert engine.version == allowed and 0 < allowed < 1000
    assert engine.stop_reason.startswith("privacy budget: epsilon")
    assert epsilon_after(engine.run, allowed) <= budget < epsilon_after(engine.run, allowed + 1)


def test_fedasync_clips_the_delta_of_the_model_it_returns() -> None:
    """FedAsync returns models: the server clips model - start, so with alpha 1 and a
    constant staleness weight each release moves the model by exactly the clipped delta
    (0.5 / sqrt(3) a coordinate) from the task's start."""
    params = FedAsyncParams(fedasync_alpha=1.0, fedasync_staleness="constant")
    engine = ran(dp_engine(FedAsync, params, concurrency=1, **{"max-versions": 5}))
    np.testing.assert_allclose(engine.strategy.model, np.full(3, 5 * 0.5 / np.sqrt(3)), rtol=1e-5)


def test_fedavg_weighs_every_update_equally_under_dp() -> None:
    engine = ran(dp_engine(FedAvg, FedAvg.Params(), **{"max-versions": 3}))
    for weights in per_version_weights(engine).values():
        assert weights == pytest.approx([1 / 3] * 3)


def unclipped(partition: int, config: Any, arrays: dict[str, np.ndarray]) -> tuple[dict, dict]:
    return delta_reply(partition, config, arrays, step=STEP)


def clipping(partition: int, config: Any, arrays: dict[str, np.ndarray]) -> tuple[dict, dict]:
    """A client that clips as Flower's fixedclipping_mod does, told the norm by its task."""
    norm = float(config[CLIPPING_NORM])
    return delta_reply(partition, config, arrays, step=norm / np.sqrt(3))


def test_client_clipping_sends_the_norm_and_rejects_an_update_that_exceeds_it(
    caplog: pytest.LogCaptureFixture,
) -> None:
    client = {"dp-clipping": "client", "max-virtual-time": 3000.0, "max-versions": 4}
    engine = ran(dp_engine(FedBuff, FedBuffParams(), unclipped, **client))
    assert engine.counters.accepted == 0 and engine.counters.rejected > 0
    assert "exceeds dp-clipping-norm 0.5: the ClientApp does not clip" in caplog.text
    sent = engine.transport.sent  # type: ignore[attr-defined]
    tasks = [config for _, _, config in sent if TaskKeys.TASK_ID in config]
    assert tasks and all(config[CLIPPING_NORM] == 0.5 for config in tasks)
    clipped = ran(dp_engine(FedBuff, FedBuffParams(), clipping, **client))
    assert clipped.counters.rejected == 0 and clipped.version == 4


def test_the_privacy_state_survives_a_checkpoint() -> None:
    engine = ran(dp_engine(FedBuff, FedBuffParams(), **{"dp-noise-multiplier": 1.0}))
    state = json.loads(json.dumps(engine.state()))
    fresh = dp_engine(FedBuff, FedBuffParams(), **{"dp-noise-multiplier": 1.0})
    fresh.load_state(state)
    assert fresh.privacy is not None and engine.privacy is not None
    assert fresh.privacy.releases == engine.privacy.releases
    assert fresh.privacy.epsilon() == pytest.approx(engine.privacy.epsilon(), rel=1e-12)


@pytest.mark.parametrize(
    ("values", "message"),
    [
        (
            {"strategy": "ca2fl", "dp-clipping-norm": 1.0},
            "strategy ca2fl cannot take differential privacy: every flush re-releases",
        ),
        (
            {"strategy": "pace", "dp-clipping-norm": 1.0},
            "strategy pace cannot take differential privacy: it keeps one model per client",
        ),
        (
            {"strategy": "safl-fedsgd", "dp-clipping-norm": 1.0, "fifo-update": "newest"},
            "differential privacy needs fifo-update=uploaded",
        ),
        ({"dp-noise-multiplier": 1.0}, "dp-noise-multiplier needs a clipping norm"),
        ({"dp-max-epsilon": 3.0}, "dp-max-epsilon needs noise"),
    ],
)
def test_what_cannot_take_dp_is_refused_in_one_line(values: dict[str, Any], message: str) -> None:
    with pytest.raises(ConfigError, match=message) as err:
        load_config(values)
    assert "\n" not in str(err.value)


def test_a_budget_below_one_release_is_refused_before_the_run() -> None:
    dp = {"dp-clipping-norm": 1.0, "dp-noise-multiplier": 1.0, "dp-max-epsilon": 0.5}
    run = run_config(**dp)
    with pytest.raises(ConfigError, match=r"dp-max-epsilon 0.5 is below the epsilon of one"):
        check_budget(run)


def test_a_local_run_reports_its_privacy_and_a_spent_budget_keeps_its_results(
    tmp_path: Path,
) -> None:
    """fedstale's ClientApp clips itself when the task says so (no update rejected); a run
    that spends its budget ends with the budget's line and its folder complete."""
    config = (
        f"runs-dir='{tmp_path}' run-name='dp' num-clients=8 concurrency=4 buffer-size=4 "
        "local-epochs=1 max-versions=50 eval-interval=500 dataset='digits' "
        "dp-clipping='client' dp-clipping-norm=1.0 dp-noise-multiplier=1.0 dp-max-epsilon=15"
    )
    done = subprocess.run(
        [sys.executable, "-m", "fedstale.launcher.cli", "run", "--local", "--run-config", config],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr[-2000:]
    folder = tmp_path / "dp"
    summary = json.loads((folder / "summary.json").read_text())
    privacy = summary["privacy"]
    assert summary["stop_reason"].startswith("privacy budget: epsilon")
    assert summary["updates_rejected"] == 0 and privacy["clipping"] == "client"
    assert 0 < privacy["epsilon"] <= 15 and privacy["releases"] == summary["versions"]
    assert f"over {privacy['releases']} releases" in done.stderr
    for kept in ("metrics.jsonl", "updates.jsonl", "config.json"):
        assert (folder / kept).stat().st_size > 0


def accountant(population: int = 6, sampling: str = "no-amplification") -> RdpAccountant:
    return RdpAccountant(
        PrivacyConfig(
            target_delta=1e-5,
            population_size=population,
            neighboring_relation=NeighboringRelation.ADD_OR_REMOVE_ONE,
            sampling_method=SamplingMethod(sampling),
        )
    )


def test_the_library_wrappers_take_flowers_arguments_and_refuse_in_one_line() -> None:
    from flwr.serverapp.strategy import FedAvg as FlowerFedAvg

    import fedstale

    wrapped = fedstale.DifferentialPrivacyServerSideFixedClipping(
        fedstale.FedBuff(buffer_size=5, num_clients=6), 1.2, 0.5, 5, accountant=accountant()
    )
    assert wrapped.strategy.settings["dp-noise-multiplier"] == 1.2
    assert wrapped.strategy.settings["dp-clipping"] == "server"
    client = fedstale.DifferentialPrivacyClientSideFixedClipping(fedstale.FedAsync(), 1.0, 0.5, 1)
    assert client.strategy.settings["dp-clipping"] == "client"
    refused = [
        (
            lambda: fedstale.DifferentialPrivacyServerSideFixedClipping(fedstale.CA2FL(), 1, 1, 5),
            "strategy ca2fl cannot take differential privacy",
        ),
        (
            lambda: fedstale.DifferentialPrivacyServerSideFixedClipping(
                fedstale.FedBuff(buffer_size=5), 1, 1, 4
            ),
            "num_sampled_clients=4, but FedBuff releases 5 updates at a time",
        ),
        (
            lambda: fedstale.DifferentialPrivacyServerSideFixedClipping(FlowerFedAvg(), 1, 1, 4),
            "for FedAvg use flwr.serverapp.strategy.DifferentialPrivacyServerSideFixedClipping",
        ),
        (
            lambda: fedstale.DifferentialPrivacyServerSideFixedClipping(
                fedstale.FedBuff(buffer_size=5), 1, 1, 5, accountant=accountant(sampling="poisson")
            ),
            "does not sample its clients uniformly at random",
        ),
        (
            lambda: fedstale.DifferentialPrivacyServerSideFixedClipping(
                fedstale.FedBuff(buffer_size=5), 1, 0, 5
            ),
            "clipping_norm must be > 0",
        ),
    ]
    for make, message in refused:
        with pytest.raises(ConfigError, match=message) as err:
            make()
        assert "\n" not in str(err.value)
