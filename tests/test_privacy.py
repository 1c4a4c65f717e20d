"""The DP math of fedstale/strategies/privacy.py against values worked by hand, and the
noise it adds against its declared standard deviation."""

from __future__ import annotations

from dataclasses import replace
from typing import Any

import numpy as np
import pytest
from flwr.supercore.differential_privacy import compute_stdv

from fedstale.strategies.base import Update
from fedstale.strategies.fedpsa import FedPSAKeys
from fedstale.strategies.privacy import (
    CONVEX,
    LINEAR,
    clip_to,
    convex_sensitivity,
    linear_sensitivity,
    noise_std,
    noised,
    release_sensitivity,
)
from fedstale.strategies.registry import declarations, is_built_in
from tests.helpers import V0, run_config


def test_a_long_delta_is_scaled_to_the_norm_and_a_short_one_kept() -> None:
    clipped, factor = clip_to(np.array([3.0, 4.0], np.float32), 1.0)  # ||.|| = 5
    np.testing.assert_allclose(clipped, [0.6, 0.8], rtol=1e-6)
    assert factor == pytest.approx(0.2)
    kept, factor = clip_to(np.array([0.3, 0.4], np.float32), 1.0)
    np.testing.assert_array_equal(kept, np.array([0.3, 0.4], np.float32))
    assert factor == 1.0
    zero, factor = clip_to(np.zeros(3, np.float32), 1.0)
    assert factor == 1.0 and not zero.any()
    with pytest.raises(ValueError, match="clipping norm must be > 0"):
        clip_to(np.ones(2, np.float32), 0.0)


def test_sensitivities_by_hand() -> None:
    # FedBuff, K = 4, eta = 1, staleness 0, 3, 0, 8: weights 1/4 * (1 + tau)^-0.5
    weights = [0.25, 0.25 * 4**-0.5, 0.25, 0.25 * 9**-0.5]
    assert linear_sensitivity(weights, 2.0) == pytest.approx(0.5)  # max w = 1/4, C = 2
    # FedAsync: one update mixed at a_t = 0.6 * 4^-0.5 = 0.3
    assert linear_sensitivity([0.3], 1.5) == pytest.approx(0.45)
    # FedPSA: softmax weights times a server step of 0.5: 2 * 0.5 * C
    assert convex_sensitivity(0.5, 1.0) == pytest.approx(1.0)
    assert linear_sensitivity([], 1.0) == 0.0
    assert noise_std(1.1, 0.5) == pytest.approx(0.55)


def test_a_plain_mean_gets_flowers_standard_deviation() -> None:
    """The mean of m clipped updates: max w = 1/m, so z * S = z * C / m, Flower's."""
    for z, clip, m in ((1.0, 1.0, 10), (0.7, 2.5, 3), (2.0, 0.1, 50)):
        ours = noise_std(z, linear_sensitivity(np.full(m, 1.0 / m), clip))
        assert ours == pytest.approx(compute_stdv(z, clip, m))


def test_the_noise_added_over_many_releases_has_the_declared_deviation() -> None:
    """4,000 releases of a 50-coordinate change, fixed seed: the sample standard
    deviation of the added noise is within 2% of z * S (its own standard error is
    1/sqrt(2 * 200,000) = 0.16%), its mean within 4 standard errors of 0."""
    rng = np.random.default_rng(7)
    z, sensitivity = 1.3, 0.25
    change = np.linspace(-1, 1, 50).astype(np.float32)
    added = np.stack([noised(change, z, sensitivity, rng) - change for _ in range(4000)])
    declared = noise_std(z, sensitivity)
    assert added.std() == pytest.approx(declared, rel=0.02)
    assert abs(added.mean()) < 4 * declared / np.sqrt(added.size)


def test_the_same_seed_gives_the_same_noise_and_no_noise_without_a_multiplier() -> None:
    change = np.ones(5, np.float32)
    first = noised(change, 1.0, 0.5, np.random.default_rng(3))
    np.testing.assert_array_equal(first, noised(change, 1.0, 0.5, np.random.default_rng(3)))
    assert not np.array_equal(first, noised(change, 1.0, 0.5, np.random.default_rng(4)))
    np.testing.assert_array_equal(noised(change, 0.0, 0.5, np.random.default_rng(3)), change)


# ---------------------------------------------------------------- each rule that takes DP
C = 0.5
DIM = 40


def dp_rule(name: str, **overrides: Any) -> Any:
    from fedstale.strategies.registry import STRATEGIES

    run = run_config(
        strategy=name,
        num_clients=8,
        concurrency=4,
        **{"dp-clipping-norm": C},
        **overrides,
    )
    cls = STRATEGIES[name]
    # FedPSA: softmax from the first flush (a queue of 1) at a low temperature, so that
    # one sketch can move every weight
    sharp = {"fedpsa-queue": 1, "fedpsa-gamma": 0.0, "fedpsa-delta": 0.05}
    params = cls.Params.model_validate({"buffer-size": 4, **(sharp if name == "fedpsa" else {})})
    strategy = cls(run, params, np.zeros(DIM, np.float32))
    if name == "fedpsa":
        strategy.bind_sketcher(lambda flat: np.ones(3))
    return strategy


def batch(rng: np.random.Generator, count: int) -> list[Update]:
    """`count` updates with deltas of norm C (random directions), random staleness and
    sketches (the base model is 0, so a model-returning rule's model is its delta)."""
    updates = []
    for i in range(count):
        delta = rng.normal(size=DIM)
        vector = (delta * C / np.linalg.norm(delta)).astype(np.float32)
        signals = {FedPSAKeys.SKETCH: rng.normal(size=3), FedPSAKeys.UPDATE_NORM_SQ: C * C}
        updates.append(Update(i, i, 0, int(rng.integers(0, 5)), 10 + i, vector, signals=signals))
    return updates


def release(name: str, updates: list[Update]) -> tuple[np.ndarray, list[float]]:
    """The model the rule releases after `updates` (from a fresh rule), and the weights."""
    strategy = dp_rule(name)
    outcome = None
    for update in updates:
        outcome = strategy.on_update(update, V0)
    assert outcome is not None and outcome.changed
    return strategy.model.astype(np.float64), [r["weight"] for r in outcome.records]


# Every built-in rule that declares how it releases (the registry's, so a new one is
# checked too); tests/test_central_dp.py checks those that cannot take DP are refused.
TAKES_DP = sorted(n for n, r in declarations().items() if is_built_in(r) and r.dp is not None)


@pytest.mark.parametrize("name", TAKES_DP)
def test_one_client_moves_a_release_by_at_most_its_declared_sensitivity(name: str) -> None:
    """200 seeded releases: one client's update removed (its delta zero, as the release's
    fixed denominator counts it) moves a linear release by at most max_i w_i C, and, for
    FedPSA, replaced by any other update of norm <= C (its sketch too) by at most
    2 step C. For a linear rule the bound is reached: the client with the largest weight
    moves it by exactly S."""
    from fedstale.strategies.registry import rule_named

    kind = rule_named(name).dp.kind  # type: ignore[union-attr]
    rng = np.random.default_rng(11)
    per_release = 1 if name == "fedasync" else 4
    tightest = 0.0
    for _ in range(200):
        updates = batch(rng, per_release)
        released, weights = release(name, updates)
        sensitivity = release_sensitivity(kind, weights, C)
        j = int(np.argmax(np.abs(weights)))
        other = batch(rng, 1)[0] if kind == CONVEX else updates[j]
        neighbour = replace(other, client=j, task_id=j, staleness=updates[j].staleness)
        if kind == LINEAR:
            neighbour = replace(neighbour, vector=np.zeros(DIM, np.float32))
        moved, _ = release(name, [*updates[:j], neighbour, *updates[j + 1 :]])
        distance = float(np.linalg.norm(released - moved))
        assert distance <= sensitivity * (1 + 1e-5)
        tightest = max(tightest, distance / sensitivity)
    assert tightest > (0.999 if kind == LINEAR else 0.5)


def test_a_client_with_several_updates_counts_once_with_its_summed_weights() -> None:
    """Worked by hand: five updates of weight 0.2, clients [0, 1, 0, 1, 0], C = 2: client
    0 holds 0.6 of the release, client 1 0.4, so S = 0.6 * 2 = 1.2 (the largest single
    weight gave 0.4). A convex release is bounded by 2 * (sum of weights) * C however its
    updates are owned."""
    weights, owners = [0.2] * 5, [0, 1, 0, 1, 0]
    assert linear_sensitivity(weights, 2.0, owners) == pytest.approx(1.2)
    assert release_sensitivity(LINEAR, weights, 2.0, owners) == pytest.approx(1.2)
    assert release_sensitivity(LINEAR, weights, 2.0) == pytest.approx(0.4)  # one update each
    assert release_sensitivity(CONVEX, [0.3, 0.3, 0.4], 1.0, [0, 0, 1]) == pytest.approx(2.0)


def test_zeroing_a_client_with_two_updates_moves_fedbuff_by_their_summed_weights() -> None:
    """FedBuff, four updates, client 0 owning two, all deltas the same direction of norm C:
    zeroing client 0's contributions moves the release by exactly (w_0 + w_2) C, past the
    largest single weight's bound and at the per-client bound."""
    direction = np.ones(DIM) / np.sqrt(DIM)
    owners = [0, 1, 0, 2]
    updates = [
        Update(owner, i, 0, i, 10, (direction * C).astype(np.float32))
        for i, owner in enumerate(owners)
    ]
    released, weights = release("fedbuff", updates)
    zeroed = [replace(u, vector=np.zeros(DIM, np.float32)) if u.client == 0 else u for u in updates]
    moved, _ = release("fedbuff", zeroed)
    distance = float(np.linalg.norm(released - moved))
    assert distance == pytest.approx((weights[0] + weights[2]) * C, rel=1e-5)
    assert distance > release_sensitivity(LINEAR, weights, C) * 1.5  # one update each: wrong
    assert distance == pytest.approx(release_sensitivity(LINEAR, weights, C, owners), rel=1e-5)


@pytest.mark.parametrize("name", TAKES_DP)
def test_each_rules_releases_get_noise_of_the_declared_deviation(name: str) -> None:
    """2,000 releases of the rule's own outcome through CentralDP (versions 1..2000, each
    its own draw, replayable with the opt-in dp-noise-seed): the added noise's sample
    standard deviation is within 3% of z * S (its standard error: 1/sqrt(2 * 80,000) = 0.25%)."""
    from fedstale.server_app.stages.central_dp import CentralDP

    strategy = dp_rule(name, **{"dp-noise-multiplier": 1.3, "dp-noise-seed": 0})
    outcome = None
    for update in batch(np.random.default_rng(5), 1 if name == "fedasync" else 4):
        outcome = strategy.on_update(update, V0)
    assert outcome is not None and outcome.changed
    privacy = CentralDP.for_run(strategy.run, strategy.params)
    assert privacy is not None
    clean = strategy.model.copy()
    added = []
    for version in range(1, 2001):
        strategy.model = clean.copy()
        privacy.release_of(strategy, outcome, version)
        added.append(strategy.model.astype(np.float64) - clean)
    weights = [r["weight"] for r in outcome.records]
    declared = 1.3 * release_sensitivity(privacy.declared.kind, weights, C)
    assert privacy.last_std == pytest.approx(declared)
    assert np.std(added) == pytest.approx(declared, rel=0.03)
