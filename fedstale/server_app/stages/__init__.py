"""The stages of the update path around the rule (pipeline.py: the protocol and the order),
side by side: secure aggregation (secure.py) and central differential privacy
(central_dp.py, with its ledger of releases, ledger.py; its accountants, accounting.py; its
noise, noise.py). `stages_for` assembles the run's list; a stage that is off is not in it."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from fedstale.common.config import KebabModel, RunConfig
from fedstale.common.layout import ParamLayout
from fedstale.server_app.stages.central_dp import CentralDP
from fedstale.server_app.stages.pipeline import Stage
from fedstale.server_app.stages.secure import SecureAggregation


def stages_for(
    run: RunConfig,
    params: KebabModel,
    layout: ParamLayout,
    accountant: Any = None,
    folder: Path | None = None,
    name: str = "",
) -> list[Stage]:
    """The run's stages in the order an update meets them: unmasked, then clipped and
    noised (central DP releases the sum secure aggregation recovered)."""
    stages: list[Stage] = []
    if run.secure_aggregation:
        stages.append(SecureAggregation(run, layout))
    privacy = CentralDP.for_run(run, params, accountant, folder, name)
    if privacy is not None:
        stages.append(privacy)
    return stages
