"""A bad run config stops with one readable line and a non-zero exit, before any client."""

from __future__ import annotations

import json
import logging
import re
import subprocess
import sys
from pathlib import Path

import pytest

from fedstale.common import partition
from fedstale.common.config import ConfigError, parse_faults
from fedstale.launcher.cli import main
from fedstale.launcher.launch import parse_pairs
from fedstale.strategies.registry import load_config
from tests import timing
from tests.helpers import UNKNOWN_STRATEGY

ROOT = Path(__file__).resolve().parent.parent


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        ({"strategy": "fedasyn"}, "unknown strategy 'fedasyn'"),
        ({"lrr": 0.1}, "unknown key 'lrr'; did you mean 'lr'?"),
        ({"lr": -1}, "'lr' = -1"),
        ({"concurrency": 60}, "concurrency (60) exceeds num-clients (50)"),
        ({"latency-min": 900.0}, "latency-min (900.0) is above latency-max"),
        ({"dataset": "cifar10", "model": "linear"}, "does not fit dataset"),
        ({"max-virtual-time": 0.0}, "no budget set"),
        ({"fedasync-staleness": "cubic"}, "'fedasync-staleness' = 'cubic'"),
        ({"test-faults": "nan@x"}, "test-faults item 'nan@x'"),
    ],
)
def test_bad_values_give_one_line(overrides: dict, message: str) -> None:
    with pytest.raises(ConfigError) as info:
        load_config(overrides)
    text = str(info.value)
    assert message in text
    assert "\n" not in text


def test_defaults_are_valid() -> None:
    run, _ = load_config({})
    assert run.strategy == "fedbuff" and run.model_name == "linear"


def test_parse_pairs_accepts_bare_strings() -> None:
    assert parse_pairs("strategy=fedasync lr=0.1 run-name='x y' seed=3") == {
        "strategy": "fedasync",
        "lr": 0.1,
        "run-name": "x y",
        "seed": 3,
    }


def test_faults_parse() -> None:
    assert parse_faults("nan@3, shape@10") == {3: "nan", 10: "shape"}


def test_cli_check_exits_nonzero_with_one_line() -> None:
    result = subprocess.run(
        [sys.executable, "-m", "fedstale.launcher.cli", "run", "--run-config", "strategy=nope"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert result.returncode == 2
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    assert lines == [f"fedstale: {UNKNOWN_STRATEGY}"]


def test_cli_check_accepts_a_good_config() -> None:
    assert main(["check", "--app", str(ROOT), "--run-config", "strategy=fedasync"]) == 0


@pytest.mark.parametrize(
    ("argv", "line"),
    [
        (["--workers", "2"], "--workers goes with --local"),
        (["--local", "--superlink", "x"], "--local runs without Flower; drop --superlink"),
        (["--local", "--workers", "0"], "--workers must be at least 1"),
    ],
)
def test_cli_local_flags_are_checked(
    argv: list[str], line: str, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit) as exit_info:
        main(["run", "--app", str(ROOT), *argv])
    assert exit_info.value.code == 2
    assert line in capsys.readouterr().err


def test_cli_local_bad_value_is_one_line(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["run", "--local", "--app", str(ROOT), "--run-config", "lr=-1"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("fedstale: ") and "lr" in err[0]


def test_a_partition_no_draw_can_meet_is_refused_before_the_run(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(partition, "PER_CLASS_DRAWS", 20)  # the same refusal, sooner
    config = (
        "dataset=digits model=mlp num-clients=150 concurrency=10 partition=dirichlet "
        f"dirichlet-convention=per-class dirichlet-alpha=0.01 runs-dir={tmp_path}"
    )
    assert main(["run", "--local", "--app", str(ROOT), "--run-config", config]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "per-class Dirichlet(0.01) over 150 clients" in err[0]
    assert not any(tmp_path.iterdir())  # refused before a run folder was made


def test_pyproject_defaults_match_the_models() -> None:
    """Every key in [tool.flwr.app.config] is known, with the same default as its model."""
    import tomllib

    from fedstale.common.config import RunConfig
    from fedstale.strategies.registry import STRATEGIES, known_keys, renamed_keys

    defaults = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["flwr"]["app"]["config"]
    old_names = renamed_keys()
    assert set(defaults) == known_keys() | set(old_names)
    assert all(defaults[old] == "" for old in old_names)  # declared, left unset
    models = [RunConfig, *(cls.Params for cls in STRATEGIES.values())]
    for model in models:
        for name, field in model.model_fields.items():
            assert defaults[field.alias or name] == field.default, name


def test_the_demo_is_fedpsa_as_the_paper_defines_it_on_a_non_iid_split() -> None:
    """`make demo`'s config is valid and is the paper's rule (issue 16), never a variant."""
    text = (ROOT / "Makefile").read_text().replace("\\\n", " ")
    line = next(row for row in text.splitlines() if row.startswith("DEMO_CONFIG ="))
    pairs = parse_pairs(line.split("=", 1)[1].replace("$(DEMO_NAME)", "demo"))
    run, params = load_config(pairs)
    assert (run.strategy, run.server_step, run.partition) == ("fedpsa", "spec", "dirichlet")
    assert params.fedpsa_ablation == "none" and params.fedpsa_calib_source == "gaussian"


def test_flower_simulation_gets_one_cpu_per_client_unless_told_otherwise() -> None:
    """Flower's Ray backend defaults to 2 CPUs a ClientApp (one actor on a 2-core box)."""
    from fedstale.launcher.cli import flower_command
    from fedstale.launcher.launch import resolve

    run, overrides = resolve(ROOT, {})
    default = flower_command(ROOT, overrides, "", run, "")
    assert default[-1] == "num-supernodes=50 client-resources-num-cpus=1"
    mine = flower_command(ROOT, overrides, "client-resources-num-cpus=2", run, "")
    assert mine[-1] == "client-resources-num-cpus=2 num-supernodes=50"


def test_the_cli_leaves_the_callers_sigterm_handler_in_place() -> None:
    """Called in-process (as here), `main` unwinds on SIGTERM only while it runs: with its
    handler left behind, a SIGTERM sent to pytest ended the running test as SystemExit 143
    and the session went on."""
    import signal

    before = signal.getsignal(signal.SIGTERM)
    assert main(["check", "--app", str(ROOT), "--run-config", "lr=-1"]) == 2
    assert signal.getsignal(signal.SIGTERM) is before


def test_version_and_a_help_for_every_subcommand(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as done:
        main(["--version"])
    assert done.value.code == 0 and capsys.readouterr().out.startswith("fedstale 0.")
    for name, flag in (
        ("check", "--federation-config"),
        ("run", "--local"),
        ("deploy", "--nodes"),
        ("compare", "--target"),
    ):
        with pytest.raises(SystemExit) as done:
            main([name, "--help"])
        shown = capsys.readouterr().out
        assert done.value.code == 0 and f"fedstale {name}" in shown and flag in shown
    with pytest.raises(SystemExit) as done:
        main([])
    assert done.value.code == 0 and "fedstale COMMAND --help" in capsys.readouterr().out
    with pytest.raises(SystemExit) as done:
        main(["nope"])
    assert done.value.code == 2


def test_flwr_run_gets_the_checkouts_fab_files_only(tmp_path: Path) -> None:
    """`flwr run` walks every file under the folder it is given (a checkout's .venv: 3 s),
    so `fedstale run` hands it a folder of the files fab-include names and the same
    pyproject.toml; Flower builds the same app bundle from it."""
    import filecmp

    from fedstale.launcher.launch import flower_app

    root = Path(__file__).resolve().parent.parent
    with flower_app(root) as staged:
        assert staged != root
        assert (staged / "pyproject.toml").read_bytes() == (root / "pyproject.toml").read_bytes()
        files = sorted(p.relative_to(staged) for p in staged.rglob("*") if p.is_file())
        assert Path("fedstale/strategies/fedbuff.py") in files
        assert not [f for f in files if f.parts[0] in (".venv", "tests", "runs", "docs")]
        assert all(filecmp.cmp(staged / f, root / f, shallow=False) for f in files)
        flwr = Path(sys.executable).parent / "flwr"
        for folder, out in ((staged, tmp_path / "staged"), (root, tmp_path / "checkout")):
            out.mkdir()
            build = [str(flwr), "build", "--app", str(folder)]
            subprocess.run(build, cwd=out, check=True, capture_output=True, timeout=timing.left())
    # Flower's rule for an app directory's name, which `flwr build` enforces; tempfile's
    # names hold "_" about one time in five, so forty stagings all pass only by rule
    for _ in range(40):
        with flower_app(root) as staged:
            assert re.fullmatch(r"[A-Za-z][A-Za-z0-9-]{0,31}", staged.name), staged.name
    staged_fab = next((tmp_path / "staged").glob("*.fab")).read_bytes()
    assert staged_fab == next((tmp_path / "checkout").glob("*.fab")).read_bytes()


@pytest.mark.parametrize(
    ("old", "new", "value", "read"),
    [
        ("fifo-update", "fedqs-fifo-update", "newest", "fedqs_fifo_update"),
        ("dropout-rate", "mafsa-dropout-rate", 0.3, "mafsa_dropout_rate"),
        ("pfedgraph-style", "pace-pfedgraph-style", "authors", "pace_pfedgraph_style"),
    ],
)
def test_a_renamed_key_is_read_under_its_old_name_with_one_line_naming_the_new(
    old: str, new: str, value: object, read: str, caplog: pytest.LogCaptureFixture
) -> None:
    """Each rule's keys carry its prefix; an old name is read for a release (the value it
    sets is the new key's), with one warning line naming the new key. Left "" (as
    pyproject.toml declares it) it sets nothing and says nothing."""
    strategy = {"fedqs": "safl-fedsgd", "mafsa": "mafsa", "pace": "pfedgraph-async"}
    rule = {"strategy": strategy[new.split("-")[0]], "num-clients": 10, "concurrency": 10}
    with caplog.at_level(logging.WARNING, logger="fedstale"):
        _, params = load_config({**rule, old: value})
    assert getattr(params, read) == value
    lines = [r.getMessage() for r in caplog.records if old in r.getMessage()]
    assert lines == [
        f"run config: '{old}' is now '{new}' (the old name is read until fedstale 0.2); rename it"
    ]
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="fedstale"):
        _, params = load_config({**rule, old: "", new: value})
    assert getattr(params, read) == value and not caplog.records


def test_a_resume_reads_the_old_name_in_an_earlier_runs_config(tmp_path: Path) -> None:
    """A run folder written before a key was renamed resumes: its config.json's old name
    is read as the new one (silently: the user did not write it); a changed value is still
    refused, under the new name."""
    from fedstale.server_app.checkpoint import Checkpoint, check_resumable

    (tmp_path / "config.json").write_text(
        json.dumps({"strategy": "safl-fedsgd", "fifo-update": "newest", "seed": 3})
    )
    checkpoint = Checkpoint("safl-fedsgd", str(tmp_path), {"version": 0}, {}, {}, [], 0, 0)
    now = {"strategy": "safl-fedsgd", "fedqs-fifo-update": "newest", "seed": 3}
    check_resumable(checkpoint, tmp_path, now)
    with pytest.raises(ConfigError, match="the checkpoint's run had fedqs-fifo-update='newest'"):
        check_resumable(checkpoint, tmp_path, {**now, "fedqs-fifo-update": "uploaded"})


def test_buffer_size_is_the_buffered_rules_key_and_run_buffer_size_still_answers() -> None:
    """`buffer-size` is declared by the rules that buffer (BufferParams), not the run config;
    a rule written for an earlier fedstale reads `run.buffer_size` until 0.2, warned."""
    from fedstale.common.config import RunConfig
    from fedstale.strategies.buffer import BufferParams
    from fedstale.strategies.registry import STRATEGIES

    assert "buffer_size" not in RunConfig.model_fields
    buffered = {name for name, cls in STRATEGIES.items() if issubclass(cls.Params, BufferParams)}
    assert {"fedbuff", "ca2fl", "fedfa", "fedpsa", "safl-fedsgd", "fedqs-sgd"} <= buffered
    assert not {"fedasync", "fedavg", "pace", "mafsa"} & buffered
    run, params = load_config({"strategy": "fedbuff", "buffer-size": 3})
    assert params.buffer_size == 3  # type: ignore[attr-defined]
    with pytest.warns(DeprecationWarning, match="BufferParams"):
        assert run.buffer_size == 3
    with pytest.raises(ConfigError, match="buffer-size"):
        load_config({"strategy": "fedasync", "buffer-size": 0})  # every rule's keys checked


def test_a_library_class_that_does_not_buffer_ignores_buffer_size_with_one_line(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """Swapping FedBuff(buffer_size=3) for FedAsync in a ServerApp keeps working until 0.2
    (one warning line); another rule's own key is still refused."""
    import fedstale

    with caplog.at_level(logging.WARNING, logger="fedstale"):
        swapped = fedstale.FedAsync(buffer_size=3, concurrency=4)
    assert swapped.settings == {"concurrency": 4}
    lines = [r.getMessage() for r in caplog.records if "buffer_size" in r.getMessage()]
    said = "FedAsync: buffer_size=3 is ignored: fedasync does not read it"
    assert len(lines) == 1 and lines[0].startswith(said)
    assert fedstale.FedBuff(buffer_size=3).settings == {"buffer-size": 3}
    with pytest.raises(ConfigError, match=r"^FedAsync: unknown argument 'fedbuff_server_lr'"):
        fedstale.FedAsync(fedbuff_server_lr=0.5)
