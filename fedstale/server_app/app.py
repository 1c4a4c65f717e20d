"""fedstale ServerApp: validate the run config, then run the asynchronous engine."""

from __future__ import annotations

import logging

from flwr.app import Context
from flwr.serverapp import Grid, ServerApp

from fedstale.common.config import ConfigError
from fedstale.server_app.cohorts import grid_transport
from fedstale.server_app.engine import EngineError
from fedstale.server_app.experiment import run_experiment
from fedstale.server_app.progress import setup_logging
from fedstale.strategies.registry import load_config

log = logging.getLogger("fedstale")
app = ServerApp()
__all__ = ["app", "setup_logging"]


@app.main()
def main(grid: Grid, context: Context) -> None:
    setup_logging()
    try:
        run, params = load_config(context.run_config)
        run_experiment(run, params, grid_transport(grid, run))
    except (ConfigError, EngineError) as err:
        log.error("%s", err)
        raise SystemExit(2) from None
