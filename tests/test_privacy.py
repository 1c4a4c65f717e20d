"""The DP math of fedstale/strategies/privacy.py against values worked by hand, and the
noise it adds against its declared standard deviation."""

from __future__ import annotations

import numpy as np
import pytest
from flwr.supercore.differential_privacy import compute_stdv

from fedstale.strategies.privacy import (
    clip_to,
    convex_sensitivity,
    linear_sensitivity,
    noise_std,
    noised,
)


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
