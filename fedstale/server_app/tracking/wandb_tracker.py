"""Weights & Biases: offline (its files in the run folder's wandb/, `wandb sync` uploads
them) unless WANDB_MODE or a logged-in account says otherwise."""

from __future__ import annotations

import os
import shutil
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Literal

from fedstale.server_app.tracking.base import Opening, Tracker


class WandbTracker(Tracker):
    name = "wandb"
    package = "wandb"

    def open(self, opening: Opening) -> str:
        import wandb

        # WANDB_MODE, where set, is wandb's to read; else offline unless an API key is given
        online = bool(os.environ.get("WANDB_API_KEY"))
        mode: Literal["online", "offline"] | None = "online" if online else "offline"
        if os.environ.get("WANDB_MODE"):
            mode = None
        self.run = wandb.init(
            project=opening.experiment,
            name=opening.name,
            dir=str(opening.folder),
            config=dict(opening.config),
            tags=[f"{k}={v}" for k, v in opening.tags.items()][:64],
            id=opening.resume_id,
            resume="allow" if opening.resume_id else None,
            mode=mode,
            reinit="create_new",
            settings=wandb.Settings(silent=True, console="off"),
        )
        return str(self.run.id)

    def log(self, step: int, values: Mapping[str, float]) -> None:
        self.run.log(dict(values), step=step)

    def upload(self, folder: Path, files: Sequence[Path]) -> None:
        kept = Path(self.run.dir) / "fedstale"
        kept.mkdir(exist_ok=True)
        for path in files:
            shutil.copy2(path, kept / path.name)

    def close(self, failed: bool) -> None:
        self.run.finish(exit_code=1 if failed else 0)
