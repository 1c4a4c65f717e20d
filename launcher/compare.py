"""`fedstale compare RUN...`: several runs on one plot and in one table.

    fedstale compare runs/fedbuff-* runs/fedpsa-* [--last 5] [--target 0.8] [--out DIR]

A RUN is a run folder, a glob, or a run name under the runs folder (`runs-dir`, else
$FEDSTALE_RUNS_DIR, else ./runs). Runs whose configs differ only in the seed form one group:
the plot shows their mean accuracy with a band (min to max over the seeds) against virtual
time, beside the staleness histogram of each group and, where updates.jsonl records it, the
mean weight the strategy gave per version. The markdown table has one row per group (mean and
std over seeds): final, best, mean of the last k evaluations, AULC, time to target, updates,
rejections. bench/'s paper reproductions build their tables and plots from the same pieces.
"""

from __future__ import annotations

import argparse
import glob
import json
import statistics
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from server_app.results import DAY, aulc, read_jsonl, runs_root

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
    accuracies: list[float]
    updates: list[dict[str, Any]] = field(default_factory=list)

    @classmethod
    def load(cls, folder: Path) -> Run:
        metrics = read_jsonl(folder / "metrics.jsonl")
        return cls(
            folder=folder,
            config=json.loads((folder / "config.json").read_text()),
            summary=json.loads((folder / "summary.json").read_text()),
            times=[row["virtual_time"] for row in metrics],
            accuracies=[row["accuracy"] for row in metrics],
            updates=read_jsonl(folder / "updates.jsonl")
            if (folder / "updates.jsonl").is_file()
            else [],
        )

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


def table(groups: list[Group], last: int, target: float | None) -> str:
    """One markdown row per group; accuracies in percent, AULC in accuracy x days."""
    target_label = f"time to {target:g}" if target is not None else "time to target"
    head = [
        "runs",
        "seeds",
        "final %",
        "best %",
        f"mean of last {last} %",
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
            mean_std([r.summary["final_accuracy"] for r in runs], 100),
            mean_std([r.summary["best_accuracy"] for r in runs], 100),
            mean_std([statistics.mean(r.accuracies[-last:]) for r in runs], 100),
            mean_std([aulc(r.times, r.accuracies) for r in runs], digits=3),
            reached([time_to(r, target) for r in runs], runs, target),
            mean_std([r.summary["updates_accepted"] for r in runs], digits=0),
            mean_std([r.summary["updates_rejected"] for r in runs], digits=0),
        ]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def band(
    runs: list[Run], unit: float = DAY
) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """(times in `unit`s, mean, min, max) of the runs' accuracy curves on the first run's
    evaluation times (others interpolated onto them; seeds of a config share them)."""
    times = np.asarray(runs[0].times, dtype=np.float64)
    curves = np.stack([np.interp(times, r.times, r.accuracies) for r in runs])
    return times / unit, curves.mean(axis=0), curves.min(axis=0), curves.max(axis=0)


def colour(index: int) -> str:
    return f"C{index % 10}"


def plot_accuracy(ax: Any, groups: list[Group], ylabel: str = "accuracy") -> None:
    """Mean accuracy against virtual days per group, with a min-max band over its seeds."""
    for index, group in enumerate(groups):
        days, mean, low, high = band(group.runs)
        n = len(group.runs)
        ax.plot(days, mean, color=colour(index), linewidth=1.3, label=f"{group.label} (n={n})")
        if n > 1:
            ax.fill_between(days, low, high, color=colour(index), alpha=0.18, linewidth=0)
    ax.set_xlabel("virtual days")
    ax.set_ylabel(ylabel)
    ax.grid(alpha=0.3)


def plot_staleness(ax: Any, groups: list[Group]) -> None:
    """Share of accepted updates per staleness (versions behind), per group."""
    for index, group in enumerate(groups):
        stale = [u["staleness"] for r in group.runs for u in r.updates if "staleness" in u]
        if stale:
            bins = np.arange(0, max(stale) + 2) - 0.5
            ax.hist(
                stale,
                bins=bins,
                density=True,
                histtype="step",
                color=colour(index),
                linewidth=1.3,
                label=group.label,
            )
    ax.set_xlabel("staleness (versions)")
    ax.set_ylabel("share of updates")
    ax.grid(alpha=0.3)


def plot_weights(ax: Any, groups: list[Group]) -> bool:
    """Mean strategy weight per version against virtual days, where recorded; False if none."""
    drawn = False
    for index, group in enumerate(groups):
        rows = [u for u in group.runs[0].updates if "weight" in u]
        if not rows:
            continue
        by_version: dict[int, list[tuple[float, float]]] = {}
        for row in rows:
            by_version.setdefault(row["version"], []).append((row["time"], row["weight"]))
        points = sorted(
            (max(t for t, _ in v), statistics.mean(w for _, w in v)) for v in by_version.values()
        )
        ax.plot(
            [t / DAY for t, _ in points],
            [w for _, w in points],
            color=colour(index),
            linewidth=0.8,
            label=group.label,
        )
        drawn = True
    ax.set_xlabel("virtual days")
    ax.set_ylabel("mean weight per version (first seed)")
    ax.grid(alpha=0.3)
    return drawn


def plot(groups: list[Group], path: Path) -> None:
    """Accuracy, staleness and (where recorded) weights side by side; one legend below,
    the same colour for a group in every panel."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    has_weights = any("weight" in u for g in groups for u in g.runs[0].updates[:50])
    panels = 3 if has_weights else 2
    legend_inches = 0.25 * len(groups) + 0.3
    fig, axes = plt.subplots(1, panels, figsize=(5 * panels, 4 + legend_inches))
    per_client = any(r.summary.get("evaluation") == "per-client" for g in groups for r in g.runs)
    plot_accuracy(axes[0], groups, "mean client accuracy" if per_client else "test accuracy")
    plot_staleness(axes[1], groups)
    if has_weights:
        plot_weights(axes[2], groups)
    handles, labels = axes[0].get_legend_handles_labels()
    fig.legend(handles, labels, loc="lower center", fontsize=8, frameon=False)
    fig.tight_layout(rect=(0, legend_inches / (4 + legend_inches), 1, 1))
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="fedstale compare", description=__doc__.split("\n\n")[0])
    parser.add_argument("runs", nargs="+", help="run folders, globs or run names")
    parser.add_argument("--last", type=int, default=5, help="evaluations in the 'last k' mean")
    parser.add_argument("--target", type=float, default=None, help="accuracy for time-to-target")
    parser.add_argument("--out", type=Path, default=None, help="where compare.png/.md go")
    parser.add_argument("--runs-dir", default="", help="where run names are looked up")
    args = parser.parse_args(argv)
    if args.last < 1:
        parser.error("--last must be at least 1")
    if args.target is not None and not 0.0 <= args.target <= 1.0:
        parser.error(f"--target {args.target:g} is not an accuracy; give one in [0, 1]")
    root = runs_root(args.runs_dir)
    try:
        folders = find_runs(args.runs, root)
        runs = [Run.load(folder) for folder in folders]
    except (CompareError, OSError, json.JSONDecodeError, KeyError) as err:
        print(f"fedstale compare: {err}", file=sys.stderr)
        return 2
    groups = group_runs(runs)
    out = args.out or root / f"compare-{time.strftime('%Y%m%d-%H%M%S')}"
    out.mkdir(parents=True, exist_ok=True)
    markdown = table(groups, args.last, args.target)
    (out / "compare.md").write_text(markdown + "\n")
    plot(groups, out / "compare.png")
    print(markdown)
    print(
        f"fedstale compare: {len(runs)} runs in {len(groups)} groups; {out / 'compare.png'}",
        file=sys.stderr,
    )
    return 0
