"""A user's own model, dataset, loss and metric, named in the run config as
'package.module:function' (tests/own_task.py): the same run in Flower simulation and with
`fedstale run --local`, a regression end to end, and one-line errors at `fedstale check`."""

from __future__ import annotations

import json
import shutil
import subprocess
from pathlib import Path

import pytest

from fedstale.common.config import ConfigError
from fedstale.launcher.cli import main
from fedstale.launcher.compare import main as compare_main
from fedstale.launcher.launch import flower_env, parse_pairs, tool
from fedstale.launcher.local import local_transport
from fedstale.server_app.experiment import run_experiment
from fedstale.server_app.results import read_jsonl
from fedstale.strategies.registry import load_config
from tests import timing
from tests.flower_procs import SimulationSuperLink

ROOT = Path(__file__).resolve().parent.parent
TINY = (
    "num-clients=4 concurrency=2 buffer-size=2 local-epochs=1 lr=0.1 "
    "max-virtual-time=2000 eval-interval=500 seed=4"
)
BLOBS = f"dataset=own_task:blobs model=own_task:net partition=dirichlet {TINY}"
LINE = "dataset=tests.own_task:line loss=mse metric=tests.own_task:neg_mae"
# Modules of a user's that go wrong, written beside the test (never inside fedstale/).
WRONG = """
import torch

def as_dict():
    return {"x": 1}

def text_model(input_shape, num_outputs):
    return "a model"

def float_loss(output, target):
    return 0.5

def text_metric(output, target):
    return "good"
"""
BROKEN = "import no_such_dependency_of_theirs\n"
OWN = "dataset=tests.own_task:blobs model=tests.own_task:net"
NOT_FOUND = (
    "module 'no_such_pkg.data' not found; install it, run from its directory or put that "
    "directory on PYTHONPATH (docs/running.md, 'Your own model and data')"
)


def user_code(folder: Path) -> Path:
    """tests/own_task.py as a user has it: a module in a folder of their own."""
    folder.mkdir(parents=True, exist_ok=True)
    shutil.copy(ROOT / "tests" / "own_task.py", folder / "own_task.py")
    return folder


def without_wall(rows: list[dict]) -> list[dict]:
    return [{k: v for k, v in row.items() if k != "wall_time"} for row in rows]


@pytest.mark.integration
def test_own_model_and_data_give_the_same_run_in_flower_and_locally(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Flower simulation finds the module on PYTHONPATH, `--local` in the current
    directory; for a seed both give the same metrics and updates, line by line."""
    code = user_code(tmp_path / "code")
    runs = tmp_path / "runs"
    monkeypatch.setenv("PYTHONPATH", str(code))
    link = SimulationSuperLink(tmp_path / "flwr-home").start()
    try:
        flower, flower_dir = link.run_app(ROOT, runs, "sim", BLOBS, timing.left())
    finally:
        link.stop()
    assert flower.returncode == 0, flower.stderr[-3000:]
    monkeypatch.delenv("PYTHONPATH")
    command = [tool("fedstale"), "run", "--local", "--workers", "2", "--app", str(ROOT)]
    command += ["--run-config", f"{BLOBS} run-name=local runs-dir={runs}"]
    local = subprocess.run(
        command, cwd=code, env=flower_env(), capture_output=True, text=True, timeout=timing.left()
    )
    assert local.returncode == 0, local.stderr[-3000:]
    rows = without_wall(read_jsonl(flower_dir / "metrics.jsonl"))
    assert rows == without_wall(read_jsonl(runs / "local" / "metrics.jsonl"))
    updates = read_jsonl(flower_dir / "updates.jsonl")
    assert updates and updates == read_jsonl(runs / "local" / "updates.jsonl")
    assert len(rows) == 5 and rows[-1]["accuracy"] > max(0.6, rows[0]["accuracy"])
    config = json.loads((flower_dir / "config.json").read_text())
    assert (config["dataset"], config["model"]) == ("own_task:blobs", "own_task:net")


def test_a_regression_runs_end_to_end(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """Float targets, the built-in linear model (trainer=auto falls back to autograd for
    MSE), MSE loss and the user's metric (minus the mean absolute error)."""
    values = {
        **parse_pairs(f"{LINE} model=linear {TINY}"),
        "run-name": "line",
        "runs-dir": str(tmp_path),
    }
    run, params = load_config(values)
    summary = run_experiment(run, params, local_transport(run))
    rows = read_jsonl(tmp_path / "line" / "metrics.jsonl")
    assert [row["virtual_time"] for row in rows] == [0.0, 500.0, 1000.0, 1500.0, 2000.0]
    # The score is stored and shown under the metric's name, never as "accuracy".
    assert rows[0]["neg_mae"] < -1.0 < rows[-1]["neg_mae"] < 0.0  # |error| shrinks
    assert not any("accuracy" in key for row in rows for key in row)
    assert rows[-1]["loss"] < rows[0]["loss"] / 10  # the test-set MSE
    assert summary["metric"] == "neg_mae" and summary["final_neg_mae"] == rows[-1]["neg_mae"]
    assert not any("accuracy" in key for key in summary)
    config = json.loads((tmp_path / "line" / "config.json").read_text())
    assert config["test-split-effective"] == "holdout"  # the loader gave no test split
    assert compare_main([str(tmp_path / "line"), "--out", str(tmp_path / "cmp")]) == 0
    table = capsys.readouterr().out
    assert "final neg_mae" in table and f"{summary['final_neg_mae']:.2f}" in table


def check(config: str, capsys: pytest.CaptureFixture[str]) -> tuple[int, list[str]]:
    """`fedstale check` as a user runs it: exit code and stderr lines."""
    code = main(["check", "--app", str(ROOT), "--run-config", f"{config} {TINY}"])
    return code, [line for line in capsys.readouterr().err.splitlines() if line.strip()]


def test_check_accepts_own_code_and_a_factory_without_arguments(
    capsys: pytest.CaptureFixture[str],
) -> None:
    assert check(OWN, capsys) == (0, ["fedstale: config ok (fedbuff on tests.own_task:blobs)"])
    regression = f"{LINE} model=tests.own_task:linear partition=quantity-dirichlet"
    assert check(regression, capsys)[0] == 0


@pytest.mark.parametrize(
    ("config", "line"),
    [
        ("dataset=no_such_pkg.data:load", f"dataset=no_such_pkg.data:load: {NOT_FOUND}"),
        (
            "dataset=tests.own_task:nope",
            "dataset=tests.own_task:nope: module 'tests.own_task' has no attribute 'nope'",
        ),
        (
            "dataset=own_broken:load",
            "dataset=own_broken:load: importing 'own_broken' failed: "
            "No module named 'no_such_dependency_of_theirs'",
        ),
        (
            "dataset=own_wrong:as_dict",
            "dataset=own_wrong:as_dict: returned a dict; expected (x_train, y_train, x_test, "
            "y_test) numpy arrays (the test pair may be None)",
        ),
        (
            "dataset=tests.own_task:blobs model=own_wrong:text_model",
            "model=own_wrong:text_model: returned a str; expected a torch.nn.Module with "
            "parameters",
        ),
        (
            f"{OWN} loss=own_wrong:float_loss",
            "loss=own_wrong:float_loss: returned a float; expected a scalar torch.Tensor that "
            "autograd can differentiate (the batch's mean loss)",
        ),
        (
            f"{OWN} metric=own_wrong:text_metric",
            "metric=own_wrong:text_metric: returned a str; expected a float (higher is better)",
        ),
        (
            f"{LINE} partition=dirichlet",
            "dataset=tests.own_task:line: partition=dirichlet splits by class label and these "
            "labels are float32 targets (regression); use partition=iid or quantity-dirichlet",
        ),
        (
            "dataset=tests.own_task:line metric=neg-mse",
            "dataset=tests.own_task:line: loss=cross-entropy needs integer class labels and "
            "the dataset gives float targets; use loss=mse metric=neg-mse (or your own)",
        ),
        (
            f"{OWN} strategy=fedpsa loss=mse",
            "run config: strategy fedpsa needs loss=cross-entropy on class labels (its "
            "sensitivity sketches are cross-entropy gradients); loss is 'mse'; fix it in "
            "[tool.flwr.app.config] of pyproject.toml or with --run-config",
        ),
    ],
)
def test_check_reports_a_wrong_own_code_in_one_line(
    config: str,
    line: str,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    (tmp_path / "own_wrong.py").write_text(WRONG)
    (tmp_path / "own_broken.py").write_text(BROKEN)
    monkeypatch.syspath_prepend(str(tmp_path))
    assert check(config, capsys) == (2, [f"fedstale: {line}"])


def test_the_server_refuses_a_missing_module_in_the_same_line(tmp_path: Path) -> None:
    """What the ServerApp logs before it exits 2 (fedstale/server_app/app.py)."""
    values = {**parse_pairs(f"dataset=no_such_pkg.data:load {TINY}"), "runs-dir": str(tmp_path)}
    run, params = load_config({**values, "run-name": "refused"})
    with pytest.raises(ConfigError) as info:
        run_experiment(run, params, local_transport(run))
    assert str(info.value) == f"dataset=no_such_pkg.data:load: {NOT_FOUND}"
    assert not (tmp_path / "refused").exists()
