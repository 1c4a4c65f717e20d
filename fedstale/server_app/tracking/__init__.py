"""Experiment trackers as listeners of a run (`tracking=mlflow,tensorboard,wandb`): every
evaluation and, per global model version, the server's view, live; the config as
parameters, the provenance as tags, the run folder's files as artifacts at the end; a
resumed run continues its tracked runs. A tracker that fails costs the run nothing: one line,
and summary.json says what did not reach it (`fedstale track` sends a run folder later)."""

from __future__ import annotations

import importlib.util
import json
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from fedstale.common.config import ConfigError, TrackingSettings, tracker_names
from fedstale.server_app.tracking.base import IDS_FILE, Opening, Tracker, Tracking
from fedstale.server_app.tracking.mlflow_tracker import MlflowTracker
from fedstale.server_app.tracking.tensorboard_tracker import TensorBoardTracker
from fedstale.server_app.tracking.wandb_tracker import WandbTracker

__all__ = [
    "IDS_FILE",
    "Opening",
    "Tracker",
    "Tracking",
    "open_tracking",
    "parameters",
    "tags",
    "trackers_named",
]

TRACKER_CLASSES: dict[str, type[Tracker]] = {
    "mlflow": MlflowTracker,
    "tensorboard": TensorBoardTracker,
    "wandb": WandbTracker,
}
TAGGED = ("strategy", "dataset", "seed", "model")  # config keys that also become tags


def trackers_named(value: str) -> list[Tracker]:
    """The trackers `tracking` names, or one ConfigError line naming the install a missing
    one needs (the tracker alone: pip leaves the user's torch as it is)."""
    found = []
    for name in tracker_names(value):
        kind = TRACKER_CLASSES[name]
        if importlib.util.find_spec(kind.package) is None:
            raise ConfigError(
                f"tracking={name}: {kind.package} is not installed; pip install {kind.package} "
                "(it leaves your torch as it is)"
            )
        found.append(kind())
    return found


def open_tracking(
    settings: TrackingSettings,
    folder: Path,
    name: str,
    config: Mapping[str, Any],
    resumed_from: Path | None = None,
    saving: bool = True,
) -> Tracking | None:
    """The run's trackers, opened (a resumed run continues the tracked runs of the folder
    it resumes from; `saving`: keep tracking.json in `folder`); None when `tracking` names
    none."""
    trackers = trackers_named(settings.tracking)
    if not trackers:
        return None
    opening = Opening(
        folder=folder,
        name=name,
        experiment=settings.tracking_experiment or "fedstale",
        uri=settings.tracking_uri,
        config=parameters(config),
        tags=tags(config),
    )
    tracking = Tracking(trackers, saving=saving)
    tracking.open(opening, previous(resumed_from))
    return tracking


def parameters(config: Mapping[str, Any]) -> dict[str, Any]:
    """The run's config.json, flat: its keys, and `provenance.*`."""
    flat = {k: v for k, v in config.items() if not isinstance(v, dict)}
    for key, value in config.items():
        if isinstance(value, dict):
            flat.update({f"{key}.{k}": v for k, v in value.items()})
    return flat


def tags(config: Mapping[str, Any]) -> dict[str, str]:
    """The tags a tracker's compare view groups by (strategy, dataset, seed, model), and
    where the run came from."""
    found = {k: str(config[k]) for k in TAGGED if k in config}
    provenance = config.get("provenance", {})
    found.update({f"provenance.{k}": str(v) for k, v in provenance.items()})
    return {"fedstale": "1", **found}


def previous(folder: Path | None) -> dict[str, Any]:
    """The tracked runs (and last step) of the folder a resumed run continues."""
    if folder is None:
        return {}
    try:
        return dict(json.loads((folder / IDS_FILE).read_text()))
    except (OSError, ValueError):
        return {}
