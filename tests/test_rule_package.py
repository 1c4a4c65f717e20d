"""A rule from another installed package, declared through the entry point group
`fedstale.rules`, runs in every door with no edit to fedstale and no monkeypatching:
`fedstale run --local`, Flower simulation and a deployment with fedstale's app, and
`fedstale.<Rule>` as a library strategy over a plain Flower ClientApp (the quickstart's);
from a fresh virtualenv that holds fedstale's wheel and the package as pip installs them."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest

from fedstale.server_app.results import read_jsonl
from fedstale.strategies.base import View
from tests.helpers import rule_package, run_config, update

ROOT = Path(__file__).resolve().parent.parent
QUICKSTART = ROOT / "examples" / "async-quickstart"
# The package of docs/architecture.md, "Write a rule as a package": its rule module and its
# pyproject.toml, taken from that page so that what the docs show is what is tested.
GUIDE = (ROOT / "docs" / "architecture.md").read_text().split("### Write a rule as a package")[1]


def fenced(first_line: str) -> str:
    """The fenced block of the guide that starts with `first_line`."""
    (block,) = [b.split("```", 1)[0] for b in GUIDE.split("\n" + first_line + "\n")[1:]]
    return block


MEDIAN_BUFFER = fenced("# mypackage/median_buffer.py")
PYPROJECT = fenced("# pyproject.toml")
RUN = "dataset=digits num-clients=6 concurrency=3 buffer-size=3 lr=0.1 max-versions=6"


@pytest.fixture(scope="module")
def package(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    """The package on a folder of its own, its dist-info naming the entry point; this
    process sees it too (the registry read afresh) for the unit checks."""
    folder = tmp_path_factory.mktemp("site")
    (folder / "median_buffer.py").write_text(MEDIAN_BUFFER)
    with rule_package(folder, "median_buffer:RULES", "median-buffer"):
        yield folder


def test_the_package_rule_is_registered_checked_and_exported(package: Path) -> None:
    import fedstale
    from fedstale.common.config import ConfigError
    from fedstale.strategies.registry import STRATEGIES, load_config, package_keys

    assert STRATEGIES["median-buffer"].__module__ == "median_buffer"
    _, params = load_config({"strategy": "median-buffer", "median-scale": 0.5, "buffer-size": 3})
    assert params.model_dump(by_alias=True) == {"buffer-size": 3, "median-scale": 0.5}
    with pytest.raises(ConfigError) as bad:  # the package's key, fixed where its user can
        load_config({"strategy": "fedbuff", "median-scale": -1})
    assert "a key of rule 'median-buffer' (median_buffer): fix it with --run-config" in str(
        bad.value
    ) and "tool.flwr" not in str(bad.value)
    assert package_keys() == {"median-scale": 1.0}
    assert "MedianBuffer" in fedstale.__all__
    assert fedstale.MedianBuffer.rule == "median-buffer"
    rule = STRATEGIES["median-buffer"](run_config(), params, np.zeros(2))
    for vector in ([1.0, 0.0], [3.0, 10.0], [2.0, -4.0]):
        outcome = rule.on_update(update(vector), View())
    assert outcome.changed
    np.testing.assert_allclose(rule.model, [1.0, 0.0])  # 0.5 * median ([2, 0])


def test_a_broken_package_is_left_out_with_one_line(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    from fedstale.strategies.registry import STRATEGIES

    with rule_package(tmp_path, "no_such_module:RULES", "broken"):
        assert "fedbuff" in STRATEGIES
    assert "rule package broken (no_such_module:RULES) left out" in caplog.text
    (tmp_path / "other").mkdir()
    (tmp_path / "other" / "taken.py").write_text(MEDIAN_BUFFER.replace("median-buffer", "fedbuff"))
    with rule_package(tmp_path / "other", "taken:RULES", "taken"):
        assert STRATEGIES["fedbuff"].__module__ == "fedstale.strategies.fedbuff"
    assert "rule 'fedbuff' of taken left out: fedstale.strategies.fedbuff has that name" in (
        caplog.text
    )


def test_a_package_cannot_replace_a_library_class(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """A rule named 'hijack' declaring library="FedBuff" would have made `fedstale.FedBuff`
    its own; it is left out with one line naming both, and FedBuff stays fedstale's."""
    import fedstale
    from fedstale.strategies.registry import STRATEGIES

    hijack = MEDIAN_BUFFER.replace("median-buffer", "hijack").replace(
        'library="MedianBuffer"', 'library="FedBuff"'
    )
    (tmp_path / "hijack.py").write_text(hijack)
    with rule_package(tmp_path, "hijack:RULES", "hijack"):
        assert "hijack" not in STRATEGIES
        assert fedstale.FedBuff.rule == "fedbuff"
    said = [line for line in caplog.text.splitlines() if "hijack" in line]
    assert len(said) == 1 and (
        "rule 'hijack' of hijack left out: fedstale.FedBuff is rule 'fedbuff' of "
        "fedstale.strategies.fedbuff's" in said[0]
    ), said


def check_run(folder: Path) -> None:
    summary = json.loads((folder / "summary.json").read_text())
    assert summary["strategy"] == "median-buffer"
    assert (summary["versions"], summary["updates_rejected"]) == (6, 0)
    assert all(
        row["weight"] == pytest.approx(1 / 3) for row in read_jsonl(folder / "updates.jsonl")
    )


# ---------------------------------------------------------------- from a fresh virtualenv
# The package as its author ships it: a project with an entry point, pip-installed into the
# virtualenv that holds only torch and fedstale's wheel (tests/wheel_env.py, "newest"),
# then run in the three doors from a directory outside the checkout.
def write_project(root: Path, renamed: dict[str, str] | None = None) -> Path:
    """The guide's package in `root`, each text of `renamed` replaced in both files."""
    texts = {"median_buffer.py": MEDIAN_BUFFER, "pyproject.toml": PYPROJECT}
    for old, new in (renamed or {}).items():
        texts = {file: text.replace(old, new) for file, text in texts.items()}
    name = (renamed or {}).get("mypackage", "mypackage")
    (root / name / name).mkdir(parents=True)
    (root / name / name / "__init__.py").write_text("")
    (root / name / name / "median_buffer.py").write_text(texts["median_buffer.py"])
    (root / name / "pyproject.toml").write_text(texts["pyproject.toml"])
    return root / name


@pytest.fixture(scope="module")
def fresh(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    """The wheel's "newest" virtualenv with the package pip-installed (uninstalled after,
    for the other tests that share the virtualenv); its bin folder."""
    from tests.wheel_env import installed, run

    bin_dir = installed()[1]["newest"]
    root = tmp_path_factory.mktemp("projects")
    run([bin_dir / "pip", "install", "-q", write_project(root)], 600)
    try:
        yield bin_dir
    finally:
        run([bin_dir / "pip", "uninstall", "-q", "-y", "mypackage", "hijack"], 300)


@pytest.mark.integration
@pytest.mark.xdist_group("venvs")
def test_from_a_fresh_venv_the_package_runs_locally_and_is_listed(
    fresh: Path, tmp_path: Path
) -> None:
    from tests.wheel_env import elsewhere, run

    here = elsewhere(tmp_path)
    config = f"{RUN} strategy=median-buffer run-name=local"
    run([fresh / "fedstale", "run", "--local", "--run-config", config], 300, here)
    check_run(here / "runs" / "local")
    listed = run([fresh / "fedstale", "check"], 120, here)
    said = (
        "fedstale: installed rule 'median-buffer' from mypackage.median_buffer (median-scale=1.0)"
    )
    assert said in listed
    bad = run([fresh / "fedstale", "check", "--run-config", "median-scale=-1"], 120, here, code=2)
    assert bad.strip().count("\n") == 0, bad
    assert (
        "a key of rule 'median-buffer' (mypackage.median_buffer): fix it with --run-config" in bad
    )


@pytest.mark.integration
@pytest.mark.xdist_group("venvs")
def test_from_a_fresh_venv_flower_simulation_takes_the_package_and_its_key(
    fresh: Path, tmp_path: Path
) -> None:
    """fedstale's app in Flower simulation, with the package's own key: Flower accepts it
    only when the app names it, so `fedstale run` hands Flower a copy of the app that
    declares it (launch.flower_app). Also the newest bound's simulation (tests/test_bounds.py
    runs the lower one): the environment's versions and the installed code ran."""
    from tests.wheel_env import elsewhere, simulate_outside_the_checkout

    here = elsewhere(tmp_path)
    config = f"{RUN} strategy=median-buffer median-scale=0.5"
    folder = simulate_outside_the_checkout(fresh, "newest", config, "sim", here, tmp_path / "home")
    check_run(folder)
    assert json.loads((folder / "config.json").read_text())["median-scale"] == 0.5


@pytest.mark.integration
@pytest.mark.xdist_group("venvs")
def test_from_a_fresh_venv_a_deployment_takes_the_package_and_its_key(
    fresh: Path, tmp_path: Path
) -> None:
    """`fedstale deploy`: a real SuperLink and two SuperNodes, whose ClientApps load the
    package's rule too, with the package's own key (the newest bound's deployment)."""
    from tests.wheel_env import elsewhere, run

    here = elsewhere(tmp_path)
    config = "strategy=median-buffer median-scale=0.5 dataset=digits buffer-size=2 "
    config += "max-virtual-time=0 eval-interval=500 max-updates=4 run-name=deployed"
    command = [fresh / "fedstale", "deploy", "--nodes", "2", "--timeout", "900"]
    run([*command, "--run-config", config], 1000, here, {"TMPDIR": str(tmp_path)})
    folder = here / "runs" / "deployed"
    summary = json.loads((folder / "summary.json").read_text())
    assert (summary["strategy"], summary["updates_accepted"]) == ("median-buffer", 4)
    assert json.loads((folder / "config.json").read_text())["median-scale"] == 0.5


@pytest.mark.integration
@pytest.mark.xdist_group("venvs")
def test_from_a_fresh_venv_the_library_offers_the_package_rule(fresh: Path, tmp_path: Path) -> None:
    """The quickstart's ServerApp with `from fedstale import MedianBuffer`, copied outside
    the checkout and run by that virtualenv's `flwr run` on a simulation SuperLink of that
    virtualenv: the wheel's library door at the newest bound."""
    import shutil

    from tests.environments import flwr_run_in_simulation
    from tests.wheel_env import elsewhere

    here = elsewhere(tmp_path)
    app = tmp_path / QUICKSTART.name
    shutil.copytree(QUICKSTART, app, ignore=shutil.ignore_patterns("__pycache__"))
    server = next(app.glob("*/server_app.py"))
    server.write_text(server.read_text().replace("FedBuff", "MedianBuffer"))
    output = flwr_run_in_simulation(fresh, app, here, tmp_path / "home", 300)
    assert "Successfully started run" in output
    (folder,) = (here / "runs").iterdir()
    summary = json.loads((folder / "summary.json").read_text())
    assert summary["strategy"] == "median-buffer", output[-3000:]
    assert (summary["versions"], summary["updates_rejected"]) == (3, 0)
    assert (here / "final_model.pt").stat().st_size > 0


@pytest.mark.integration
@pytest.mark.xdist_group("venvs")
def test_from_a_fresh_venv_a_hijack_is_refused(fresh: Path, tmp_path: Path) -> None:
    """A second installed package whose rule declares library="FedBuff": left out with one
    line naming both, `fedstale.FedBuff` still fedstale's, the first package untouched."""
    from tests.wheel_env import elsewhere, run

    here = elsewhere(tmp_path)
    claims = {"mypackage": "hijack", "median-buffer": "hijack"}
    claims['library="MedianBuffer"'] = 'library="FedBuff"'
    run([fresh / "pip", "install", "-q", write_project(tmp_path, claims)], 600)
    code = "import fedstale; print(fedstale.FedBuff.rule, fedstale.MedianBuffer.rule)"
    output = run([fresh / "python", "-c", code], 120, here)
    said = [line for line in output.splitlines() if "hijack" in line]
    assert len(said) == 1 and (
        "rule 'hijack' of hijack.median_buffer left out: fedstale.FedBuff is rule 'fedbuff' of "
        "fedstale.strategies.fedbuff's" in said[0]
    ), output
    assert output.strip().splitlines()[-1] == "fedbuff median-buffer"


def test_a_rule_package_imports_only_the_public_authoring_module() -> None:
    """The package here and the README's rule import nothing of fedstale but `fedstale.rules`,
    whose every name resolves."""
    import ast

    import fedstale.rules

    readme = (ROOT / "README.md").read_text()
    block = readme.split("This block is run by `tests/test_readme_strategy.py`")[1]
    block = block.split("```python\n", 1)[1].split("```", 1)[0]
    for source in (MEDIAN_BUFFER, block):
        tree = ast.parse(source)
        modules = {node.module for node in ast.walk(tree) if isinstance(node, ast.ImportFrom)}
        assert {m for m in modules if m and m.startswith("fedstale")} == {"fedstale.rules"}
    assert all(hasattr(fedstale.rules, name) for name in fedstale.rules.__all__)
