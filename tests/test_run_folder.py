"""A run folder keeps what a run made: a used run-name is refused (or, asked for, the earlier
run moved aside whole), a refused run leaves nothing behind, every check that can be made
before a run is made by `fedstale check`, and config.json says where a run came from."""

from __future__ import annotations

import gzip
import hashlib
import json
import subprocess
import sys
from pathlib import Path

import pytest

from fedstale.common.config import ConfigError
from fedstale.launcher.cli import main
from fedstale.launcher.launch import merged_pairs, parse_pairs
from fedstale.server_app.provenance import provenance
from fedstale.server_app.results import RUN_FILES
from tests import timing

ROOT = Path(__file__).resolve().parent.parent
TINY = (
    "dataset=digits num-clients=6 concurrency=3 buffer-size=2 lr=0.1 latency-min=1 latency-max=4 "
)
TINY += "max-virtual-time=40 eval-interval=10"


def fedstale(*argv: str) -> subprocess.CompletedProcess:
    """`fedstale ...` as a user runs it, from the checkout."""
    command = [sys.executable, "-m", "fedstale.launcher.cli", *argv]
    return subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=timing.left())


def local_run(
    runs: Path, name: str, *extra: str, config: str = TINY
) -> subprocess.CompletedProcess:
    pairs = f"{config} run-name={name} runs-dir={runs} checkpoint-every=2"
    return fedstale("run", "--local", "--workers", "1", "--run-config", pairs, *extra)


def fingerprint(folder: Path) -> dict[str, str]:
    return {
        path.name: hashlib.sha256(path.read_bytes()).hexdigest()
        for path in sorted(folder.iterdir())
        if path.is_file()
    }


def one_line(result: subprocess.CompletedProcess) -> str:
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    assert result.returncode == 2, result.stderr[-2000:]
    assert len(lines) == 1, lines
    return lines[0]


def test_a_used_run_name_is_refused_and_the_earlier_run_is_untouched(tmp_path: Path) -> None:
    first = local_run(tmp_path, "a")
    assert first.returncode == 0, first.stderr[-2000:]
    before = fingerprint(tmp_path / "a")
    assert {"config.json", "run.log", "summary.json", "checkpoint.pkl"} <= set(before)

    again = local_run(tmp_path, "a", config=TINY.replace("lr=0.1", "lr=0.2"))
    line = one_line(again)
    assert "already holds a run" in line and "--overwrite" in line and "resume-from=" in line
    assert fingerprint(tmp_path / "a") == before
    checked = fedstale("check", "--run-config", f"{TINY} run-name=a runs-dir={tmp_path}")
    assert "already holds a run" in one_line(checked)

    replaced = local_run(tmp_path, "a", "--overwrite", config=TINY.replace("lr=0.1", "lr=0.2"))
    assert replaced.returncode == 0, replaced.stderr[-2000:]
    (aside,) = tmp_path.glob("a.previous-*")
    assert fingerprint(aside) == before  # moved whole, not one file lost or mixed
    assert json.loads((tmp_path / "a" / "config.json").read_text())["lr"] == 0.2


def test_resuming_continues_the_same_folder(tmp_path: Path) -> None:
    assert local_run(tmp_path, "r").returncode == 0
    folder = tmp_path / "r"
    rows = (folder / "updates.jsonl").read_text().splitlines()
    longer = TINY.replace("max-virtual-time=40", "max-virtual-time=80")
    resumed = local_run(tmp_path, "r", config=f"{longer} resume-from={folder}")
    assert resumed.returncode == 0, resumed.stderr[-2000:]
    now = (folder / "updates.jsonl").read_text().splitlines()
    assert len(now) > len(rows) and not list(tmp_path.glob("r.previous-*"))
    assert "resumed from" in (folder / "run.log").read_text()


def test_a_resume_of_another_config_is_refused_before_anything_is_written(
    tmp_path: Path,
) -> None:
    assert local_run(tmp_path, "base").returncode == 0
    other = f"{TINY.replace('lr=0.1', 'lr=0.3')} resume-from={tmp_path / 'base'}"
    line = one_line(local_run(tmp_path, "other", config=other))
    assert "the checkpoint's run had lr=0.1, this one 0.3" in line
    assert not (tmp_path / "other").exists()
    plain = fedstale("check", "--run-config", f"{TINY} resume-from={tmp_path}")
    assert "no checkpoint at" in one_line(plain)


def test_a_missing_or_broken_dataset_is_one_line_and_no_folder(tmp_path: Path) -> None:
    data = tmp_path / "data" / "fmnist"
    data.mkdir(parents=True)
    for name in ("train-images", "train-labels", "t10k-images", "t10k-labels"):
        suffix = "idx3" if "images" in name else "idx1"
        with gzip.open(data / f"{name}-{suffix}-ubyte.gz", "wb") as handle:
            handle.write(b"not an idx file")
    config = f"dataset=fmnist data-dir={tmp_path / 'data'} max-virtual-time=100"
    for command in ("check", "run"):
        runs = tmp_path / command
        argv = ["--run-config", f"{config} run-name=x runs-dir={runs}"]
        line = one_line(fedstale(command, *(["--local"] if command == "run" else []), *argv))
        assert line.startswith("fedstale: dataset 'fmnist':") and "not an unsigned-byte IDX" in line
        assert not (runs / "x").exists()


def test_an_unwritable_runs_dir_is_one_line(tmp_path: Path) -> None:
    blocker = tmp_path / "file"
    blocker.write_text("")
    line = one_line(fedstale("check", "--run-config", f"runs-dir={blocker / 'runs'}"))
    assert "runs-dir: cannot create" in line


def test_check_writes_nothing(tmp_path: Path) -> None:
    """`fedstale check` only validates: no runs directory appears (the run makes it)."""
    runs = tmp_path / "deep" / "runs"
    result = fedstale("check", "--run-config", f"dataset=digits runs-dir={runs}")
    assert result.returncode == 0, result.stderr
    assert not any(tmp_path.iterdir())


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--run-config", "lr=0.1 lr=0.2"], "'lr' is given twice"),
        (["--federation-config", "num-supernode=5"], "no key 'num-supernode'"),
        (["--federation-config", "num-supernodes=many"], "--federation-config 'num-supernodes"),
    ],
)
def test_check_refuses_what_flower_would_take_silently(argv: list[str], message: str) -> None:
    assert message in one_line(fedstale("check", *argv))


def test_later_run_configs_override_earlier_ones() -> None:
    assert merged_pairs(["lr=0.1 seed=2", "lr=0.2", ""]) == {"lr": 0.2, "seed": 2}
    with pytest.raises(ConfigError, match="'seed' is given twice"):
        parse_pairs("seed=1 seed=1")


def test_compare_refuses_a_target_outside_0_1_for_accuracy_runs(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """The range is the runs' metric's: accuracy's is [0, 1] (a regression's score may be
    any number)."""
    assert local_run(tmp_path, "p").returncode == 0
    with pytest.raises(SystemExit) as info:
        main(["compare", str(tmp_path / "p"), "--target", "1.5", "--out", str(tmp_path / "c")])
    assert info.value.code == 2
    assert "--target 1.5 is not an accuracy" in capsys.readouterr().err


def test_config_json_says_where_the_run_came_from(tmp_path: Path) -> None:
    assert local_run(tmp_path, "p").returncode == 0
    config = json.loads((tmp_path / "p" / "config.json").read_text())
    assert config["test-split"] == "standard"
    assert config["test-split-effective"] == "holdout"  # digits has no standard test split
    found = config["provenance"]
    for package in ("fedstale", "flwr", "torch", "numpy", "python"):
        assert found[package], package
    assert found == json.loads(json.dumps(provenance()))
    head = subprocess.run(["git", "-C", str(ROOT), "rev-parse", "HEAD"], capture_output=True)
    if head.returncode == 0:  # a checkout (CI's clean clone is one)
        assert found["git-commit"] == head.stdout.decode().strip()
        assert isinstance(found["git-dirty"], bool)
    log = (tmp_path / "p" / "run.log").read_text()
    assert "digits has no standard test split" in log and "done: final accuracy" in log
    assert set(RUN_FILES) <= {p.name for p in (tmp_path / "p").iterdir()}


def test_a_dataset_that_cannot_be_found_or_fetched_is_a_config_error(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from fedstale.common import data, usercode
    from fedstale.common.config import parse_run_config

    def unavailable(name: str, data_dir: str = "") -> None:
        raise data.DatasetUnavailable(
            f"{name} not found and no mirror answered; {data.HOW_TO_GET[name]}"
        )

    monkeypatch.setattr(usercode, "load_dataset", unavailable)
    with pytest.raises(ConfigError, match=r"^dataset 'mnist': mnist not found .* data-dir$"):
        usercode.require_dataset(parse_run_config({"dataset": "mnist"}))


def test_a_run_started_in_a_flower_app_folder_writes_beside_it(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """`flwr run .` packs every .json and .jsonl of the app folder into the app bundle and
    installs it on every node: a library run started there (the ServerApp's folder in a
    simulation) writes to `<app>-runs`, unless runs/ is in the app's .gitignore or the user
    chose (runs_dir, $FEDSTALE_RUNS_DIR)."""
    import fedstale
    from fedstale.server_app.results import outside_the_app

    monkeypatch.delenv("FEDSTALE_RUNS_DIR", raising=False)
    app = tmp_path / "myapp"
    (app / "myapp").mkdir(parents=True)
    (app / "pyproject.toml").write_text('[tool.flwr.app]\npublisher = "me"\n')
    assert outside_the_app(app) == str(tmp_path / "myapp-runs")
    assert outside_the_app(app / "myapp") == str(tmp_path / "myapp-runs")
    assert outside_the_app(tmp_path) == ""  # not an app: ./runs
    monkeypatch.chdir(app)
    run, _ = fedstale.FedBuff().run_config(4, 3, 60.0, {})
    assert run.runs_dir == str(tmp_path / "myapp-runs")
    chosen, _ = fedstale.FedBuff(runs_dir=str(tmp_path / "mine")).run_config(4, 3, 60.0, {})
    assert chosen.runs_dir == str(tmp_path / "mine")
    for ignored in ("runs/", "/runs", "runs/*"):
        (app / ".gitignore").write_text(f"__pycache__/\n{ignored}\n")
        assert outside_the_app(app) == ""  # the bundle leaves runs/ out already
    (app / ".gitignore").unlink()
    monkeypatch.setenv("FEDSTALE_RUNS_DIR", str(tmp_path / "env"))
    assert outside_the_app(app) == ""
