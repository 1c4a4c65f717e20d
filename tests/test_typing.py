"""The library's classes as a type checker, an IDE and `help()` see them: each made of its
rule's `Params` and the library's arguments (pydantic models, PEP 681), typed, with their
defaults; mypy flags a misspelt argument and passes the examples' ServerApps."""

from __future__ import annotations

import inspect
import pydoc
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

import fedstale
from fedstale.common.config import RunConfig
from fedstale.server_app import library
from fedstale.strategies.registry import declarations, is_built_in
from tests import timing

ROOT = Path(__file__).resolve().parent.parent
SERVER_APPS = sorted(ROOT.glob("examples/*/*/server_app.py"))


def test_each_built_in_class_is_its_rules_keys_and_the_librarys_arguments() -> None:
    """library.py holds one short class per built-in rule with a library name (found from
    the registry), made of the rule's own Params, its capabilities' arguments and
    AsyncStrategy; nothing is generated."""
    from fedstale.server_app.flower_strategy import (
        AsyncStrategy,
        ServerModelArguments,
        TopologyArguments,
    )

    built_in = [r for r in declarations().values() if r.library and is_built_in(r)]
    assert len(built_in) == 12
    assert sorted(library.__all__) == sorted(r.library for r in built_in)  # what mypy sees
    for rule in built_in:
        cls = getattr(library, rule.library)
        assert cls.rule == rule.name and issubclass(cls, rule.strategy.Params)
        assert issubclass(cls, AsyncStrategy)
        assert issubclass(cls, ServerModelArguments) == rule.server_model
        assert issubclass(cls, TopologyArguments) == rule.topology
        assert rule.about.split()[0] in (cls.__doc__ or "")
    assert len(Path(library.__file__).read_text().splitlines()) < 100


def test_a_misspelt_or_wrong_argument_is_one_line_at_run_time() -> None:
    with pytest.raises(fedstale.ConfigError) as misspelt:
        fedstale.FedBuff(bufer_size=5)  # type: ignore[call-arg]
    assert (
        str(misspelt.value) == "FedBuff: unknown argument 'bufer_size'; did you mean 'buffer_size'?"
    )
    with pytest.raises(fedstale.ConfigError, match=r"^FedBuff: 'buffer_size' = 0: .*greater"):
        fedstale.FedBuff(buffer_size=0)


# What docs/library.md promises, written here rather than read from the code that makes the
# classes: the library's own defaults, and the arguments whose None means "from start()".
LIBRARY_OWN = {"clock": "wall", "lr_decay": 1.0, "max_virtual_time": 0.0}
FROM_START_ARGUMENTS = {
    "lr", "max_versions", "task_timeout", "task_ttl", "eval_interval", "num_clients"
}  # fmt: skip


def documented_defaults() -> dict[str, object]:
    """pyproject.toml's run config (what `flwr run` uses), keys in snake_case."""
    table = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["flwr"]["app"]
    return {key.replace("-", "_"): value for key, value in table["config"].items()}


def test_each_class_takes_its_rules_keys_and_every_rules_keys_with_their_defaults() -> None:
    """Every class takes every key a library run reads, keyword-only, with the default the
    docs give: pyproject.toml's, the library's own where it differs, None from `start`."""
    documented = documented_defaults()
    app_only = {key.replace("-", "_") for key in RunConfig.app_only_keys()} | {"strategy"}
    for rule in declarations().values():
        if not (rule.library and is_built_in(rule)):
            continue
        parameters = inspect.signature(getattr(fedstale, rule.library)).parameters
        keys = {*RunConfig.model_fields, *rule.strategy.Params.model_fields}
        for name in keys:
            if name in app_only:
                assert name not in parameters, (rule.library, name)
                continue
            expected = None if name in FROM_START_ARGUMENTS else LIBRARY_OWN.get(name)
            if expected is None and name not in FROM_START_ARGUMENTS:
                expected = documented[name]
            assert parameters[name].default == expected, (rule.library, name)
            assert parameters[name].kind is inspect.Parameter.KEYWORD_ONLY


def test_help_shows_the_arguments_and_given_defaults_are_not_settings() -> None:
    text = pydoc.render_doc(fedstale.FedBuff, renderer=pydoc.plaintext)
    parameters = inspect.signature(fedstale.FedBuff).parameters
    for name, kind, default in (("buffer_size", "int", 5), ("fedbuff_server_lr", "float", 1.0)):
        shown = str(parameters[name])
        assert shown.startswith(f"{name}: typing.Annotated[{kind},") and shown in text
        assert shown.endswith(f"= {default}")
    assert "Nguyen" in text
    assert fedstale.FedBuff(buffer_size=5, concurrency=4, lr=None).settings == {"concurrency": 4}
    assert fedstale.FedBuff(clock="virtual").settings == {"clock": "virtual"}


def mypy(*paths: Path) -> subprocess.CompletedProcess[str]:
    command = [sys.executable, "-m", "mypy", "--follow-imports=silent"]
    command += ["--ignore-missing-imports", "--no-incremental", *map(str, paths)]
    return subprocess.run(command, capture_output=True, text=True, timeout=timing.left(), cwd=ROOT)


@pytest.fixture(scope="module")
def checked(tmp_path_factory: pytest.TempPathFactory) -> subprocess.CompletedProcess[str]:
    """One mypy run over a user's snippet and the examples' ServerApps."""
    snippet = tmp_path_factory.mktemp("snippet") / "snippet.py"
    snippet.write_text(
        "import fedstale\n"
        "strategy = fedstale.FedBuff(bufer_size=5, concurrency=10)\n"
        "clocked = fedstale.FedAsync(clock='sundial')\n"
        "fine = fedstale.FedPSA(buffer_size=5, fedpsa_gamma=2.0, clock='virtual')\n"
        "wrapped = fedstale.DifferentialPrivacyServerSideFixedClipping(\n"
        "    fine, noise_multiplier=1.0, clipping_norm=0.5, num_sampled_clients=5)\n"
    )
    return mypy(snippet, *SERVER_APPS)


def test_mypy_flags_a_misspelt_argument_and_a_wrong_choice(
    checked: subprocess.CompletedProcess[str],
) -> None:
    errors = [line for line in checked.stdout.splitlines() if ": error:" in line]
    snippet = [line for line in errors if "snippet.py" in line]
    assert len(snippet) == 2, checked.stdout
    assert 'Unexpected keyword argument "bufer_size" for "FedBuff"' in snippet[0]
    assert 'did you mean "buffer_size"' in snippet[0]
    assert "\"Literal['virtual', 'wall']\"" in snippet[1]


def test_the_examples_server_apps_type_check_clean(
    checked: subprocess.CompletedProcess[str],
) -> None:
    assert len(SERVER_APPS) == 3
    errors = [line for line in checked.stdout.splitlines() if ": error:" in line]
    assert not [line for line in errors if "server_app.py" in line], checked.stdout


def test_the_package_is_marked_typed() -> None:
    assert (ROOT / "fedstale" / "py.typed").is_file()
