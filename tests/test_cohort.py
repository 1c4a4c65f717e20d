"""Cohort training (fedstale/common/cohort.py) against per-task training: the same
parameters and last-pass loss for clients of different sizes, learning rates, proximal
terms and step budgets, and a client without data left where it started."""

from __future__ import annotations

import copy
from pathlib import Path

import pytest
import torch

from fedstale.common.cohort import Member, cohort_train
from fedstale.common.models import LeNet
from fedstale.common.training import local_train


def members(model: torch.nn.Module) -> list[Member]:
    torch.manual_seed(0)
    out = []
    settings = [
        (150, 2, 0, 0.0),
        (97, 2, 0, 0.01),
        (200, 1, 5, 0.0),
        (64, 3, 0, 0.0),
        (0, 2, 0, 0.0),
    ]
    for k, (n, epochs, steps, mu) in enumerate(settings):
        start = {name: p.detach() + 0.001 * k for name, p in model.named_parameters()}
        x, y = 0.1 * torch.randn(n, 1, 28, 28), torch.randint(0, 10, (n,))
        # small steps: a diverging run would magnify float summation order into the result
        out.append(Member(start, x, y, epochs, 64, 0.01 + 0.005 * k, k, mu, steps))
    return out


def test_a_cohort_trains_each_client_as_its_own_task_would() -> None:
    model = LeNet((1, 28, 28), 10)
    cohort = members(model)
    trained = cohort_train(model, cohort)
    for member, (params, loss) in zip(cohort, trained, strict=True):
        alone = copy.deepcopy(model)
        with torch.no_grad():
            for name, p in alone.named_parameters():
                p.copy_(member.params[name])
        expected = local_train(
            alone,
            member.x,
            member.y,
            epochs=member.epochs,
            batch_size=member.batch_size,
            lr=member.lr,
            seed=member.seed,
            proximal_mu=member.proximal_mu,
            steps=member.steps,
            closed_form=False,
        )
        for name, p in alone.named_parameters():
            torch.testing.assert_close(params[name], p.detach(), rtol=1e-5, atol=1e-5)
        if len(member.y):
            assert loss == pytest.approx(expected, rel=1e-5)
        else:
            assert all(torch.equal(params[n], member.params[n]) for n in params)


def test_a_golden_run_with_cohort_training_matches_its_golden_files(tmp_path: Path) -> None:
    """FedBuff's golden config with trainer=cohort in --local's cohort transport: the same
    events, floats within the golden tolerances of per-task training; cohorts of more than
    one task formed."""
    from fedstale.launcher.local import cohort_transport
    from fedstale.server_app.experiment import run_experiment
    from fedstale.strategies.registry import load_config
    from tests.goldens import differences, golden_values, one_thread, without_wall_time

    run, params = load_config({**golden_values("fedbuff", tmp_path), "trainer": "cohort"})
    transport = cohort_transport(run)
    with one_thread():
        run_experiment(run, params, transport)
    folder = tmp_path / "fedbuff"
    produced = {
        "metrics.jsonl": without_wall_time((folder / "metrics.jsonl").read_text()),
        "updates.jsonl": (folder / "updates.jsonl").read_text(),
    }
    assert differences("fedbuff", produced) == []
    assert max(transport.sizes) > 1 and sum(transport.sizes) >= 300


def test_a_rule_with_a_client_half_trains_alone_and_says_so(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    from fedstale.launcher.local import cohort_transport
    from fedstale.server_app.experiment import run_experiment
    from fedstale.strategies.registry import load_config

    values = {
        "strategy": "fedpsa",
        "trainer": "cohort",
        "dataset": "digits",
        "num-clients": 6,
        "concurrency": 3,
        "buffer-size": 2,
        "local-epochs": 1,
        "max-versions": 3,
        "max-virtual-time": 0.0,
        "runs-dir": str(tmp_path),
        "run-name": "psa",
    }
    run, params = load_config(values)
    summary = run_experiment(run, params, cohort_transport(run))
    assert summary["versions"] == 3 and summary["updates_rejected"] == 0
    assert "trainer=cohort: client rules ['fedpsa-sketch'] change local training" in caplog.text
