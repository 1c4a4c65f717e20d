"""Secure aggregation in real runs (`--local`, fedstale's own door): every release equals the
plain weighted sum of its updates within the stated quantisation bound; the server's view
holds no update in the clear; holders give each share once and never for one client alone;
a buffer survives holders that die while U answer, is dropped below U with one line; bad
replies are rejected and the run goes on; the rules that cannot take it are refused."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from fedstale.client_app import secagg as client_half
from fedstale.client_app.task import evaluate_task
from fedstale.common.config import ConfigError
from fedstale.common.records import flat
from fedstale.common.schema import MSG_TRAIN, RETURN_MODEL, TaskKeys
from fedstale.common.secagg import protocol as wire
from fedstale.common.secagg.coding import MaskCode
from fedstale.common.secagg.field import PRIME, Quantiser, random_elements
from fedstale.launcher.inprocess import InProcessTransport
from fedstale.launcher.local import trainer_for
from fedstale.server_app.experiment import run_experiment
from fedstale.server_app.stages.secure import SecureAggregation
from fedstale.strategies.registry import load_config

BASE = {
    "dataset": "digits",
    "model": "mlp",
    "strategy": "fedbuff",
    "num-clients": 6,
    "concurrency": 3,
    "buffer-size": 3,
    "max-virtual-time": 0.0,
    "eval-interval": 1e9,
    "checkpoint-every": 0,
    "secagg-timeout": 2.0,
}
SECURE = {"secure-aggregation": True}


class Watched(InProcessTransport):
    """fedstale's in-process clients; keeps each task's true delta (before masking), what
    the server received, and leaves the holders in `silent` mute on unmask messages."""

    def __init__(
        self,
        run: Any,
        silent: frozenset[int] = frozenset(),
        corrupt: bool = False,
        wrong: frozenset[int] = frozenset(),
        garbage: frozenset[int] = frozenset(),
        replay: frozenset[int] = frozenset(),
        garbled_for: frozenset[int] = frozenset(range(64)),
    ) -> None:
        super().__init__(run, self.capture(trainer_for(run)), evaluate_task)
        self.deltas: dict[int, np.ndarray] = {}
        self.received: list[Any] = []
        self.silent, self.corrupt, self.wrong = silent, corrupt, wrong
        self.garbage, self.replay = garbage, replay  # clients whose shares are bad
        self.garbled_for = garbled_for  # the holders whose shares from them are bad
        self.first_shares: dict[int, dict[str, np.ndarray]] = {}  # client: its first update's
        self.sender: dict[str, int] = {}  # msg id: the client it went to

    def capture(self, train: Any) -> Any:
        def trained(cfg, partition, config, arrays, sets=None, state=None):  # type: ignore[no-untyped-def]
            stage = config.get(wire.STAGE)
            if stage != wire.MASK:
                return train(cfg, partition, config, arrays, sets, state)
            from fedstale.client_app.task import train_task

            def plain(*args: Any) -> Any:
                metrics, result, outputs = train_task(*args)
                names = list(arrays)
                trained = flat(result, names)
                if config[TaskKeys.RETURN] == RETURN_MODEL:
                    trained = trained - flat(arrays, names)
                self.deltas[int(config[TaskKeys.TASK_ID])] = trained
                return metrics, result, outputs

            return client_half.secure_train(plain, cfg, partition, config, arrays, sets, state)

        return trained

    def send(self, node_id, message_type, config, arrays=None, sets=None):  # type: ignore[no-untyped-def]
        client = node_id - 1000
        holding = config.get(wire.STAGE) in (wire.CHECK, wire.UNMASK)
        if message_type == MSG_TRAIN and holding and client in self.silent:
            self.count += 1
            return f"silent-{self.count}"  # a holder that died: no reply ever comes
        msg_id = super().send(node_id, message_type, config, arrays, sets)
        self.sender[msg_id] = client
        return msg_id

    def receive(self, msg_ids):  # type: ignore[no-untyped-def]
        replies = super().receive(msg_ids)
        for reply in replies:
            parts = reply.sets.get(wire.SET, {})
            client = self.sender.get(reply.msg_id, -1)
            if wire.MASKED in parts and self.corrupt:
                parts[wire.MASKED] = parts[wire.MASKED][:-1]  # one element short
                self.corrupt = False
            if wire.MASKED in parts:
                self.spoil_shares(client, parts)
            if wire.AGGREGATE in parts and client in self.wrong:  # a holder answering at random
                parts[wire.AGGREGATE] = random_elements(parts[wire.AGGREGATE].size).astype(
                    np.uint32
                )
            self.received.append(reply)
        return replies

    def spoil_shares(self, client: int, parts: dict[str, np.ndarray]) -> None:
        """A client sending garbage shares, or replaying those of its first update."""
        names = [name for name in parts if name.startswith("share-")]
        first = self.first_shares.setdefault(client, {n: parts[n].copy() for n in names})
        for name in names:
            if int(name.rsplit("-", 1)[1]) not in self.garbled_for:
                continue
            if client in self.garbage:
                parts[name] = np.frombuffer(os.urandom(parts[name].size), np.uint8)
            elif client in self.replay:
                parts[name] = first[name]


def secure_run(tmp_path: Path, name: str, **values: Any) -> tuple[dict, Watched]:
    folder = {"runs-dir": str(tmp_path), "run-name": name}
    run, params = load_config({**BASE, **SECURE, **folder, **values})
    watched = Watched(run)
    return run_experiment(run, params, watched), watched


def model_of(folder: Path) -> np.ndarray:
    state = torch.load(folder / "model.pt")
    return np.concatenate([t.numpy().ravel() for t in state.values()]).astype(np.float64)


@pytest.mark.parametrize("rule", ["fedbuff", "fedavg", "safl-fedsgd", "safl-fedavg"])
def test_every_release_is_the_plain_weighted_sum_within_the_stated_bound(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, rule: str
) -> None:
    checked: list[tuple[float, float]] = []
    unmask = SecureAggregation.unmask
    values = {"runs-dir": str(tmp_path), "run-name": "s", "max-versions": 5, "strategy": rule}
    run, params = load_config({**BASE, **SECURE, **values})
    watched = Watched(run)

    def checking(self: SecureAggregation, strategy: Any, outcome: Any, exchange: Any) -> bool:
        before = strategy.model.astype(np.float64)
        done = unmask(self, strategy, outcome, exchange)
        weights = [float(r["weight"]) for r in outcome.records]
        deltas = [np.clip(watched.deltas[int(r["task"])], -1, 1) for r in outcome.records]
        plain = sum(w * d for w, d in zip(weights, deltas, strict=True))
        moved = strategy.model.astype(np.float64) - before
        # float32 rounding of the model itself, beside the quantisation bound
        slack = np.abs(strategy.model).max() * 2.0**-23
        checked.append(
            (float(np.max(np.abs(moved - plain))), self.quantiser.error_bound(weights) + slack)
        )
        return done

    monkeypatch.setattr(SecureAggregation, "unmask", checking)
    summary = run_experiment(run, params, watched)
    assert summary["versions"] == 5
    assert checked and all(error <= bound for error, bound in checked)
    assert all(error > 0 for error, _ in checked)  # the sum went through the field


def test_the_first_release_equals_the_plain_runs_within_the_bound(tmp_path: Path) -> None:
    one = {"max-versions": 1}
    plain_run, params = load_config({**BASE, **one, "runs-dir": str(tmp_path), "run-name": "plain"})
    run_experiment(plain_run, params, Watched(plain_run))
    summary, _ = secure_run(tmp_path, "secure", **one)
    bound = summary["secure_aggregation"]["error_bound_max"]
    difference = np.abs(model_of(tmp_path / "secure") - model_of(tmp_path / "plain"))
    assert 0 < difference.max() <= bound + 1e-6  # float32 model
    assert summary["secure_aggregation"]["buffers"] == 1


def test_the_server_never_sees_an_update_in_the_clear(tmp_path: Path) -> None:
    _, watched = secure_run(tmp_path, "view", **{"max-versions": 4})
    quantiser = Quantiser()
    masked = [
        r.sets[wire.SET][wire.MASKED]
        for r in watched.received
        if wire.MASKED in r.sets.get(wire.SET, {})
    ]
    assert len(masked) >= 12
    for vector in masked:
        as_update = quantiser.decode(vector, 1.0)  # read as if it were not masked
        for delta in watched.deltas.values():
            correlation = np.corrcoef(as_update, np.clip(delta, -1, 1))[0, 1]
            assert abs(correlation) < 0.1
    assert not any(r.arrays for r in watched.received if wire.MASKED in r.sets.get(wire.SET, {}))


class Holders:
    """N holders (clients 0..N-1, each also a sender) and their masked updates, through the
    client half's own functions: what a server, honest or not, can ask of them."""

    def __init__(self, holders: int = 4, privacy: int = 1, recovery: int = 3) -> None:
        self.code = MaskCode(holders=holders, privacy=privacy, recovery=recovery, length=10)
        self.states: list[dict[str, np.ndarray]] = [{} for _ in range(holders)]
        self.keyset = {
            wire.key_name(j): client_half.own_key(state) for j, state in enumerate(self.states)
        }
        self.config = {
            wire.HOLDERS: holders,
            wire.PRIVACY: privacy,
            wire.RECOVERY: recovery,
            wire.LENGTH: 10,
            wire.CLIP_RANGE: 1.0,
            wire.PRECISION_BITS: 16,
            wire.WEIGHT_BITS: 10,
        }
        self.roster = {**self.config, wire.ROSTER: list(range(holders))}
        for state in self.states:  # the key round's last message
            client_half.pin_roster(self.roster, self.keyset, state, wire.HolderPolicy())
        self.sent: dict[int, tuple[int, dict[str, np.ndarray]]] = {}  # update: sender, parts
        self.deltas: dict[int, np.ndarray] = {}

    def mask(self, update: int, sender: int) -> None:
        self.deltas[update] = np.linspace(-0.5, 0.5, 10) * (update + 1) / 10
        config = {**self.config, wire.UPDATE: update, wire.SENDER: sender}
        parts = client_half.masked_parts(config, self.deltas[update], self.states[sender])
        self.sent[update] = (sender, parts)

    def check(self, j: int, updates: list[int], **shares: np.ndarray) -> dict[str, np.ndarray]:
        parts = {}
        for u in updates:
            parts[wire.update_share_name(u)] = self.sent[u][1][wire.share_name(j)]
        parts.update({wire.update_share_name(int(u)): v for u, v in shares.items()})
        senders = [self.sent[u][0] for u in updates]
        config = {**self.config, wire.HOLDER: j, wire.UPDATES: updates, wire.SENDERS: senders}
        return client_half.checked_parts(config, parts, self.states[j])

    def unmask(self, j: int, updates: list[int], factors: list[int]) -> np.ndarray:
        config = {wire.HOLDER: j, wire.UPDATES: updates, wire.FACTORS: factors}
        answer = client_half.aggregate_parts(config, wire.HolderPolicy(), self.states[j])
        return answer[wire.AGGREGATE]


@pytest.fixture(autouse=True)
def answered_records(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Holders record what they answered under the test's own folder."""
    monkeypatch.setenv(client_half.ANSWERED_DIR, str(tmp_path / "answered"))


def test_holders_give_each_share_once_and_never_for_one_client_alone() -> None:
    """The server, following the protocol, asks the holders for every subset it can: one
    update alone is refused (fewer than secagg-min-clients clients), and any set naming an
    update already unmasked is refused; so the only sums it ever learns are of disjoint
    buffers of two or more clients."""
    fed = Holders()
    for u in range(3):
        fed.mask(u, sender=u)
    for u in range(3):  # one update alone: refused by every holder
        for j in range(4):
            fed.check(j, [u])
            with pytest.raises(wire.Refused, match="fewer than secagg-min-clients"):
                fed.unmask(j, [u], [1024])
    answers = {}
    for j in range(3):
        assert list(fed.check(j, [0, 1])[wire.OPENED]) == [0, 1]
        answers[j] = fed.unmask(j, [0, 1], [1024, 512])
    mask = fed.code.decode([0, 1, 2], np.stack([answers[j] for j in range(3)]))
    assert mask.shape == (10,)
    for j in range(3):  # update 0 or 1 again, in any company: not even checked again
        for again in ([0, 2], [1, 2], [0, 1]):
            assert set(fed.check(j, again)[wire.FAILED]) & {0, 1}
            with pytest.raises(wire.Refused, match="not opened at the last check"):
                fed.unmask(j, again, [1024, 1024])
    # holder 3 never answered: alone it cannot give the server a second, different sum
    fed.check(3, [0, 2])
    lone = fed.unmask(3, [0, 2], [1024, 1024])
    with pytest.raises(ValueError, match="3 distinct holders"):
        fed.code.decode([3], lone[None, :])


@pytest.mark.parametrize(
    ("factors", "refusal"),
    [
        ([1024, 0], r"weights \[0, 1024\] outside \[64, 1024\]"),  # B weighs nothing
        ([1024, PRIME], "outside \\[64, 1024\\]"),  # p: zero in the field
        ([1024, 1], "outside \\[64, 1024\\]"),  # 2^-10 of A: B barely blurs A
        ([2**20, 1024], "outside"),  # a largest weight past 2^g
        ([512, 512], "the largest weight is 512, not 2\\^10"),
    ],
)
def test_a_request_weighing_one_client_alone_is_refused_by_every_honest_holder(
    factors: list[int], refusal: str
) -> None:
    """Today's attacks 1 and 2 (docs/privacy.md): a real buffer {A, B} asked with weights
    that make it A's update; each of U holders refuses, so no mask of A is ever decoded."""
    fed = Holders()
    fed.mask(0, sender=0)
    fed.mask(1, sender=1)
    for j in range(4):
        fed.check(j, [0, 1])
        with pytest.raises(wire.Refused, match=refusal):
            fed.unmask(j, [0, 1], factors)
        assert client_half.answered(fed.states[j]) == set()  # nothing spent by a refusal


def test_an_update_the_server_sealed_itself_or_a_swapped_key_is_refused() -> None:
    """Attack 3: a buffer {A, F} where F is sealed by the server under a key pair of its own,
    naming client 1 as sender. Holders open shares only with the keys pinned in the key
    round, so F fails the check and {A, F} is refused; a later roster bringing the
    server's key in place of client 1's is refused outright."""
    from fedstale.common.secagg.sealing import context, new_private_key, public_key, seal

    fed = Holders()
    fed.mask(0, sender=0)
    server_private = new_private_key()
    shares = fed.code.encode(random_elements(10))
    digest = client_half.roster_of(fed.states[0]).digest
    server_key = np.frombuffer(public_key(server_private), np.uint8)
    swapped = {**fed.keyset, wire.key_name(1): server_key}
    for j in range(4):
        holder_key = bytes(fed.keyset[wire.key_name(j)])
        forged = seal(shares[j], server_private, holder_key, context(7, 1, j, digest))
        fed.sent[7] = (1, {wire.share_name(j): forged})
        checked = fed.check(j, [0, 7])
        assert list(checked[wire.OPENED]) == [0] and list(checked[wire.FAILED]) == [7]
        with pytest.raises(wire.Refused, match=r"update\(s\) \[7\] not opened"):
            fed.unmask(j, [0, 7], [1024, 1024])
        refusal = "own key is not in the roster" if j == 1 else "differ from those pinned"
        with pytest.raises(wire.Refused, match=refusal):
            client_half.pin_roster(fed.roster, swapped, fed.states[j], wire.HolderPolicy())


def test_a_forged_roster_at_a_holder_opens_no_honest_share() -> None:
    """A holder that pinned a roster where client 1's key is the server's (the server lied
    to it in the key round): the honest clients sealed under the honest roster's digest,
    so their shares do not open there; the server's F opens only there. No holder can
    answer for {A, F}."""
    from fedstale.common.secagg.sealing import context, new_private_key, public_key, seal

    fed = Holders()
    fed.mask(0, sender=0)
    server_private = new_private_key()
    server_key = np.frombuffer(public_key(server_private), np.uint8)
    lied_to: dict[str, np.ndarray] = {"secagg.private-key": fed.states[3]["secagg.private-key"]}
    forged_keys = {**fed.keyset, wire.key_name(1): server_key}
    client_half.pin_roster(fed.roster, forged_keys, lied_to, wire.HolderPolicy())
    digest = client_half.roster_of(lied_to).digest
    share = fed.code.encode(random_elements(10))[3]
    forged = seal(
        share, server_private, bytes(fed.keyset[wire.key_name(3)]), context(7, 1, 3, digest)
    )
    config = {**fed.config, wire.HOLDER: 3, wire.UPDATES: [0, 7], wire.SENDERS: [0, 1]}
    parts = {wire.update_share_name(0): fed.sent[0][1][wire.share_name(3)]}
    parts[wire.update_share_name(7)] = forged
    checked = client_half.checked_parts(config, parts, lied_to)
    assert list(checked[wire.OPENED]) == [7] and list(checked[wire.FAILED]) == [0]


@pytest.mark.parametrize(
    ("privacy", "recovery", "refusal"),
    [
        (1, 2, "U must exceed N/2"),  # two disjoint pairs of holders could each decode
        (0, 3, "below this client's 1"),  # T = 0: one holder's share is the mask's piece
        (3, 3, "not 0 <= T < U <= N"),
    ],
)
def test_a_code_the_client_did_not_agree_to_is_refused_in_the_key_round(
    privacy: int, recovery: int, refusal: str
) -> None:
    """Finding of the review: N, T and U came from the server alone. A client now checks
    the code against its own floor on T, 2U > N and U + T >= N before it pins, and refuses
    a mask task whose code is not the pinned one."""
    fed = Holders()
    fresh: dict[str, np.ndarray] = {}
    client_half.own_key(fresh)
    keyset = {**fed.keyset, wire.key_name(0): client_half.own_key(fresh)}
    roster = {**fed.roster, wire.PRIVACY: privacy, wire.RECOVERY: recovery}
    with pytest.raises(wire.Refused, match=refusal):
        client_half.pin_roster(roster, keyset, fresh, wire.HolderPolicy())
    other = {**fed.config, wire.RECOVERY: 4, wire.UPDATE: 9, wire.SENDER: 0}
    with pytest.raises(wire.Refused, match="not the pinned"):
        client_half.masked_parts(other, np.zeros(10), fed.states[0])


def _answer_once(state: dict, folder: str, barrier: Any, results: Any) -> None:
    os.environ[client_half.ANSWERED_DIR] = folder
    config = {wire.HOLDER: 0, wire.UPDATES: [0, 1], wire.FACTORS: [1024, 1024]}
    barrier.wait()
    try:
        client_half.aggregate_parts(config, wire.HolderPolicy(), state)
        results.put("answered")
    except wire.Refused as err:
        results.put(str(err))


def test_two_unmask_messages_at_once_are_answered_at_most_once(tmp_path: Path) -> None:
    """Two ClientApp processes of one node, each started from the same state (as a
    SuperNode hands a Context to each), asked for the same updates at the same moment:
    the record on the node's disk, claimed under a lock, lets exactly one answer."""
    import multiprocessing

    fed = Holders()
    fed.mask(0, sender=0)
    fed.mask(1, sender=1)
    fed.check(0, [0, 1])
    context = multiprocessing.get_context("fork")
    for attempt in range(3):
        barrier, results = context.Barrier(2), context.Queue()
        state = {name: array.copy() for name, array in fed.states[0].items()}
        folder = str(tmp_path / f"answered-{attempt}")
        workers = [
            context.Process(target=_answer_once, args=(state, folder, barrier, results))
            for _ in range(2)
        ]
        for worker in workers:
            worker.start()
        outcomes = sorted(results.get(timeout=60) for _ in workers)
        for worker in workers:
            worker.join(30)
        assert outcomes[0] == "answered"
        assert outcomes[1].startswith("asked again for update(s) [0, 1]")


def test_a_buffer_survives_holders_that_die_while_u_answer(tmp_path: Path) -> None:
    run, params = load_config(
        {**BASE, **SECURE, "runs-dir": str(tmp_path), "run-name": "dead", "max-versions": 3}
    )
    summary = run_experiment(run, params, Watched(run, silent=frozenset({5})))
    secure = summary["secure_aggregation"]
    assert summary["versions"] == 3
    assert (secure["holders"], secure["recovery_threshold"]) == (6, 4)
    assert secure["buffers_dropped"] == 0


def plain_sums_checked(
    monkeypatch: pytest.MonkeyPatch, watched: Watched
) -> list[tuple[float, float, int]]:
    """Every unmask's move of the model against the plain weighted sum of the deltas the
    clients really sent, for the updates the buffer kept: (error, bound, updates kept)."""
    checked: list[tuple[float, float, int]] = []
    unmask = SecureAggregation.unmask

    def checking(self: SecureAggregation, strategy: Any, outcome: Any, exchange: Any) -> bool:
        before = strategy.model.astype(np.float64)
        dropped = self.counts.updates_dropped
        done = unmask(self, strategy, outcome, exchange)
        spoiled = watched.garbage | watched.replay
        kept = [
            r
            for r in outcome.records
            if not (self.counts.updates_dropped > dropped and int(r["client"]) in spoiled)
        ]
        weights = [float(r["weight"]) for r in kept]
        plain = sum(
            w * np.clip(watched.deltas[int(r["task"])], -1, 1)
            for w, r in zip(weights, kept, strict=True)
        )
        moved = strategy.model.astype(np.float64) - before
        slack = np.abs(strategy.model).max() * 2.0**-23
        if done:
            bound = self.quantiser.error_bound(weights) + slack
            checked.append((float(np.max(np.abs(moved - plain))), bound, len(kept)))
        else:
            assert not moved.any()  # a dropped buffer moves nothing
        return done

    monkeypatch.setattr(SecureAggregation, "unmask", checking)
    return checked


def test_a_holder_answering_at_random_is_named_and_every_buffer_recovered_from_the_rest(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    run, params = load_config(
        {**BASE, **SECURE, "runs-dir": str(tmp_path), "run-name": "liar", "max-versions": 4}
    )
    watched = Watched(run, wrong=frozenset({2}))
    checked = plain_sums_checked(monkeypatch, watched)
    summary = run_experiment(run, params, watched)
    secure = summary["secure_aggregation"]
    assert summary["versions"] == 4 and secure["buffers_dropped"] == 0
    named = caplog.text.count("holder 2 (client 2) answered a share that does not fit")
    # asked first in three of the four buffers (U + 1 = 5 of 6, starting one further each
    # time); the fourth never asked it
    assert secure["wrong_answers"] == named == 3
    assert len(checked) == 4 and all(error <= bound for error, bound, _ in checked)


def test_two_holders_answering_at_random_drop_the_buffer_never_a_wrong_model(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """Six holders, U = 4, secagg-wrong-answers 1: with two wrong answers no five agree, so
    each buffer is dropped with one line and the model never moves wrongly."""
    run, params = load_config(
        {**BASE, **SECURE, "runs-dir": str(tmp_path), "run-name": "liars", "max-updates": 9}
    )
    watched = Watched(run, wrong=frozenset({1, 4}))
    checked = plain_sums_checked(monkeypatch, watched)
    summary = run_experiment(run, params, watched)
    assert summary["versions"] == 0 and summary["secure_aggregation"]["buffers_dropped"] == 3
    assert not checked
    assert caplog.text.count("no 5 of the 6 answers agree: more than 1 wrong") == 3


@pytest.mark.parametrize("spoil", ["garbage", "replay"])
def test_a_client_sending_bad_shares_costs_only_its_own_updates(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture, spoil: str
) -> None:
    """Client 3 sends random bytes as every share (or replays its first update's shares):
    each holder's check names its update, the server drops that update alone, named with
    its node, and recovers the rest of the buffer: every honest update counted, but for
    one left alone in its buffer by client 3's (one client's update is never released)."""
    run, params = load_config(
        {**BASE, **SECURE, "runs-dir": str(tmp_path), "run-name": spoil, "max-versions": 6}
    )
    watched = Watched(run, **{spoil: frozenset({3})})
    checked = plain_sums_checked(monkeypatch, watched)
    summary = run_experiment(run, params, watched)
    secure = summary["secure_aggregation"]
    lines = [line for line in caplog.text.splitlines() if "(client 3) dropped" in line]
    assert lines and secure["updates_dropped"] == len(lines)
    assert all("did not open at 6 of the 6 holders that checked" in line for line in lines)
    alone = caplog.text.count("1 client(s) left in it, fewer than secagg-min-clients 2")
    assert summary["versions"] == 6 and secure["buffers_dropped"] == alone
    # each release moved the model by the plain sum of every honest update in its buffer
    assert len(checked) == 6 and all(error <= bound for error, bound, _ in checked)
    assert sum(kept for _, _, kept in checked) < 18  # some of client 3's were in them


def test_a_client_garbling_some_of_its_shares_costs_one_buffer_then_its_updates_are_refused(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """Client 3 garbles its shares for holders 0 and 1 only (2 of 6, U = 4): the holders
    that opened all answer at once (spent), too few to decode with one spare; those left
    cannot reach U + 1 either, so that buffer is lost, once: client 3 is named and its
    later updates are refused; every later buffer is released."""
    run, params = load_config(
        {**BASE, **SECURE, "runs-dir": str(tmp_path), "run-name": "some", "max-versions": 5}
    )
    watched = Watched(run, garbage=frozenset({3}), garbled_for=frozenset({0, 1}))
    summary = run_experiment(run, params, watched)
    secure = summary["secure_aggregation"]
    assert summary["versions"] == 5 and secure["buffers_dropped"] <= 1
    assert (
        caplog.text.count("client 3 sent shares that open at some holders and not at others") == 1
    )
    assert summary["updates_rejected"] >= 1
    assert "client 3 sent shares that opened at some holders and not at others; its updates" in (
        caplog.text
    )


def test_below_u_a_buffer_is_dropped_with_one_line_and_the_run_goes_on(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    run, params = load_config(
        {**BASE, **SECURE, "runs-dir": str(tmp_path), "run-name": "few", "max-updates": 9}
    )
    summary = run_experiment(run, params, Watched(run, silent=frozenset({0, 1, 5})))
    secure = summary["secure_aggregation"]
    assert summary["updates_accepted"] == 9 and summary["versions"] == 0
    assert secure["buffers_dropped"] == secure["buffers"] == 3
    assert "buffer of 3 updates dropped: 3 of the 6 holders answered, 5 needed" in caplog.text


def test_a_malformed_masked_update_is_rejected_and_the_run_goes_on(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    run, params = load_config(
        {**BASE, **SECURE, "runs-dir": str(tmp_path), "run-name": "bad", "max-versions": 2}
    )
    summary = run_experiment(run, params, Watched(run, corrupt=True))
    assert summary["versions"] == 2 and summary["updates_rejected"] == 1
    assert "the masked update is uint32 of shape (4809,), not 4810 field elements" in caplog.text


@pytest.mark.parametrize(
    ("values", "refusal"),
    [
        ({"strategy": "fedasync"}, "releases every update alone"),
        ({"strategy": "fedpsa"}, "cannot take secure aggregation"),
        ({"strategy": "ca2fl"}, "cannot take secure aggregation"),
        ({"dp-clipping-norm": 1.0}, "use dp-clipping=client"),
        ({"buffer-size": 6, "secagg-precision-bits": 24}, "overflows the field"),
        ({"secagg-privacy": 3, "secagg-recovery": 3}, "must exceed secagg-privacy"),
    ],
)
def test_what_cannot_take_secure_aggregation_is_refused_in_one_line(
    values: dict[str, Any], refusal: str
) -> None:
    with pytest.raises(ConfigError, match=refusal):
        load_config({**BASE, **SECURE, "max-versions": 4, **values})


def test_a_recovery_threshold_of_half_the_holders_or_less_is_refused_at_the_start(
    tmp_path: Path,
) -> None:
    """With U <= N / 2 two disjoint sets of U holders could each unmask a different buffer
    holding the same update; the run refuses it in one line before any task."""
    from fedstale.server_app.engine import EngineError

    run, params = load_config(
        {
            **BASE,
            **SECURE,
            "runs-dir": str(tmp_path),
            "run-name": "half",
            "max-versions": 2,
            "secagg-privacy": 1,
            "secagg-recovery": 3,
        }
    )
    with pytest.raises(EngineError, match="secagg-recovery 3 is at most half of the 6 holders"):
        run_experiment(run, params, Watched(run))


def test_a_secure_run_resumes_from_its_checkpoint(tmp_path: Path) -> None:
    """The resumed run asks for the holders' keys again; in process the clients' kept
    state (their private keys) does not survive, so a buffer masked under the old keys
    would be dropped with one line; the checkpoint at 4 follows a release, so none is."""
    secure_run(tmp_path, "first", **{"max-versions": 5, "checkpoint-every": 2})
    resumed = {"max-versions": 7, "checkpoint-every": 2, "resume-from": str(tmp_path / "first")}
    summary, _ = secure_run(tmp_path, "second", **resumed)
    secure = summary["secure_aggregation"]
    assert summary["versions"] == 7 and secure["buffers_dropped"] == 0
    assert secure["buffers"] == 3  # from the checkpoint at 4


def test_a_run_whose_holders_all_fall_silent_stops_with_one_line(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """Every buffer dropped (no holder answers): after 5 in a row the run stops, its folder
    complete, rather than train for a version budget it can never reach."""
    run, params = load_config(
        {
            **BASE,
            **SECURE,
            "runs-dir": str(tmp_path),
            "run-name": "mute",
            "max-versions": 4,
            "secagg-timeout": 0.2,
        }
    )
    summary = run_experiment(run, params, Watched(run, silent=frozenset(range(6))))
    assert summary["versions"] == 0 and summary["secure_aggregation"]["buffers_dropped"] == 5
    assert summary["stop_reason"].startswith("secure aggregation: 5 buffers in a row dropped")
    assert (tmp_path / "mute" / "summary.json").is_file()


def test_central_dp_noises_the_unmasked_sum_and_accounts_every_release(tmp_path: Path) -> None:
    """Secure aggregation with central DP: the ClientApp clips (the server cannot see the
    update), the server noises each unmasked sum, and the ledger holds every release."""
    from fedstale.server_app.stages.central_dp import Accounting

    dp = {"dp-clipping": "client", "dp-clipping-norm": 1.0, "dp-noise-multiplier": 1.0}
    summary, _ = secure_run(tmp_path, "dp", **dp, **{"max-versions": 4})
    privacy = summary["privacy"]
    assert summary["versions"] == privacy["releases"] == 4 and summary["updates_rejected"] == 0
    run, _ = load_config({**BASE, **SECURE, **dp, "max-versions": 4})
    assert privacy["epsilon"] == pytest.approx(Accounting.of(run).epsilon_after(4), rel=1e-12)
    assert summary["secure_aggregation"]["clip_range"] == 1.0  # R follows dp-clipping-norm


def test_secure_aggregation_on_two_worker_processes_is_the_one_process_run(
    tmp_path: Path,
) -> None:
    from fedstale.launcher.local import pooled_transport
    from fedstale.server_app.results import read_jsonl

    secure_run(tmp_path, "one", **{"max-versions": 4})
    run, params = load_config(
        {**BASE, **SECURE, "runs-dir": str(tmp_path), "run-name": "two", "max-versions": 4}
    )
    with pooled_transport(run, 2) as transport:
        run_experiment(run, params, transport)
    for name in ("updates.jsonl", "metrics.jsonl"):
        one, two = read_jsonl(tmp_path / "one" / name), read_jsonl(tmp_path / "two" / name)
        assert [{k: v for k, v in r.items() if k != "wall_time"} for r in one] == [
            {k: v for k, v in r.items() if k != "wall_time"} for r in two
        ]


def keyed_stage(holders: int = 3) -> SecureAggregation:
    """A stage whose key round `holders` clients answered (a stand-in exchange)."""
    from fedstale.common.layout import ParamLayout
    from fedstale.server_app.transport import Reply

    run, _ = load_config({**BASE, **SECURE, "num-clients": holders, "max-versions": 2})
    stage = SecureAggregation(run, ParamLayout(("w",), ((4,),)))

    def exchange(requests: list, needed: int, seconds: float) -> list:
        def answer(config: dict) -> dict:
            if config[wire.STAGE] == wire.ROSTER_STAGE:
                return {wire.PINNED: np.zeros(64, np.uint8)}
            return {wire.PUBLIC_KEY: client_half.own_key({})}

        return [
            (client, Reply(f"k{client}", sets={wire.SET: answer(config)}))
            for client, config, _ in requests
        ]

    stage.started(exchange, list(range(holders)))
    return stage


def good_parts(stage: SecureAggregation) -> dict[str, np.ndarray]:
    code = stage.ready()
    sealed = 12 + 4 * code.share_length + 16
    parts = {wire.share_name(j): np.zeros(sealed, np.uint8) for j in range(code.holders)}
    return {**parts, wire.MASKED: np.zeros(4, np.uint32), wire.PUBLIC_KEY: np.zeros(32, np.uint8)}


@pytest.mark.parametrize(
    ("change", "reason"),
    [
        ({wire.MASKED: np.zeros(4, np.float32)}, "float32 of shape \\(4,\\), not 4 field elements"),
        ({wire.MASKED: np.full(4, 2**32 - 1, np.uint32)}, "not 4 field elements below"),
        ({wire.share_name(1): np.zeros(7, np.uint8)}, "a sealed share is missing or not"),
        ({wire.share_name(2): None}, "a sealed share is missing or not"),
        ({wire.PUBLIC_KEY: np.zeros(31, np.uint8)}, "public key is not 32 bytes"),
    ],
)
def test_a_masked_reply_of_the_wrong_size_type_or_range_is_rejected_in_one_line(
    change: dict[str, Any], reason: str
) -> None:
    from fedstale.common.schema import InvalidReply
    from fedstale.server_app.transport import Reply

    stage = keyed_stage()
    parts = {k: v for k, v in {**good_parts(stage), **change}.items() if v is not None}
    with pytest.raises(InvalidReply, match=reason):
        stage.reply(0, 0, Reply("m", metrics={}, sets={wire.SET: parts}))
    stage.reply(1, 0, Reply("m", metrics={}, sets={wire.SET: good_parts(stage)}))  # the same, whole
    with pytest.raises(InvalidReply, match=r"add fedstale\.secagg_mod\(\)"):
        stage.reply(2, 0, Reply("m", metrics={}, arrays={"w": np.zeros(4, np.float32)}))


def test_a_holders_share_out_of_range_is_ignored_with_one_line(
    caplog: pytest.LogCaptureFixture,
) -> None:
    from fedstale.server_app.transport import Reply

    stage = keyed_stage()
    code = stage.ready()
    bad = Reply(
        "a", sets={wire.SET: {wire.AGGREGATE: np.full(code.share_length, 2**32 - 1, np.uint32)}}
    )
    assert stage.checked_share(0, 0, bad, code) is None
    short = Reply("b", sets={wire.SET: {wire.AGGREGATE: np.zeros(1, np.uint32)}})
    assert stage.checked_share(1, 1, short, code) is None
    good = Reply("c", sets={wire.SET: {wire.AGGREGATE: np.ones(code.share_length, np.uint32)}})
    assert stage.checked_share(2, 2, good, code) is not None
    assert caplog.text.count("sent a share of shape") == 2


def test_a_clientapp_without_the_mod_is_named_in_one_line_and_the_run_stops(
    tmp_path: Path,
) -> None:
    """secure-aggregation on, but the clients' train function without the client half (on
    `--local`'s worker process, where a client's exception is its error reply, as in
    Flower): the key request reaches it and fails on every node; the run stops before any
    task, its one line naming the mod to add."""
    from fedstale.client_app.task import train_task
    from fedstale.launcher import local
    from fedstale.server_app.engine import EngineError

    run, params = load_config(
        {**BASE, **SECURE, "runs-dir": str(tmp_path), "run-name": "nomod", "max-versions": 2}
    )
    with (
        pytest.MonkeyPatch.context() as patch,
        pytest.raises(EngineError) as raised,
    ):
        patch.setattr(local, "trainer_for", lambda run: train_task)  # the mod forgotten
        with local.pooled_transport(run, 1) as transport:
            run_experiment(run, params, transport)
    line = str(raised.value)
    assert "\n" not in line and "none of the 6 ClientApps that replied sent a key" in line
    assert "add fedstale.secagg_mod() to the ClientApp's train handler" in line
