"""User code named in the run config as 'package.module:attribute' (`model`, `dataset`,
`loss`, `metric`): imported on first use, every failure one `ConfigError` line that names
the key, the reference and the fix.

The module is looked up on sys.path, where Flower puts the app directory, with the current
directory added at the end (as `python -m` would), so a module beside the command is found.
"""

from __future__ import annotations

import importlib
import inspect
import os
import sys
from collections.abc import Callable
from typing import Any

from fedstale.common.config import ConfigError, is_reference

__all__ = ["accepts", "call", "describe", "is_reference", "resolve"]
NOT_FOUND_HINT = (
    "install it, run from its directory or put that directory on PYTHONPATH "
    "(docs/running.md, 'Your own model and data')"
)


def _import(module_name: str) -> Any:
    cwd = os.getcwd()
    if cwd not in sys.path and "" not in sys.path:
        sys.path.append(cwd)
        importlib.invalidate_caches()
    try:
        return importlib.import_module(module_name)
    except ModuleNotFoundError as err:
        # Not found itself (or a parent package), or a module it imports is missing?
        parts = module_name.split(".")
        prefixes = {".".join(parts[: i + 1]) for i in range(len(parts))}
        if err.name in prefixes:
            raise ConfigError(f"module '{module_name}' not found; {NOT_FOUND_HINT}") from None
        raise ConfigError(f"importing '{module_name}' failed: {err}") from None
    except Exception as err:  # the user's module raised while importing
        raise ConfigError(f"importing '{module_name}' failed: {describe(err)}") from None


def describe(err: BaseException) -> str:
    """An exception as one line: its type and first line of message."""
    message = str(err).strip().splitlines()
    return f"{type(err).__name__}: {message[0]}" if message else type(err).__name__


def resolve(key: str, reference: str) -> Callable[..., Any]:
    """The callable `reference` names, or one ConfigError line prefixed with
    '<key>=<reference>: '."""
    try:
        module_name, attribute = reference.split(":", 1)
        target: Any = _import(module_name)
        for part in attribute.split("."):
            if not hasattr(target, part):
                raise ConfigError(f"module '{module_name}' has no attribute '{attribute}'")
            target = getattr(target, part)
        if not callable(target):
            raise ConfigError(f"'{attribute}' is a {type(target).__name__}, not a function")
    except ConfigError as err:
        raise ConfigError(f"{key}={reference}: {err}") from None
    return target


def call(key: str, reference: str, function: Callable[..., Any], *args: Any) -> Any:
    """`function(*args)`; an exception it raises becomes one ConfigError line."""
    try:
        return function(*args)
    except ConfigError:
        raise
    except Exception as err:
        raise ConfigError(f"{key}={reference}: raised {describe(err)}") from None


def accepts(function: Callable[..., Any], *args: Any) -> bool:
    """`function` can be called with exactly these positional arguments."""
    try:
        inspect.signature(function).bind(*args)
    except TypeError:
        return False
    except ValueError:  # no signature (a builtin): let the call decide
        return True
    return True
