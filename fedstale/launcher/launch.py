"""What `fedstale run` and `fedstale deploy` share: reading `k=v` configs, the app's
defaults, the validated run config, and the environment Flower's processes need."""

from __future__ import annotations

import json
import os
import re
import shutil
import sys
import tempfile
import tomllib
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from fedstale.common.config import (
    FIX_HINT,
    KEYS_HINT,
    ConfigError,
    KebabModel,
    RunConfig,
    RunSettings,
    score_words,
)
from fedstale.server_app.results import run_name, runs_root
from fedstale.strategies.registry import load_config

# The installed package; a wheel ships the repository's pyproject.toml (the app's components
# and defaults) and the docker/ scripts the launcher runs as package data in fedstale/app/.
PACKAGE = Path(__file__).resolve().parents[1]
PACKAGE_APP = PACKAGE / "app"
COMPONENTS = {
    "serverapp": "fedstale.server_app.app:app",
    "clientapp": "fedstale.client_app.app:app",
}
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
    from fedstale.launcher.flower_internals import SIMULATION_CONFIG, SIMULATION_FROM_JSON

    simulation_config, simulation_config_from_json = (
        SIMULATION_CONFIG.load(),
        SIMULATION_FROM_JSON.load(),
    )
    values = parse_pairs(text)
    known = sorted(f.name.replace("_", "-") for f in simulation_config.DESCRIPTOR.fields)
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


def is_app(folder: Path) -> bool:
    """`folder` holds a pyproject.toml describing fedstale's Flower app."""
    try:
        table = tomllib.loads((folder / "pyproject.toml").read_text())
    except (OSError, tomllib.TOMLDecodeError):
        return False
    return table.get("tool", {}).get("flwr", {}).get("app", {}).get("components") == COMPONENTS


def installed_app() -> Path:
    """The app that came with the package: the wheel's fedstale/app/, or, for an editable
    install, the checkout the package lives in."""
    for folder in (PACKAGE_APP, PACKAGE.parent):
        if is_app(folder):
            return folder
    raise ConfigError(
        f"this fedstale install has no app description ({PACKAGE_APP / 'pyproject.toml'}); "
        "reinstall the wheel or pass --app with the fedstale directory"
    )


def find_app(given: Path | None) -> Path:
    """--app; else the current directory when it is a fedstale app (a checkout); else the
    app installed with the package (its runs then go to ./runs)."""
    if given is not None:
        return given.resolve()
    here = Path.cwd()
    return here if is_app(here) else installed_app()


def hint_for(message: str, given: Path | None) -> str:
    """A config error's fix as it applies to how fedstale runs: a user of the app installed
    with the package (the wheel, no pyproject.toml of theirs) fixes it with --run-config."""
    try:
        app = find_app(given)
    except ConfigError:
        return message
    if app != PACKAGE_APP:
        return message
    keys = f"every key and its default: [tool.flwr.app.config] in {PACKAGE_APP / 'pyproject.toml'}"
    message = message.replace(KEYS_HINT, keys)
    return message.replace(FIX_HINT, "fix it with --run-config 'key=value'")


def runs_home(app: Path) -> Path:
    """Where runs go unless `runs-dir` says: the app's runs/, or ./runs for the app shipped
    inside the installed package (site-packages is no place for results)."""
    return Path.cwd() / "runs" if app == PACKAGE_APP else app / "runs"


@contextmanager
def flower_app(app: Path) -> Iterator[Path]:
    """The directory to hand `flwr run`: a temporary copy of `app` holding only what its FAB
    needs. Flower's `flwr run` walks every file under the folder it is given before it
    applies fab-include (a checkout's .venv and runs/: 3 s of CPU for each run), so an app
    with fab-include patterns is staged as the files they name and its pyproject.toml, the
    same FAB. The shipped app's copy drops the fab-include patterns (they name the
    checkout's files), so its FAB holds no code and the SuperLink's ServerApp and the
    ClientApps import the fedstale installed in their environment. When installed rule
    packages add keys the app's [tool.flwr.app.config] lacks, the copy declares them with
    their defaults (Flower refuses a run-config key its app does not name)."""
    missing = missing_package_keys(app)
    table = tomllib.loads((app / "pyproject.toml").read_text())
    flower = table["tool"]["flwr"]["app"]
    shipped = app == PACKAGE_APP
    included = [] if shipped else flower.get("fab-include", [])
    if not (shipped or missing or included):
        yield app
        return
    with tempfile.TemporaryDirectory(prefix="fedstale-app-") as folder:
        # A folder of its own: tempfile's names may hold "_", which `flwr build` refuses in
        # an app directory's name (letters, digits and hyphens only).
        staged = Path(folder) / "app"
        staged.mkdir()
        copy_included(app, staged, included)
        if shipped or missing:
            import tomli_w  # a dependency of flwr

            flower["config"].update(missing)
            if shipped:
                for key in ("fab-include", "fab-exclude"):
                    flower.pop(key, None)
            (staged / "pyproject.toml").write_text(tomli_w.dumps(table))
        else:
            shutil.copy2(app / "pyproject.toml", staged)
        yield staged


def missing_package_keys(app: Path) -> dict[str, Any]:
    """Installed packages' rule keys (with their defaults) that `app` does not declare."""
    from fedstale.strategies.registry import package_keys

    declared = app_defaults(app)
    return {key: value for key, value in package_keys().items() if key not in declared}


def copy_included(app: Path, folder: Path, patterns: list[str]) -> None:
    """The files of `app` that its fab-include patterns name, at the same relative paths."""
    for pattern in patterns:
        for found in app.glob(pattern):
            if found.is_file():
                target = folder / found.relative_to(app)
                target.parent.mkdir(parents=True, exist_ok=True)
                shutil.copy2(found, target)


def resolve(app: Path, overrides: dict[str, Any]) -> tuple[RunConfig, dict[str, Any]]:
    """Validated config and the overrides to hand to Flower (run name and runs dir set)."""
    fused = {**app_defaults(app), **overrides}
    run, _ = load_config(fused)
    extra = dict(overrides)
    if not run.run_name:
        extra["run-name"] = run_name(run)
    if not run.runs_dir:
        extra["runs-dir"] = str(runs_root(str(runs_home(app))))
    run, _ = load_config({**fused, **extra})
    return run, extra


def preflight(
    app: Path, pairs: dict[str, Any], federation: str = ""
) -> tuple[RunConfig, KebabModel, dict[str, Any]]:
    """Every check that can be made before a run starts (config, federation options, runs
    directory, the checkpoint to resume, an earlier run in the folder, the dataset): the
    validated config, the strategy's keys and the overrides for Flower, or one ConfigError
    line."""
    from fedstale.server_app.experiment import prepare

    run, overrides = resolve(app, pairs)
    federation_options(federation)
    _, params = load_config({**app_defaults(app), **overrides})
    prepare(run, params)
    return run, params, overrides


def report(run: RunSettings, run_dir: Path, started: float, failure: str) -> int:
    """The closing line (the result, or `failure`: what failed and how to resume) and the
    exit code."""
    if not finished(run_dir, started):
        print(failure, file=sys.stderr)
        return 1
    result = json.loads((run_dir / "summary.json").read_text())
    print(
        f"fedstale: {run.run_name}: {score_words(result, run.metric)}, results in {run_dir}",
        file=sys.stderr,
    )
    return 0


def finished(run_dir: Path, started: float) -> bool:
    """This run wrote its summary (a resumed run's folder may hold an older one)."""
    summary = run_dir / "summary.json"
    return summary.is_file() and summary.stat().st_mtime >= started


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
        raise ConfigError(f"'{name}' not found; install fedstale's dependencies (make setup)")
    return found
