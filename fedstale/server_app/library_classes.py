"""The library's classes by name, `fedstale.<library>`, for every rule declared with a
library name: fedstale's own from library.py, an installed package's made here the same
way, from its declaration: its `Params`, its capabilities' arguments and the library's
(`help()` and pydantic read them typed; a type checker reads a class written in source,
docs/library.md shows the two lines). Apart from flower_strategy.py, which library.py
builds on."""

from __future__ import annotations

import functools
from typing import ClassVar

from fedstale.server_app import library
from fedstale.server_app.flower_strategy import (
    AsyncStrategy,
    ServerModelArguments,
    TopologyArguments,
)
from fedstale.strategies.registry import declarations


@functools.cache
def library_classes() -> dict[str, type[AsyncStrategy]]:
    classes: dict[str, type[AsyncStrategy]] = {}
    for rule in declarations().values():
        if not rule.library:
            continue
        typed = getattr(library, rule.library, None)
        if isinstance(typed, type) and issubclass(typed, AsyncStrategy) and typed.rule == rule.name:
            classes[rule.library] = typed
            continue
        bases: list[type] = [AsyncStrategy, rule.strategy.Params]
        if rule.server_model:
            bases.append(ServerModelArguments)
        if rule.topology:
            bases.append(TopologyArguments)
        attributes = {
            "rule": rule.name,
            "__annotations__": {"rule": ClassVar[str]},
            "__module__": __name__,
        }
        classes[rule.library] = type(rule.library, tuple(bases), attributes)
    return classes


def __getattr__(name: str) -> type[AsyncStrategy]:
    classes = library_classes()
    if name not in classes:
        raise AttributeError(f"module '{__name__}' has no attribute '{name}'")
    return classes[name]
