"""The one-run privacy audit (bench/privacy_audit.py): its bound worked by hand, and a small
audit of real FedBuff and FedAsync runs whose bound stays under the accountant's epsilon and
finds the leak at low noise."""

from __future__ import annotations

import argparse
import math
from pathlib import Path

import pytest

from bench.privacy_audit import Cell, audit, lower_bound, p_value, per_client_epsilon


def test_with_no_delta_all_r_right_refutes_the_epsilon_whose_q_to_the_r_is_5_percent() -> None:
    """r = v = 20, delta = 0: p = q^20 < 0.05 exactly while q > 0.05^(1/20) = 0.86089, so
    the bound is ln(q / (1 - q)) = 1.8227."""
    q = 0.05 ** (1 / 20)
    assert lower_bound(100, 20, 20, 0.0) == pytest.approx(math.log(q / (1 - q)), abs=1e-6)
    assert p_value(100, 20, 20, 1.8227, 0.0) == pytest.approx(0.05, rel=1e-3)


def test_delta_only_weakens_the_bound_and_chance_refutes_nothing() -> None:
    assert lower_bound(1000, 200, 180, 1e-3) < lower_bound(1000, 200, 180, 0.0)
    assert p_value(1000, 200, 180, 1.0, 1e-3) > p_value(1000, 200, 180, 1.0, 0.0)
    assert lower_bound(1000, 200, 100, 1e-5) == 0.0  # half right: what a coin gets


@pytest.mark.parametrize("rule", ["fedbuff", "fedasync"])
def test_the_audit_flags_a_planted_under_noising_bug_and_passes_the_honest_run(
    tmp_path: Path, rule: str
) -> None:
    """A cell where the audit can refute the claim: each canary in about one release at
    z = 2 (claimed epsilon of one canary about 2, from dp_accounting called directly on
    the public schedule), 600 canaries and 80 guesses each way (all right would refute up
    to 3.95). The honest run's bound stays under the claim; the same run with a quarter of
    the claimed noise (a planted bug) passes it: VIOLATION. The noise is replayable here
    (dp-noise-seed) so that the test gives the same count every time: measured, the honest
    run 98/160 right (bound 0.18), the planted 150/160 (2.15) for FedBuff."""
    options = argparse.Namespace(
        canaries=600,
        honest=20,
        participations=1,
        guesses=80,
        dataset="digits",
        model="mlp",
        noise_seed=11,
    )
    honest = audit(Cell(rule, 2.0, 0), options, tmp_path)
    assert honest["reachable"] > honest["canary_epsilon"] > 1.0  # the audit has power
    assert honest["verdict"] == "consistent"
    assert honest["audit_epsilon"] <= honest["canary_epsilon"] <= honest["accountant_epsilon"]
    planted = audit(Cell(rule, 2.0, 0, planted=0.25), options, tmp_path)
    assert planted["canary_epsilon"] == pytest.approx(honest["canary_epsilon"], rel=0.2)
    assert planted["verdict"] == "VIOLATION"
    assert planted["audit_epsilon"] > planted["canary_epsilon"]


def test_the_claimed_epsilon_of_a_canary_is_dp_accountings_for_its_gaussian() -> None:
    """mu = 0.5 (w C / sigma): dp_accounting's PLD gives 1.993 at delta 1e-5; two releases
    of mu 0.5 compose to one of mu sqrt(0.5)."""
    assert per_client_epsilon(0.25, 1e-5) == pytest.approx(1.9931, abs=1e-3)
    assert per_client_epsilon(0.5, 1e-5) > per_client_epsilon(0.25, 1e-5)
    assert per_client_epsilon(0.0, 1e-5) == 0.0
