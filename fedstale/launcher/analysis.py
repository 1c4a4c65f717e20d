"""Reading finished runs and summarising them: a run folder as a `Run`, runs grouped by
setting (seeds pooled), mean ± std, time to a target, the comparison table. Used by
`fedstale compare` (fedstale/launcher/compare.py) and by bench/'s reproductions."""

from __future__ import annotations

import glob
import json
import statistics
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from fedstale.common.config import score_key, summary_score
from fedstale.server_app.results import aulc, read_jsonl

# Keys that name or place a run, or only change how it is shown: never a difference in kind.
NOT_A_SETTING = {
    "seed",
    "run-name",
    "runs-dir",
    "resume-from",
    "data-dir",
    "progress-interval",
    "checkpoint-every",
    "device",
    "client-threads",
    "overwrite",
    "provenance",
}


@dataclass
class Run:
    folder: Path
    config: dict[str, Any]
    summary: dict[str, Any]
    times: list[float]
    accuracies: list[float]  # the run's score, whatever its metric (`metric`)
    updates: list[dict[str, Any]] = field(default_factory=list)
    metric: str = "accuracy"

    @classmethod
    def load(cls, folder: Path) -> Run:
        metrics = read_jsonl(folder / "metrics.jsonl")
        summary = json.loads((folder / "summary.json").read_text())
        metric = summary.get("metric") or "accuracy"  # unscored runs, and runs before the key
        return cls(
            folder=folder,
            config=json.loads((folder / "config.json").read_text()),
            summary=summary,
            metric=metric,
            times=[row["virtual_time"] for row in metrics],
            accuracies=[row[score_key(metric)] for row in metrics],
            updates=read_jsonl(folder / "updates.jsonl")
            if (folder / "updates.jsonl").is_file()
            else [],
        )

    def score(self, which: str) -> float:
        """The summary's "final" or "best" score."""
        return summary_score(self.summary, self.metric, which)

    def setting(self) -> tuple[tuple[str, str], ...]:
        return tuple(
            sorted((k, json.dumps(v)) for k, v in self.config.items() if k not in NOT_A_SETTING)
        )


@dataclass
class Group:
    label: str
    runs: list[Run]


class CompareError(ValueError):
    """A RUN argument that names nothing usable."""


def find_runs(patterns: Sequence[str], runs_dir: Path) -> list[Path]:
    """Run folders (those with a summary.json) named by paths, globs or run names, in order,
    each once."""
    found: list[Path] = []
    for pattern in patterns:
        matches = [Path(p) for p in sorted(glob.glob(pattern))]
        if not matches:
            matches = [Path(p) for p in sorted(glob.glob(str(runs_dir / pattern)))]
        folders = [m for m in matches if (m / "summary.json").is_file()]
        if not folders:
            raise CompareError(
                f"'{pattern}' names no finished run (a folder with summary.json) here or in "
                f"{runs_dir}; pass run folders, globs or run names"
            )
        found += [f.resolve() for f in folders if f.resolve() not in found]
    return found


def group_runs(runs: list[Run]) -> list[Group]:
    """Runs that differ only in the seed (and in names and places) share a group; a group is
    labelled by the settings in which the groups differ."""
    by_setting: dict[tuple, list[Run]] = {}
    for run in runs:
        by_setting.setdefault(run.setting(), []).append(run)
    settings = [dict(s) for s in by_setting]
    # Keys every group has (a strategy's own keys follow from the strategy) that differ.
    shared = set.intersection(*(set(s) for s in settings)) - {"strategy"}
    differing = sorted(k for k in shared if len({s[k] for s in settings}) > 1)
    groups = []
    for setting, members in by_setting.items():
        values = dict(setting)
        label = " ".join(
            [json.loads(values.get("strategy", '"?"'))]
            + [f"{k}={json.loads(values[k])}" for k in differing]
        )
        groups.append(Group(label, members))
    return groups


def mean_std(values: Sequence[float], scale: float = 1.0, digits: int = 2) -> str:
    """`mean ± std (n=k)`, `value` for one, `-` for none."""
    values = [v * scale for v in values if v is not None]
    if not values:
        return "-"
    if len(values) == 1:
        return f"{values[0]:.{digits}f}"
    return (
        f"{statistics.mean(values):.{digits}f} ± {statistics.stdev(values):.{digits}f} "
        f"(n={len(values)})"
    )


def first_reach(times: Sequence[float], values: Sequence[float], target: float) -> float | None:
    """The first time whose value is at or above `target`; None when never reached."""
    return next((t for t, v in zip(times, values, strict=True) if v >= target), None)


def time_to(run: Run, target: float | None) -> float | None:
    """The first evaluation's virtual time at or above `target` (the run's own target-hit
    time when none is given); None when never reached."""
    if target is None:
        return run.summary.get("time_to_target")
    return first_reach(run.times, run.accuracies, target)


def reached(values: list[float | None], runs: list[Run], target: float | None) -> str:
    """Mean time to target over the runs that reached it; `-` where none was set."""
    if target is None and not any(r.config.get("target-accuracy") for r in runs):
        return "-"
    hits = [v for v in values if v is not None]
    if not hits:
        return "never"
    text = mean_std(hits, digits=0)
    return text if len(hits) == len(values) else f"{text}, {len(hits)}/{len(values)} runs"


def common_metric(runs: Sequence[Run]) -> str:
    """The metric every run scored; one CompareError line when they differ."""
    metrics = sorted({r.metric for r in runs})
    if len(metrics) > 1:
        raise CompareError(
            f"the runs score different metrics ({', '.join(metrics)}); compare runs of one"
        )
    return metrics[0]


def table(groups: list[Group], last: int, target: float | None) -> str:
    """One markdown row per group; accuracies in percent (other metrics as they are), AULC
    in score x days."""
    metric = common_metric([r for g in groups for r in g.runs])
    scale, unit = (100, "%") if metric == "accuracy" else (1, metric)
    target_label = f"time to {target:g}" if target is not None else "time to target"
    head = [
        "runs",
        "seeds",
        f"final {unit}",
        f"best {unit}",
        f"mean of last {last} {unit}",
        "AULC",
        target_label,
        "updates",
        "rejected",
    ]
    lines = ["| " + " | ".join(head) + " |", "|" + " --- |" * len(head)]
    for group in groups:
        runs = group.runs
        cells = [
            group.label,
            ",".join(str(r.config.get("seed", "?")) for r in runs),
            mean_std([r.score("final") for r in runs], scale),
            mean_std([r.score("best") for r in runs], scale),
            mean_std([statistics.mean(r.accuracies[-last:]) for r in runs], scale),
            mean_std([aulc(r.times, r.accuracies) for r in runs], digits=3),
            reached([time_to(r, target) for r in runs], runs, target),
            mean_std([r.summary["updates_accepted"] for r in runs], digits=0),
            mean_std([r.summary["updates_rejected"] for r in runs], digits=0),
        ]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)
