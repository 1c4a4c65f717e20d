"""The privacy ledger and the budget (fedstale/server_app/stages/): every release written
before it leaves, counted across resumes and forks of one lineage, the budget checked on
the live ledger before each release, a killed run losing nothing, nothing un-noised kept,
values outside the guarantee left out by default, and the secure noise option."""

from __future__ import annotations

import json
import os
import pickle
import signal
import subprocess
import sys
import time
from collections import deque
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from flwr.supercore.privacy_accounting import GaussianPrivacyEvent
from flwr.supercore.privacy_accounting.rdp_accountant import RdpAccountant

from fedstale.common.config import ConfigError
from fedstale.server_app import checkpoint
from fedstale.server_app.stages.central_dp import Accounting, CentralDP
from fedstale.server_app.stages.ledger import LEDGER_FILE, RELEASE, Ledger
from fedstale.server_app.stages.noise import NOISE_STREAM, SecureGaussian
from fedstale.server_app.stages.pipeline import Pipeline
from fedstale.strategies.base import Outcome
from fedstale.strategies.fedbuff import FedBuff, FedBuffParams
from fedstale.strategies.registry import load_config, rule_named
from tests import timing
from tests.helpers import run_config
from tests.test_central_dp import accountant, dp_engine, ran
from tests.test_checkpoint import BASE, run

ROOT = Path(__file__).resolve().parents[1]
DP = {"strategy": "fedbuff", "dp-clipping-norm": 1.0, "dp-noise-multiplier": 1.0}


def ledger_lines(folder: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in (folder / LEDGER_FILE).read_text().splitlines()]


def releases_of(folder: Path) -> int:
    return sum(1 for line in ledger_lines(folder) if line["origin"] == RELEASE)


# ---------------------------------------------------------------- the ledger itself
def test_a_file_ledger_is_read_once_by_each_reader_and_shared_by_two(tmp_path: Path) -> None:
    path = tmp_path / LEDGER_FILE
    first, second = Ledger.at(path, "a"), Ledger.at(path, "b")
    with first.held() as lines:
        assert lines == []
        first.append(
            {"origin": RELEASE, "noise_multiplier": 1.0, "sample_size": 1, "population_size": 4}
        )
    with second.held() as lines:
        assert [line["noise_multiplier"] for line in lines] == [1.0]
        second.append(
            {"origin": RELEASE, "noise_multiplier": 2.0, "sample_size": 1, "population_size": 4}
        )
    with first.held() as lines:  # only what the other branch wrote since
        assert [line["noise_multiplier"] for line in lines] == [2.0]
    with second.held() as lines:
        assert lines == []


ONE = {"origin": RELEASE, "noise_multiplier": 1.0, "sample_size": 1, "population_size": 4}


def test_only_a_torn_last_line_is_tolerated_said_and_cut_off_before_the_next(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    path = tmp_path / LEDGER_FILE
    ledger = Ledger.at(path, "a")
    with ledger.held():
        ledger.append(ONE)
    with path.open("ab") as handle:
        handle.write(b'{"origin": "rel')  # a crash in the middle of the next write
    again = Ledger.at(path, "b")
    with again.held() as lines:
        assert len(lines) == 1
        again.append(ONE)
    assert "cut short by a crash" in caplog.text
    assert len(Ledger.at(path, "c").entries()) == 2
    assert path.read_bytes().count(b"\n") == 3 and b'"rel\n' not in path.read_bytes()


# ---------------------------------------------------------------- resumes and forks
def test_two_forks_of_one_checkpoint_each_count_the_whole_lineage(tmp_path: Path) -> None:
    """base: 4 releases (checkpoint at 4). fork1 and fork2 each resume it to version 8:
    fork1 reports 8 releases, fork2 the 12 the clients' data paid for."""
    run(tmp_path, "base", **DP, **{"max-versions": 4})
    base = tmp_path / "base"
    resume = {"max-versions": 8, "resume-from": str(base)}
    first, _ = run(tmp_path, "fork1", **DP, **resume)
    second, _ = run(tmp_path, "fork2", **DP, **resume)
    config, _ = load_config({**BASE, **DP, "max-versions": 12})
    assert (first["versions"], second["versions"]) == (8, 8)
    assert first["privacy"]["releases"] == 8 and second["privacy"]["releases"] == 12
    assert second["privacy"]["epsilon"] == pytest.approx(
        Accounting.of(config).epsilon_after(12), rel=1e-12
    )
    assert releases_of(base) == 12 and not (tmp_path / "fork2" / LEDGER_FILE).exists()
    assert {line["run"] for line in ledger_lines(base)} == {"base", "fork1", "fork2"}


def test_resuming_a_run_its_budget_stopped_is_refused_and_releases_nothing(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """z = 1: 4 releases spend 10.73, a fifth would spend 12.30 > 12."""
    budget = {**DP, "dp-max-epsilon": 12.0, "checkpoint-every": 1, "max-versions": 50}
    summary, _ = run(tmp_path, "spent", **budget)
    folder = tmp_path / "spent"
    assert summary["stop_reason"].startswith("privacy budget: epsilon 10.7")
    assert summary["privacy"]["releases"] == summary["versions"] == 4
    with pytest.raises(ConfigError, match="privacy budget is spent, nothing was released"):
        run(tmp_path, "again", **{**budget, "resume-from": str(folder)})
    assert releases_of(folder) == 4 and not (tmp_path / "again").exists()
    from fedstale.launcher.cli import main

    config = " ".join(
        f"{key}={value}" for key, value in {**BASE, **budget, "resume-from": str(folder)}.items()
    )
    config += f" runs-dir={tmp_path} run-name=spent"
    assert main(["run", "--local", "--app", str(ROOT), "--run-config", config]) == 2
    assert "privacy budget is spent" in capsys.readouterr().err
    assert releases_of(folder) == 4


def test_a_resume_without_its_lineages_ledger_is_refused(tmp_path: Path) -> None:
    run(tmp_path, "base", **DP, **{"max-versions": 4})
    (tmp_path / "base" / LEDGER_FILE).rename(tmp_path / "elsewhere.jsonl")
    with pytest.raises(ConfigError, match=r"privacy ledger of this run.s lineage.*missing"):
        run(tmp_path, "fork", **DP, **{"max-versions": 8, "resume-from": str(tmp_path / "base")})


def rechained(lines: list[dict[str, Any]]) -> str:
    """Lines written back with every `prev` recomputed: a chain that is whole again."""
    from fedstale.server_app.stages.ledger import line_hash

    out, head = [], ""
    for line in lines:
        raw = json.dumps({**line, "prev": head}, sort_keys=True).encode()
        out.append(raw.decode())
        head = line_hash(raw)
    return "".join(f"{raw}\n" for raw in out)


def garbled(text: str, index: int) -> str:
    lines = text.splitlines(True)
    lines[index] = lines[index][:20] + "\n"
    return "".join(lines)


def edit_z(lines: list[dict[str, Any]], number: int) -> list[dict[str, Any]]:
    return [
        {**line, "noise_multiplier": 1000.0} if i == number else line
        for i, line in enumerate(lines)
    ]


@pytest.mark.parametrize(
    ("rewind", "refusal"),
    [
        (lambda text, lines: "", "holds 0 lines, the checkpoint counted 6"),
        (lambda text, lines: "".join(text.splitlines(True)[:2]), "holds 2 lines, the checkpoint"),
        (
            lambda text, lines: "".join(
                json.dumps(line, sort_keys=True) + "\n" for line in edit_z(lines, 2)
            ),
            "line 4 does not follow line 3",
        ),
        (
            lambda text, lines: text.replace('"sample_size": 2', '"sample_size":  2', 1),
            "line 3 does not follow line 2",
        ),
        (lambda text, lines: garbled(text, 2), "line 3 is not a ledger line"),
        (lambda text, lines: rechained(edit_z(lines, 2)), "line 6 is not the one the checkpoint"),
        (lambda text, lines: rechained(lines[:1] + lines[2:]), "holds 5 lines, the checkpoint"),
        (
            lambda text, lines: rechained([{**lines[0], "lineage": "0" * 32}, *lines[1:]]),
            "another lineage's ledger",
        ),
    ],
    ids=[
        "emptied",
        "shortened",
        "z-edited",
        "reformatted",
        "garbled",
        "rechained",
        "rechained-short",
        "relabelled",
    ],
)
def test_a_rewound_or_edited_ledger_is_refused_on_resume(
    tmp_path: Path, rewind: Any, refusal: str, capsys: pytest.CaptureFixture[str]
) -> None:
    """base: a checkpoint after its 5 releases (6 ledger lines with the lineage's). Each
    way of rewinding or editing its ledger is refused in one line, nothing released."""
    run(tmp_path, "base", **DP, **{"max-versions": 5, "checkpoint-every": 5})
    path = tmp_path / "base" / LEDGER_FILE
    text = path.read_text()
    path.write_text(rewind(text, ledger_lines(tmp_path / "base")))
    resume = {"max-versions": 8, "resume-from": str(tmp_path / "base")}
    with pytest.raises(ConfigError, match=refusal):
        run(tmp_path, "fork", **DP, **resume)
    assert not (tmp_path / "fork").exists()
    from fedstale.launcher.cli import main

    config = " ".join(f"{key}={value}" for key, value in {**BASE, **DP, **resume}.items())
    config += f" runs-dir={tmp_path} run-name=fork"
    capsys.readouterr()  # the base run's log, when an earlier test left the CLI's handler
    assert main(["run", "--local", "--app", str(ROOT), "--run-config", config]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "cannot be trusted" in err[0]


def test_an_overwritten_base_never_lends_its_path_to_a_fork_of_the_old_checkpoint(
    tmp_path: Path,
) -> None:
    """base (4 releases) overwritten by a new base (a new lineage at the same path, 4
    releases): a fork of the old checkpoint counts the old lineage (4 + 4), never the new."""
    run(tmp_path, "base", **DP, **{"max-versions": 4})
    run(tmp_path, "base", **DP, **{"max-versions": 4, "overwrite": True})
    (old,) = tmp_path.glob("base.previous-*")
    fork, _ = run(tmp_path, "fork", **DP, **{"max-versions": 8, "resume-from": str(old)})
    assert fork["privacy"]["releases"] == 8 and fork["privacy"]["ledger"] == str(old / LEDGER_FILE)
    assert releases_of(old) == 8 and releases_of(tmp_path / "base") == 4
    lineages = {ledger_lines(folder)[0]["lineage"] for folder in (old, tmp_path / "base")}
    assert len(lineages) == 2


def test_a_killed_run_loses_no_release_from_the_ledger(tmp_path: Path) -> None:
    """SIGKILL well past the last checkpoint: the ledger holds every version a client got,
    and the resumed run counts them all besides its own."""
    common = (
        f"runs-dir='{tmp_path}' num-clients=6 concurrency=3 buffer-size=2 local-epochs=1 "
        "max-virtual-time=0 eval-interval=1e9 dataset='digits' checkpoint-every=5 "
        "dp-clipping-norm=1.0 dp-noise-multiplier=3.0"
    )
    config = f"{common} run-name='killed' max-versions=100000"
    folder = tmp_path / "killed"
    command = [sys.executable, "-m", "fedstale.launcher.cli", "run", "--local"]
    process = subprocess.Popen(
        [*command, "--run-config", config],
        cwd=ROOT,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        start_new_session=True,
    )
    try:
        deadline = time.monotonic() + 240
        while time.monotonic() < deadline:
            rows = (folder / "updates.jsonl").read_text() if folder.is_dir() else ""
            versions = [json.loads(row)["version"] for row in rows.splitlines()]
            if versions and max(versions) >= 8 and max(versions) % 5 not in (0, 4):
                break
            time.sleep(0.05)
        os.killpg(process.pid, signal.SIGKILL)
    finally:
        process.wait(timeout=30)
    seen = max(
        json.loads(row)["version"] for row in (folder / "updates.jsonl").read_text().splitlines()
    )
    saved = checkpoint.load(str(folder))
    before = releases_of(folder)
    assert before >= seen >= saved.version  # every release a client got is on the books
    resumed = f"{common} run-name='after' max-versions={saved.version + 2} resume-from='{folder}'"
    done = subprocess.run(
        [*command, "--run-config", resumed],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=timing.left(),
    )
    assert done.returncode == 0, done.stderr[-2000:]
    privacy = json.loads((tmp_path / "after" / "summary.json").read_text())["privacy"]
    assert privacy["releases"] == before + 2 == releases_of(folder)


# ---------------------------------------------------------------- the budget
def flowers_accountant(priors: int) -> RdpAccountant:
    """Flower's RdpAccountant holding `priors` releases at z = 1 (the budget is the run's)."""
    held = accountant(population=6)
    if priors:
        held.compose(GaussianPrivacyEvent(1.0, 2, 6), priors)
    return held


def test_an_accountant_passed_with_releases_stops_the_run_before_it_passes_the_budget() -> None:
    """Flower's accountant already holding 3 releases (9.01): one more fits (10.73), a
    second would not (12.30 > 12)."""
    settings = {"dp-noise-multiplier": 1.0, "dp-max-epsilon": 12.0, "max-versions": 20}
    engine = dp_engine(FedBuff, FedBuffParams(), **settings)
    declared = rule_named("fedbuff").dp
    assert declared is not None
    stage = CentralDP(Accounting.of(engine.run), declared, flowers_accountant(3))
    engine.stages = Pipeline([stage])
    ran(engine)
    assert (engine.version, stage.own, stage.releases) == (1, 1, 1)
    assert stage.epsilon() == pytest.approx(10.73, abs=0.01) and stage.epsilon() <= 12
    assert engine.stop_reason.startswith("privacy budget: epsilon 10.7")
    spent = dp_engine(FedBuff, FedBuffParams(), **settings)
    spent.stages = Pipeline([CentralDP(Accounting.of(spent.run), declared, flowers_accountant(4))])
    ran(spent)
    assert spent.version == 0 and spent.stop_reason.startswith("privacy budget")


def test_a_release_past_the_budget_is_withheld_and_the_model_stays_the_last_released() -> None:
    run_ = run_config(
        **{"dp-clipping-norm": 1.0, "dp-noise-multiplier": 1.0, "dp-max-epsilon": 12.0}
    )
    strategy = FedBuff(run_, FedBuffParams(buffer_size=2), np.zeros(3, np.float32))
    stage = CentralDP.for_run(run_, strategy.params)
    assert stage is not None and stage.opening(strategy) == ""
    outcome = Outcome(changed=True, records=[{"client": 0, "weight": 0.5}])
    verdicts = [stage.release_of(strategy, outcome, version) for version in range(1, 5)]
    assert all(v.released for v in verdicts) and verdicts[-1].stop.startswith("privacy budget")
    released = strategy.model.copy()
    strategy.model = strategy.model + 1.0  # the rule's next, un-noised model
    withheld = stage.release_of(strategy, outcome, 5)
    assert not withheld.released and withheld.stop.startswith("privacy budget")
    assert np.array_equal(strategy.model, released) and stage.releases == 4
    assert stage.epsilon() is not None and stage.epsilon() <= 12


# ---------------------------------------------------------------- nothing un-noised kept
@pytest.mark.parametrize(("z", "limit"), [(1.0, 20.0), (2.0, 8.0)])
def test_the_pld_budget_stops_at_the_last_release_dp_accountings_pld_keeps_within(
    z: float, limit: float
) -> None:
    """The PLD accountant's budget check (the analytic Gaussian to find the threshold, the
    PLD to confirm it) stops where composing dp_accounting's PLD release by release does."""
    import dp_accounting
    from dp_accounting.pld.pld_privacy_accountant import PLDAccountant

    from fedstale.server_app.stages.accounting import (
        AccountingConfig,
        GaussianRelease,
        PldAccountant,
    )

    def direct(releases: int) -> float:
        relation = dp_accounting.NeighboringRelation.ADD_OR_REMOVE_ONE
        pld = PLDAccountant(relation, value_discretization_interval=1e-4)
        pld.compose(dp_accounting.GaussianDpEvent(z), releases)
        return float(pld.get_epsilon(1e-5))

    ours = PldAccountant(AccountingConfig(1e-5, 10, limit))
    release = GaussianRelease(z, 1, 10)
    while not ours.would_exceed(release):
        ours.compose(release)
    made = ours.num_releases
    assert direct(made) <= limit < direct(made + 1)
    assert ours.get_epsilon(1e-5) == pytest.approx(direct(made), rel=1e-9)


def model_sized(value: Any, size: int) -> list[np.ndarray]:
    """Every array of `size` numbers anywhere in a checkpoint's state."""
    if isinstance(value, np.ndarray):
        return [value.ravel().astype(np.float64)] if value.size == size else []
    if isinstance(value, dict):
        return [a for item in value.values() for a in model_sized(item, size)]
    if isinstance(value, (list, tuple)):
        return [a for item in value for a in model_sized(item, size)]
    if hasattr(value, "__dict__"):
        return model_sized(vars(value), size)
    return []


def reveals_noise(released: np.ndarray, other: np.ndarray, direction: np.ndarray) -> bool:
    """`released - other` is the release's noise (a multiple of its known direction) to
    float32 rounding: `other` is the un-noised model."""
    difference = released - other
    if not np.any(difference):
        return False
    scale = float(difference @ direction / (direction @ direction))
    return bool(np.linalg.norm(difference - scale * direction) < 1e-4 * np.linalg.norm(difference))


@pytest.mark.parametrize(
    "rule", [{"strategy": "fedpsa", "fedpsa-diagnostic": True}, {"strategy": "fedbuff"}]
)
def test_no_checkpoint_holds_a_model_from_which_a_release_noise_follows(
    tmp_path: Path, rule: dict[str, Any]
) -> None:
    """With dp-noise-seed the noise of the checkpointed release is known up to its scale:
    nothing model-sized in the checkpoint differs from the released model by it."""
    seed = 3
    noise = {**DP, **rule, "dp-noise-seed": seed, "checkpoint-every": 1, "max-versions": 3}
    run(tmp_path, "noised", **noise)
    saved = checkpoint.load(str(tmp_path / "noised"))
    released = saved.strategy_state["model"].astype(np.float64)
    direction = np.random.default_rng([seed, NOISE_STREAM, saved.version]).standard_normal(
        released.size
    )
    assert reveals_noise(released, released - 0.5 * direction, direction)  # the check bites
    others = model_sized(saved.engine_state, released.size)
    others += model_sized(
        {k: v for k, v in saved.strategy_state.items() if k != "model"}, released.size
    )
    if rule.get("fedpsa-diagnostic"):
        assert others  # the diagnostic's history is there, and holds released models only
    assert not any(reveals_noise(released, other, direction) for other in others)


# ---------------------------------------------------------------- private by default
def values_in(value: Any, path: str = "") -> Iterator[tuple[str, Any]]:
    """Every leaf of a checkpoint's state, with where it lies."""
    if isinstance(value, dict):
        for key, inner in value.items():
            yield from values_in(inner, f"{path}/{key}")
    elif isinstance(value, (list, tuple, set, deque)):
        for index, inner in enumerate(value):
            yield from values_in(inner, f"{path}[{index}]")
    else:
        yield path, value


@pytest.mark.parametrize("strategy", ["fedpsa", "fedbuff", "safl-fedsgd", "fedavg"])
def test_under_dp_a_checkpoint_holds_no_per_client_value_unless_kept(
    tmp_path: Path, strategy: str
) -> None:
    """checkpoint.pkl scanned leaf by leaf: with noise it holds the released model, the
    public schedule and counts, the ledger's place; no norm (FedPSA's queue and m0), no
    clipped count, no update not yet released. With dp-client-values=keep they are there
    (the scan bites)."""
    noise = {**DP, "strategy": strategy, "checkpoint-every": 1, "max-versions": 12}
    if strategy == "fedpsa":
        noise["fedpsa-queue"] = 4  # m0 is set after 4 updates
    omitted = set()
    for values in ("auto", "keep"):
        run(tmp_path, values, **noise, **{"dp-client-values": values})
        with (tmp_path / values / "checkpoint.pkl").open("rb") as handle:
            saved = pickle.load(handle)
        leaves = dict(values_in({"engine": saved.engine_state, "rule": saved.strategy_state}))
        names = {path.rsplit("/", 1)[-1].split("[")[0] for path in leaves}
        private = {"queue", "m0", "clipped", "buffer", "received", "fifo", "newest"} & names
        if values == "auto":
            assert not private, private
            omitted = names
            arrays = [v for v in leaves.values() if isinstance(v, np.ndarray) and v.size > 100]
            released = saved.strategy_state["model"]
            assert all(a is released or a.shape == released.shape for a in arrays)
        else:
            assert private and "clipped" in private
            assert private.isdisjoint(omitted)


def test_with_noise_values_outside_the_guarantee_are_left_out_unless_kept(tmp_path: Path) -> None:
    noise = {**DP, "strategy": "fedpsa", "max-versions": 3}
    summary, _ = run(tmp_path, "auto", **noise)
    rows = [json.loads(r) for r in (tmp_path / "auto" / "updates.jsonl").read_text().splitlines()]
    assert rows and all(
        set(row) <= {"time", "version", "client", "task", "staleness", "late"} for row in rows
    )
    privacy = summary["privacy"]
    assert privacy["updates_clipped"] is None and privacy["client_values"] == "omitted"
    assert privacy["relation"] == "zero-out of one client's updates, public dispatch schedule"
    kept, _ = run(tmp_path, "kept", **noise, **{"dp-client-values": "keep"})
    rows = [json.loads(r) for r in (tmp_path / "kept" / "updates.jsonl").read_text().splitlines()]
    assert all("kappa" in row and "weight" in row for row in rows)
    assert kept["privacy"]["updates_clipped"] is not None
    with pytest.raises(ConfigError, match="dp-client-values=auto leaves out"):
        load_config({**noise, "eval-target": "per-client"})


# ---------------------------------------------------------------- secure noise
def test_secure_noise_is_standard_gaussian_and_never_repeats() -> None:
    first, second = SecureGaussian(), SecureGaussian()
    draws = first.normal(0.0, 2.0, 200_000)
    assert np.std(draws) == pytest.approx(2.0, rel=0.01) and abs(np.mean(draws)) < 0.02
    assert abs(float(np.mean((draws / 2.0) ** 4)) - 3.0) < 0.1  # Gaussian kurtosis
    assert not np.allclose(first.normal(0, 1, 8), first.normal(0, 1, 8))
    assert not np.allclose(first.normal(0, 1, 8), second.normal(0, 1, 8))
    assert first.normal(0, 1, (3, 4)).shape == (3, 4)


def test_a_run_with_secure_noise_says_so_and_the_choice_is_checked(tmp_path: Path) -> None:
    summary, _ = run(tmp_path, "secure", **DP, **{"dp-secure-noise": True, "max-versions": 2})
    assert summary["privacy"]["generator"].startswith("ChaCha20")
    for values, message in (
        ({"dp-secure-noise": True}, "dp-secure-noise draws noise"),
        ({**DP, "dp-secure-noise": True, "dp-noise-seed": 1}, "choose one"),
    ):
        with pytest.raises(ConfigError, match=message):
            load_config(values)


@pytest.mark.parametrize("damage", ["missing", "edited"])
def test_a_copy_of_the_folder_never_stands_in_for_a_damaged_or_missing_ledger(
    tmp_path: Path, damage: str
) -> None:
    """The review's finding: a copy of the run folder taken at its checkpoint, then 4 more
    releases on the lineage's ledger, then that ledger deleted or edited: a resume from the
    copy must not count the copy's 5 releases; it is refused (only a whole ledger of
    another lineage at the recorded path sends it to the copy's)."""
    import shutil

    run(tmp_path, "base", **DP, **{"max-versions": 4})
    shutil.copytree(tmp_path / "base", tmp_path / "copy")
    run(tmp_path, "more", **DP, **{"max-versions": 8, "resume-from": str(tmp_path / "base")})
    path = tmp_path / "base" / LEDGER_FILE
    assert releases_of(tmp_path / "base") == 8
    if damage == "missing":
        path.unlink()
    else:
        path.write_text(path.read_text().replace('"sample_size": 2', '"sample_size": 3', 1))
    resume = {"max-versions": 12, "resume-from": str(tmp_path / "copy")}
    with pytest.raises(ConfigError, match="cannot be trusted"):
        run(tmp_path, "fork", **DP, **resume)


def test_a_copy_beside_a_new_lineage_is_not_taken_for_a_moved_ledger(tmp_path: Path) -> None:
    """The second review's finding: a copy of the run folder at its checkpoint, 4 more
    releases on the lineage's ledger, the folder deleted and a new run started in its place:
    a resume from the copy finds another lineage at the recorded path, and the copy (of
    this lineage, but not moved there by --overwrite) is refused, not counted (4 of 8)."""
    import shutil

    run(tmp_path, "base", **DP, **{"max-versions": 4})
    shutil.copytree(tmp_path / "base", tmp_path / "copy")
    run(tmp_path, "more", **DP, **{"max-versions": 8, "resume-from": str(tmp_path / "base")})
    shutil.rmtree(tmp_path / "base")
    run(tmp_path, "base", **DP, **{"max-versions": 4})
    resume = {"max-versions": 12, "resume-from": str(tmp_path / "copy")}
    with pytest.raises(ConfigError, match="no --overwrite moved it there"):
        run(tmp_path, "fork", **DP, **resume)
