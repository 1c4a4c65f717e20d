"""Results of a run in runs/<name>/: config.json (with the run's provenance), run.log,
metrics.jsonl, updates.jsonl, summary.json, model.pt and accuracy.png (the score against
virtual time).

A folder that holds an earlier run is never cleared: a run with a used `run-name` is refused
unless it resumes that very folder (`resume-from`) or `overwrite` is set, and then the
earlier run is moved aside to `<name>.previous-<time>`, whole."""

from __future__ import annotations

import json
import logging
import os
import time
import tomllib
from pathlib import Path
from typing import Any

import numpy as np

from fedstale.common.config import ConfigError, RunConfig, RunSettings
from fedstale.common.files import resume_folder
from fedstale.server_app.stages.ledger import LEDGER_FILE, mark_moved

log = logging.getLogger("fedstale")
DAY = 86_400.0  # FLGo: one virtual day is 86,400 time units


def runs_root(configured: str) -> Path:
    """`runs-dir` from the run config, else $FEDSTALE_RUNS_DIR, else ./runs."""
    return Path(configured or os.environ.get("FEDSTALE_RUNS_DIR", "runs")).expanduser().resolve()


def outside_the_app(cwd: Path) -> str:
    """The runs directory of a run started in `cwd` that names none: "" (./runs, or
    $FEDSTALE_RUNS_DIR), except inside a Flower app folder whose .gitignore does not name
    runs/: `flwr run` packs every .json and .jsonl there into the app bundle and installs it
    on every node, so the results go beside the folder, to `<app>-runs`."""
    if os.environ.get("FEDSTALE_RUNS_DIR"):
        return ""
    app = next((folder for folder in (cwd, *cwd.parents) if is_flower_app(folder)), None)
    if app is None or ignores_runs(app):
        return ""
    return str(app.parent / f"{app.name}-runs")


def is_flower_app(folder: Path) -> bool:
    try:
        config = tomllib.loads((folder / "pyproject.toml").read_text())
    except (OSError, ValueError):
        return False
    return "app" in config.get("tool", {}).get("flwr", {})


def ignores_runs(app: Path) -> bool:
    """The app's .gitignore, which Flower's bundle follows, leaves out runs/."""
    try:
        lines = (app / ".gitignore").read_text().splitlines()
    except OSError:
        return False
    named = {f"{root}runs{tail}" for root in ("", "/") for tail in ("", "/", "/*", "/**")}
    return any(line.strip() in named for line in lines)


CHECKPOINT_FILE = "checkpoint.pkl"
# What a run writes into its folder: any of them there means the folder holds a run.
RUN_FILES = (
    "config.json",
    "run.log",
    "metrics.jsonl",
    "updates.jsonl",
    "summary.json",
    "model.pt",
    "accuracy.png",
    CHECKPOINT_FILE,
)


def holds_a_run(folder: Path) -> bool:
    return any((folder / name).exists() for name in RUN_FILES)


def resumes_in_place(run: RunSettings, folder: Path) -> bool:
    return bool(run.resume_from) and resume_folder(run.resume_from) == folder


def check_run_dir(run: RunSettings, name: str) -> Path:
    """The folder this run's results go to, or one ConfigError line when it holds an
    earlier run that this run would mix with."""
    folder = runs_root(run.runs_dir) / name
    if run.overwrite or not holds_a_run(folder) or resumes_in_place(run, folder):
        return folder
    raise ConfigError(
        f"run-name '{name}': {folder} already holds a run; choose another run-name, "
        f"resume it with resume-from={folder}, or pass --overwrite (overwrite=true) to move "
        f"it aside to {name}.previous-<time>"
    )


def claim_run_dir(run: RunSettings, name: str) -> Path:
    """`check_run_dir`, then with `overwrite` the earlier run moved aside (never deleted)."""
    folder = check_run_dir(run, name)
    if run.overwrite and holds_a_run(folder) and not resumes_in_place(run, folder):
        stamp = time.strftime("%Y%m%d-%H%M%S")
        aside, count = folder.with_name(f"{name}.previous-{stamp}"), 1
        while aside.exists():
            count += 1
            aside = folder.with_name(f"{name}.previous-{stamp}-{count}")
        folder.rename(aside)
        if (aside / LEDGER_FILE).is_file():
            mark_moved(aside / LEDGER_FILE)
        log.warning("overwrite: the earlier run in %s was moved to %s", folder, aside)
    return folder


def writable_runs_dir(run: RunSettings) -> Path:
    """The runs directory, or one ConfigError line where a run could not write it. Nothing is
    created here (`fedstale check` writes nothing): the run makes its folder when it starts."""
    root = runs_root(run.runs_dir)
    existing = next(folder for folder in (root, *root.parents) if folder.exists())
    if not existing.is_dir():
        raise ConfigError(f"runs-dir: cannot create {root} ({existing} is a file); set runs-dir")
    if not os.access(existing, os.W_OK | os.X_OK):
        where = root if existing == root else f"{root} ({existing} is not writable)"
        raise ConfigError(
            f"runs-dir: cannot create or write {where}; set runs-dir to a folder you own"
        )
    return root


def run_name(run: RunConfig) -> str:
    """`run-name`, or `<strategy>-<dataset>-s<seed>-<timestamp>` when it is empty (a
    dataset reference `pkg.module:loader` as `pkg.module.loader`)."""
    if run.run_name:
        return run.run_name
    dataset = run.dataset.replace(":", ".")
    return f"{run.strategy}-{dataset}-s{run.seed}-{time.strftime('%Y%m%d-%H%M%S')}"


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
    """Appends JSON lines as the run goes, and the run's log lines to run.log; writes the
    summary, model and plot at the end."""

    def __init__(self, directory: Path, kept: dict[str, list[str]] | None = None) -> None:
        """`kept`: the rows a resumed run starts from (`checkpointed_rows`)."""
        self.dir = directory
        self.dir.mkdir(parents=True, exist_ok=True)
        kept = kept or {}
        for name in ("metrics.jsonl", "updates.jsonl"):
            (self.dir / name).write_text("".join(kept.get(name, [])), encoding="utf-8")
        self.metric_rows = len(kept.get("metrics.jsonl", []))
        self.update_rows = len(kept.get("updates.jsonl", []))
        self._metrics = (self.dir / "metrics.jsonl").open("a", encoding="utf-8")
        self._updates = (self.dir / "updates.jsonl").open("a", encoding="utf-8")
        self._log = logging.FileHandler(self.dir / "run.log", encoding="utf-8")
        self._log.setFormatter(logging.Formatter("%(asctime)s %(levelname)s: %(message)s"))
        log.addHandler(self._log)

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
        log.removeHandler(self._log)
        self._log.close()

    def discard(self) -> None:
        """Remove what this recorder wrote into a folder it found empty of runs."""
        self.close()
        for name in RUN_FILES:
            (self.dir / name).unlink(missing_ok=True)
        if not any(self.dir.iterdir()):
            self.dir.rmdir()

    def write_summary(self, summary: dict[str, Any]) -> None:
        (self.dir / "summary.json").write_text(json.dumps(summary, indent=2) + "\n")

    def save_model(self, state: dict[str, np.ndarray]) -> None:
        import torch

        torch.save(
            {k: torch.from_numpy(np.array(v)) for k, v in state.items()}, self.dir / "model.pt"
        )

    def plot(
        self,
        title: str,
        times: list[float],
        accuracies: list[float],
        ylabel: str = "test accuracy",
        name: str = "accuracy",
    ) -> None:
        """<name>.png: the run's score (accuracy.png, neg_mse.png, ...) over virtual time."""
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
        fig.savefig(self.dir / f"{name}.png", dpi=110)
        plt.close(fig)


def checkpointed_rows(folder: Path, metric_rows: int, update_rows: int) -> dict[str, list[str]]:
    """The rows of `folder` that a checkpoint counted (later ones were never checkpointed),
    or one ConfigError line when the folder holds fewer."""
    counts = {"metrics.jsonl": metric_rows, "updates.jsonl": update_rows}
    return {name: _first_lines(folder / name, count) for name, count in counts.items()}


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
