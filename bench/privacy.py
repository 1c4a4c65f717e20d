"""Accuracy against epsilon under central DP: FedBuff and synchronous FedAvg on
Fashion-MNIST at the same (epsilon, delta) and the same number of client trainings.

    python -m bench.privacy              # 3 seeds of every cell (about 6 min on 2 cores)
    python -m bench.privacy --report     # the table and plot of the runs already done
    python -m bench.privacy --updates 4000 --epsilons 100,20

Protocol: Fashion-MNIST, the linear model, 50 clients split by Dirichlet 0.1 (Hsu), 10
tasks in flight; FedBuff's buffer K = 10 and FedAvg's rounds of 10 clients, so both make
one release per 10 client trainings and, at the same budget of client trainings
(`--updates`, default 2,000: 200 releases), the same number of releases. Noise without
amplification makes epsilon a function of the releases and the noise multiplier alone, so
for each target epsilon one z (found by bisection with Flower's RdpAccountant at delta
1e-5) serves both rules; both clip each update's delta to C = 0.3 (about the update norm
a third of the updates exceed in a run without DP, so clipping bites but does not flatten
everything). A release's sensitivity is C times the largest per-client sum of weights:
C / 10 for FedAvg (its uniform weight 1/10 under DP, one update per client), at least
C / 10 for FedBuff (eta_g / K with eta_g 1), more where a fast client holds two updates of
a buffer (about a fifth of FedBuff's releases here). Each cell also runs without DP ("none") and
with clipping only ("inf": no noise). Local training: 1 epoch, batch 64, SGD lr 0.01
decaying 0.999 per version; latency uniform 10-500 units on the virtual clock.

Writes under --out (runs/privacy-bench): results.jsonl (resumable), table.md, accuracy.png;
bench/results/privacy-2000u.jsonl is the recorded results.jsonl of docs/benchmarks.md.
"""

from __future__ import annotations

import argparse
import math
import statistics
from functools import partial
from pathlib import Path
from typing import Any

from bench import reproduce
from bench.grid import Job, Runner, matching, run_in_process, table_head
from bench.reproduce import Options, Paper, Result, Suite, figure, table_row
from fedstale.launcher.analysis import mean_std

RULES = ("fedbuff", "fedavg")
CLIPPING_NORM = 0.3
DELTA = 1e-5
PER_RELEASE = 10
NONE, CLIP_ONLY = "none", "inf"
BASE = {
    "dataset": "fmnist",
    "model": "linear",
    "partition": "dirichlet",
    "dirichlet-alpha": 0.1,
    "num-clients": 50,
    "concurrency": PER_RELEASE,
    "buffer-size": PER_RELEASE,
    "local-epochs": 1,
    "max-virtual-time": 0.0,
    "dp-target-delta": DELTA,
}


def noise_for(epsilon: float, releases: int) -> float:
    """The noise multiplier whose `releases` releases spend exactly `epsilon` at DELTA."""
    from fedstale.common.config import RunConfig
    from fedstale.server_app.stages.central_dp import Accounting

    def spent(z: float) -> float:
        run = RunConfig.model_validate(
            {**BASE, "dp-clipping-norm": 1.0, "dp-noise-multiplier": z, "max-updates": 1}
        )
        return Accounting.of(run).epsilon_after(releases)

    low, high = 1e-3, 1e3
    for _ in range(60):  # bisection on log z: epsilon falls as z grows
        middle = math.sqrt(low * high)
        low, high = (middle, high) if spent(middle) > epsilon else (low, middle)
    return high


def privacy_config(epsilon: str, releases: int) -> dict[str, Any]:
    if epsilon == NONE:
        return {}
    clipping = {"dp-clipping-norm": CLIPPING_NORM}
    if epsilon == CLIP_ONLY:
        return clipping
    return {**clipping, "dp-noise-multiplier": noise_for(float(epsilon), releases)}


def jobs(options: Options) -> list[Job]:
    releases = options.updates // PER_RELEASE
    settings = {e: privacy_config(e, releases) for e in epsilons(options)}
    out = []
    for seed in range(options.seeds):
        for epsilon in epsilons(options):
            for rule in RULES:
                config = {**BASE, "strategy": rule, "max-updates": options.updates}
                out.append(
                    Job(
                        f"{rule}-eps{epsilon}-s{seed}",
                        {"rule": rule, "epsilon": epsilon, "seed": seed},
                        {**config, **settings[epsilon], "seed": seed},
                    )
                )
    return out


def epsilons(options: Options) -> list[str]:
    return [NONE, CLIP_ONLY, *(e for e in options.epsilons.split(",") if e)]


def run_job(job: Job, runs_dir: str) -> dict[str, Any]:
    result, _ = run_in_process(job, runs_dir, job.config)
    result["noise_multiplier"] = job.config.get("dp-noise-multiplier", 0.0)
    return result


def cell(rows: list[Result], what: str) -> str:
    if not rows:
        return "-"
    if what == "accuracy":
        return mean_std([100 * r["summary"]["final_accuracy"] for r in rows])
    if what == "virtual":
        return f"{statistics.mean(r['summary']['virtual_time'] for r in rows):,.0f}"
    return f"{statistics.mean(r['seconds'] for r in rows):.1f}"


def spent(rows: list[Result]) -> str:
    values = [(r["summary"].get("privacy") or {}).get("epsilon") for r in rows]
    known = [v for v in values if v is not None]
    return f"{statistics.mean(known):.3g}" if known else "-"


def table(results: list[Result], options: Options) -> str:
    columns = ["epsilon (target)", "z", "epsilon spent", "releases"]
    for rule in RULES:
        columns += [f"{rule} final acc %", f"{rule} virtual time", f"{rule} wall s"]
    lines = table_head(
        f"Final accuracy (mean ± std over seeds) against epsilon at delta {DELTA:g}, "
        f"{options.updates} client trainings, C = {CLIPPING_NORM}",
        columns,
    )
    for epsilon in epsilons(options):
        rows = matching(results, epsilon=epsilon)
        z = f"{rows[0]['noise_multiplier']:.3g}" if rows else "-"
        releases = rows[0]["summary"].get("privacy", {}).get("releases", "-") if rows else "-"
        line = [epsilon, z, spent(rows), releases]
        for rule in RULES:
            ruled = matching(rows, rule=rule)
            line += [cell(ruled, "accuracy"), cell(ruled, "virtual"), cell(ruled, "wall")]
        lines.append(table_row(line))
    return "\n".join(lines)


def finals(rows: list[Result]) -> list[float]:
    return [r["summary"]["final_accuracy"] for r in rows]


def plot(results: list[Result], path: Path) -> None:
    with figure(path, 1, 6) as (_, ax):
        noised = sorted({r["epsilon"] for r in results} - {NONE, CLIP_ONLY}, key=float)
        for rule, colour in zip(RULES, ("tab:blue", "tab:orange"), strict=True):
            points = [(float(e), finals(matching(results, rule=rule, epsilon=e))) for e in noised]
            points = [(e, statistics.mean(a)) for e, a in points if a]
            if points:
                ax.plot(*zip(*points, strict=True), "o-", color=colour, label=f"{rule}, DP")
            for kind, style in ((NONE, ":"), (CLIP_ONLY, "--")):
                rows = matching(results, rule=rule, epsilon=kind)
                if rows:
                    mean = statistics.mean(r["summary"]["final_accuracy"] for r in rows)
                    ax.axhline(mean, color=colour, linestyle=style, label=f"{rule}, {kind}")
        ax.set_xscale("log")
        ax.set_xlabel(f"epsilon at delta {DELTA:g}")
        ax.set_ylabel("final test accuracy")
        ax.legend(fontsize=8)


def options(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--seeds", type=int, default=3)
    parser.add_argument("--updates", type=int, default=2000, help="client trainings per run")
    parser.add_argument("--epsilons", default="200,50,10", help="target epsilons, comma-separated")


def runner(options: Options) -> Runner:
    return partial(run_job)


PAPER = Paper(
    description=__doc__ or "",
    suites={"epsilon": Suite(jobs, table, "table.md", plot, "accuracy.png")},
    default_suite="epsilon",
    default_out=Path("runs/privacy-bench"),
    runner=runner,
    options=options,
    suite_choice=False,
)


def main(argv: list[str] | None = None) -> None:
    reproduce.main(PAPER, argv)


if __name__ == "__main__":
    main()
