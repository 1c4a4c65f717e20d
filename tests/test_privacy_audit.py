"""The one-run privacy audit (bench/privacy_audit.py): its bound worked by hand, and a small
audit of real FedBuff and FedAsync runs whose bound stays under the accountant's epsilon and
finds the leak at low noise."""

from __future__ import annotations

import argparse
import math
from pathlib import Path

import pytest

from bench.privacy_audit import Cell, audit, lower_bound, p_value


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
def test_an_audit_of_a_real_run_finds_the_leak_and_stays_under_the_accountant(
    tmp_path: Path, rule: str
) -> None:
    options = argparse.Namespace(
        canaries=100, honest=20, participations=2, guesses=20, dataset="digits", model="mlp"
    )
    low_noise = audit(Cell(rule, 0.5, 0), options, tmp_path)
    assert low_noise["correct"] >= 35  # of 40: the canaries show through little noise
    assert 0 < low_noise["audit_epsilon"] <= low_noise["canary_epsilon"]
    assert low_noise["canary_epsilon"] <= low_noise["accountant_epsilon"]
    high_noise = audit(Cell(rule, 4.0, 0), options, tmp_path)
    assert high_noise["audit_epsilon"] <= high_noise["canary_epsilon"]
    assert high_noise["canary_epsilon"] <= high_noise["accountant_epsilon"]
    assert high_noise["audit_epsilon"] < low_noise["audit_epsilon"]
