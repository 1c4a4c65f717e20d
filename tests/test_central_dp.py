"""Central DP in the engine (fedstale/server_app/stages/central_dp.py): clipping before the rule,
noise of the declared deviation (per client) on every release, unpredictable unless a
replay seed is asked for, accounted with Flower's RdpAccountant (or PLD), a budget that
ends the run, and nodes that do not clip excluded."""

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
from fedstale.common.layout import ParamLayout
from fedstale.common.schema import CLIPPING_NORM, TaskKeys
from fedstale.server_app.engine import Engine
from fedstale.server_app.stages import stages_for
from fedstale.server_app.stages.central_dp import (
    Accounting,
    CentralDP,
)
from fedstale.server_app.stages.noise import NOISE_STREAM
from fedstale.strategies.base import Outcome, Update
from fedstale.strategies.fedasync import FedAsync, FedAsyncParams
from fedstale.strategies.fedavg import FedAvg
from fedstale.strategies.fedbuff import FedBuff, FedBuffParams
from fedstale.strategies.registry import load_config
from tests import timing
from tests.helpers import (
    ScriptedTransport,
    delta_reply,
    rule_params,
    run_config,
    scripted_engine,
)

LAYOUT = ParamLayout(names=("w",), shapes=((3,),))
STEP = 1.0  # every client's delta: (1, 1, 1), norm sqrt(3)
ROOT = Path(__file__).resolve().parents[1]


def dp_engine(
    strategy_cls: type, params: Any, train_fn: Any = None, nodes: int = 6, **overrides: Any
) -> Engine:
    settings = {
        "strategy": strategy_cls.name,
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
    given = params.model_dump(by_alias=True, exclude_unset=True)  # the run's buffer-size else
    params = type(params).model_validate({**settings, **given})
    strategy = strategy_cls(run, params, np.zeros(3, dtype=np.float32))
    transport = ScriptedTransport(nodes, train_fn or delta_reply, seed=1)
    stages = stages_for(run, params, LAYOUT)
    return scripted_engine(run, strategy, transport, LAYOUT, stages=stages)


def dp(engine: Engine) -> CentralDP:
    """The run's central DP stage (the test fails where the run has none)."""
    stage = engine.stages.find(CentralDP)
    assert stage is not None, "no central DP stage in this run"
    return stage


def ran(engine: Engine) -> Engine:
    engine.run_loop()
    return engine


def per_version_weights(engine: Engine) -> dict[int, list[float]]:
    rows = engine.listeners.recorder.updates  # type: ignore[attr-defined]
    out: dict[int, list[float]] = {}
    for row in rows:
        out.setdefault(row["version"], []).append(row["weight"])
    return out


def per_version_client_sums(engine: Engine) -> dict[int, float]:
    """Each release's largest sum, over its clients, of one client's weights."""
    sums: dict[int, dict[int, float]] = {}
    for row in engine.listeners.recorder.updates:  # type: ignore[attr-defined]
        of_version = sums.setdefault(row["version"], {})
        of_version[row["client"]] = of_version.get(row["client"], 0.0) + abs(row["weight"])
    return {version: max(clients.values()) for version, clients in sums.items()}


def replayed_noise(engine: Engine, z: float, norm: float, seed: int) -> np.ndarray:
    """The sum of the noise `dp-noise-seed=seed` gives every release of `engine`."""
    return sum(
        np.random.default_rng([seed, NOISE_STREAM, version]).normal(0, z * top * norm, size=3)
        for version, top in per_version_client_sums(engine).items()
    )


def test_server_clipping_scales_each_delta_to_the_norm_before_the_rule_sees_it() -> None:
    """FedBuff, clipping only: each (1,1,1) delta arrives as 0.5 / sqrt(3) per coordinate,
    so the model is sum over releases of sum_i w_i * 0.5 / sqrt(3)."""
    engine = ran(dp_engine(FedBuff, FedBuffParams()))
    weights = per_version_weights(engine)
    expected = sum(sum(w) for w in weights.values()) * 0.5 / np.sqrt(3)
    np.testing.assert_allclose(engine.strategy.model, np.full(3, expected), rtol=1e-5)
    assert dp(engine).clipped == engine.counters.accepted
    assert dp(engine).epsilon() is None  # clipping without noise: no guarantee


def test_with_dp_noise_seed_every_release_replays_noise_of_z_times_its_sensitivity() -> None:
    """The noised model minus the clip-only model is, release by release, the draw of
    rng([dp-noise-seed, NOISE_STREAM, version]) with standard deviation z * C * (the largest
    per-client sum of weights) (the deltas do not depend on the model here, so the two runs
    see the same updates); another dp-noise-seed gives other noise."""
    clean = ran(dp_engine(FedBuff, FedBuffParams()))
    z, norm = 1.5, 0.5
    noisy_config = {"dp-noise-multiplier": z, "dp-noise-seed": 4}
    noisy = ran(dp_engine(FedBuff, FedBuffParams(), **noisy_config))
    assert per_version_weights(noisy) == per_version_weights(clean)
    expected = replayed_noise(noisy, z, norm, seed=4)
    np.testing.assert_allclose(noisy.strategy.model - clean.strategy.model, expected, atol=1e-5)
    again = ran(dp_engine(FedBuff, FedBuffParams(), **noisy_config))
    np.testing.assert_array_equal(again.strategy.model, noisy.strategy.model)  # bit for bit
    other_config = {**noisy_config, "dp-noise-seed": 5}
    other = ran(dp_engine(FedBuff, FedBuffParams(), **other_config))
    assert not np.array_equal(other.strategy.model, noisy.strategy.model)
    assert dp(noisy).summary()["privacy"]["noise"] == "replayable from dp-noise-seed: not private"


def test_without_dp_noise_seed_nobody_who_knows_the_run_config_can_replay_the_noise() -> None:
    """Two runs of the same config (the same seed, as every ClientApp knows it) draw
    different noise, and neither is the stream of the run's seed."""
    clean = ran(dp_engine(FedBuff, FedBuffParams()))
    z, norm = 1.5, 0.5
    first = ran(dp_engine(FedBuff, FedBuffParams(), **{"dp-noise-multiplier": z}))
    second = ran(dp_engine(FedBuff, FedBuffParams(), **{"dp-noise-multiplier": z}))
    assert per_version_weights(first) == per_version_weights(second)  # the same releases
    first_noise = first.strategy.model - clean.strategy.model
    assert not np.allclose(first_noise, second.strategy.model - clean.strategy.model)
    for guess in (first.run.seed, 0, 1):
        assert not np.allclose(first_noise, replayed_noise(first, z, norm, seed=guess))
    assert dp(first).summary()["privacy"]["noise"] == "operating-system entropy"


def test_a_client_with_several_updates_in_a_release_is_noised_by_their_summed_weights() -> None:
    """2 clients, buffer-size 5: every release holds one client at least 3 times. Worked by
    hand for FedBuff (eta 1, fresh updates weigh 1/5 each): a release of clients
    [0, 1, 0, 1, 0] has per-client sums 0.6 and 0.4, so S = 0.6 C, three times the largest
    single weight's 0.2 C. The noise of every release follows the per-client sum, so epsilon
    is the accountant's for z per release (the true sensitivity's)."""
    z, norm = 1.0, 0.5
    two = {"num-clients": 2, "concurrency": 2, "buffer-size": 5, "max-versions": 10}
    clean = ran(dp_engine(FedBuff, FedBuffParams(), nodes=2, **two))
    noisy_config = {**two, "dp-noise-multiplier": z, "dp-noise-seed": 7}
    noisy = ran(dp_engine(FedBuff, FedBuffParams(), nodes=2, **noisy_config))
    sums = per_version_client_sums(noisy)
    singles = {v: max(w) for v, w in per_version_weights(noisy).items()}
    assert len(sums) == 10 and all(sums[v] >= 2.5 * singles[v] for v in sums)
    expected = replayed_noise(noisy, z, norm, seed=7)
    np.testing.assert_allclose(noisy.strategy.model - clean.strategy.model, expected, atol=1e-5)
    assert dp(noisy).last_std == pytest.approx(z * norm * sums[10])
    assert dp(noisy).epsilon() == pytest.approx(
        Accounting.of(noisy.run).epsilon_after(10), rel=1e-12
    )


def test_the_epsilon_spent_is_flowers_rdp_accountant_over_one_event_per_release() -> None:
    engine = ran(dp_engine(FedBuff, FedBuffParams(), **{"dp-noise-multiplier": 1.1}))
    releases = engine.version
    assert dp(engine).releases == releases == 12
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
    assert dp(engine).epsilon() == pytest.approx(flower.get_epsilon(1e-5), rel=1e-12)
    summary = dp(engine).summary()["privacy"]
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
    accounting = Accounting.of(engine.run)
    allowed = accounting.releases_within()
    assert engine.version == allowed and 0 < allowed < 1000
    assert engine.stop_reason.startswith("privacy budget: epsilon")
    assert accounting.epsilon_after(allowed) <= budget < accounting.epsilon_after(allowed + 1)


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
    assert engine.counters.accepted == 0
    assert "exceeds dp-clipping-norm 0.5: the ClientApp does not clip" in caplog.text
    # each of the 6 nodes excluded at its 3rd rejection (dp-max-rejections), then the run ends
    assert engine.counters.rejected == 6 * 3
    assert caplog.text.count("excluded from the run: 3 of its updates exceeded") == 6
    assert engine.stop_reason.startswith("every node was excluded for updates above")
    sent = engine.federation.transport.sent  # type: ignore[attr-defined]
    tasks = [config for _, _, config in sent if TaskKeys.TASK_ID in config]
    assert tasks and all(config[CLIPPING_NORM] == 0.5 for config in tasks)
    clipped = ran(dp_engine(FedBuff, FedBuffParams(), clipping, **client))
    assert clipped.counters.rejected == 0 and clipped.version == 4


def test_one_node_that_does_not_clip_is_excluded_and_the_others_go_on(
    caplog: pytest.LogCaptureFixture,
) -> None:
    def node_2_does_not_clip(partition: int, config: Any, arrays: dict) -> tuple[dict, dict]:
        return (unclipped if partition == 2 else clipping)(partition, config, arrays)

    client = {"dp-clipping": "client", "max-versions": 20, "dp-max-rejections": 2}
    engine = ran(dp_engine(FedBuff, FedBuffParams(), node_2_does_not_clip, **client))
    assert engine.version == 20 and engine.counters.rejected == 2
    assert 2 not in engine.federation.nodes.clients and len(engine.federation.nodes.clients) == 5
    assert "(client 2) excluded from the run: 2 of its updates" in caplog.text
    clients = {row["client"] for row in engine.listeners.recorder.updates}  # type: ignore[attr-defined]
    assert 2 not in clients and len(clients) == 5


def test_an_update_within_the_float_slack_of_the_norm_is_clipped_to_the_norm() -> None:
    """Client mode accepts a norm up to C (1 + 1e-4) (a float32 clip may land a hair above
    C) and scales it to C: nothing above C enters a release."""
    run = run_config(**{"dp-clipping": "client", "dp-clipping-norm": 1.0})
    privacy = CentralDP.for_run(run, rule_params("fedbuff"))
    assert isinstance(privacy, CentralDP)
    over = np.array([1.0 + 5e-5, 0.0, 0.0], np.float32)
    clipped = privacy.clip(Update(0, 0, 0, 0, 1, over), None)
    assert float(np.linalg.norm(clipped.vector.astype(np.float64))) <= 1.0
    within = np.array([0.6, 0.8, 0.0], np.float32) * np.float32(0.999)
    assert privacy.clip(Update(0, 0, 0, 0, 1, within), None).vector is within


def test_the_pld_accountant_gives_dp_accountings_pld_epsilon_for_the_same_releases() -> None:
    """`dp-accountant=pld`: the same Gaussian events composed by dp_accounting's
    PLDAccountant directly (17.86 against RDP's 19.05 for 10 releases at z = 1)."""
    import dp_accounting
    from dp_accounting.pld.pld_privacy_accountant import PLDAccountant

    releases = {"max-versions": 10, "dp-noise-multiplier": 1.0}
    pld = ran(dp_engine(FedBuff, FedBuffParams(), **releases, **{"dp-accountant": "pld"}))
    rdp = ran(dp_engine(FedBuff, FedBuffParams(), **releases))
    direct = PLDAccountant(dp_accounting.NeighboringRelation.ADD_OR_REMOVE_ONE)
    direct.compose(dp_accounting.GaussianDpEvent(1.0), 10)
    assert dp(pld).epsilon() == pytest.approx(direct.get_epsilon(1e-5), rel=1e-9)
    assert dp(pld).epsilon() == pytest.approx(17.857, abs=0.01)
    assert dp(rdp).epsilon() == pytest.approx(19.0536, abs=1e-3)
    summary = dp(pld).summary()["privacy"]
    assert summary["accounting"].startswith("pld, zero-out of one client's updates")
    fresh = dp_engine(FedBuff, FedBuffParams(), **releases, **{"dp-accountant": "pld"})
    fresh.load_state(json.loads(json.dumps(pld.state())))  # through a checkpoint
    assert dp(fresh).epsilon() == pytest.approx(dp(pld).epsilon(), rel=1e-12)


class Deployed(ScriptedTransport):
    simulated = False


def test_a_noise_seed_is_refused_in_a_deployment_and_said_in_a_simulation(
    caplog: pytest.LogCaptureFixture,
) -> None:
    from fedstale.server_app.lifecycle import check_noise_seed

    run = run_config(**{"dp-clipping-norm": 1.0, "dp-noise-multiplier": 1.0, "dp-noise-seed": 3})
    with pytest.raises(ConfigError, match="dp-noise-seed=3 makes the DP noise replayable") as err:
        check_noise_seed(run, Deployed(2, delta_reply))
    assert "\n" not in str(err.value)
    check_noise_seed(run, ScriptedTransport(2, delta_reply))
    assert "the DP noise is replayable from the seed and NOT private" in caplog.text


def test_fedstale_deploy_refuses_a_noise_seed_before_starting_anything(
    capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    from fedstale.launcher.cli import main

    config = "dataset=digits max-updates=2 dp-clipping-norm=1 dp-noise-multiplier=1 dp-noise-seed=3"
    home = tmp_path / "home"
    argv = ["deploy", "--nodes", "1", "--keep-dir", str(home), "--run-config", config]
    assert main([*argv[:1], "--app", str(ROOT), *argv[1:]]) == 2
    said = capsys.readouterr().err.strip().splitlines()
    assert said[-1].startswith("fedstale: dp-noise-seed makes the DP noise replayable")
    assert not home.exists()  # refused before any process or folder


def test_dp_client_values_omit_keeps_only_what_the_guarantee_covers() -> None:
    """FedPSA's weights come from the clients' sketches and its rows carry kappa: with
    `omit`, the rows keep the dispatch schedule; a linear rule keeps its weights too."""
    row = {"client": 1, "task": 7, "staleness": 2, "weight": 0.3, "kappa": 0.8, "late": True}
    omit = {"dp-clipping-norm": 1.0, "dp-client-values": "omit"}
    psa = rule_params("fedpsa")
    fedpsa = CentralDP.for_run(run_config(strategy="fedpsa", **omit), psa)
    fedbuff = CentralDP.for_run(run_config(**omit), rule_params("fedbuff"))
    kept = CentralDP.for_run(run_config(strategy="fedpsa", **{"dp-clipping-norm": 1.0}), psa)
    assert fedpsa is not None and fedbuff is not None and kept is not None
    assert fedpsa.record(row) == {"client": 1, "task": 7, "staleness": 2, "late": True}
    assert fedbuff.record(row) == {k: v for k, v in row.items() if k != "kappa"}
    assert kept.record(row) == row
    with pytest.raises(ConfigError, match="per-client evaluation scores the clients' own data"):
        load_config({**omit, "eval-target": "per-client"})


def test_a_resumed_run_draws_fresh_unpredictable_noise() -> None:
    """The noise generator is never checkpointed: two resumptions of the same checkpoint
    noise the same next release differently (with dp-noise-seed, identically)."""
    z = {"dp-noise-multiplier": 1.0}
    for seeded, same in (({}, False), ({"dp-noise-seed": 2}, True)):
        engine = ran(dp_engine(FedBuff, FedBuffParams(), **z, **seeded))
        state = json.loads(json.dumps(engine.state()))
        assert "rng" not in json.dumps(state["privacy"])
        outcome = Outcome(changed=True, records=[{"client": 0, "weight": 0.5}])
        models = []
        for _ in range(2):
            resumed = dp_engine(FedBuff, FedBuffParams(), **z, **seeded)
            resumed.load_state(state)
            resumed.strategy.model = np.zeros(3, np.float32)
            dp(resumed).release_of(resumed.strategy, outcome, engine.version + 1)
            models.append(resumed.strategy.model)
        assert np.array_equal(models[0], models[1]) == same


def test_the_privacy_state_survives_a_checkpoint() -> None:
    engine = ran(dp_engine(FedBuff, FedBuffParams(), **{"dp-noise-multiplier": 1.0}))
    state = json.loads(json.dumps(engine.state()))
    fresh = dp_engine(FedBuff, FedBuffParams(), **{"dp-noise-multiplier": 1.0})
    fresh.load_state(state)
    assert dp(fresh).releases == dp(engine).releases
    assert dp(fresh).epsilon() == pytest.approx(dp(engine).epsilon(), rel=1e-12)


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
            {"strategy": "safl-fedsgd", "dp-clipping-norm": 1.0, "fedqs-fifo-update": "newest"},
            "differential privacy needs fedqs-fifo-update=uploaded",
        ),
        ({"dp-noise-multiplier": 1.0}, "dp-noise-multiplier needs a clipping norm"),
        ({"dp-max-epsilon": 3.0}, "dp-max-epsilon needs noise"),
        ({"dp-clipping-norm": 1.0, "dp-noise-seed": 1}, "dp-noise-seed seeds noise"),
        ({"dp-accountant": "moments"}, "dp-accountant"),
    ],
)
def test_what_cannot_take_dp_is_refused_in_one_line(values: dict[str, Any], message: str) -> None:
    with pytest.raises(ConfigError, match=message) as err:
        load_config(values)
    assert "\n" not in str(err.value)


def test_a_budget_below_one_release_is_refused_before_the_run(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from fedstale.launcher.cli import main

    dp = {"dp-clipping-norm": 1.0, "dp-noise-multiplier": 1.0, "dp-max-epsilon": 0.5}
    run = run_config(**dp)
    with pytest.raises(ConfigError, match=r"dp-max-epsilon 0.5 is below the epsilon of one"):
        Accounting.of(run).check_budget()
    runs = tmp_path / "new-runs"
    config = f"dataset=digits runs-dir={runs} " + " ".join(f"{k}={v}" for k, v in dp.items())
    assert main(["run", "--local", "--app", str(ROOT), "--run-config", config]) == 2
    assert "below the epsilon of one release" in capsys.readouterr().err
    assert not runs.exists()  # no empty runs directory left behind


def test_check_says_when_one_client_holds_several_updates_of_every_release(
    capsys: pytest.CaptureFixture[str],
) -> None:
    from fedstale.launcher.cli import main

    config = "dataset=digits num-clients=4 concurrency=4 buffer-size=10 dp-clipping-norm=1"
    assert main(["check", "--app", str(ROOT), "--run-config", config]) == 0
    said = capsys.readouterr().err
    assert (
        "fedstale: DP: 10 updates per release from 4 clients: some client holds at least 3" in said
    )
    assert main(["check", "--app", str(ROOT), "--run-config", "dataset=digits"]) == 0
    assert "DP:" not in capsys.readouterr().err


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
        timeout=timing.left(),
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

    users = fedstale.FedBuff(buffer_size=5, num_clients=6)
    wrapped = fedstale.DifferentialPrivacyServerSideFixedClipping(
        users, 1.2, 0.5, 5, accountant=accountant()
    )
    assert wrapped.strategy.settings["dp-noise-multiplier"] == 1.2
    assert wrapped.strategy.dp_clipping == "server"  # the default: not among the settings
    assert users.settings == {} and users.dp_noise_multiplier == 0.0  # the user's object kept
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


def test_fedstales_rdp_accountant_is_flowers_to_the_last_digit_and_shares_its_state() -> None:
    """fedstale's RdpAccountant (dp_accounting, no Flower internals) composes as Flower's
    does: the same epsilon, optimal order and delta for mixed events, and each loads the
    other's state (a checkpoint written with Flower's accountant resumes)."""
    from fedstale.server_app.stages.accounting import AccountingConfig, GaussianRelease
    from fedstale.server_app.stages.accounting import RdpAccountant as Ours

    ours, flower = Ours(AccountingConfig(1e-5, 6)), accountant()
    for noise, size, count in ((1.1, 2, 3), (0.7, 6, 1), (2.0, 1, 5)):
        ours.compose(GaussianRelease(noise, size, 6), count)
        flower.compose(GaussianPrivacyEvent(noise, size, 6), count)
    assert ours.get_epsilon(1e-5) == flower.get_epsilon(1e-5)
    assert ours.get_delta(3.0) == flower.get_delta(3.0)
    mine, theirs = ours.get_privacy_spent(), flower.get_privacy_spent()
    assert (mine.epsilon, mine.optimal_order, mine.num_releases) == (
        theirs.epsilon,
        theirs.optimal_order,
        theirs.num_releases,
    ) and mine.num_releases == 9
    assert json.loads(json.dumps(ours.state_dict())) == flower.state_dict()
    from_flowers = Ours(AccountingConfig(1e-5, 6))
    from_flowers.load_state_dict(flower.state_dict())
    assert from_flowers.get_epsilon(1e-5) == flower.get_epsilon(1e-5)
    back = accountant()
    back.load_state_dict(ours.state_dict())
    assert back.get_epsilon(1e-5) == flower.get_epsilon(1e-5)
    event = GaussianRelease(1.1, 2, 6)
    limit = flower.get_epsilon(1e-5) + 0.01
    assert ours.would_exceed(event, limit) == flower.would_exceed(event, limit) is True
