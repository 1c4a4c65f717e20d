"""An empirical lower bound on epsilon from one training run, beside the accountant's
epsilon (issue 66): the one-run audit of Steinke, Nasr and Jagielski ("Privacy auditing
with one (1) training run", NeurIPS 2023), with canary clients planted in real runs of
FedBuff and FedAsync under central DP.

    python -m bench.privacy_audit [--canaries 1000] [--honest 500] [--seeds 3]
        [--noise 0.5,1,2] [--rules fedbuff,fedasync] [--guesses 100] [--out DIR]
    python -m bench.privacy_audit --report --out DIR     # the table of the runs done

The game. Of the run's clients, `--canaries` are canaries: each gets a random direction u_i
(a unit vector of the model's dimension) and a fair coin. A canary whose coin says "in"
returns C u_i as its first update's delta (C: dp-clipping-norm); one whose coin says "out"
returns a zero delta: the zero-out relation the accountant charges for. A canary's later
updates are zero in both worlds, so only its first update's release depends on the coin,
and the epsilon claimed for it is that release's Gaussian mechanism alone. The
other clients train on their Fashion-MNIST partitions as usual. Each run goes through
fedstale's own door (the engine, the rule, the privacy stage, the in-process transport)
with its defaults; only the canaries' replies are replaced.

The auditor sees what a client of the run sees, and the public schedule: every released
model (each task carries the model it starts from, so every version reaches some client)
and updates.jsonl as written under noise (client, task, staleness and, for these linear
releases, the weight). From these it knows which release each update joined (the one after
the version it arrived at), the update's weight w and the release's noise deviation
sigma_v = z S_v. For each canary it adds up, over its updates, the log-likelihood ratio of
"in" against "out" of the release's change projected on u_i (for a rule that takes models
back, FedAsync, less the public part w (M_base - M_prev)), and guesses "in" for the
`--guesses` highest sums, "out" for the `--guesses` lowest, and abstains on the rest.

The bound. If the run is (epsilon, delta)-DP for each canary, the number of correct
guesses among r is stochastically dominated by a Binomial(r, e^eps / (1 + e^eps)) up to a
term in delta (their Theorem 5.2 and the algorithm of their Appendix D). The bound reported
is the largest epsilon whose p-value for the observed count stays below 0.05: the run is
not (epsilon, delta)-DP for any smaller epsilon, with 95% confidence. It is a lower bound
on the true epsilon of one canary; it must never exceed the accountant's epsilon (a bound
above it is a bug in one of them), nor the epsilon of the releases a canary took part in,
which the table shows between the two.

Writes under --out (default runs/privacy-audit): results.jsonl (one row per rule, noise
and seed; a cell already there is not run again), each run's folder, table.md.
bench/results/privacy-audit.jsonl is the recorded results.jsonl of docs/privacy.md (about
5 minutes on 2 cores: 18 runs of 1,500 clients).
"""

from __future__ import annotations

import argparse
import json
import logging
import math
import statistics
import sys
from collections import defaultdict
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
from fedstale.common.records import ArraySets  # noqa: E402
from fedstale.common.schema import RETURN_MODEL, TaskKeys  # noqa: E402
from fedstale.launcher.inprocess import InProcessTransport  # noqa: E402

CONFIDENCE = 0.95
CLIPPING_NORM = 1.0
BUFFER = 10


# ---------------------------------------------------------------- the bound


def p_value(canaries: int, guesses: int, correct: int, epsilon: float, delta: float) -> float:
    """P[at least `correct` of `guesses` right] for an (epsilon, delta)-DP run with
    `canaries` canaries: the binomial tail at q = e^eps / (1 + e^eps), plus 2 m delta times
    the largest mean, over i, of the binomial's mass on [correct - i, correct)."""
    from scipy.stats import binom

    q = 1.0 / (1.0 + math.exp(-epsilon))
    tail = float(binom.sf(correct - 1, guesses, q))
    below = binom.pmf(np.arange(correct - 1, -1, -1), guesses, q)  # correct-1, ..., 0
    steps = np.arange(1, correct + 1)
    spread = float(np.max(np.cumsum(below) / steps)) if correct else 0.0
    return min(1.0, tail + 2 * canaries * delta * spread)


def lower_bound(canaries: int, guesses: int, correct: int, delta: float) -> float:
    """The largest epsilon the guesses refute at 95% confidence (0: none)."""
    alpha = 1.0 - CONFIDENCE
    if p_value(canaries, guesses, correct, 0.0, delta) >= alpha:
        return 0.0
    low, high = 0.0, 1.0
    while p_value(canaries, guesses, correct, high, delta) < alpha:
        low, high = high, 2 * high
    for _ in range(50):
        middle = (low + high) / 2
        low, high = (
            (middle, high)
            if p_value(canaries, guesses, correct, middle, delta) < alpha
            else (low, middle)
        )
    return low


# ---------------------------------------------------------------- the canaries


@dataclass
class Canaries:
    """The canaries' directions and coins, and everything the run's clients saw."""

    count: int
    directions: np.ndarray  # (count, dimension), unit rows
    inside: np.ndarray  # (count,) bool: the coin
    norm: float
    models: dict[int, np.ndarray] = field(default_factory=dict)  # version -> released model
    tasks: dict[int, tuple[int, int]] = field(default_factory=dict)  # task -> (client, base)
    first: dict[int, int] = field(default_factory=dict)  # canary -> the task carrying its coin
    returns: str = ""

    @classmethod
    def drawn(cls, count: int, dimension: int, norm: float, seed: int) -> Canaries:
        rng = np.random.default_rng([seed, 0xCA])
        directions = rng.standard_normal((count, dimension))
        directions /= np.linalg.norm(directions, axis=1, keepdims=True)
        return cls(count, directions, rng.random(count) < 0.5, norm)

    def delta_of(self, client: int, task: int) -> np.ndarray:
        """C u_i or zero by the coin on the canary's first task; zero on any later one, in
        both worlds (so only the first update's releases depend on the coin)."""
        first = self.first.setdefault(client, task)
        return self.norm * (self.inside[client] and task == first) * self.directions[client]


class CanaryTransport(InProcessTransport):
    """The in-process transport with clients 0 .. m-1 replaced by canaries; it keeps every
    model a task carried (what the clients saw)."""

    def __init__(self, run: Any, count: int, seed: int) -> None:
        from fedstale.client_app.task import client_model, evaluate_task, train_task

        super().__init__(run, train_task, evaluate_task)
        _, self.layout = client_model(run)
        self.canaries = Canaries.drawn(count, self.layout.total, CLIPPING_NORM, seed)

    def train(
        self, msg_id: str, partition: int, config: dict, arrays: dict, sets: ArraySets | None
    ) -> None:
        canaries, start = self.canaries, self.layout.flatten(arrays).astype(np.float64)
        version = int(config[TaskKeys.VERSION])
        canaries.models.setdefault(version, start)
        canaries.tasks[int(config[TaskKeys.TASK_ID])] = (partition, version)
        canaries.returns = str(config[TaskKeys.RETURN])
        super().train(msg_id, partition, config, arrays, sets)
        if partition >= canaries.count:
            return
        reply = self.replies[msg_id]
        delta = canaries.delta_of(partition, int(config[TaskKeys.TASK_ID]))
        vector = start + delta if canaries.returns == RETURN_MODEL else delta
        reply.arrays = self.layout.unflatten(vector.astype(np.float32))


# ---------------------------------------------------------------- the auditor


def releases_of(rows: list[dict[str, Any]], canaries: Canaries) -> dict[int, list[dict]]:
    """The public schedule: each update's row with its base version, by the release it
    joined (the version after the one it arrived at)."""
    releases: dict[int, list[dict]] = defaultdict(list)
    for row in rows:
        client, base = canaries.tasks[int(row["task"])]
        assert client == int(row["client"]), "updates.jsonl and the tasks disagree"
        releases[base + int(row["staleness"]) + 1].append({**row, "base": base})
    return releases


def claimed_sigma(rows: list[dict[str, Any]], norm: float, z: float) -> float:
    """The noise deviation the run claims for one release, recomputed here from the public
    schedule and the documented rule (docs/privacy.md, The accounting), not with
    fedstale's own function: z C times the largest sum, over the release's clients, of one
    client's |weights|."""
    per_client: dict[int, float] = defaultdict(float)
    for row in rows:
        per_client[int(row["client"])] += abs(float(row["weight"]))
    return z * norm * max(per_client.values())


def scores(
    releases: dict[int, list[dict]], canaries: Canaries, z: float
) -> tuple[np.ndarray, np.ndarray]:
    """Each canary's summed log-likelihood ratio, and its summed (w C / sigma)^2 (the
    square of its Gaussian mechanisms' mu over the releases it joined), at the claimed
    sigma of each release."""
    total, mu2 = np.zeros(canaries.count), np.zeros(canaries.count)
    models, norm = canaries.models, canaries.norm
    for version, rows in releases.items():
        if version not in models or version - 1 not in models:
            continue  # the run's last release: no task carried it
        sigma = claimed_sigma(rows, norm, z)
        change = models[version] - models[version - 1]
        for row in rows:
            client = int(row["client"])
            if client >= canaries.count or canaries.first.get(client) != int(row["task"]):
                continue  # an honest client, or a canary's later update (zero either way)
            weight = float(row["weight"])
            seen = change
            if canaries.returns == RETURN_MODEL:  # less the public pull towards its base
                seen = change - weight * (models[row["base"]] - models[version - 1])
            projected = float(seen @ canaries.directions[client])
            signal = weight * norm
            total[client] += (projected * signal - signal**2 / 2) / sigma**2
            mu2[client] += (signal / sigma) ** 2
    return total, mu2


def guessed(total: np.ndarray, inside: np.ndarray, guesses: int) -> tuple[int, int]:
    """(guesses made, guesses right): "in" for the highest sums, "out" for the lowest."""
    order = np.argsort(total, kind="stable")
    k = min(guesses, len(order) // 2)
    right = int(np.sum(inside[order[-k:]])) + int(np.sum(~inside[order[:k]]))
    return 2 * k, right


def per_client_epsilon(mu2: float, delta: float) -> float:
    """The epsilon the run claims for one canary: its releases' Gaussian mechanisms (at the
    claimed sigmas) compose exactly into one Gaussian of mu = sqrt(sum mu_i^2) (Dong, Roth
    and Su 2019), whose epsilon at `delta` comes from dp_accounting's PLD accountant,
    called directly (not through fedstale's accounting)."""
    import dp_accounting
    from dp_accounting.pld import PLDAccountant

    if mu2 <= 0:
        return 0.0
    accountant = PLDAccountant()
    accountant.compose(dp_accounting.GaussianDpEvent(1.0 / math.sqrt(mu2)))
    return float(accountant.get_epsilon(delta))


@contextmanager
def under_noised(scale: float) -> Iterator[None]:
    """A planted bug for the audit to find: every release noised with `scale` times the
    deviation the accountant charges for (1: the honest run)."""
    from fedstale.server_app.stages import central_dp

    honest = central_dp.noised
    if scale == 1.0:
        yield
        return

    def planted(change: np.ndarray, z: float, sensitivity: float, rng: Any) -> np.ndarray:
        return honest(change, z, sensitivity * scale, rng)

    central_dp.noised = planted
    try:
        yield
    finally:
        central_dp.noised = honest


# ---------------------------------------------------------------- one run


@dataclass(frozen=True)
class Cell:
    rule: str
    noise: float
    seed: int
    planted: float = 1.0  # the noise actually added, as a share of the claimed

    @property
    def name(self) -> str:
        bug = "" if self.planted == 1.0 else f"-planted{self.planted:g}"
        return f"{self.rule}-z{self.noise:g}-s{self.seed}{bug}"


def audit(cell: Cell, args: argparse.Namespace, runs: Path) -> dict[str, Any]:
    from fedstale.server_app.experiment import run_experiment
    from fedstale.strategies.registry import load_config

    clients = args.canaries + args.honest
    updates = args.participations * clients
    versions = updates // BUFFER if cell.rule == "fedbuff" else updates
    values = {
        "strategy": cell.rule,
        "dataset": args.dataset,
        "model": args.model,
        "num-clients": clients,
        "concurrency": BUFFER,
        "buffer-size": BUFFER,
        "max-versions": versions,
        "max-virtual-time": 0.0,
        "eval-interval": 1e12,
        "checkpoint-every": 0,
        "seed": cell.seed,
        "dp-clipping-norm": CLIPPING_NORM,
        "dp-noise-multiplier": cell.noise,
        "runs-dir": str(runs),
        "run-name": cell.name,
    }
    if getattr(args, "noise_seed", None) is not None:  # replayable noise: tests only
        values["dp-noise-seed"] = args.noise_seed
    run, params = load_config(values)
    transport = CanaryTransport(run, args.canaries, cell.seed)
    with under_noised(cell.planted):
        summary = run_experiment(run, params, transport)
    canaries = transport.canaries
    rows = jsonl(runs / cell.name / "updates.jsonl")
    total, mu2 = scores(releases_of(rows, canaries), canaries, cell.noise)
    made, right = guessed(total, canaries.inside, args.guesses)
    delta = run.dp_target_delta
    audit_epsilon = lower_bound(args.canaries, made, right, delta)
    claimed = per_client_epsilon(float(np.max(mu2)), delta)
    return {
        "cell": cell.name,
        "rule": cell.rule,
        "z": cell.noise,
        "seed": cell.seed,
        "planted": cell.planted,
        "canaries": args.canaries,
        "honest": args.honest,
        "participations": args.participations,
        "releases": summary["versions"],
        "guesses": made,
        "correct": right,
        "audit_epsilon": audit_epsilon,
        "reachable": lower_bound(args.canaries, made, made, delta),
        "canary_epsilon": claimed,
        "accountant_epsilon": float(summary["privacy"]["epsilon"]),
        "verdict": "VIOLATION" if audit_epsilon > claimed else "consistent",
        "delta": delta,
    }


def jsonl(path: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in path.read_text().splitlines()]


# ---------------------------------------------------------------- the table


def table(rows: list[dict[str, Any]]) -> str:
    cells: dict[tuple[str, float, float], list[dict]] = defaultdict(list)
    for row in rows:
        cells[(row["rule"], row["z"], row.get("planted", 1.0))].append(row)

    def spread(values: list[float]) -> str:
        if len(values) == 1 or min(values) == max(values):
            return f"{values[0]:.2f}"
        return f"{statistics.mean(values):.2f} [{min(values):.2f}-{max(values):.2f}]"

    lines = [
        "| rule | z | noise added | seeds | releases | guesses right | audit lower bound | "
        "largest bound these guesses can give | claimed epsilon of one canary | "
        "accountant's epsilon | verdict |",
        "| --- | ---: | --- | ---: | ---: | --- | --- | --- | --- | --- | --- |",
    ]
    for (rule, z, planted), group in sorted(cells.items()):
        right = ", ".join(f"{r['correct']}/{r['guesses']}" for r in group)
        added = "as claimed" if planted == 1.0 else f"{planted:g} x claimed (planted bug)"
        verdicts = sorted({r.get("verdict", "") for r in group})
        lines.append(
            f"| {rule} | {z:g} | {added} | {len(group)} | {group[0]['releases']} | {right} | "
            f"{spread([r['audit_epsilon'] for r in group])} | "
            f"{spread([r.get('reachable', float('nan')) for r in group])} | "
            f"{spread([r['canary_epsilon'] for r in group])} | "
            f"{spread([r['accountant_epsilon'] for r in group])} | {', '.join(verdicts)} |"
        )
    return "\n".join(lines)


def same_protocol(row: dict[str, Any], args: argparse.Namespace) -> bool:
    """Whether a recorded row was run with these canaries, clients and guesses."""
    shape = (row["canaries"], row.get("honest"), row.get("participations"), row["guesses"])
    return shape == (args.canaries, args.honest, args.participations, 2 * args.guesses)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--canaries", type=int, default=1000)
    parser.add_argument("--honest", type=int, default=500)
    parser.add_argument("--participations", type=int, default=1, help="updates per client")
    parser.add_argument("--guesses", type=int, default=150, help="each way: in and out")
    parser.add_argument("--noise", default="2,4")
    parser.add_argument(
        "--planted", default="1,0.25", help="noise added as shares of the claimed; <1: a bug"
    )
    parser.add_argument("--rules", default="fedbuff,fedasync")
    parser.add_argument("--seeds", type=int, default=3)
    parser.add_argument("--dataset", default="fmnist")
    parser.add_argument("--model", default="linear")
    parser.add_argument("--out", type=Path, default=ROOT / "runs" / "privacy-audit")
    parser.add_argument("--report", action="store_true")
    args = parser.parse_args(argv)
    from fedstale.server_app.app import setup_logging

    setup_logging()
    logging.getLogger("fedstale").setLevel(logging.WARNING)  # a line per client otherwise
    results = args.out / "results.jsonl"
    args.out.mkdir(parents=True, exist_ok=True)
    done = (
        [json.loads(line) for line in results.read_text().splitlines()] if results.exists() else []
    )
    if not args.report:
        cells = [
            Cell(rule, float(z), seed, float(planted))
            for seed in range(args.seeds)
            for rule in args.rules.split(",")
            for z in args.noise.split(",")
            for planted in args.planted.split(",")
        ]
        finished = {row["cell"] for row in done if same_protocol(row, args)}
        for cell in cells:
            if cell.name in finished:
                continue
            row = audit(cell, args, args.out / "runs")
            done.append(row)
            with results.open("a") as out:
                out.write(json.dumps(row) + "\n")
            print(
                f"{cell.name}: {row['correct']}/{row['guesses']} right, audit epsilon >= "
                f"{row['audit_epsilon']:.2f} (at most {row['reachable']:.2f}); claimed for "
                f"one canary {row['canary_epsilon']:.2f}; accountant "
                f"{row['accountant_epsilon']:.2f}: {row['verdict']}",
                flush=True,
            )
    text = table([row for row in done if same_protocol(row, args)])
    (args.out / "table.md").write_text(text + "\n")
    print(text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
