"""Secure aggregation's plain-array parts (fedstale/common/secagg/): quantisation into the
field with its error bound, the mask code (Lagrange encoding, recovery from any U shares of
any weighted sum, privacy of any T shares), and sealed shares."""

from __future__ import annotations

import itertools

import numpy as np
import pytest

from fedstale.common.secagg.coding import MaskCode, lagrange
from fedstale.common.secagg.field import (
    PRIME,
    Quantiser,
    add,
    from_wire,
    in_field,
    random_elements,
    subtract,
    to_wire,
    weighted_sum,
)
from fedstale.common.secagg.sealing import (
    Unsealable,
    context,
    new_private_key,
    public_key,
    seal,
    unseal,
)


def test_quantising_clips_to_the_range_rounds_to_the_precision_and_wraps_negatives() -> None:
    """R = 1, f = 2: 0.5 -> 2, -0.25 -> -1 = p - 1, 2.0 -> clipped to 1 -> 4, 0.3 -> 1.2 -> 1,
    -0.3 -> -1.2 -> -1 (towards zero: never longer)."""
    quantiser = Quantiser(clip_range=1.0, precision_bits=2, weight_bits=3)
    values = np.array([0.5, -0.25, 2.0, 0.3, -0.3])
    assert quantiser.quantise(values).tolist() == [2, PRIME - 1, 4, 1, PRIME - 1]
    # weights 0.5 and 0.25: s = 0.5, W = (8, 4); 8 * 2 + 4 * (-1) = 12 at scale 2^5 / 0.5
    units, top = quantiser.weight_units([0.5, 0.25])
    assert (units, top) == ([8, 4], 0.5)
    total = weighted_sum([np.array([2], np.uint64), np.array([PRIME - 1], np.uint64)], units)
    assert quantiser.decode(total, top).tolist() == [12 * 0.5 / 32]  # 0.5 * 0.5 - 0.25 * 0.25


def test_a_weighted_sum_decodes_within_its_stated_error_bound() -> None:
    quantiser = Quantiser()
    rng = np.random.default_rng(3)
    deltas = [rng.uniform(-1, 1, 500) for _ in range(10)]
    weights = [0.1 * (1 + tau) ** -0.5 for tau in range(10)]
    units, top = quantiser.weight_units(weights)
    total = weighted_sum([quantiser.quantise(d) for d in deltas], units)
    exact = sum(w * d for w, d in zip(weights, deltas, strict=True))
    error = np.max(np.abs(quantiser.decode(total, top) - exact))
    assert 0 < error <= quantiser.error_bound(weights) < 5e-4
    assert quantiser.fits(10) and not quantiser.fits(40)  # 40 * 2^26 passes p / 2


def test_lagrange_basis_worked_by_hand_in_f13() -> None:
    """Points 1, 2 at 3 in F_13: l_1(3) = (3-2)/(1-2) = -1 = 12, l_2(3) = (3-1)/(2-1) = 2."""
    assert lagrange([3], [1, 2], 13).tolist() == [[12, 2]]


def test_any_u_shares_of_a_weighted_buffer_give_its_mask() -> None:
    code = MaskCode(holders=6, privacy=2, recovery=4, length=11)
    masks = [random_elements(11) for _ in range(3)]
    shares = [code.encode(mask) for mask in masks]
    factors = [5, PRIME - 3, 1]  # any integers, negative ones included
    buffer_mask = weighted_sum(masks, factors)
    combined = weighted_sum(shares, factors)  # each holder combines its own shares
    for holders in itertools.combinations(range(6), 4):
        assert np.array_equal(code.decode(list(holders), combined[list(holders)]), buffer_mask)
    with pytest.raises(ValueError, match="4 distinct holders"):
        code.decode([0, 1, 2], combined[[0, 1, 2]])


def test_any_t_shares_are_hidden_by_the_noise_pieces() -> None:
    """Privacy against T holders: for every set of T holders, the code restricted to the T
    noise pieces is invertible, so those T shares are uniform whatever the mask is."""
    code = MaskCode(holders=7, privacy=3, recovery=5, length=20)
    noise_columns = code.encoder[:, code.pieces :]
    for holders in itertools.combinations(range(7), 3):
        assert rank_mod(noise_columns[list(holders)], PRIME) == 3
    mask = random_elements(20)
    first, second = code.encode(mask), code.encode(mask)
    assert all(not np.array_equal(a, b) for a, b in zip(first, second, strict=True))  # fresh noise


def rank_mod(matrix: np.ndarray, prime: int) -> int:
    rows = [[int(v) % prime for v in row] for row in matrix]
    rank, width = 0, len(rows[0])
    for column in range(width):
        pivot = next((r for r in range(rank, len(rows)) if rows[r][column]), None)
        if pivot is None:
            continue
        rows[rank], rows[pivot] = rows[pivot], rows[rank]
        scale = pow(rows[rank][column], prime - 2, prime)
        rows[rank] = [v * scale % prime for v in rows[rank]]
        for r in range(len(rows)):
            if r != rank and rows[r][column]:
                factor = rows[r][column]
                rows[r] = [
                    (a - factor * b) % prime for a, b in zip(rows[r], rows[rank], strict=True)
                ]
        rank += 1
    return rank


def test_masking_then_unmasking_gives_the_quantised_update_back() -> None:
    update = Quantiser().quantise(np.linspace(-1, 1, 9))
    mask = random_elements(9)
    masked = add(update, mask)
    assert in_field(to_wire(masked)) and not np.array_equal(masked, update)
    assert np.array_equal(subtract(from_wire(to_wire(masked)), mask), update)
    assert not in_field(np.array([PRIME], np.uint32)) and not in_field(masked)  # uint64


def test_a_sealed_share_opens_only_for_its_holder_its_update_and_unaltered() -> None:
    sender, holder, other = new_private_key(), new_private_key(), new_private_key()
    share = random_elements(8)
    bound = context(update=7, sender=0, holder=1)
    sealed = seal(share, sender, public_key(holder), bound)
    assert np.array_equal(unseal(sealed, holder, public_key(sender), bound), share)
    tampered = sealed.copy()
    tampered[-1] ^= 1
    for private, sealed_share, bound_to in (
        (other, sealed, bound),  # not its holder
        (holder, sealed, context(update=8, sender=0, holder=1)),  # replayed for another update
        (holder, tampered, bound),  # altered on the way
    ):
        with pytest.raises(Unsealable):
            unseal(sealed_share, private, public_key(sender), bound_to)


def test_a_decode_withstands_f_wrong_answers_and_refuses_what_it_cannot_trust() -> None:
    """N = 6, U = 4 (T = 2), f = 1: a set of U + f = 5 answers that fit one polynomial of
    degree 3 holds at least U right ones when at most one is wrong, so it is the true one.
    Six honest answers fit; one wrong among six is excluded; with two wrong no five fit:
    refused; U answers alone (or five with one wrong) cannot be checked: refused."""
    from fedstale.common.secagg.coding import Disagreement, decode_checked

    code = MaskCode(holders=6, privacy=2, recovery=4, length=20)
    mask = random_elements(20)
    shares = code.encode(mask)
    honest = {j: shares[j] for j in range(6)}
    decoded, wrong = decode_checked(code, honest)
    assert np.array_equal(decoded, mask) and wrong == []
    one_wrong = {**honest, 2: (shares[2] + 1) % PRIME}
    decoded, wrong = decode_checked(code, one_wrong)
    assert np.array_equal(decoded, mask) and wrong == [2]
    with pytest.raises(Disagreement, match="no 5 of the 6 answers agree"):
        decode_checked(code, {**one_wrong, 4: (shares[4] + 7) % PRIME})
    with pytest.raises(Disagreement, match="cannot be checked: at least 5"):
        decode_checked(code, {j: honest[j] for j in range(4)})
    with pytest.raises(Disagreement, match="no 5 of the 5"):
        decode_checked(code, {j: one_wrong[j] for j in range(5)})
    with pytest.raises(Disagreement, match="no 6 of the 6"):  # f = 2: all six must fit
        decode_checked(code, one_wrong, wrong=2)


def lagrange_values(points: list[int], at: list[int]) -> np.ndarray:
    """prod_{p in points} (x - p) mod PRIME at each x of `at`: zero at every point."""
    values = []
    for x in at:
        total = 1
        for point in points:
            total = total * (x - point) % PRIME
        values.append(total)
    return np.array(values, dtype=np.uint64)


def test_colluding_holders_past_f_are_caught_when_f_covers_them() -> None:
    """The review's attack: N = 10, T = 3, U = 7; holders 0, 1 and 2 collude and shift their
    answers by e l(alpha_j), l vanishing at six honest holders' points, so that nine
    answers (theirs and those six) fit a wrong polynomial. With f = 1 nine fitting answers
    are taken (three wrong is more than f covers: documented); with f = T = 3 a decode
    needs ten that fit, and is refused."""
    from fedstale.common.secagg.coding import Disagreement, decode_checked

    code = MaskCode(holders=10, privacy=3, recovery=7, length=14)
    shares = code.encode(random_elements(14))
    honest_points = [code.alphas[j] for j in range(4, 10)]  # holder 3 is left out
    shift = lagrange_values(honest_points, [code.alphas[j] for j in range(3)])
    answers = {j: shares[j] for j in range(10)}
    for j in range(3):
        answers[j] = (shares[j] + 5 * shift[j]) % PRIME
    _, named = decode_checked(code, answers, wrong=1)
    assert named == [3]  # an honest holder blamed: f = 1 does not cover three colluders
    with pytest.raises(Disagreement):
        decode_checked(code, answers, wrong=3)


def test_a_holders_policy_worked_by_hand() -> None:
    """g = 10, ratio 1/16: weights must be integers in [64, 1024], the largest 1024, over
    two or more distinct senders."""
    from fedstale.common.secagg.protocol import HolderPolicy

    policy = HolderPolicy(min_clients=2, min_weight_ratio=1 / 16, weight_bits=10, rule="fedbuff")
    assert policy.least_factor == 64
    assert policy.refusal([0, 1], [1024, 64]) == ""
    assert policy.refusal([0, 1, 1], [1024, 724, 512]) == ""
    assert "fewer than secagg-min-clients 2" in policy.refusal([3, 3], [1024, 1024])
    assert "outside [64, 1024] (fedbuff secagg-min-weight-ratio" in policy.refusal(
        [0, 1], [1024, 63]
    )
    assert "outside" in policy.refusal([0, 1], [1024, PRIME])
    assert "outside" in policy.refusal([0, 1], [1024, -64 % PRIME])
    assert "not 2^10" in policy.refusal([0, 1], [512, 512])
