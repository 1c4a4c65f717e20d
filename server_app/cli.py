"""`fedstale`: check a run config, then run the app in Flower simulation.

    fedstale check [--run-config "k=v ..."]
    fedstale run   [--run-config "k=v ..."] [--federation-config "k=v ..."] [--app DIR]
                   [--superlink NAME]
    fedstale deploy --nodes N [--delays s,s,...] [--tls] [--run-config "k=v ..."]
                   (a local SuperLink and N SuperNodes: server_app/deploy.py)

`flwr run` exits 0 even when the ServerApp fails, and only sees a bad value once the
simulation is up. `fedstale run` validates the fused config first (one line and exit 2 on a
problem), sizes the federation to `num-clients`, sends results to `<app>/runs/` and exits
non-zero unless the run wrote its summary. String values need no quotes here
(`strategy=fedasync` works; Flower itself wants `strategy='fedasync'`).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shlex
import shutil
import subprocess
import sys
import time
import tomllib
from pathlib import Path
from typing import Any

from common.config import ConfigError, RunConfig
from server_app.results import runs_root
from strategies.registry import load_config

PAIR = re.compile(r"(\S+?)=('[^']*'|\"[^\"]*\"|\S+)")


def parse_pairs(text: str) -> dict[str, Any]:
    """`k=v k2=v2` -> dict, values read as TOML, bare words taken as strings."""
    values: dict[str, Any] = {}
    for key, raw in PAIR.findall(text or ""):
        try:
            values[key] = tomllib.loads(f"v = {raw}")["v"]
        except tomllib.TOMLDecodeError:
            values[key] = raw.strip("'\"")
    leftover = PAIR.sub("", text or "").strip()
    if leftover:
        raise ConfigError(f"cannot read '{leftover}' in the config; write key=value pairs")
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
        extra["run-name"] = (
            f"{run.strategy}-{run.dataset}-s{run.seed}-{time.strftime('%Y%m%d-%H%M%S')}"
        )
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


def flower_command(
    app: Path, overrides: dict[str, Any], federation: str, run: RunConfig, superlink: str
) -> list[str]:
    fed_values = parse_pairs(federation)
    fed_values.setdefault("num-supernodes", run.num_clients)
    return [
        tool("flwr"),
        "run",
        str(app),
        *([superlink] if superlink else []),
        "--stream",
        "--run-config",
        to_flower(overrides),
        "--federation-config",
        to_flower(fed_values),
    ]


def run_simulation(app: Path, run_config: str, federation: str, superlink: str = "") -> int:
    run, overrides = resolve(app, parse_pairs(run_config))
    command = flower_command(app, overrides, federation, run, superlink)
    print("fedstale: " + shlex.join(command), file=sys.stderr)
    env = flower_env()
    started = time.time()
    subprocess.run(command, env=env, check=False)
    summary = runs_root(run.runs_dir) / run.run_name / "summary.json"
    if not summary.is_file() or summary.stat().st_mtime < started:
        print(f"fedstale: the run failed (no {summary}); see the log above", file=sys.stderr)
        return 1
    result = json.loads(summary.read_text())
    print(
        f"fedstale: {run.run_name}: final accuracy {result['final_accuracy']:.4f}, "
        f"best {result['best_accuracy']:.4f}, results in {summary.parent}",
        file=sys.stderr,
    )
    return 0


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["deploy"]:
        from server_app import deploy

        try:
            return deploy.main(argv[1:])
        except ConfigError as err:
            print(f"fedstale: {err}", file=sys.stderr)
            return 2
    parser = argparse.ArgumentParser(prog="fedstale", description=__doc__.split("\n\n")[0])
    parser.add_argument("command", choices=["check", "run", "deploy"])
    parser.add_argument("--run-config", default="", help="key=value pairs over the defaults")
    parser.add_argument("--federation-config", default="", help="Flower simulation options")
    parser.add_argument("--app", type=Path, default=Path.cwd(), help="the fedstale directory")
    parser.add_argument(
        "--superlink", default="", help="SuperLink connection name (default: Flower's default)"
    )
    args = parser.parse_args(argv)
    app = args.app.resolve()
    try:
        if args.command == "check":
            run, _ = resolve(app, parse_pairs(args.run_config))
            print(f"fedstale: config ok ({run.strategy} on {run.dataset})", file=sys.stderr)
            return 0
        return run_simulation(app, args.run_config, args.federation_config, args.superlink)
    except ConfigError as err:
        print(f"fedstale: {err}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
