"""The FedQS reproduction's claim lines, against hand-worked curves, and its regimes grid."""

from __future__ import annotations

from typing import Any

from bench.reproduce_fedqs import claim_lines, regime_jobs


def run(method: str, curve: list[tuple[float, float]], seed: int = 0) -> dict[str, Any]:
    return {
        "method": method,
        "alpha": 0.1,
        "seed": seed,
        "curve": curve,
        "summary": {
            "final_accuracy": curve[-1][1],
            "best_accuracy": max(accuracy for _, accuracy in curve),
        },
    }


FEDAVG = run("fedavg", [(0, 0.10), (100, 0.50), (200, 0.70), (400, 0.90)])


def test_fedqs_that_reaches_fedavg_is_timed_against_fedavgs_end() -> None:
    fedqs = run("fedqs-sgd", [(0, 0.10), (50, 0.60), (100, 0.95), (120, 0.93)])
    (line,) = claim_lines([FEDAVG, fedqs])
    # FedAvg's final 90%: FedQS-SGD's first evaluation >= 90 is at 100, 25% of 400
    assert line == (
        "- alpha 0.1: FedQS-SGD reaches FedAvg's final 90.00% at virtual time 100, "
        "25% of FedAvg's 400"
    )


def test_fedqs_short_of_fedavg_says_how_far_and_what_fedavg_needed() -> None:
    fedqs = run("fedqs-sgd", [(0, 0.10), (10, 0.66), (20, 0.62)])
    (line,) = claim_lines([FEDAVG, fedqs])
    # best 66%, ends at 20 = 5.0% of 400; FedAvg first reaches 62% at 200
    assert line == (
        "- alpha 0.1: FedQS-SGD did not reach FedAvg's 90.00% in its budget (best 66.00%; "
        "its runs end at 20, 5.0% of FedAvg's 400); FedAvg reached FedQS-SGD's final "
        "62.00% at 200"
    )


def test_pairs_compare_final_accuracy_and_oscillation() -> None:
    # oscillation: std of the evaluations in the last 20% of the run (t >= 80 of 100)
    fedqs = run("fedqs-sgd", [(0, 0.1), (80, 0.70), (90, 0.74), (100, 0.72)])
    safl = run("safl-fedsgd", [(0, 0.1), (80, 0.60), (90, 0.80), (100, 0.70)])
    (line,) = claim_lines([fedqs, safl])
    # finals 72 vs 70; pstdev of (70, 74, 72) = 1.633, of (60, 80, 70) = 8.165
    assert line == "- alpha 0.1: fedqs-sgd - safl-fedsgd: final +2.00 points, oscillation -6.53"


def test_pairs_over_seeds_give_each_seeds_difference() -> None:
    runs = [
        run("fedqs-sgd", [(0, 0.1), (100, 0.70)], seed=0),
        run("fedqs-sgd", [(0, 0.1), (100, 0.80)], seed=1),
        run("safl-fedsgd", [(0, 0.1), (100, 0.75)], seed=0),
        run("safl-fedsgd", [(0, 0.1), (100, 0.76)], seed=1),
    ]
    (line,) = claim_lines(runs)
    # means 75 vs 75.5; seed 0: 70 - 75, seed 1: 80 - 76; one evaluation each: no oscillation
    assert line == (
        "- alpha 0.1: fedqs-sgd - safl-fedsgd: final -0.50 points, oscillation +0.00; "
        "per seed s0 -5.00, s1 +4.00"
    )


def test_regimes_run_the_chosen_settings_every_seed_of_one_before_the_next() -> None:
    jobs = regime_jobs(seeds=3, seeds_all=1, settings="50c,a0.1")
    settings = [job.labels["setting"] for job in jobs]
    # alpha 0.1: 2 methods x 3 regimes + uniform weights in ours = 7 a seed; 50 clients: 6
    assert len(jobs) == 3 * 7 + 3 * 6
    assert settings == sorted(settings, key=settings.index)  # grouped, in the table's order
    assert settings[0].startswith("alpha 0.1") and settings[-1].startswith("50 clients 1:20")
    assert [job.labels["seed"] for job in jobs[:21:7]] == [0, 1, 2]
    few = [job for job in jobs if job.labels["regime"] == "concurrency K"]
    assert {(j.config.get("num-clients"), j.config["concurrency"]) for j in few} == {
        (None, 10),
        (50, 5),
    }
    uniform = [job for job in jobs if "uniform" in job.labels["method"]]
    assert {(j.labels["regime"], j.config["fedqs-base-weights"]) for j in uniform} == {
        ("ours", "uniform")
    }
    assert {job.config["buffer-size"] for job in jobs if job.config.get("num-clients") == 50} == {5}
