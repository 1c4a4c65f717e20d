"""TensorBoard: event files in the run folder's tensorboard/ (`tensorboard --logdir runs`
shows every run), written with torch's SummaryWriter (which needs the tensorboard package)."""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence

from fedstale.server_app.tracking.base import Opening, Tracker

FOLDER = "tensorboard"


class TensorBoardTracker(Tracker):
    name = "tensorboard"
    package = "tensorboard"

    def open(self, opening: Opening) -> str:
        from torch.utils.tensorboard import SummaryWriter

        where = opening.folder / FOLDER
        self.writer = SummaryWriter(log_dir=str(where))
        if not opening.resume_id:  # a resumed run writes on into the same folder
            config = json.dumps(dict(opening.config), indent=1, sort_keys=True, default=str)
            self.writer.add_text("config", f"```\n{config}\n```", 0)
            self.writer.add_text("tags", json.dumps(dict(opening.tags)), 0)
        self.writer.flush()
        return str(where)

    def log(self, step: int, values: Mapping[str, float]) -> None:
        self.log_many([(step, values)])

    def log_many(self, entries: Sequence[tuple[int, Mapping[str, float]]]) -> None:
        for step, values in entries:
            for key, value in values.items():
                self.writer.add_scalar(key, value, step)
        self.writer.flush()  # live: TensorBoard reads what is on the disk

    def close(self, failed: bool) -> None:
        self.writer.close()
