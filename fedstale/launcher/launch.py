"""What `fedstale run` and `fedstale deploy` share: reading `k=v` configs, the app's
defaults, the validated run config, and the environment Flower's processes need."""

from __future__ import annotations

import os
import re
import shutil
import sys
import tomllib
from pathlib import Path
from typing import Any

from fedstale.common.config import ConfigError, RunConfig
from fedstale.server_app.results import run_name, runs_root
from fedstale.strategies.registry import load_config

PAIR = re.compile(r"(\S+?)=('[^']*'|\"[^\"]*\"|\S+)")


def parse_pairs(text: str) -> dict[str, Any]:
    """`k=v k2=v2` -> dict, values read as TOML, bare words taken as strings; a key given
    twice is refused (which one was meant?)."""
    values: dict[str, Any] = {}
    for key, raw in PAIR.findall(text or ""):
        if key in values:
            raise ConfigError(
                f"'{key}' is given twice in '{text.strip()}'; give each key once "
                "(a later --run-config overrides an earlier one)"
            )
        try:
            values[key] = tomllib.loads(f"v = {raw}")["v"]
        except tomllib.TOMLDecodeError:
            values[key] = raw.strip("'\"")
    leftover = PAIR.sub("", text or "").strip()
    if leftover:
        raise ConfigError(f"cannot read '{leftover}' in the config; write key=value pairs")
    return values


def merged_pairs(texts: list[str] | None) -> dict[str, Any]:
    """Several `k=v` strings (repeated --run-config), later ones overriding earlier ones."""
    merged: dict[str, Any] = {}
    for text in texts or []:
        merged.update(parse_pairs(text))
    return merged


def federation_options(text: str) -> dict[str, Any]:
    """`--federation-config` pairs, each a key and value Flower's simulation takes, or one
    ConfigError line."""
    from flwr.proto.federation_config_pb2 import SimulationConfig
    from flwr.supercore.utils import simulation_config_from_json

    values = parse_pairs(text)
    known = sorted(f.name.replace("_", "-") for f in SimulationConfig.DESCRIPTOR.fields)
    for key in values:
        if key not in known:
            raise ConfigError(
                f"--federation-config: Flower's simulation has no key '{key}'; "
                f"its keys are {', '.join(known)}"
            )
    try:
        simulation_config_from_json({k.replace("-", "_"): v for k, v in values.items()})
    except (ValueError, TypeError) as err:
        raise ConfigError(f"--federation-config '{text.strip()}': {err}") from None
    return values


def to_flower(values: dict[str, Any]) -> str:
    """dict -> the `k=v` string Flower parses (strings quoted)."""
    parts = []
    for key, value in values.items():
        if isinstance(value, str):
            parts.append(f'{key}="{value}"')
        elif isinstance(value, bool):
            parts.append(f"{key}={str(value).lower()}")
        else:
            parts.append(f"{key}={value}")
    return " ".join(parts)


def app_defaults(app: Path) -> dict[str, Any]:
    pyproject = app / "pyproject.toml"
    if not pyproject.is_file():
        raise ConfigError(f"no pyproject.toml in {app}; pass --app with the fedstale directory")
    return tomllib.loads(pyproject.read_text())["tool"]["flwr"]["app"]["config"]


def resolve(app: Path, overrides: dict[str, Any]) -> tuple[RunConfig, dict[str, Any]]:
    """Validated config and the overrides to hand to Flower (run name and runs dir set)."""
    fused = {**app_defaults(app), **overrides}
    run, _ = load_config(fused)
    extra = dict(overrides)
    if not run.run_name:
        extra["run-name"] = run_name(run)
    if not run.runs_dir:
        extra["runs-dir"] = str(runs_root(str(app / "runs")))
    run, _ = load_config({**fused, **extra})
    return run, extra


def flower_env(**extra: str) -> dict[str, str]:
    """The environment Flower's processes need: this environment's console scripts first on
    PATH (flwr starts `flower-superlink`, which starts `flower-superexec`, from PATH) and no
    runtime dependency installation (else the SuperLink runs `uv sync`: a CUDA torch)."""
    path = os.pathsep.join([str(Path(sys.executable).parent), os.environ.get("PATH", "")])
    return {
        **os.environ,
        "PATH": path,
        "FLWR_DISABLE_RUNTIME_DEPENDENCY_INSTALLATION": "1",
        **extra,
    }


def tool(name: str) -> str:
    """A console script of this environment (beside the interpreter), else from PATH."""
    beside = Path(sys.executable).parent / name
    if beside.is_file():
        return str(beside)
    found = shutil.which(name)
    if found is None:
        raise ConfigError(f"'{name}' not found; install flwr[simulation]==1.41.0 (make setup)")
    return found
