"""A rule from another installed package, declared through the entry point group
`fedstale.rules`, runs in every door with no edit to fedstale and no monkeypatching:
`fedstale run --local`, Flower simulation with fedstale's app, and `fedstale.<Rule>` as a
library strategy over a plain Flower ClientApp (the quickstart's)."""

from __future__ import annotations

import json
import os
import subprocess
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest

from fedstale.launcher.deploy import CONNECTION
from fedstale.launcher.launch import tool
from fedstale.server_app.results import read_jsonl
from fedstale.strategies.base import View
from tests.flower_procs import SimulationSuperLink
from tests.helpers import rule_package, run_config, update

ROOT = Path(__file__).resolve().parent.parent
QUICKSTART = ROOT / "examples" / "async-quickstart"
# The package: one file, its declaration at the end, nothing of fedstale edited.
MEDIAN_BUFFER = '''
import numpy as np
from pydantic import Field

from fedstale.rules import Buffer, KebabModel, Outcome, Rule, Strategy, Update, View
from fedstale.rules import update_record


class MedianParams(KebabModel):
    median_scale: float = Field(1.0, gt=0)


class MedianBuffer(Strategy):
    """K deltas buffered; w <- w + scale * their coordinate-wise median."""

    name = "median-buffer"
    Params = MedianParams
    kept = ("buffer",)

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.buffer: Buffer[Update] = Buffer(self.run.buffer_size)

    def on_update(self, update: Update, view: View) -> Outcome:
        batch = self.buffer.add(update)
        if batch is None:
            return Outcome()
        step = np.median(np.stack([u.vector for u in batch]), axis=0)
        self.model = (self.model + self.params.median_scale * step).astype(np.float32)
        return Outcome(True, [update_record(u, 1.0 / len(batch)) for u in batch])


RULES = (Rule(MedianBuffer, library="MedianBuffer", about=MedianBuffer.__doc__ or ""),)
'''
RUN = "dataset=digits num-clients=6 concurrency=3 buffer-size=3 lr=0.1 max-versions=6"


@pytest.fixture(scope="module")
def package(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    """The package on a folder of its own, its dist-info naming the entry point; this
    process sees it too (the registry read afresh) for the unit checks."""
    folder = tmp_path_factory.mktemp("site")
    (folder / "median_buffer.py").write_text(MEDIAN_BUFFER)
    with rule_package(folder, "median_buffer:RULES", "median-buffer"):
        yield folder


def with_package(folder: Path) -> dict[str, str]:
    path = os.pathsep.join(p for p in (str(folder), os.environ.get("PYTHONPATH", "")) if p)
    return {"PYTHONPATH": path}


def test_the_package_rule_is_registered_checked_and_exported(package: Path) -> None:
    import fedstale
    from fedstale.common.config import ConfigError
    from fedstale.strategies.registry import STRATEGIES, load_config, package_keys

    assert STRATEGIES["median-buffer"].__module__ == "median_buffer"
    _, params = load_config({"strategy": "median-buffer", "median-scale": 0.5})
    assert params.model_dump(by_alias=True) == {"median-scale": 0.5}
    with pytest.raises(ConfigError) as bad:  # the package's key, fixed where its user can
        load_config({"strategy": "fedbuff", "median-scale": -1})
    assert "a key of rule 'median-buffer' (median_buffer): fix it with --run-config" in str(
        bad.value
    ) and "tool.flwr" not in str(bad.value)
    assert package_keys() == {"median-scale": 1.0}
    assert "MedianBuffer" in fedstale.__all__
    assert fedstale.MedianBuffer.rule == "median-buffer"
    rule = STRATEGIES["median-buffer"](run_config(buffer_size=3), params, np.zeros(2))
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


@pytest.mark.integration
def test_fedstale_run_local_runs_the_package_rule(package: Path, tmp_path: Path) -> None:
    command = [tool("fedstale"), "run", "--local", "--app", str(ROOT), "--run-config"]
    command += [f"{RUN} strategy=median-buffer run-name=local runs-dir={tmp_path}"]
    env = {**os.environ, **with_package(package)}
    result = subprocess.run(command, env=env, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    check_run(tmp_path / "local")
    listed = subprocess.run(
        [tool("fedstale"), "check", "--app", str(ROOT)],
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert listed.returncode == 0, listed.stderr[-2000:]
    said = "fedstale: installed rule 'median-buffer' from median_buffer (median-scale=1.0)"
    assert said in listed.stderr


def check_run(folder: Path) -> None:
    summary = json.loads((folder / "summary.json").read_text())
    assert summary["strategy"] == "median-buffer"
    assert (summary["versions"], summary["updates_rejected"]) == (6, 0)
    assert all(
        row["weight"] == pytest.approx(1 / 3) for row in read_jsonl(folder / "updates.jsonl")
    )


@pytest.fixture(scope="module")
def link(package: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[SimulationSuperLink]:
    """A simulation SuperLink whose processes (ServerApp, ClientApps) see the package;
    started in a folder of its own, where the library's example writes its runs/."""
    work = tmp_path_factory.mktemp("work")
    here = Path.cwd()
    os.chdir(work)
    try:
        started = SimulationSuperLink(work / "home", **with_package(package)).start()
    finally:
        os.chdir(here)
    yield started
    started.stop()


@pytest.mark.integration
def test_flower_simulation_with_fedstale_app_runs_the_package_rule(
    link: SimulationSuperLink, tmp_path: Path
) -> None:
    """With the package's own key: Flower accepts it only when the app names it, so
    `fedstale run` hands Flower a copy of the app that declares it (launch.flower_app)."""
    config = f"{RUN} strategy=median-buffer median-scale=0.5"
    result, folder = link.run_app(ROOT, tmp_path, "sim", config, 420)
    assert result.returncode == 0, result.stderr[-3000:]
    check_run(folder)
    assert json.loads((folder / "config.json").read_text())["median-scale"] == 0.5


@pytest.mark.integration
def test_the_library_offers_the_package_rule_over_a_plain_clientapp(
    link: SimulationSuperLink, tmp_path: Path
) -> None:
    """The quickstart's ServerApp with `from fedstale import MedianBuffer`."""
    import shutil

    app = tmp_path / QUICKSTART.name
    shutil.copytree(QUICKSTART, app, ignore=shutil.ignore_patterns("__pycache__"))
    server = next(app.glob("*/server_app.py"))
    server.write_text(server.read_text().replace("FedBuff", "MedianBuffer"))
    work = Path(link.link.home).parent
    before = set((work / "runs").iterdir()) if (work / "runs").exists() else set()
    command = [tool("flwr"), "run", str(app), CONNECTION, "--stream"]
    command += ["--run-config", "num-server-rounds=3"]
    command += ["--federation-config", "num-supernodes=4 client-resources-num-cpus=1"]
    result = subprocess.run(
        command, env=link.env, capture_output=True, text=True, timeout=300, check=False
    )
    assert result.returncode == 0, result.stderr[-3000:]
    (run,) = set((work / "runs").iterdir()) - before
    summary = json.loads((run / "summary.json").read_text())
    assert summary["strategy"] == "median-buffer", (result.stdout + result.stderr)[-3000:]
    assert (summary["versions"], summary["updates_rejected"]) == (3, 0)


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
