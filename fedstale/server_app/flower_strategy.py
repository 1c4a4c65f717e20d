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
import logging
import math
import textwrap
import time
from collections import defaultdict
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, ClassVar, Literal

import numpy as np
import torch
from flwr.app import ArrayRecord, ConfigRecord, Message, MetricRecord
from flwr.serverapp import Grid
from flwr.serverapp.strategy import FedAvg as FlowerFedAvg
from flwr.serverapp.strategy import Result
from pydantic import BaseModel, ConfigDict, Field, PrivateAttr, ValidationError, field_validator

from fedstale.common.config import (
    FIX_HINT,
    ConfigError,
    EngineSettings,
    KebabModel,
    RunConfig,
    describe_validation_error,
    did_you_mean,
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
from fedstale.server_app.results import RunRecorder, claim_run_dir, outside_the_app
from fedstale.server_app.scored import Evaluator
from fedstale.server_app.stages.central_dp import CentralDP
from fedstale.server_app.transport import GridTransport, Transport
from fedstale.strategies.base import ModelServices, Setup, TorchModel
from fedstale.strategies.registry import (
    STRATEGIES,
    load_config,
    rule_named,
    with_new_names,
)

log = logging.getLogger("fedstale")
FLOWER_LOGGER = "flwr"  # Flower's own logger (flwr.supercore.logger)
EvaluateFn = Callable[[int, ArrayRecord], MetricRecord | None]
ShouldStop = Callable[[int, Result], bool]
WALL_EVAL_SECONDS = 10.0  # evaluate_fn's period on the wall clock unless eval_interval is set
OWN_ARGUMENTS = ("num_clients", "min_available_nodes", "fraction_evaluate")
# Arguments every class took before they became some rules' keys: another class still
# takes them, with one warning line, so that swapping FedBuff for FedAsync in a ServerApp
# keeps working (a type checker flags them); until fedstale 0.2
FORMERLY_EVERY_CLASS = ("buffer_size",)


def said_runs_dir(chosen: str) -> str:
    """`chosen` (see results.outside_the_app), said once when it moves results out of the
    Flower app folder the run started in."""
    if chosen:
        log.info(
            "results go to %s, beside the Flower app folder: flwr run packs the folder's "
            ".json and .jsonl files into the app bundle (runs_dir= chooses)",
            chosen,
        )
    return chosen


class LibraryArguments(EngineSettings):
    """Every run-config key a library run reads (fedstale's own app's keys are left out),
    in snake_case, with the run config's defaults, except: a Flower user's server runs on
    the wall clock, with no virtual-time budget and no lr decay unless asked; None comes
    from `start` (lr from train_config, else 0.01; max_versions from num_rounds; task_timeout
    and task_ttl from timeout; eval_interval 10 s on the wall clock). And the library's own:
    `num_clients` (default: every node online once `min_available_nodes` are) and
    `fraction_evaluate` (Flower evaluate messages to the nodes with the final model). The
    values are checked as the run config's are, when the class is made."""

    model_config = ConfigDict(protected_namespaces=(), arbitrary_types_allowed=True)

    num_clients: int | None = None  # type: ignore[assignment]
    min_available_nodes: int = 2  # below 1: 1
    fraction_evaluate: float = 1.0
    clock: Literal["virtual", "wall"] = "wall"
    lr_decay: float = 1.0
    max_virtual_time: float = 0.0
    lr: float | None = None  # type: ignore[assignment]
    max_versions: int | None = None  # type: ignore[assignment]
    task_timeout: float | None = None  # type: ignore[assignment]
    task_ttl: float | None = None  # type: ignore[assignment]
    eval_interval: float | None = None  # type: ignore[assignment]

    @field_validator("min_available_nodes")
    @classmethod
    def _at_least_one(cls, nodes: int) -> int:
        return max(1, nodes)


class AsyncStrategy(LibraryArguments):
    """A fedstale rule driving any Flower ClientApp. Its keyword arguments are fedstale's
    run config keys in snake_case (`buffer_size=5`, `fedbuff_server_lr=0.5`,
    `clock="virtual"`): `LibraryArguments` and the rule's own `Params`, which each rule's
    class (library.py) is made of; see docs/library.md.

    Not a subclass of Flower's `Strategy`: Flower's contract is rounds (`configure_train`
    sends a round's messages, `aggregate_train` folds that round's replies), and an
    asynchronous rule has none: it folds each reply as it arrives, into whichever version
    is current then. What it keeps of Flower's Strategy is what a ServerApp calls: `start`
    with Flower's arguments (and 1.43's `should_stop`), returning Flower's `Result`,
    `summary`, and Flower's federated evaluation (`configure_evaluate`,
    `aggregate_evaluate`). A rule's capabilities add their own arguments to its class:
    `model_fn` and `input_shape` where it computes on the model at the server
    (`ServerModelArguments`: FedPSA), `edges` (client -> edge) where it has a Topology."""

    rule: ClassVar[str]
    # Set by the DP wrappers (flower_privacy.py): Flower's num_sampled_clients, checked
    # against the rule's updates per release, and the accountant the releases compose into.
    _per_release: int | None = PrivateAttr(default=None)
    _accountant: Any = PrivateAttr(default=None)

    if not TYPE_CHECKING:  # a type checker reads the fields' own __init__

        def __init__(self, **given: Any) -> None:
            try:
                super().__init__(**type(self).arguments_of(given))
            except ValidationError as err:
                message = describe_validation_error(err).replace("run config: ", "", 1)
                fix = f"fix {type(self).__name__}(...)'s arguments"
                raise ConfigError(
                    f"{type(self).__name__}: {message.replace(FIX_HINT, fix)}"
                ) from None
            self.check_client_halves()
            self.check_settings()

    @classmethod
    def __pydantic_init_subclass__(cls, **kwargs: Any) -> None:
        """A rule's class without a docstring of its own takes its rule's `about`."""
        super().__pydantic_init_subclass__(**kwargs)
        if "rule" in cls.__dict__ and cls.__dict__.get("__doc__") is None:
            cls.__doc__ = described(cls)

    @classmethod
    def arguments_of(cls, given: Mapping[str, Any]) -> dict[str, Any]:
        """`given` with a renamed key's old name under its new one (one line saying so),
        or one ConfigError line naming an unknown argument and the closest known one."""
        kebab = with_new_names({key.replace("_", "-"): v for key, v in given.items()})
        named = {key.replace("-", "_"): value for key, value in kebab.items()}
        for name in sorted(set(named) - set(cls.model_fields)):
            if name not in FORMERLY_EVERY_CLASS:
                hint = did_you_mean(name, cls.model_fields, "see docs/library.md")
                raise ConfigError(f"{cls.__name__}: unknown argument '{name}'; {hint}")
            log.warning(
                "%s: %s=%r is ignored: %s does not read it (only the buffered rules do); drop it",
                cls.__name__,
                name,
                named.pop(name),
                cls.rule,
            )
        return named

    # ---------------------------------------------------------------- configuration
    @property
    def settings(self) -> dict[str, Any]:
        """The run-config keys given (kebab-case), other than None and their defaults."""
        fields = type(self).model_fields
        return {
            key: value
            for key, value in self.run_values().items()
            if key.replace("-", "_") in self.model_fields_set
            and value != fields[key.replace("-", "_")].default
        }

    @classmethod
    def rule_keys(cls) -> list[str]:
        """The rule's own keys, by field name."""
        return list(STRATEGIES[cls.rule].Params.model_fields)

    def run_values(self) -> dict[str, Any]:
        """Every run-config key this class holds (kebab-case; None: from `start`, left
        out), the library's own arguments and the capabilities' apart."""
        keys = (set(RunConfig.model_fields) | set(type(self).rule_keys())) - set(OWN_ARGUMENTS)
        held = {name: getattr(self, name) for name in type(self).model_fields if name in keys}
        return {name.replace("_", "-"): v for name, v in held.items() if v is not None}

    @property
    def accountant(self) -> Any:
        return self._accountant

    def with_privacy(
        self, settings: Mapping[str, Any], per_release: int, accountant: Any
    ) -> AsyncStrategy:
        """A copy under central DP (the DP wrappers'): `settings` its dp- keys, Flower's
        num_sampled_clients and accountant; one ConfigError line where the rule cannot
        take it. The user's object keeps its own settings."""
        update = {key.replace("-", "_"): value for key, value in settings.items()}
        private = self.model_copy(update=update)
        private._per_release, private._accountant = per_release, accountant
        private.check_settings()
        return private

    def check_settings(self) -> None:
        """Refuse here, not at start, settings that cannot run (a latency profile it cannot
        simulate, DP on a rule that cannot take it)."""
        placeholder = max(self.min_available_nodes, self.concurrency)
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
        `concurrency` is capped at the number of clients."""
        every_client = rule_named(self.rule).topology  # every client trains at once
        wanted = num_clients if every_client else self.concurrency
        if wanted > num_clients:
            log.warning("concurrency %d capped at the %d clients online", wanted, num_clients)
        wall = self.clock == "wall"
        from_start = {
            "lr": train_config.get("lr", 0.01),
            "max-versions": num_rounds,
            "task-timeout": timeout,
            "task-ttl": timeout,
            "eval-interval": WALL_EVAL_SECONDS if wall else RunConfig().eval_interval,
        }
        values: dict[str, Any] = {
            "strategy": self.rule,
            **from_start,
            **self.run_values(),
            "num-clients": num_clients,
            "eval-target": "global",
            "concurrency": min(wanted, num_clients),
        }
        if not values.get("runs-dir"):
            values["runs-dir"] = said_runs_dir(outside_the_app(Path.cwd()))
        try:
            run, params = load_config(values)
        except ConfigError as err:
            message = str(err).replace(FIX_HINT, f"fix {type(self).__name__}(...)'s arguments")
            raise ConfigError(message) from None
        self.check_release(run, params)
        return run, params

    def check_release(self, run: RunConfig, params: KebabModel) -> None:
        """Flower's num_sampled_clients (the DP wrappers') is the rule's updates per release."""
        release = rule_named(self.rule).dp
        if self._per_release is None or release is None:
            return
        actual = release.per_release(run, params)
        if actual != self._per_release:
            raise ConfigError(
                f"num_sampled_clients={self._per_release}, but {type(self).__name__} releases "
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
        wanted = self.num_clients or self.min_available_nodes
        nodes = wait_for_nodes(grid, wanted, self.node_wait_seconds)
        run, params = self.run_config(self.num_clients or nodes, num_rounds, timeout, user_config)
        arrays = from_array_record(initial_arrays)
        door = LibraryDoor(run, self, grid, arrays, user_config, *calls)
        lifecycle.run_through(door, params)
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


def number(metrics: MetricRecord, key: str) -> float:
    value = metrics.get(key)
    return float(value) if isinstance(value, int | float) else math.nan


def array_record_of(flat: np.ndarray, layout: ParamLayout, contract: FlowerContract) -> ArrayRecord:
    return to_array_record(contract.outgoing(layout.unflatten(flat)))


def wait_for_nodes(grid: Grid, wanted: int, wait: float) -> int:
    """How many nodes are online once `wanted` are (waiting `wait` seconds at most), or one
    EngineError line."""
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

    run: RunConfig
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

    def name(self) -> str:
        return (
            self.run.run_name
            or f"{self.run.strategy}-s{self.run.seed}-{time.strftime('%Y%m%d-%H%M%S')}"
        )

    def settings(self, params: KebabModel, name: str) -> dict[str, Any]:
        settings = settings_of(self.run, params, name)
        return {k: v for k, v in settings.items() if k not in RunConfig.app_only_keys()}

    def config_extras(self) -> dict[str, Any]:
        return {"train-config": self.user_config}

    def transport(self) -> Transport:
        return GridTransport(self.grid, self.run.task_ttl)

    def nodes(self) -> Nodes:
        strategy = self.strategy
        edges = dict(strategy.edges) if isinstance(strategy, TopologyArguments) else {}
        return NodesInOrder(self.run.num_clients, edge_of=dict(edges))

    def model(self) -> Model:
        return Model(self.layout, self.layout.flatten(self.arrays))

    def recorder(self, name: str, kept: dict[str, list[str]]) -> RunRecorder:
        self.run_recorder = ResultRecorder(claim_run_dir(self.run, name), kept)
        return self.run_recorder

    def started(self, engine: Engine) -> None:
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

    def accountant(self) -> Any:
        accountant = self.strategy.accountant
        if accountant is not None and accountant.config.population_size != self.run.num_clients:
            raise ConfigError(
                f"the accountant's population_size is {accountant.config.population_size}, "
                f"but {self.run.num_clients} clients take part; make PrivacyConfig("
                f"population_size={self.run.num_clients}, ...)"
            )
        return accountant

    def setup(self, model: Model) -> Setup:
        """The layout, and uniform client sizes: a Flower ClientApp's data sizes are unknown
        until it answers."""
        return Setup(
            segments=tuple(model.layout.segments),
            client_sizes=np.ones(self.run.num_clients),
            sizes_known=False,
        )

    def services(self, model: Model) -> ModelServices:
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
                    f"{self.run.strategy} computes on the model at the server: pass "
                    f"{type(strategy).__name__}(model_fn=<your model factory>, "
                    "input_shape=<one sample's shape>)"
                )
            module = model_fn()
            return TorchModel(module, input_shape, output_width(module, input_shape))

        def no_held_out(setting: str) -> Any:
            raise ConfigError(
                f"{self.run.strategy}: {setting} needs held-out data at the server, which only "
                "fedstale's own app has; leave it out here, or run with `fedstale run`"
            )

        return ModelServices(model=torch_model, held_out=no_held_out)

    def evaluator(self, model: Model, version: Callable[[], int]) -> Evaluator:
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

    def finished(self, engine: Engine, recorder: RunRecorder) -> None:
        self.collect(engine)
        privacy = engine.stages.find(CentralDP)
        if privacy is not None and privacy.epsilon() is not None:
            self.result.privacy = privacy.spent()


# ---------------------------------------------------------------- the rules, by name


class ServerModelArguments(BaseModel):
    """The arguments of a rule that computes on the model at the server (ServerModel):
    `model_fn` builds your model, `input_shape` is one sample's shape."""

    model_config = ConfigDict(protected_namespaces=(), arbitrary_types_allowed=True)

    model_fn: Callable[[], torch.nn.Module] | None = None
    input_shape: Sequence[int] | None = None

    @field_validator("input_shape")
    @classmethod
    def _as_tuple(cls, shape: Sequence[int] | None) -> tuple[int, ...] | None:
        return tuple(shape) if shape is not None else None


class TopologyArguments(BaseModel):
    """The argument of a rule with edges (Topology): `edges`, client -> edge (default:
    seeded groups, or the `edge-id` each node declares)."""

    edges: Mapping[int, int] = Field(default_factory=dict)


def described(cls: type[AsyncStrategy]) -> str:
    """A rule's class's docstring: its rule's `about`, and which keys are its own."""
    about = rule_named(cls.rule).about.strip()
    first, _, rest = about.partition("\n")
    own = ", ".join(cls.rule_keys()) or "none"
    return (
        f"{first}\n{textwrap.dedent(rest)}\n\nIts own keys: {own}; the others are every "
        "rule's (docs/library.md)."
    )
