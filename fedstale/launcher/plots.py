"""The comparison's figures: accuracy bands over seeds, staleness histograms and the mean
weight per version, each drawn on a matplotlib axis the caller owns."""

from __future__ import annotations

import statistics
from pathlib import Path
from typing import Any

import numpy as np

from fedstale.common.config import score_label
from fedstale.launcher.analysis import Group, Run
from fedstale.server_app.results import DAY


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
    metric = groups[0].runs[0].metric
    plot_accuracy(axes[0], groups, score_label(metric, per_client))
    plot_staleness(axes[1], groups)
    if has_weights:
        plot_weights(axes[2], groups)
    handles, labels = axes[0].get_legend_handles_labels()
    fig.legend(handles, labels, loc="lower center", fontsize=8, frameon=False)
    fig.tight_layout(rect=(0, legend_inches / (4 + legend_inches), 1, 1))
    fig.savefig(path, dpi=110)
    plt.close(fig)
