"""Results of a run in runs/<name>/: config.json, metrics.jsonl, updates.jsonl,
summary.json, model.pt and accuracy.png (accuracy against virtual time)."""

from __future__ import annotations

import json
import logging
import os
import time
from pathlib import Path
from typing import Any

import numpy as np

from common.config import ConfigError, RunConfig

log = logging.getLogger("fedstale")
DAY = 86_400.0  # FLGo: one virtual day is 86,400 time units


def runs_root(configured: str) -> Path:
    """`runs-dir` from the run config, else $FEDSTALE_RUNS_DIR, else ./runs."""
    return Path(configured or os.environ.get("FEDSTALE_RUNS_DIR", "runs")).expanduser().resolve()


def run_name(run: RunConfig) -> str:
    """`run-name`, or `<strategy>-<dataset>-s<seed>-<timestamp>` when it is empty."""
    if run.run_name:
        return run.run_name
    return f"{run.strategy}-{run.dataset}-s{run.seed}-{time.strftime('%Y%m%d-%H%M%S')}"


def aulc(times: list[float], accuracies: list[float], unit: float = DAY) -> float:
    """Area under the accuracy curve (trapezoids), time in `unit`s (days, as the paper)."""
    if len(times) < 2:
        return 0.0
    t = np.asarray(times, dtype=np.float64) / unit
    a = np.asarray(accuracies, dtype=np.float64)
    return float(np.sum((t[1:] - t[:-1]) * (a[1:] + a[:-1]) / 2.0))


def read_jsonl(path: Path) -> list[dict[str, Any]]:
    """The rows of a metrics.jsonl or updates.jsonl."""
    return [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines()]


class RunRecorder:
    """Appends JSON lines as the run goes; writes the summary, model and plot at the end."""

    def __init__(self, directory: Path, resume: tuple[Path, int, int] | None = None) -> None:
        """`resume`: (run folder, metric rows, update rows) of a checkpoint; those first rows
        are kept (copied when the folder differs), later ones were never checkpointed."""
        self.dir = directory
        self.dir.mkdir(parents=True, exist_ok=True)
        kept = {"metrics.jsonl": [], "updates.jsonl": []}
        if resume is not None:
            source, metric_rows, update_rows = resume
            for name, rows in (("metrics.jsonl", metric_rows), ("updates.jsonl", update_rows)):
                kept[name] = _first_lines(source / name, rows)
        for name in ("metrics.jsonl", "updates.jsonl", "summary.json"):
            (self.dir / name).unlink(missing_ok=True)
        for name, lines in kept.items():
            (self.dir / name).write_text("".join(lines), encoding="utf-8")
        self.metric_rows = len(kept["metrics.jsonl"])
        self.update_rows = len(kept["updates.jsonl"])
        self._metrics = (self.dir / "metrics.jsonl").open("a", encoding="utf-8")
        self._updates = (self.dir / "updates.jsonl").open("a", encoding="utf-8")

    def write_config(self, config: dict[str, Any]) -> None:
        (self.dir / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")

    def metric(self, row: dict[str, Any]) -> None:
        self._metrics.write(json.dumps(row) + "\n")
        self._metrics.flush()
        self.metric_rows += 1

    def update(self, row: dict[str, Any]) -> None:
        self._updates.write(json.dumps(row) + "\n")
        self._updates.flush()  # followers (tail -f, tests) see every row as it is made
        self.update_rows += 1

    def close(self) -> None:
        self._metrics.close()
        self._updates.close()

    def write_summary(self, summary: dict[str, Any]) -> None:
        (self.dir / "summary.json").write_text(json.dumps(summary, indent=2) + "\n")

    def save_model(self, state: dict[str, np.ndarray]) -> None:
        import torch

        torch.save(
            {k: torch.from_numpy(np.array(v)) for k, v in state.items()}, self.dir / "model.pt"
        )

    def plot(
        self, title: str, times: list[float], accuracies: list[float], ylabel: str = "test accuracy"
    ) -> None:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        fig, ax = plt.subplots(figsize=(6, 4))
        ax.plot(times, accuracies, marker=".", linewidth=1.2)
        ax.set_xlabel("virtual time (units)")
        ax.set_ylabel(ylabel)
        ax.set_title(title)
        ax.grid(alpha=0.3)
        fig.tight_layout()
        fig.savefig(self.dir / "accuracy.png", dpi=110)
        plt.close(fig)


def _first_lines(path: Path, count: int) -> list[str]:
    if count == 0:
        return []
    lines = path.read_text(encoding="utf-8").splitlines(keepends=True) if path.is_file() else []
    if len(lines) < count:
        raise ConfigError(
            f"resume-from: {path} has {len(lines)} rows, the checkpoint counted {count}; "
            "resume from the run folder the checkpoint was written in, unchanged"
        )
    return lines[:count]
