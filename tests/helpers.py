"""Shared test helpers: configs, updates, and a scripted stand-in for Flower's Grid."""

from __future__ import annotations

import sys
import time
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import numpy as np

from fedstale.common.config import KebabModel, RunConfig
from fedstale.common.latency import profile_for
from fedstale.common.layout import ParamLayout
from fedstale.common.schema import MSG_QUERY, MSG_TRAIN, ReplyKeys, TaskKeys
from fedstale.server_app.contract import Contract, FedstaleContract
from fedstale.server_app.engine import Engine, Listeners
from fedstale.server_app.evaluation import Scoreboard
from fedstale.server_app.federation import Federation
from fedstale.server_app.nodes import NodeBook, Nodes
from fedstale.server_app.scored import ClientScorer, Evaluator
from fedstale.server_app.stages.pipeline import Stage
from fedstale.server_app.transport import Reply, Transport
from fedstale.strategies.base import Strategy, Update, View
from fedstale.strategies.registry import STRATEGIES

V0 = View()  # the view of a strategy at version 0, for unit tests of on_update


TEST_DEFAULTS = {"num-clients": 4, "concurrency": 2, "buffer-size": 2}


def run_config(**overrides: Any) -> RunConfig:
    values = {**TEST_DEFAULTS, **overrides}
    return RunConfig.model_validate({k.replace("_", "-"): v for k, v in values.items()})


def rule_params(strategy: str, **overrides: Any) -> KebabModel:
    """The rule's Params as `run_config`'s values would give them (buffer-size 2)."""
    values = {**TEST_DEFAULTS, **overrides}
    kebab = {k.replace("_", "-"): v for k, v in values.items()}
    return STRATEGIES[strategy].Params.model_validate(kebab)


def update(vector: list[float], staleness: int = 0, client: int = 0, n: int = 1) -> Update:
    return Update(
        client=client,
        task_id=0,
        base_version=0,
        staleness=staleness,
        num_examples=n,
        vector=np.asarray(vector, dtype=np.float32),
    )


TrainFn = Callable[[int, Mapping[str, Any], dict[str, np.ndarray]], tuple[dict, dict | None]]
# A TrainFn may return a third item: the reply's other named array sets.


class ScriptedTransport:
    """Answers queries with the node's partition and train tasks with `train_fn`; each reply
    becomes visible only after a random number of `receive` calls, so replies arrive in
    an order unrelated to virtual finish times."""

    simulated = True

    def __init__(
        self,
        num_nodes: int,
        train_fn: TrainFn,
        seed: int = 0,
        max_delay_calls: int = 6,
        errors: Iterable[int] = (),
    ) -> None:
        self.nodes = {1000 + 7 * i: i for i in range(num_nodes)}
        self.train_fn = train_fn
        self.rng = np.random.default_rng(seed)
        self.max_delay = max_delay_calls
        self.errors = set(errors)
        self.pending: dict[str, tuple[int, Reply]] = {}
        self.sent: list[tuple[int, str, dict[str, Any]]] = []
        self.counter = 0
        self.receives = 0

    def node_ids(self) -> list[int]:
        return sorted(self.nodes)

    def send(self, node_id, message_type, config, arrays=None, sets=None) -> str:  # type: ignore[no-untyped-def]
        self.counter += 1
        msg_id = f"m{self.counter}"
        self.sent.append((node_id, message_type, dict(config)))
        partition = self.nodes[node_id]
        if message_type == MSG_QUERY:
            reply = Reply(msg_id, metrics={ReplyKeys.PARTITION_ID: partition})
        elif message_type == MSG_TRAIN and config[TaskKeys.TASK_ID] in self.errors:
            reply = Reply(msg_id, error_code=5, error="node unavailable")
        else:
            metrics, out, *named = self.train_fn(partition, config, dict(arrays or {}))
            reply = Reply(msg_id, metrics=metrics, arrays=out, sets=named[0] if named else {})
        self.pending[msg_id] = (int(self.rng.integers(0, self.max_delay + 1)), reply)
        return msg_id

    def wait(self, seconds: float) -> None:
        time.sleep(seconds)

    def receive(self, msg_ids: Iterable[str]) -> list[Reply]:
        self.receives += 1
        ready = []
        for msg_id in list(msg_ids):
            if msg_id not in self.pending:
                continue
            wait, reply = self.pending[msg_id]
            if wait <= 0:
                ready.append(reply)
                del self.pending[msg_id]
            else:
                self.pending[msg_id] = (wait - 1, reply)
        return ready


class PolledTime:
    """Stands in for the `time` module of the engine and its evaluation reports: its
    `monotonic()` moves `step` seconds per `receive` of the scripted transport, so a
    task-timeout counts polls, and a busy machine (a process paused for 0.2 s) cannot make
    a reply that was ready count as late."""

    sleep = staticmethod(time.sleep)
    time = staticmethod(time.time)

    def __init__(self, transport: ScriptedTransport, step: float = 0.01) -> None:
        self.transport, self.step = transport, step

    def monotonic(self) -> float:
        return 1000.0 + self.transport.receives * self.step


def use_polled_time(monkeypatch: Any, transport: ScriptedTransport) -> None:
    """Make the engine's deadlines count `transport`'s polls (see PolledTime); call it
    before the engine is built."""
    from fedstale.server_app import engine, reports

    fake = PolledTime(transport)
    monkeypatch.setattr(engine, "time", fake)
    monkeypatch.setattr(reports, "time", fake)


def delta_reply(
    partition: int, config: Mapping[str, Any], arrays: dict[str, np.ndarray], step: float = 1.0
) -> tuple[dict, dict]:
    """A well-formed reply: a delta of +step (model plus step for return=model)."""
    metrics = {
        ReplyKeys.TASK_ID: int(config[TaskKeys.TASK_ID]),
        ReplyKeys.PARTITION_ID: partition,
        ReplyKeys.NUM_EXAMPLES: 10 + partition,
        ReplyKeys.TRAIN_LOSS: 0.5,
        ReplyKeys.COMPUTE_SECONDS: 0.01,
    }
    if config[TaskKeys.RETURN] == "delta":
        out = {k: np.full_like(v, step) for k, v in arrays.items()}
    else:
        out = {k: v + step for k, v in arrays.items()}
    return metrics, out


class ListRecorder:
    def __init__(self) -> None:
        self.metrics: list[dict[str, Any]] = []
        self.updates: list[dict[str, Any]] = []

    def metric(self, row: dict[str, Any]) -> None:
        self.metrics.append(row)

    def update(self, row: dict[str, Any]) -> None:
        self.updates.append(row)


# The one line a run config naming strategy 'nope' gets (every registered rule listed).
UNKNOWN_STRATEGY = (
    "run config: unknown strategy 'nope'; choose one of "
    f"{', '.join(sorted(STRATEGIES))}; fix it in [tool.flwr.app.config] of pyproject.toml "
    "or with --run-config"
)


def bind_server(run: RunConfig, strategy: Strategy) -> None:
    """Bind `strategy` as a run does: the server's own model, layout and data."""
    from fedstale.common.federation import FederationKey
    from fedstale.common.layout import ParamLayout
    from fedstale.common.run_model import run_model
    from fedstale.server_app.experiment import services_for, setup_for
    from fedstale.strategies.base import ServerModel

    model = run_model(run)
    strategy.bind(setup_for(FederationKey.of(run), ParamLayout.of(model)))
    if isinstance(strategy, ServerModel):
        strategy.bind_services(services_for(FederationKey.of(run), model))


@contextmanager
def rule_package(folder: Path, entry: str, name: str = "rule-package") -> Iterator[Path]:
    """An installed package declaring rules, as pip leaves one: a dist-info folder whose
    entry point `fedstale.rules` names `entry` ("module:RULES"), on sys.path; the registry
    (and the library's classes) read afresh inside the block and after it."""
    from fedstale.server_app.library_classes import library_classes
    from fedstale.strategies.registry import declarations

    info = folder / f"{name.replace('-', '_')}-0.1.dist-info"
    info.mkdir(parents=True, exist_ok=True)
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {name}\nVersion: 0.1\n")
    (info / "entry_points.txt").write_text(f"[fedstale.rules]\n{name} = {entry}\n")
    sys.path.insert(0, str(folder))
    declarations.cache_clear()
    library_classes.cache_clear()
    try:
        yield info
    finally:
        sys.path.remove(str(folder))
        declarations.cache_clear()
        library_classes.cache_clear()


def scripted_engine(
    run: RunConfig,
    strategy: Strategy,
    transport: Transport,
    layout: ParamLayout,
    evaluator: Evaluator = lambda flat: (0.0, 0.0),
    *,
    contract: Contract | None = None,
    nodes: Nodes | None = None,
    client_scorer: ClientScorer | None = None,
    stages: Sequence[Stage] = (),
    engine_cls: type[Engine] = Engine,
) -> Engine:
    """An engine as the lifecycle assembles one (fedstale's contract, a node per partition,
    the run's latency profile), over the transport a test scripts; it records into a
    ListRecorder."""
    federation = Federation(
        transport,
        nodes or NodeBook(run.num_clients),
        layout,
        profile_for(run),
        contract or FedstaleContract(),
    )
    scores = Scoreboard(run, strategy, transport, layout, evaluator, client_scorer)
    return engine_cls(run, strategy, federation, scores, Listeners(ListRecorder()), stages)
