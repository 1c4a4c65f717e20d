"""Local running: the clients' work called in this process (or in worker processes), behind
the engine's Transport interface (inprocess.py, pool.py beside this file), so that
server_app never imports client_app."""

from __future__ import annotations

from functools import partial

from fedstale.client_app.secagg import TrainFn, secure_train
from fedstale.client_app.task import evaluate_task, train_cohorts, train_task, warm_up
from fedstale.common.config import ClientSettings
from fedstale.launcher.inprocess import CohortPool, CohortTransport, InProcessTransport
from fedstale.launcher.pool import PooledTransport


def trainer_for(run: ClientSettings) -> TrainFn:
    """fedstale's train function, behind secure aggregation's client half when it is on."""
    return partial(secure_train, train_task) if run.secure_aggregation else train_task


def local_transport(run: ClientSettings) -> InProcessTransport:
    return InProcessTransport(run, trainer_for(run), evaluate_task)


def pooled_transport(run: ClientSettings, workers: int) -> PooledTransport:
    """Clients trained in `workers` processes, each warmed up as it starts; close it (or use
    `with`) when the run ends."""
    return PooledTransport(run, trainer_for(run), evaluate_task, workers, warm_up)


def cohort_pool() -> CohortPool:
    """Where the runs of a grid in this process train their waiting tasks together."""
    return CohortPool(train_cohorts)


def cohort_transport(run: ClientSettings, pool: CohortPool | None = None) -> CohortTransport:
    """`trainer=cohort`: the tasks waiting to be trained, trained together in this process
    on `client-threads` threads (on CPU one thread ran LeNet's cohorts fastest), with those
    of the other runs in `pool` (a grid's; none: this run alone)."""
    return CohortTransport(run, pool or cohort_pool(), evaluate_task)
