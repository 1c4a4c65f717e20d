"""Secure aggregation as one stage of the engine (`secure-aggregation=true`): the server
sees each update only masked, and learns each buffer's weighted sum alone.

The update path with it on: a reply's "secagg" set (the masked, quantised delta and the
mask's N sealed shares) is checked and kept, and the rule is handed the update a zero delta
would have made (`placeholder`: a zero delta, or the model the task started from). A rule
whose release is linear in its updates' deltas with the weights its records give
(`Release(LINEAR)`, the declaration central DP uses) then moves its model by exactly the
public part; when it releases, `unmask` asks U holders for their shares of the buffer's
weighted mask, recovers sum_i W_i x_i and adds it, before the privacy stage adds noise.
Below U answers the buffer is dropped with one line: the rule's model stays, no version.

The engine owns the messages: the key round and the unmasking send theirs through the
engine's `Messages` (pipeline.gather: these messages to these clients, the replies that came
within the timeout).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from functools import partial
from typing import Any

import numpy as np

from fedstale.common.config import RunConfig
from fedstale.common.layout import ParamLayout
from fedstale.common.schema import RETURN_MODEL, InvalidReply
from fedstale.common.secagg import protocol as wire
from fedstale.common.secagg.coding import Disagreement, MaskCode, decode_checked
from fedstale.common.secagg.field import (
    PRIME,
    Quantiser,
    from_wire,
    in_field,
    subtract,
    weighted_sum,
)
from fedstale.common.secagg.protocol import HolderPolicy
from fedstale.common.secagg.sealing import NONCE_BYTES
from fedstale.server_app.stages.pipeline import (
    Messages,
    Request,
    Sets,
    Stage,
    StageError,
    Verdict,
    gather,
)
from fedstale.server_app.transport import Reply
from fedstale.strategies.base import Outcome, Strategy

log = logging.getLogger("fedstale")
TAG_BYTES = 16  # ChaCha20-Poly1305's tag
WIRE_BYTES = 4  # a field element on the wire
KEY_BYTES = 32
DROPS_IN_A_ROW = 5  # buffers dropped one after another before the run stops

Exchange = Callable[[list[Request], int, float], list[tuple[int, Reply]]]


@dataclass
class Masked:
    """What the server keeps of one update until its buffer is released."""

    client: int
    vector: np.ndarray  # field elements
    shares: list[np.ndarray]  # sealed, one per holder
    public_key: bytes


@dataclass
class Buffer:
    """A buffer being unmasked: its updates (task ids), what is kept of each, their weights."""

    tasks: list[int]
    kept: dict[int, Masked]
    weights: dict[int, float]

    @property
    def weights_list(self) -> list[float]:
        return [self.weights[t] for t in self.tasks]

    def factors(self, quantiser: Quantiser) -> tuple[list[int], float]:
        """The integer weights W_i, relative to the largest of these updates, and its scale."""
        return quantiser.weight_units(self.weights_list)


@dataclass
class Counts:
    buffers: int = 0
    dropped: int = 0
    dropped_in_a_row: int = 0
    bytes_in: int = 0
    bytes_out: int = 0
    refusals: int = 0
    wrong_answers: int = 0  # holders' answers that did not fit the others'
    updates_dropped: int = 0  # updates left out of their buffer (shares or weight)
    unmask_seconds: float = 0.0
    errors: list[float] = field(default_factory=list)


class SecureAggregation(Stage):
    """The secure aggregation stage of a run (`secure-aggregation=true`)."""

    key = "secure"

    def __init__(self, run: RunConfig, layout: ParamLayout) -> None:
        self.run = run
        self.layout = layout
        self.length = layout.total
        self.quantiser = Quantiser(
            clip_range=run.secagg_range,
            precision_bits=run.secagg_precision_bits,
            weight_bits=run.secagg_weight_bits,
        )
        self.holders: list[int] = []  # client of each holder index
        self.keys: list[bytes] = []
        self.code: MaskCode | None = None
        self.starts: dict[int, np.ndarray] = {}
        self.kept: dict[int, Masked] = {}
        self.counts = Counts()
        self.silent: set[int] = set()  # holders that did not reply when last asked
        self.asked: set[int] = set()  # holders asked for the buffer being unmasked
        self.suspects: set[int] = set()  # clients whose shares opened at some holders only
        self.policy = HolderPolicy.of_run(run)

    # ---------------------------------------------------------------- keys
    def joined(self, clients: list[int], messages: Messages) -> list[int]:
        """The key round; the clients that sent no key get no task."""
        left_out = self.started(partial(gather, messages), clients)
        for client in left_out:
            log.warning("client %d sent no key in the key round: no task for it", client)
        return left_out

    def started(self, exchange: Exchange, clients: list[int]) -> list[int]:
        before = (self.holders, self.keys)
        self.ask_keys(exchange, clients)
        if self.kept and (self.holders, self.keys) != before:
            log.warning(
                "secure aggregation: %d masked update(s) from before the resume were "
                "shared among holders whose keys changed; their buffer will be dropped",
                len(self.kept),
            )
            self.kept.clear()
        holders, privacy, recovery = self.thresholds(len(self.holders))
        if recovery > holders:
            raise SecureAggregationError(
                f"secure aggregation: {len(self.holders)} of {len(clients)} clients sent a key, "
                f"fewer than secagg-recovery {recovery}; start more SuperNodes or lower it"
            )
        if 2 * recovery <= holders:
            # two disjoint sets of U holders could each unmask a different buffer holding
            # the same update, and the difference of the two sums would show single updates
            raise SecureAggregationError(
                f"secure aggregation: secagg-recovery {recovery} is at most half of the "
                f"{holders} holders; raise it above {holders // 2}"
            )
        if recovery + privacy < holders:
            # the N - U holders left after a decode could give a second combination of an
            # update: more than T shares of its mask
            raise SecureAggregationError(
                f"secure aggregation: secagg-recovery {recovery} plus secagg-privacy "
                f"{privacy} is below the {holders} holders; raise one of them"
            )
        self.code = MaskCode(holders, privacy, recovery, self.length)
        self.pin_roster(exchange)
        log.info(
            "secure aggregation: %d holders, any %d recover a buffer, any %d learn nothing; "
            "holders answer for %d or more clients, %s weights within %g of a buffer's largest",
            holders,
            recovery,
            privacy,
            self.policy.min_clients,
            self.policy.rule,
            self.policy.min_weight_ratio,
        )
        return [client for client in clients if client not in self.holders]

    def ask_keys(self, exchange: Exchange, clients: list[int]) -> None:
        requests: list[Request] = [(client, {wire.STAGE: wire.KEYS}, {}) for client in clients]
        answered, errors = {}, []
        # the nodes may still be starting (worker processes, SuperNodes): node-wait-seconds
        for client, reply in exchange(requests, len(requests), self.run.node_wait_seconds):
            key = reply.sets.get(wire.SET, {}).get(wire.PUBLIC_KEY)
            if reply.error_code is None and _is_key(key):
                answered[client] = bytes(np.asarray(key, np.uint8))
            else:
                errors.append(reply.error or "a reply without a key")
        if errors and not answered:
            raise SecureAggregationError(
                f"secure aggregation: none of the {len(errors)} ClientApps that replied sent a "
                "key (the key request reached their train function, which failed): add "
                "fedstale.secagg_mod() to the ClientApp's train handler, "
                "@app.train(mods=[fedstale.secagg_mod()])"
            )
        self.holders = sorted(answered)
        self.keys = [answered[client] for client in self.holders]

    def pin_roster(self, exchange: Exchange) -> None:
        """The key round's last message: every holder pins the roster and the code, after
        checking the code against its own policy; too few pinned: one line."""
        code = self.ready()
        config = {wire.STAGE: wire.ROSTER_STAGE, wire.ROSTER: list(self.holders)}
        config |= self.code_config(code)
        sets = {wire.SET: wire.keys_array(self.keys)}
        requests: list[Request] = [(client, config, sets) for client in self.holders]
        pinned, refusals = 0, []
        for client, reply in exchange(requests, len(requests), self.run.node_wait_seconds):
            if reply.error_code is None and wire.PINNED in reply.sets.get(wire.SET, {}):
                pinned += 1
            else:
                refusals.append(f"client {client}: {reply.error or 'no answer'}")
        for refusal in refusals:
            log.warning("secure aggregation: roster not pinned by %s", refusal)
        if pinned < code.recovery + self.run.secagg_wrong_answers:
            raise SecureAggregationError(
                f"secure aggregation: {pinned} of the {code.holders} holders pinned the roster, "
                f"{code.recovery + self.run.secagg_wrong_answers} needed; first refusal: "
                f"{refusals[0] if refusals else 'none'}"
            )

    def thresholds(self, holders: int) -> tuple[int, int, int]:
        """(N, T, U): T and U as set, else T = N // 3 and U = N - N // 3 (a third may drop)."""
        privacy = self.run.secagg_privacy if self.run.secagg_privacy >= 0 else holders // 3
        recovery = self.run.secagg_recovery or holders - holders // 3
        return holders, privacy, max(recovery, privacy + 1)

    # ---------------------------------------------------------------- tasks
    def task_parts(self, task_id: int, client: int, carries: str) -> tuple[dict[str, Any], Sets]:
        code = self.ready()
        if client not in self.holders:
            raise SecureAggregationError(
                f"secure aggregation: client {client} sent no key in the key round"
            )
        config = {
            wire.STAGE: wire.MASK,
            wire.RETURNS: carries,
            wire.HOLDERS: code.holders,
            wire.PRIVACY: code.privacy,
            wire.RECOVERY: code.recovery,
            wire.LENGTH: code.length,
            wire.CLIP_RANGE: self.quantiser.clip_range,
            wire.PRECISION_BITS: self.quantiser.precision_bits,
            wire.WEIGHT_BITS: self.quantiser.weight_bits,
            wire.UPDATE: task_id,
            wire.SENDER: client,
        }
        return config, {}

    def sent(self, task_id: int, start: np.ndarray, returns: str, carries: str) -> None:
        if carries == RETURN_MODEL:
            self.starts[task_id] = np.array(start, dtype=np.float32, copy=True)

    def reply(self, task_id: int, client: int, reply: Reply) -> Reply:
        """Keep the masked update; the reply the rule sees carries its placeholder."""
        code = self.ready()
        if client in self.suspects:
            raise InvalidReply(
                f"secure aggregation: client {client} sent shares that opened at some holders "
                "and not at others; its updates are refused"
            )
        parts = reply.sets.get(wire.SET)
        if parts is None:
            raise InvalidReply(
                "no 'secagg' array set: the ClientApp does not mask its update "
                "(add fedstale.secagg_mod() to its train handler)"
            )
        masked = np.asarray(parts.get(wire.MASKED, np.zeros(0)))
        if masked.shape != (code.length,) or not in_field(masked):
            raise InvalidReply(
                f"secure aggregation: the masked update is {masked.dtype} of shape "
                f"{masked.shape}, not {code.length} field elements below {PRIME}"
            )
        sealed = NONCE_BYTES + WIRE_BYTES * code.share_length + TAG_BYTES
        shares = [np.asarray(parts.get(wire.share_name(j), ())) for j in range(code.holders)]
        if any(s.dtype != np.uint8 or s.shape != (sealed,) for s in shares):
            raise InvalidReply(
                f"secure aggregation: a sealed share is missing or not {sealed} bytes "
                f"(each of the {code.holders} holders gets one)"
            )
        key = parts.get(wire.PUBLIC_KEY)
        if not _is_key(key):
            raise InvalidReply("secure aggregation: the reply's public key is not 32 bytes")
        key_bytes = bytes(np.asarray(key, np.uint8))
        self.kept[task_id] = Masked(client, from_wire(masked), shares, key_bytes)
        self.counts.bytes_in += masked.nbytes + sum(s.nbytes for s in shares) + KEY_BYTES
        sets = {name: part for name, part in reply.sets.items() if name != wire.SET}
        return Reply(
            reply.msg_id, metrics=reply.metrics, arrays=self.placeholder(task_id), sets=sets
        )

    def placeholder(self, task_id: int) -> dict[str, np.ndarray]:
        """The main arrays a zero delta would have come back as: zeros where the wire
        carries deltas, the model the task started from where it carries models."""
        start = self.starts.get(task_id)
        return self.layout.unflatten(
            start if start is not None else np.zeros(self.length, np.float32)
        )

    def forget(self, task_id: int) -> None:
        self.starts.pop(task_id, None)

    # ---------------------------------------------------------------- releases
    def release(
        self, strategy: Strategy[Any], outcome: Outcome, version: int, messages: Messages
    ) -> Verdict:
        released = self.unmask(strategy, outcome, partial(gather, messages))
        return Verdict(released=released, stop=self.stop())

    def unmask(self, strategy: Strategy[Any], outcome: Outcome, exchange: Exchange) -> bool:
        """Recover the released buffer's weighted sum and add it to the rule's model; False:
        the buffer dropped (one line), the model as it was.

        One round when all is well: U + f holders are sent their sealed shares and the
        weights; each opens every share and, if all open, answers at once; the answers are
        checked against each other (`decode_checked`). Where a share did not open, the
        holders that answered have spent their one answer on these updates, so the rest
        of the buffer is checked first and then unmasked by the holders that did not
        answer: the update whose shares failed costs only itself."""
        code = self.ready()
        started = time.perf_counter()
        tasks = [int(record["task"]) for record in outcome.records]
        weights = {int(r["task"]): float(r["weight"]) for r in outcome.records}
        lost = [task for task in tasks if task not in self.kept]
        kept = {task: self.kept.pop(task) for task in tasks if task in self.kept}
        if lost:
            return self.drop(
                len(tasks),
                f"the masked updates of task(s) {lost} were lost with the keys "
                "they were shared under",
            )
        units, _ = self.quantiser.weight_units([weights[t] for t in tasks])
        tasks = self.weighable(tasks, dict(zip(tasks, units, strict=True)), kept)
        problem = self.too_few_clients(tasks, kept)
        if problem:
            return self.drop(len(weights), problem)
        buffer = Buffer(tasks, kept, weights)
        self.asked = set()
        answers, reports = self.open_and_answer(code, buffer, self.first_wave(code), exchange)
        result = self.decoded(code, answers)
        if isinstance(result, str) and not reports:  # silent or wrong: ask those not asked
            unasked = [j for j in self.order(code) if j not in self.asked]
            more, reports = self.open_and_answer(code, buffer, unasked, exchange)
            answers.update(more)
            result = self.decoded(code, answers)
        if isinstance(result, str) and reports:
            buffer, result = self.without_bad_shares(code, buffer, answers, reports, exchange)
        if isinstance(result, str):
            return self.drop(len(weights), result)
        mask, wrong = result
        for j in wrong:
            self.counts.wrong_answers += 1
            log.warning(
                "secure aggregation: holder %d (client %d) answered a share that does not fit "
                "the others': excluded from this buffer, recovered from the rest",
                j,
                self.holders[j],
            )
        factors, top = buffer.factors(self.quantiser)
        total = subtract(weighted_sum([kept[t].vector for t in buffer.tasks], factors), mask)
        if not self.quantiser.in_range(total, factors):
            return self.drop(
                len(weights),
                "the decoded sum is outside what its updates can sum to: more "
                "holders answered wrongly than secagg-wrong-answers covers",
            )
        summed = self.quantiser.decode(total, top)
        strategy.model = (strategy.model.astype(np.float64) + summed).astype(np.float32)
        self.counts.buffers += 1
        self.counts.dropped_in_a_row = 0
        self.counts.errors.append(self.quantiser.error_bound(buffer.weights_list))
        self.counts.unmask_seconds += time.perf_counter() - started
        return True

    def too_few_clients(self, tasks: list[int], kept: dict[int, Masked]) -> str:
        clients = len({kept[t].client for t in tasks})
        if clients >= self.policy.min_clients:
            return ""
        return (
            f"{clients} client(s) left in it, fewer than secagg-min-clients "
            f"{self.policy.min_clients}"
        )

    def decoded(
        self, code: MaskCode, answers: dict[int, np.ndarray]
    ) -> tuple[np.ndarray, list[int]] | str:
        """The mask and the holders whose answers did not fit, or why not (a line)."""
        if len(answers) < self.needed(code):
            return (
                f"{len(answers)} of the {code.holders} holders answered, {self.needed(code)} "
                "needed (secagg-recovery plus secagg-wrong-answers)"
            )
        try:
            return decode_checked(code, answers, self.run.secagg_wrong_answers)
        except Disagreement as err:
            return f"{len(answers)} of the {code.holders} holders answered: {err}"

    def order(self, code: MaskCode) -> list[int]:
        """The holders in the order they are asked: those that replied last time first,
        starting one further at each buffer (the work spreads)."""
        first = self.counts.buffers % code.holders
        order = [(first + k) % code.holders for k in range(code.holders)]
        return sorted(order, key=lambda j: j in self.silent)

    def needed(self, code: MaskCode) -> int:
        """Answers a decode needs: U, and f more so that f wrong ones cannot pass."""
        return code.recovery + self.run.secagg_wrong_answers

    def first_wave(self, code: MaskCode) -> list[int]:
        """U + f holders; when their answers disagree, those not asked yet are asked."""
        return self.order(code)[: code.recovery + self.run.secagg_wrong_answers]

    def open_and_answer(
        self, code: MaskCode, buffer: Buffer, holders: Sequence[int], exchange: Exchange
    ) -> tuple[dict[int, np.ndarray], dict[int, set[int]]]:
        """Ask `holders` to open their shares of the buffer and answer when all open:
        ({holder: answer}, {holder: updates whose shares did not open there})."""
        factors, _ = buffer.factors(self.quantiser)
        config = {
            **self.buffer_config(code, buffer),
            wire.STAGE: wire.UNMASK,
            wire.FACTORS: list(factors),
        }
        requests = [self.request(j, config, self.holder_parts(j, buffer)) for j in holders]
        self.asked.update(holders)
        alive = [j for j in holders if j not in self.silent]
        # every holder that replied last time; holders silent then are asked but not waited
        # for, unless fewer than U + 1 are left (a dead holder costs no timeout)
        needed = max(len(alive), min(len(holders), self.needed(code)))
        answers: dict[int, np.ndarray] = {}
        reports: dict[int, set[int]] = {}
        replies = exchange(requests, needed, self.run.secagg_timeout)
        replied = {self.holders.index(client) for client, _ in replies}
        self.silent = (self.silent | set(holders)) - replied
        for client, reply in replies:
            j = self.holders.index(client)
            failed = reply.sets.get(wire.SET, {}).get(wire.FAILED)
            if reply.error_code is None and failed is not None and len(failed):
                reports[j] = {int(u) for u in np.asarray(failed)}
                continue
            share = self.checked_share(j, client, reply, code)
            if share is not None:
                answers[j] = share
        return answers, reports

    def without_bad_shares(
        self,
        code: MaskCode,
        buffer: Buffer,
        answers: dict[int, np.ndarray],
        reports: dict[int, set[int]],
        exchange: Exchange,
    ) -> tuple[Buffer, tuple[np.ndarray, list[int]] | str]:
        """The buffer without the updates whose shares did not open, checked and then
        unmasked by the holders that have not answered for it (those that did are spent)."""
        self.note_partial(buffer, answers, reports)
        unspent = [j for j in range(code.holders) if j not in answers]
        opened = self.check(code, buffer, unspent, exchange)
        tasks, able = self.usable(code, buffer, opened)
        if len(able) < self.needed(code):
            return buffer, (
                f"{len(able)} of the {code.holders} holders can answer for it, "
                f"{self.needed(code)} needed (secagg-recovery plus secagg-wrong-answers)"
            )
        problem = self.too_few_clients(tasks, buffer.kept)
        if problem:
            return buffer, problem
        reduced = Buffer(tasks, buffer.kept, buffer.weights)
        return reduced, self.decoded(code, self.ask(code, reduced, able, exchange))

    def note_partial(
        self, buffer: Buffer, answers: dict[int, np.ndarray], reports: dict[int, set[int]]
    ) -> None:
        """A client whose shares opened at some holders and failed at others, where other
        shares opened, sent some garbage on purpose or was tampered with: its updates are
        refused from now on (one line), so it can cost at most this buffer."""
        working = set(answers) | {j for j, bad in reports.items() if bad != set(buffer.tasks)}
        for task in buffer.tasks:
            failed = {j for j, bad in reports.items() if task in bad} & working
            client = buffer.kept[task].client
            if failed and (working - failed) and client not in self.suspects:
                self.suspects.add(client)
                log.warning(
                    "secure aggregation: client %d sent shares that open at some holders and "
                    "not at others (task %d): its updates are refused from now on",
                    client,
                    task,
                )

    def weighable(
        self, tasks: list[int], unit_of: dict[int, int], kept: dict[int, Masked]
    ) -> list[int]:
        """The updates whose weight the holders accept: one below secagg-min-weight-ratio of
        the buffer's largest counts as a zero delta (logged), as a holder would refuse it."""
        light = [t for t in tasks if unit_of[t] < self.policy.least_factor]
        for task in light:
            self.counts.updates_dropped += 1
            log.warning(
                "secure aggregation: update of task %d (client %d) left out of its buffer: "
                "its %s weight is below secagg-min-weight-ratio %g of the buffer's largest",
                task,
                kept[task].client,
                self.policy.rule,
                self.policy.min_weight_ratio,
            )
        return [t for t in tasks if t not in light]

    def check(
        self, code: MaskCode, buffer: Buffer, holders: Sequence[int], exchange: Exchange
    ) -> dict[int, set[int]]:
        """`holders` open their share of each update and keep it, answering nothing yet:
        {holder index: updates opened}."""
        config = {**self.buffer_config(code, buffer), wire.STAGE: wire.CHECK}
        requests = [self.request(j, config, self.holder_parts(j, buffer)) for j in holders]
        opened: dict[int, set[int]] = {}
        for client, reply in exchange(requests, len(requests), self.run.secagg_timeout):
            parts, j = reply.sets.get(wire.SET, {}), self.holders.index(client)
            if reply.error_code is None and wire.OPENED in parts:
                opened[j] = {int(u) for u in np.asarray(parts[wire.OPENED])}
            else:
                self.refused(j, client, reply.error or "no check in its reply")
        return opened

    def usable(
        self, code: MaskCode, buffer: Buffer, opened: dict[int, set[int]]
    ) -> tuple[list[int], list[int]]:
        """The updates whose shares opened widely enough, and the holders at which every one
        of them opened. An update whose shares failed at more holders than can be spared
        (all but U + f of those that checked) is its sender's fault or a replay: dropped,
        named with its client; a holder at which a kept update failed is left out."""
        spare = len(opened) - self.needed(code)
        good = []
        for task in buffer.tasks:
            failed = sum(task not in updates for updates in opened.values())
            if failed > max(spare, 0):
                self.counts.updates_dropped += 1
                log.warning(
                    "secure aggregation: update of task %d (client %d) dropped: its shares did "
                    "not open at %d of the %d holders that checked (altered, replayed or "
                    "duplicated); the rest of its buffer goes on",
                    task,
                    buffer.kept[task].client,
                    failed,
                    len(opened),
                )
            else:
                good.append(task)
        able = sorted(j for j, updates in opened.items() if updates.issuperset(good))
        return good, able

    def ask(
        self, code: MaskCode, buffer: Buffer, able: Sequence[int], exchange: Exchange
    ) -> dict[int, np.ndarray]:
        """The shares of the buffer's weighted mask from every holder that checked it:
        {holder index: share}. Spare answers (more than U) let wrong ones be found."""
        factors, _ = buffer.factors(self.quantiser)
        config = {wire.STAGE: wire.UNMASK, wire.UPDATES: buffer.tasks, wire.FACTORS: factors}
        requests = [self.request(j, config, {}) for j in able]
        answers: dict[int, np.ndarray] = {}
        for client, reply in exchange(requests, len(requests), self.run.secagg_timeout):
            j = self.holders.index(client)
            share = self.checked_share(j, client, reply, code)
            if share is not None:
                answers[j] = share
        return answers

    def buffer_config(self, code: MaskCode, buffer: Buffer) -> dict[str, Any]:
        return {
            wire.UPDATES: list(buffer.tasks),
            wire.SENDERS: [buffer.kept[t].client for t in buffer.tasks],
            **self.code_config(code),
        }

    def code_config(self, code: MaskCode) -> dict[str, Any]:
        return {
            wire.LENGTH: code.length,
            wire.HOLDERS: code.holders,
            wire.PRIVACY: code.privacy,
            wire.RECOVERY: code.recovery,
        }

    def request(self, j: int, config: dict[str, Any], parts: dict[str, np.ndarray]) -> Request:
        self.counts.bytes_out += sum(a.nbytes for a in parts.values())
        sets = {wire.SET: parts} if parts else {}
        return self.holders[j], {**config, wire.HOLDER: j}, sets

    def refused(self, j: int, client: int, why: str) -> None:
        self.counts.refusals += 1
        log.warning("secure aggregation: holder %d (client %d) did not answer: %s", j, client, why)

    def checked_share(self, j: int, client: int, reply: Reply, code: MaskCode) -> Any:
        """A holder's answer as field elements, or None (logged) when it gave none."""
        share = reply.sets.get(wire.SET, {}).get(wire.AGGREGATE)
        if reply.error_code is not None or share is None:
            self.refused(j, client, f"no share: {reply.error or 'no aggregate in its reply'}")
            return None
        share = np.asarray(share)
        if share.shape != (code.share_length,) or not in_field(share):
            self.counts.refusals += 1
            log.warning(
                "secure aggregation: holder %d (client %d) sent a share of shape %s, "
                "not %d field elements: ignored",
                j,
                client,
                share.shape,
                code.share_length,
            )
            return None
        self.counts.bytes_in += share.nbytes
        return from_wire(share)

    def drop(self, size: int, why: str) -> bool:
        log.warning("secure aggregation: buffer of %d updates dropped: %s", size, why)
        self.dropped()
        return False

    def dropped(self) -> None:
        self.counts.buffers += 1
        self.counts.dropped += 1
        self.counts.dropped_in_a_row += 1

    def stop(self) -> str:
        if self.counts.dropped_in_a_row < DROPS_IN_A_ROW:
            return ""
        return (
            f"secure aggregation: {DROPS_IN_A_ROW} buffers in a row dropped, fewer than "
            "secagg-recovery holders answer: check that the SuperNodes are up"
        )

    def holder_parts(self, holder: int, buffer: Buffer) -> dict:
        """A holder's array set: its sealed share of each update."""
        parts: dict[str, np.ndarray] = {}
        for task in buffer.tasks:
            parts[wire.update_share_name(task)] = buffer.kept[task].shares[holder]
        return parts

    def ready(self) -> MaskCode:
        if self.code is None:
            raise RuntimeError("secure aggregation used before its key round")
        return self.code

    def state(self) -> dict[str, Any]:
        """The holders and their keys, and the masked updates of the buffer in progress
        (masked and sealed: nothing in them is readable without the holders)."""
        return {
            "holders": list(self.holders),
            "keys": list(self.keys),
            "kept": dict(self.kept),
            "suspects": sorted(self.suspects),
        }

    def load_state(self, state: dict[str, Any]) -> None:
        self.holders = list(state.get("holders", []))
        self.keys = list(state.get("keys", []))
        self.kept = dict(state.get("kept", {}))
        self.suspects = set(state.get("suspects", []))

    def figures(self) -> dict[str, float]:
        counts = self.counts
        return {"secure/buffers": counts.buffers, "secure/buffers_dropped": counts.dropped}

    def summary(self) -> dict[str, Any]:
        code = self.ready()
        counts = self.counts
        return {
            "secure_aggregation": {
                "holders": code.holders,
                "privacy_threshold": code.privacy,
                "recovery_threshold": code.recovery,
                "buffers": counts.buffers,
                "buffers_dropped": counts.dropped,
                "holder_refusals": counts.refusals,
                "wrong_answers": counts.wrong_answers,
                "updates_dropped": counts.updates_dropped,
                "bytes_in": counts.bytes_in,
                "bytes_out": counts.bytes_out,
                "unmask_seconds": round(counts.unmask_seconds, 3),
                "error_bound_max": max(counts.errors, default=0.0),
                "clip_range": self.quantiser.clip_range,
                "precision_bits": self.quantiser.precision_bits,
                "weight_bits": self.quantiser.weight_bits,
            }
        }


class SecureAggregationError(StageError):
    """Secure aggregation cannot start (too few holders)."""


def _is_key(key: Any) -> bool:
    return key is not None and np.asarray(key).dtype == np.uint8 and np.asarray(key).size == 32
