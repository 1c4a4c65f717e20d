"""Every rule's declaration (its file's RULES) holds up, and what is derived from the
declarations agrees with them: the registry, the library classes and exports, the wire
keys, the capabilities."""

from __future__ import annotations

import numpy as np
import pytest

import fedstale
from fedstale.common.schema import common_keys
from fedstale.server_app.flower_strategy import AsyncStrategy
from fedstale.server_app.library_classes import library_classes
from fedstale.strategies.base import PerClientModels, Strategy, Topology
from fedstale.strategies.registry import (
    BUILT_IN,
    STRATEGIES,
    declarations,
    declared,
    load_config,
    name_taken,
    with_topology,
)
from fedstale.strategies.rule import Rule

COMMON = common_keys()


def test_every_built_in_module_declares_its_rules_and_only_they_are_registered() -> None:
    """Derived from the files, not counted by hand: every module of fedstale/strategies/
    that declares `RULES` is in BUILT_IN, and exactly their rules are registered."""
    from importlib import import_module
    from pathlib import Path

    folder = Path(import_module("fedstale.strategies").__file__ or "").parent
    declaring = {f.stem for f in folder.glob("*.py") if "\nRULES = " in f.read_text()}
    assert declaring == set(BUILT_IN)
    declared = [
        rule.name
        for name in BUILT_IN
        for rule in import_module(f"fedstale.strategies.{name}").RULES
    ]
    assert len(declared) == len(set(declared))
    assert sorted(declared) == sorted(declarations()) == sorted(STRATEGIES)


@pytest.mark.parametrize("name", sorted(STRATEGIES))
def test_a_rules_signals_are_among_its_declared_wire_keys(name: str) -> None:
    rule = declarations()[name]
    values = {"strategy": name, "num-clients": 4, "concurrency": 4, "mafsa-edges": 2}
    run, params = load_config(values)
    strategy = rule.strategy(run, params, np.zeros(3, np.float32))
    assert set(strategy.signals()) <= set(rule.wire)
    assert not set(rule.wire) & COMMON, "a rule's wire key shadows a common one"


def test_no_built_in_rule_takes_what_another_declares() -> None:
    """The check a package's rule meets holds among fedstale's own: no two files' rules
    share a wire key, a mod or a library class."""
    rules = list(declarations().values())
    for rule in rules:
        assert name_taken(rule, [r for r in rules if r is not rule]) is None, rule.name


def test_a_package_rule_taking_another_rules_wire_key_is_left_out() -> None:
    from fedstale.strategies.fedqs import FedQSKeys

    class Borrower(Strategy):
        name = "borrower"

        def on_update(self, update, view):  # type: ignore[no-untyped-def]
            raise NotImplementedError

    rules = list(declarations().values())
    taken = name_taken(Rule(Borrower, wire=("borrowed", FedQSKeys.SPREAD)), rules)
    assert taken == "wire key 'fedqs-spread' is rule 'fedqs-sgd' of fedstale.strategies.fedqs's"
    assert name_taken(Rule(Borrower, wire=("borrowed",)), rules) is None
    with pytest.raises(TypeError, match="wire key 'task-id' is one every task carries"):
        declared(Rule(Borrower, wire=("task-id",)), "test")


def test_the_library_offers_exactly_the_rules_declared_with_a_library_name() -> None:
    offered = {r.library: r.name for r in declarations().values() if r.library}
    assert {name: cls.rule for name, cls in library_classes().items()} == offered
    for name, rule in offered.items():
        cls = getattr(fedstale, name)
        assert issubclass(cls, AsyncStrategy) and cls.rule == rule and cls.__doc__
        assert name in fedstale.__all__ and name in dir(fedstale)  # completion offers it
    assert {"fedpsa_mod", "fedqs_mod", "mafsa_mod", "AsyncStrategy"} <= set(fedstale.__all__)
    assert {"fedpsa_mod", "secagg_mod", "AsyncStrategy", "__version__"} <= set(dir(fedstale))
    assert "PACE" not in fedstale.__all__ and "LocalOnly" not in fedstale.__all__


def test_capabilities_are_read_from_the_classes() -> None:
    per_client = {n for n, r in declarations().items() if r.per_client_models}
    assert per_client == {"pace", "pfedgraph-async", "local-only"}
    assert set(with_topology()) == {"mafsa", "hierfedavg"}
    assert {n for n, r in declarations().items() if r.server_model} == {"fedpsa"}
    for name, rule in declarations().items():
        assert issubclass(rule.strategy, PerClientModels) == (name in per_client)
        assert issubclass(rule.strategy, Topology) == rule.topology


def test_deploy_edges_go_under_the_key_each_topology_rule_declares(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """`fedstale deploy --edges E` sets the rule's own `edges_key`, never a hard-coded one."""
    from fedstale.common.config import ConfigError
    from fedstale.launcher.deploy import check_edges, deployment_config

    for name in with_topology():
        key = declarations()[name].strategy.edges_key  # type: ignore[attr-defined]
        assert deployment_config(6, {"strategy": name}, 2)[key] == 2
    monkeypatch.setattr(declarations()["hierfedavg"].strategy, "edges_key", "other-edges")
    assert deployment_config(6, {"strategy": "hierfedavg"}, 3)["other-edges"] == 3
    with pytest.raises(ConfigError, match="--edges 3 and other-edges=2 disagree"):
        check_edges(3, 6, {"strategy": "hierfedavg", "other-edges": 2})
    with pytest.raises(ConfigError, match="a rule with edges"):
        deployment_config(6, {"strategy": "fedbuff"}, 2)


def test_a_declaration_that_cannot_hold_is_refused_in_one_line() -> None:
    class NoName(Strategy):
        def on_update(self, update, view):  # type: ignore[no-untyped-def]
            raise NotImplementedError

    with pytest.raises(TypeError, match="has no `name`"):
        declared((Rule(NoName),), "test")
    with pytest.raises(TypeError, match="declares no fedstale Rule"):
        declared((), "test")
    pace = declarations()["pace"]
    with pytest.raises(TypeError, match=r"its client rules .* name no mod"):
        declared(Rule(pace.strategy, library="PACE"), "test")
    pace_half = type(pace.client_rules[0])

    class MisnamedHalf(pace_half):  # type: ignore[misc, valid-type]
        mod = "fedstale.client_app.mods:pace_mod"

    class WithMisnamedHalf(pace.strategy):  # type: ignore[misc, valid-type]
        client_rules = (MisnamedHalf(),)

    with pytest.raises(TypeError, match=r"is not 'module:function\(arguments\)'"):
        declared(Rule(WithMisnamedHalf), "test")


def test_the_mod_a_client_half_declares_once_gives_its_export_and_its_hint() -> None:
    fedpsa = declarations()["fedpsa"]
    assert fedpsa.mods == {"fedpsa_mod": "fedstale.client_app.mods"}
    (sketch,) = fedpsa.client_rules
    assert (
        sketch.mod_hint()
        == "add fedstale.fedpsa_mod(model_fn, input_shape) to your ClientApp's mods"
    )
    assert fedstale.fedpsa_mod.__module__ == "fedstale.client_app.mods"
    assert declarations()["mafsa"].client_rules[0].mod_hint() == (
        "add fedstale.mafsa_mod() to your ClientApp's mods"
    )
