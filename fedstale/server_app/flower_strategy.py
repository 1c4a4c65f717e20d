"""fedstale's rules as Flower strategies, for a Flower user's own ServerApp and ClientApp.

    strategy = fedstale.FedBuff(buffer_size=5, concurrency=10)      # was: FedAvg(...)
    result = strategy.start(grid=grid, initial_arrays=arrays, num_rounds=50,
                            train_config=ConfigRecord({"lr": 0.01}), evaluate_fn=...)

`start` runs fedstale's engine (tasks in flight, versions, staleness, supersede,
checkpoints, a results folder) against any ClientApp that answers Flower's standard train
message (contract.py, FlowerContract) and returns Flower's `Result`. A round is one new
global model version: `num_rounds` versions, as Flower's FedAvg makes one per round.
Nodes become clients 0..n-1 in the order they appear (nodes.py, NodesInOrder).
"""

from __future__ import annotations

import functools
import inspect
import logging
import math
import time
from collections import defaultdict
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, ClassVar

import numpy as np
import torch
from flwr.app import ArrayRecord, ConfigRecord, Message, MetricRecord
from flwr.serverapp import Grid
from flwr.serverapp.strategy import FedAvg as FlowerFedAvg
from flwr.serverapp.strategy import Result

from fedstale.common.config import (
    FIX_HINT,
    ConfigError,
    KebabModel,
    RunConfig,
)
from fedstale.common.latency import profile_for
from fedstale.common.layout import ParamLayout
from fedstale.common.models import output_width
from fedstale.common.records import from_array_record, to_array_record
from fedstale.server_app import lifecycle
from fedstale.server_app.contract import FlowerContract
from fedstale.server_app.engine import Engine, EngineError
from fedstale.server_app.experiment import settings_of
from fedstale.server_app.lifecycle import Door, Model
from fedstale.server_app.nodes import Nodes, NodesInOrder
from fedstale.server_app.progress import setup_logging
from fedstale.server_app.results import RunRecorder, claim_run_dir
from fedstale.server_app.scored import Evaluator
from fedstale.server_app.stages.central_dp import CentralDP
from fedstale.server_app.transport import GridTransport, Transport
from fedstale.strategies.base import ModelServices, Setup, TorchModel
from fedstale.strategies.registry import STRATEGIES, load_config, rule_named

log = logging.getLogger("fedstale")
FLOWER_LOGGER = "flwr"  # Flower's own logger (flwr.supercore.logger)
EvaluateFn = Callable[[int, ArrayRecord], MetricRecord | None]
ShouldStop = Callable[[int, Result], bool]
WALL_EVAL_SECONDS = 10.0  # evaluate_fn's period on the wall clock unless eval_interval is set
# Where the library's defaults differ from the run config's: a Flower user's server runs on
# the wall clock, with no virtual-time budget and no lr decay unless asked.
LIBRARY_DEFAULTS: dict[str, Any] = {"clock": "wall", "lr-decay": 1.0, "max-virtual-time": 0.0}
CAPABILITY_ARGUMENTS = {"model_fn", "input_shape", "edges"}  # ServerModel's, Topology's
# Defaults that come from `start` (None in the classes' signatures): lr from train_config
# (else 0.01), max-versions from num_rounds, both timeouts from timeout, eval-interval
# WALL_EVAL_SECONDS on the wall clock (else the run config's).
FROM_START = ("lr", "max-versions", "task-timeout", "task-ttl", "eval-interval")


class AsyncStrategy:
    """A fedstale rule driving any Flower ClientApp. Keyword arguments are fedstale's run
    config keys in snake_case (`buffer_size=5`, `fedbuff_server_lr=0.5`, `clock="virtual"`);
    see docs/library.md; each rule's class (library.py) declares them typed.

    Not a subclass of Flower's `Strategy`: Flower's contract is rounds (`configure_train`
    sends a round's messages, `aggregate_train` folds that round's replies), and an
    asynchronous rule has none: it folds each reply as it arrives, into whichever version
    is current then. What it keeps of Flower's Strategy is what a ServerApp calls: `start`
    with Flower's arguments (and 1.43's `should_stop`), returning Flower's `Result`,
    `summary`, and Flower's federated evaluation (`configure_evaluate`,
    `aggregate_evaluate`). Also: `num_clients` (default: every node online once
    `min_available_nodes` are), `fraction_evaluate` (Flower evaluate messages to the nodes
    with the final model). A rule's capabilities add their own arguments to its class
    (library_classes): `model_fn` and `input_shape` where it computes on the model at the
    server (ServerModel: FedPSA), `edges` (client -> edge) where it has a Topology."""

    rule: ClassVar[str]
    # Set by the DP wrappers (flower_privacy.py): Flower's num_sampled_clients, checked
    # against the rule's updates per release, and the accountant the releases compose into.
    per_release: int | None = None
    accountant: Any = None

    def __init__(
        self,
        *,
        num_clients: int | None = None,
        min_available_nodes: int = 2,
        fraction_evaluate: float = 1.0,
        **settings: Any,
    ) -> None:
        self.num_clients = num_clients
        self.min_available_nodes = max(1, min_available_nodes)
        self.fraction_evaluate = fraction_evaluate
        self.settings = {key.replace("_", "-"): value for key, value in settings.items()}
        self.check_client_halves()
        self.check_settings()

    # ---------------------------------------------------------------- configuration
    def check_settings(self) -> None:
        """Refuse here, not at start, settings that cannot run (a latency profile it cannot
        simulate, DP on a rule that cannot take it)."""
        placeholder = max(self.min_available_nodes, int(self.settings.get("concurrency", 10)))
        run, _ = self.run_config(self.num_clients or placeholder, 1, 3600.0, {})
        profile_for(run)

    def check_client_halves(self) -> None:
        for client_rule in STRATEGIES[self.rule].client_rules:
            if not client_rule.mod:
                raise ConfigError(
                    f"{self.rule}: its client half ({client_rule.name}) runs only in "
                    "fedstale's own ClientApp; run it with `fedstale run`"
                )

    def run_config(
        self, num_clients: int, num_rounds: int, timeout: float, train_config: Mapping[str, Any]
    ) -> tuple[RunConfig, KebabModel]:
        """The run config of one `start` over `num_clients` nodes, or one ConfigError line.
        `concurrency` (default 10) is capped at the number of clients."""
        every_client = rule_named(self.rule).topology  # every client trains at once
        wanted = num_clients if every_client else int(self.settings.get("concurrency", 10))
        if wanted > num_clients:
            log.warning("concurrency %d capped at the %d clients online", wanted, num_clients)
        wall = self.settings.get("clock", LIBRARY_DEFAULTS["clock"]) == "wall"
        values: dict[str, Any] = {
            "strategy": self.rule,
            **LIBRARY_DEFAULTS,
            "num-clients": num_clients,
            "lr": train_config.get("lr", 0.01),
            "max-versions": num_rounds,
            "task-timeout": timeout,
            "task-ttl": timeout,
            "eval-interval": WALL_EVAL_SECONDS if wall else RunConfig().eval_interval,
            "eval-target": "global",
            **self.settings,
            "concurrency": min(wanted, num_clients),
        }
        try:
            run, params = load_config(values)
        except ConfigError as err:
            message = str(err).replace(FIX_HINT, f"fix {type(self).__name__}(...)'s arguments")
            raise ConfigError(message) from None
        self.check_release(run)
        return run, params

    def check_release(self, run: RunConfig) -> None:
        """Flower's num_sampled_clients (the DP wrappers') is the rule's updates per release."""
        release = rule_named(self.rule).dp
        if self.per_release is None or release is None:
            return
        actual = release.per_release(run)
        if actual != self.per_release:
            raise ConfigError(
                f"num_sampled_clients={self.per_release}, but {type(self).__name__} releases "
                f"{actual} updates at a time here (buffer_size, or concurrency for FedAvg); "
                f"pass num_sampled_clients={actual}"
            )

    def summary(self) -> None:
        log.info("fedstale %s, settings %s", self.rule, self.settings or "default")

    # ---------------------------------------------------------------- Flower's evaluation
    def configure_evaluate(
        self, server_round: int, arrays: ArrayRecord, config: ConfigRecord, grid: Grid
    ) -> Iterable[Message]:
        """Flower's federated evaluation, as its FedAvg does it (`fraction_evaluate`)."""
        return self.evaluation.configure_evaluate(server_round, arrays, config, grid)

    def aggregate_evaluate(
        self, server_round: int, replies: Iterable[Message]
    ) -> MetricRecord | None:
        return self.evaluation.aggregate_evaluate(server_round, replies)

    @functools.cached_property
    def evaluation(self) -> FlowerFedAvg:
        """Flower's FedAvg for federated evaluation only, made once. Its warning that
        training is skipped (fraction_train 0) is about itself, not the user's run: muted."""
        flower = logging.getLogger(FLOWER_LOGGER)
        level = flower.level
        flower.setLevel(logging.ERROR)
        try:
            return FlowerFedAvg(
                fraction_train=0.0,
                fraction_evaluate=self.fraction_evaluate,
                min_evaluate_nodes=1,
                min_available_nodes=self.min_available_nodes,
            )
        finally:
            flower.setLevel(level)

    # ---------------------------------------------------------------- the run
    def start(
        self,
        grid: Grid,
        initial_arrays: ArrayRecord,
        num_rounds: int = 3,
        timeout: float = 3600,
        train_config: ConfigRecord | None = None,
        evaluate_config: ConfigRecord | None = None,
        evaluate_fn: EvaluateFn | None = None,
        should_stop: ShouldStop | None = None,
    ) -> Result:
        """Run the rule until `num_rounds` global versions (or another budget in the
        settings, or `should_stop(version, result)` is true after a new version, as Flower
        1.43's early stopping) and return Flower's Result: the final arrays, the clients'
        train metrics per version (weighted by num-examples), evaluate_fn's metrics per
        version, and the clients' evaluation of the final model."""
        setup_logging()
        configs = (ConfigRecord(train_config or {}), ConfigRecord(evaluate_config or {}))
        calls = (evaluate_fn, should_stop)
        try:
            return self.run(grid, initial_arrays, num_rounds, timeout, configs, calls)
        except (ConfigError, EngineError) as err:
            # One line in the run's log; the exception is the caller's, as with Flower's own
            # strategies: a library never ends the user's ServerApp process itself.
            log.error("%s", err)
            raise

    def run(
        self,
        grid: Grid,
        initial_arrays: ArrayRecord,
        num_rounds: int,
        timeout: float,
        configs: tuple[ConfigRecord, ConfigRecord],
        calls: tuple[EvaluateFn | None, ShouldStop | None],
    ) -> Result:
        user_config = dict(configs[0])
        nodes = wait_for_nodes(grid, self.num_clients or self.min_available_nodes, self.settings)
        run, params = self.run_config(self.num_clients or nodes, num_rounds, timeout, user_config)
        arrays = from_array_record(initial_arrays)
        door = LibraryDoor(self, grid, arrays, user_config, *calls)
        lifecycle.run_through(door, run, params)
        self.evaluate_clients(grid, door.engine_version, door.result, configs[1], timeout)
        return door.result

    def hints(self) -> dict[str, str]:
        return {rule.name: rule.mod_hint() for rule in STRATEGIES[self.rule].client_rules}

    def evaluate_clients(
        self, grid: Grid, version: int, result: Result, config: ConfigRecord, timeout: float
    ) -> None:
        """One round of Flower evaluate messages with the final model (fraction_evaluate)."""
        if self.fraction_evaluate <= 0:
            return
        messages = self.configure_evaluate(version, result.arrays, config, grid)
        replies = grid.send_and_receive(messages, timeout=timeout)
        metrics = self.aggregate_evaluate(version, replies)
        if metrics is not None:
            result.evaluate_metrics_clientapp[version] = metrics


def given_arguments(arguments: dict[str, Any]) -> dict[str, Any]:
    """A generated class's `locals()` (library.py) as AsyncStrategy's keywords: its own
    arguments, and the settings given other than their defaults (None: from `start`)."""
    cls = arguments.pop("__class__")
    arguments.pop("self")
    defaults = {
        name: parameter.default
        for name, parameter in inspect.signature(cls.__init__).parameters.items()
    }
    own = set(inspect.signature(AsyncStrategy.__init__).parameters) | CAPABILITY_ARGUMENTS
    return {
        name: value
        for name, value in arguments.items()
        if name in own or (value is not None and value != defaults[name])
    }


def number(metrics: MetricRecord, key: str) -> float:
    value = metrics.get(key)
    return float(value) if isinstance(value, int | float) else math.nan


def array_record_of(flat: np.ndarray, layout: ParamLayout, contract: FlowerContract) -> ArrayRecord:
    return to_array_record(contract.outgoing(layout.unflatten(flat)))


def wait_for_nodes(grid: Grid, wanted: int, settings: Mapping[str, Any]) -> int:
    """How many nodes are online once `wanted` are, or one EngineError line."""
    wait = float(settings.get("node-wait-seconds", RunConfig().node_wait_seconds))
    deadline = time.monotonic() + wait
    while True:
        found = len(list(grid.get_node_ids()))
        if found >= wanted:
            return found
        if time.monotonic() > deadline:
            raise EngineError(
                f"only {found} of {wanted} nodes connected within {wait:g} s; start more "
                "SuperNodes (in simulation: options.num-supernodes) or lower min_available_nodes"
            )
        time.sleep(0.5)


@dataclass
class AsyncResult(Result):
    """Flower's Result, and under DP with noise the privacy spent (Flower's PrivacySpent:
    epsilon at the target delta, the number of releases)."""

    privacy: Any = None


class ResultRecorder(RunRecorder):
    """The run folder's recorder, also keeping which tasks each version aggregated."""

    def __init__(self, directory: Path, kept: dict[str, list[str]] | None = None) -> None:
        super().__init__(directory, kept)
        self.tasks_of: dict[int, list[int]] = defaultdict(list)

    def update(self, row: dict[str, Any]) -> None:
        super().update(row)
        self.tasks_of[int(row["version"])].append(int(row["task"]))

    def train_metrics(self, replies: Mapping[int, Mapping[str, Any]]) -> dict[int, MetricRecord]:
        """Per version, the scalar train metrics of the replies it aggregated, weighted by
        num-examples (Flower's FedAvg's train_metrics_aggr_fn)."""
        out = {}
        for version, tasks in sorted(self.tasks_of.items()):
            rows = [replies[t] for t in tasks if t in replies]
            weights = np.array([float(r["num-examples"]) for r in rows])
            if not rows or weights.sum() <= 0:
                continue
            keys = [
                k for k, v in rows[0].items() if isinstance(v, int | float) and k != "num-examples"
            ]
            out[version] = MetricRecord(
                {
                    k: float(np.dot(weights, [float(r.get(k, 0.0)) for r in rows]) / weights.sum())
                    for k in keys
                }
            )
        return out


@dataclass
class LibraryDoor(Door):
    """The library's way in: a user's Grid, their initial arrays and evaluate_fn, any
    ClientApp answering Flower's train message; the clients' data sizes are unknown. What
    the run gives back is in `result` (and the final version in `engine_version`)."""

    strategy: AsyncStrategy
    grid: Grid
    arrays: dict[str, np.ndarray]
    user_config: dict[str, Any]
    evaluate_fn: EvaluateFn | None
    should_stop: ShouldStop | None = None
    result: AsyncResult = field(default_factory=AsyncResult)
    engine_version: int = 0
    run_recorder: RunRecorder | None = None

    def __post_init__(self) -> None:
        shapes = tuple(tuple(a.shape) for a in self.arrays.values())
        self.layout = ParamLayout(tuple(self.arrays), shapes)
        dtypes = {name: a.dtype for name, a in self.arrays.items()}
        self.flower = FlowerContract(self.user_config, dtypes, self.strategy.hints())
        self.contract = self.flower

    def name(self, run: RunConfig) -> str:
        return run.run_name or f"{run.strategy}-s{run.seed}-{time.strftime('%Y%m%d-%H%M%S')}"

    def settings(self, run: RunConfig, params: KebabModel, name: str) -> dict[str, Any]:
        settings = settings_of(run, params, name)
        return {k: v for k, v in settings.items() if k not in RunConfig.app_only_keys()}

    def config_extras(self, run: RunConfig) -> dict[str, Any]:
        return {"train-config": self.user_config}

    def transport(self, run: RunConfig) -> Transport:
        return GridTransport(self.grid, run.task_ttl)

    def nodes(self, run: RunConfig) -> Nodes:
        edges = self.strategy.edges if isinstance(self.strategy, TopologyArguments) else {}
        return NodesInOrder(run.num_clients, edge_of=dict(edges))

    def model(self, run: RunConfig) -> Model:
        return Model(self.layout, self.layout.flatten(self.arrays))

    def recorder(self, run: RunConfig, name: str, kept: dict[str, list[str]]) -> RunRecorder:
        self.run_recorder = ResultRecorder(claim_run_dir(run, name), kept)
        return self.run_recorder

    def started(self, run: RunConfig, engine: Engine) -> None:
        should_stop = self.should_stop
        if should_stop is None:
            return

        def stop_check(version: int) -> str:
            """Flower's should_stop(round, result) after each new version, with the
            result so far (the current model, the metrics of the versions made)."""
            self.collect(engine)
            return "should_stop" if should_stop(version, self.result) else ""

        engine.stop_check = stop_check

    def collect(self, engine: Engine) -> None:
        """The Result as of now: the current model and the clients' train metrics."""
        self.engine_version = engine.version
        self.result.arrays = array_record_of(engine.strategy.model, self.layout, self.flower)
        if isinstance(self.run_recorder, ResultRecorder):
            metrics = self.run_recorder.train_metrics(self.flower.metrics)
            self.result.train_metrics_clientapp.update(metrics)

    def accountant(self, run: RunConfig) -> Any:
        accountant = self.strategy.accountant
        if accountant is not None and accountant.config.population_size != run.num_clients:
            raise ConfigError(
                f"the accountant's population_size is {accountant.config.population_size}, "
                f"but {run.num_clients} clients take part; make PrivacyConfig("
                f"population_size={run.num_clients}, ...)"
            )
        return accountant

    def setup(self, run: RunConfig, model: Model) -> Setup:
        """The layout, and uniform client sizes: a Flower ClientApp's data sizes are unknown
        until it answers."""
        return Setup(
            segments=tuple(model.layout.segments),
            client_sizes=np.ones(run.num_clients),
            sizes_known=False,
        )

    def services(self, run: RunConfig, model: Model) -> ModelServices:
        """The user's model where `model_fn` and `input_shape` were given (built once, when
        the rule first asks); no held-out data (only fedstale's own app has a test split)."""
        strategy = self.strategy
        given = isinstance(strategy, ServerModelArguments)
        model_fn = strategy.model_fn if given else None
        input_shape = strategy.input_shape if given else None

        @functools.cache
        def torch_model() -> TorchModel:
            if model_fn is None or input_shape is None:
                raise ConfigError(
                    f"{run.strategy} computes on the model at the server: pass "
                    f"{type(strategy).__name__}(model_fn=<your model factory>, "
                    "input_shape=<one sample's shape>)"
                )
            module = model_fn()
            return TorchModel(module, input_shape, output_width(module, input_shape))

        def no_held_out(setting: str) -> Any:
            raise ConfigError(
                f"{run.strategy}: {setting} needs held-out data at the server, which only "
                "fedstale's own app has; leave it out here, or run with `fedstale run`"
            )

        return ModelServices(model=torch_model, held_out=no_held_out)

    def evaluator(self, run: RunConfig, model: Model, version: Callable[[], int]) -> Evaluator:
        """The engine's scorer: `evaluate_fn(version, arrays)`, its MetricRecord kept in
        the Result by version; "accuracy" and "loss" from it go to metrics.jsonl."""
        evaluate_fn, result, contract = self.evaluate_fn, self.result, self.flower

        def score(flat: np.ndarray) -> tuple[float, float]:
            if evaluate_fn is None:
                return math.nan, math.nan
            metrics = evaluate_fn(version(), array_record_of(flat, model.layout, contract))
            if metrics is None:
                return math.nan, math.nan
            result.evaluate_metrics_serverapp[version()] = metrics
            return number(metrics, "accuracy"), number(metrics, "loss")

        return score

    def finished(self, run: RunConfig, engine: Engine, recorder: RunRecorder) -> None:
        self.collect(engine)
        privacy = engine.stages.find(CentralDP)
        if privacy is not None and privacy.epsilon() is not None:
            self.result.privacy = privacy.spent()


# ---------------------------------------------------------------- the rules, by name


class ServerModelArguments(AsyncStrategy):
    """The arguments of a rule that computes on the model at the server (ServerModel):
    `model_fn` builds your model, `input_shape` is one sample's shape."""

    def __init__(
        self,
        *,
        model_fn: Callable[[], torch.nn.Module] | None = None,
        input_shape: Sequence[int] | None = None,
        **kwargs: Any,
    ) -> None:
        self.model_fn = model_fn
        self.input_shape = tuple(input_shape) if input_shape is not None else None
        super().__init__(**kwargs)


class TopologyArguments(AsyncStrategy):
    """The argument of a rule with edges (Topology): `edges`, client -> edge (default:
    seeded groups, or the `edge-id` each node declares)."""

    def __init__(self, *, edges: Mapping[int, int] | None = None, **kwargs: Any) -> None:
        self.edges = dict(edges or {})
        super().__init__(**kwargs)
