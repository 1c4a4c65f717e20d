"""`fedstale track FOLDER... --to mlflow[,tensorboard,wandb]`: earlier run folders into
experiment trackers, as a run would have logged them (its config as parameters, its
provenance as tags, every evaluation, per version its updates' staleness and weights, its
files as artifacts): runs made before tracking, runs whose tracker was down, the recorded
reproduction runs. The folders are read, never changed (but for TensorBoard's event files
and W&B's offline files, written beside them as a run writes them)."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from pydantic import ValidationError

from fedstale.common.config import ConfigError, TrackingSettings
from fedstale.server_app.results import read_jsonl
from fedstale.server_app.tracking import open_tracking, trackers_named


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="fedstale track", description=__doc__.split("\n\n")[0])
    parser.add_argument("folders", nargs="+", type=Path, help="run folders (runs/<name>)")
    parser.add_argument("--to", required=True, help="trackers: mlflow, tensorboard, wandb")
    parser.add_argument("--tracking-uri", default="", help="MLflow's tracking URI")
    parser.add_argument("--experiment", default="", help="MLflow experiment / W&B project")
    args = parser.parse_args(argv)
    given = {"tracking": args.to, "tracking-uri": args.tracking_uri}
    try:
        settings = TrackingSettings.model_validate(
            {**given, "tracking-experiment": args.experiment}
        )
    except ValidationError as err:
        message = err.errors()[0]["msg"].removeprefix("Value error, ")
        raise ConfigError(f"--to {args.to}: {message}") from None
    trackers_named(settings.tracking)  # a missing install is one line before anything is sent
    for folder in args.folders:
        if not (folder / "config.json").is_file():
            raise ConfigError(f"{folder}: no config.json, not a run folder (runs/<name>)")
    failed = 0
    for folder in args.folders:
        result = track(folder, settings)
        missed = result["missed"]
        runs = ", ".join(f"{name} {run}" for name, run in result["runs"].items())
        print(f"fedstale: {folder}: {runs or 'nothing sent'}", file=sys.stderr)
        for name, why in missed.items():
            print(f"fedstale: {folder}: {name} missed it ({why['error']})", file=sys.stderr)
        failed += bool(missed)
    return 1 if failed else 0


def track(folder: Path, settings: TrackingSettings) -> dict:
    config = json.loads((folder / "config.json").read_text())
    name = str(config.get("run-name") or folder.name)
    tracking = open_tracking(settings, folder, name, config, saving=False)
    assert tracking is not None, "--to names a tracker"
    rows = {name: rows_of(folder / name) for name in ("metrics.jsonl", "updates.jsonl")}
    tracking.replay(rows["metrics.jsonl"], rows["updates.jsonl"])
    files = sorted(path for path in folder.iterdir() if path.is_file())
    return tracking.finish(folder, files, failed=False)


def rows_of(path: Path) -> list[dict]:
    return read_jsonl(path) if path.is_file() else []
