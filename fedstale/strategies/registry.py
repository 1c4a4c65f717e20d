"""The rules by name, derived from their declarations (fedstale/strategies/rule.py), and
the full validation of a run config.

fedstale's own rules: one line each in `BUILT_IN`, the module whose `RULES` declares them.
Another installed package adds rules under the entry point group `fedstale.rules` (an
entry point names a `Rule`, a tuple of them, or a module with `RULES`); they are found
in every process that imports the registry, so the ServerApp, the ClientApp and the
library see the same rules."""

from __future__ import annotations

import logging
from collections.abc import Iterable, Iterator, Mapping
from functools import cache
from importlib import import_module
from importlib.metadata import entry_points
from types import ModuleType
from typing import Any

import numpy as np

from fedstale.common.config import (
    FIX_HINT,
    KEYS_HINT,
    ConfigError,
    KebabModel,
    PrivacySettings,
    RunConfig,
    RunSettings,
    did_you_mean,
    parse_model,
)
from fedstale.strategies.base import Strategy
from fedstale.strategies.client import ClientRule
from fedstale.strategies.rule import Rule

log = logging.getLogger("fedstale")
ENTRY_POINTS = "fedstale.rules"
BUILT_IN = (
    "fedavg",
    "fedasync",
    "fedbuff",
    "ca2fl",
    "fedfa",
    "fedpsa",
    "pace",
    "fedqs",
    "mafsa",
    "hierfedavg",
    "local_only",
)


def declared(found: Rule | Iterable[Rule] | ModuleType, source: str) -> tuple[Rule, ...]:
    """The rules an entry point or module declares, each checked."""
    if isinstance(found, ModuleType):
        found = getattr(found, "RULES", ())
    rules = (found,) if isinstance(found, Rule) else tuple(found)
    if not rules or not all(isinstance(rule, Rule) for rule in rules):
        raise TypeError(f"{source}: declares no fedstale Rule (give a Rule, a tuple, or RULES)")
    for rule in rules:
        rule.check()
    return rules


def from_packages() -> list[Rule]:
    """The rules other installed packages declare (entry point group `fedstale.rules`); one
    that cannot be loaded is left out with one warning line, and the run goes on."""
    rules = []
    for point in entry_points(group=ENTRY_POINTS):
        try:
            rules += declared(point.load(), f"entry point {point.name} ({point.value})")
        except Exception as err:  # a broken package must not take fedstale down with it
            log.warning("rule package %s (%s) left out: %s", point.name, point.value, err)
    return rules


@cache
def declarations() -> dict[str, Rule]:
    """Every rule by name: fedstale's own, then the packages'. A package's rule whose name,
    library class, mod or a wire key is taken is left out with one warning line naming both: a
    package cannot silently replace `fedstale.FedBuff`."""
    modules = [import_module(f"fedstale.strategies.{name}") for name in BUILT_IN]
    by_name = {r.name: r for module in modules for r in declared(module, module.__name__)}
    for rule in from_packages():
        taken = name_taken(rule, by_name.values())
        if taken is not None:
            log.warning("%s left out: %s", describe(rule), taken)
            continue
        by_name[rule.name] = rule
    return by_name


def exported_names(rule: Rule) -> set[str]:
    """The names a rule adds to `fedstale`: its library class and its client half's mod."""
    return ({rule.library} if rule.library else set()) | set(rule.mods)


def name_taken(rule: Rule, others: Iterable[Rule]) -> str | None:
    """Why `rule` cannot join `others`: its name, library class, mod or a wire key is
    already theirs (the rules of one file may share their mod and wire keys)."""
    for other in others:
        if other.name == rule.name:
            return f"{other.strategy.__module__} has that name"
        if other.library and other.library == rule.library:
            return f"fedstale.{rule.library} is {describe(other)}'s"
        if other.strategy.__module__ == rule.strategy.__module__:
            continue
        shared = sorted(exported_names(rule) & exported_names(other))
        if shared:
            return f"fedstale.{shared[0]} is {describe(other)}'s"
        keys = sorted(set(rule.wire) & set(other.wire))
        if keys:
            return f"wire key '{keys[0]}' is {describe(other)}'s"
    return None


def describe(rule: Rule) -> str:
    return f"rule '{rule.name}' of {rule.strategy.__module__}"


class Strategies(Mapping[str, type[Strategy]]):
    """Strategy classes by rule name, read from the declarations on first use."""

    def __getitem__(self, name: str) -> type[Strategy]:
        return declarations()[name].strategy

    def __iter__(self) -> Iterator[str]:
        return iter(declarations())

    def __len__(self) -> int:
        return len(declarations())


STRATEGIES = Strategies()


def rule_named(name: str) -> Rule:
    return declarations()[name]


def client_rules() -> dict[str, ClientRule]:
    """Every registered strategy's client rules, by the name a task gives them."""
    return {rule.name: rule for cls in STRATEGIES.values() for rule in cls.client_rules}


def cohort_rules() -> frozenset[str]:
    """The client rules whose work leaves a task's local training batchable in a cohort
    (`ClientRule.in_cohorts`)."""
    return frozenset(name for name, rule in client_rules().items() if rule.in_cohorts)


# A renamed key's old name is read until this release (then it is unknown, and the
# "did you mean" of an unknown key names the new one).
OLD_NAMES_READ_UNTIL = "0.2"


def renamed_keys() -> dict[str, str]:
    """Every renamed key, old name -> new: the run config's and every rule's."""
    renamed = dict(RunConfig.renamed)
    for cls in STRATEGIES.values():
        renamed.update(cls.Params.renamed)
    return renamed


def with_new_names(values: Mapping[str, Any], say: bool = True) -> dict[str, Any]:
    """`values` with each renamed key under its new name, with one warning line naming it
    (`say`). An old name left empty is dropped: pyproject.toml declares each old name as ""
    so that Flower's `--run-config` still takes it."""
    named = dict(values)
    for old, new in renamed_keys().items():
        if old not in named:
            continue
        value = named.pop(old)
        if value == "":
            continue
        if say:
            log.warning(
                "run config: '%s' is now '%s' (the old name is read until fedstale %s); rename it",
                old,
                new,
                OLD_NAMES_READ_UNTIL,
            )
        named[new] = value
    return named


def known_keys() -> set[str]:
    keys = RunConfig.keys()
    for cls in STRATEGIES.values():
        keys |= cls.Params.keys()
    return keys


def _reject_unknown_keys(values: Mapping[str, Any]) -> None:
    known = known_keys()
    for key in sorted(set(values) - known):
        hint = did_you_mean(key, known, KEYS_HINT)
        raise ConfigError(f"run config: unknown key '{key}'; {hint}")


def load_config(values: Mapping[str, Any]) -> tuple[RunConfig, KebabModel]:
    """The run config and the strategy's own parameters, or one ConfigError line."""
    values = with_new_names(values)
    _reject_unknown_keys(values)
    run = parse_model(RunConfig, values)
    if run.strategy not in STRATEGIES:
        raise ConfigError(
            f"run config: unknown strategy '{run.strategy}'; choose one of "
            f"{', '.join(sorted(STRATEGIES))}; {FIX_HINT}"
        )
    # Every strategy's keys are checked, so a bad value never waits for the day it is used.
    all_params = {name: parse_params(name, values) for name in STRATEGIES}
    rule, params = rule_named(run.strategy), all_params[run.strategy]
    try:
        check_labels(rule, run)
        check_privacy(rule, run)
        check_secure(rule, run, all_params)
        rule.strategy.check(run, params)
    except ValueError as err:
        raise ConfigError(f"run config: {err}; {FIX_HINT}") from None
    return run, params


def parse_params(name: str, values: Mapping[str, Any]) -> KebabModel:
    """A rule's own keys; a bad value of a package's key names the package's rule and fixes
    it with --run-config (the app's pyproject.toml is not its author's to edit)."""
    rule = declarations()[name]
    try:
        return parse_model(rule.strategy.Params, values)
    except ConfigError as err:
        if is_built_in(rule):
            raise
        fix = f"a key of rule '{name}' ({rule.strategy.__module__}): fix it with --run-config"
        raise ConfigError(str(err).replace(FIX_HINT, fix)) from None


def is_built_in(rule: Rule) -> bool:
    return rule.strategy.__module__.startswith("fedstale.strategies.")


def package_defaults() -> dict[str, dict[str, Any]]:
    """Each installed package's rule by name: the keys it adds, with their defaults (not
    those fedstale's own rules declare already, such as `buffer-size`)."""
    rules = declarations().values()
    built_in = RunConfig.keys().union(*(r.strategy.Params.keys() for r in rules if is_built_in(r)))
    return {
        rule.name: {
            key: value
            for key, value in rule.strategy.Params().model_dump(by_alias=True).items()
            if key not in built_in
        }
        for rule in rules
        if not is_built_in(rule)
    }


def package_rules() -> list[str]:
    """One line per installed package's rule: its name, module and keys with defaults."""
    lines = []
    for name, defaults in package_defaults().items():
        keys = ", ".join(f"{k}={v}" for k, v in defaults.items()) or "no keys of its own"
        lines.append(f"rule '{name}' from {declarations()[name].strategy.__module__} ({keys})")
    return lines


def package_keys() -> dict[str, Any]:
    """The keys installed packages' rules add, with their defaults: `fedstale run` declares
    them in the app it hands Flower, which refuses a run-config key its app does not name."""
    keys: dict[str, Any] = {}
    for defaults in package_defaults().values():
        keys.update({k: v for k, v in defaults.items() if v is not None})
    return keys


def check_labels(rule: Rule, run: RunSettings) -> None:
    if rule.labels and run.loss != "cross-entropy":
        raise ValueError(
            f"strategy {rule.name} needs loss=cross-entropy on class labels ({rule.labels}); "
            f"loss is '{run.loss}'"
        )


def check_privacy(rule: Rule, run: PrivacySettings) -> None:
    if run.clips and rule.dp is None:
        why = rule.no_dp or "it declares no release sensitivity (Rule(dp=...))"
        able = ", ".join(name for name, r in declarations().items() if r.dp is not None)
        raise ValueError(
            f"strategy {rule.name} cannot take differential privacy: {why}; "
            f"the rules that can: {able}"
        )


def check_secure(rule: Rule, run: RunConfig, all_params: Mapping[str, KebabModel]) -> None:
    """Secure aggregation needs a release that is a weighted sum of at least two updates'
    deltas with public weights (`Release(LINEAR)`, as central DP declares it), whose sum
    the field holds."""
    if not run.secure_aggregation:
        return
    from fedstale.common.secagg.field import Quantiser
    from fedstale.strategies.privacy import LINEAR

    able = ", ".join(
        name
        for name, r in declarations().items()
        if r.dp is not None and r.dp.kind == LINEAR and r.dp.per_release(run, all_params[name]) > 1
    )
    if rule.dp is None or rule.dp.kind != LINEAR:
        why = "its release is not declared a weighted sum of deltas with public weights"
        raise ValueError(
            f"strategy {rule.name} cannot take secure aggregation: {why}; the rules that "
            f"can: {able}"
        )
    updates = rule.dp.per_release(run, all_params[rule.name])
    if updates < 2:
        raise ValueError(
            f"strategy {rule.name} releases every update alone, so its release would show "
            f"that update: secure aggregation needs two or more; the rules that can: {able}"
        )
    quantiser = Quantiser(run.secagg_range, run.secagg_precision_bits, run.secagg_weight_bits)
    if not quantiser.fits(updates):
        raise ValueError(
            f"a weighted sum of {updates} updates within +-{run.secagg_range:g} at "
            f"secagg-precision-bits {run.secagg_precision_bits} and secagg-weight-bits "
            f"{run.secagg_weight_bits} overflows the field (2^32): lower either"
        )


def with_topology() -> list[str]:
    """The rules whose nodes may name an edge (`edge-id`), every client training at once."""
    return [name for name, rule in declarations().items() if rule.topology]


def build_strategy(run: RunConfig, params: KebabModel, initial: np.ndarray) -> Strategy:
    return STRATEGIES[run.strategy](run, params, initial)
