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

The engine owns the messages: `unmask` and `started` get its `exchange` (send these
messages to these nodes, return the replies that came within the timeout).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

import numpy as np

from fedstale.common.config import RunConfig
from fedstale.common.layout import ParamLayout
from fedstale.common.schema import RETURN_MODEL, InvalidReply
from fedstale.common.secagg import protocol as wire
from fedstale.common.secagg.coding import MaskCode
from fedstale.common.secagg.field import (
    PRIME,
    Quantiser,
    from_wire,
    in_field,
    subtract,
    weighted_sum,
)
from fedstale.common.secagg.sealing import NONCE_BYTES
from fedstale.server_app.transport import Reply
from fedstale.strategies.base import Outcome, Strategy

log = logging.getLogger("fedstale")
TAG_BYTES = 16  # ChaCha20-Poly1305's tag
WIRE_BYTES = 4  # a field element on the wire
KEY_BYTES = 32
DROPS_IN_A_ROW = 5  # buffers dropped one after another before the run stops

Request = tuple[int, dict[str, Any], dict[str, dict[str, np.ndarray]]]  # node, config, sets
Exchange = Callable[[list[Request], int, float], list[tuple[int, Reply]]]


class SecureStage(Protocol):
    def started(self, exchange: Exchange, clients: list[int]) -> None:
        """Before the first task: the holders' keys."""

    def task_parts(
        self, task_id: int, client: int, carries: str
    ) -> tuple[dict[str, Any], dict[str, Any]]:
        """A train task's config entries and array sets (its reply carries `carries`)."""

    def sent(self, task_id: int, start: np.ndarray, returns: str) -> None:
        """Task `task_id` starts from the flat model `start`; its reply carries `returns`
        (a delta or a model) on the wire."""

    def take(self, task_id: int, client: int, reply: Reply) -> Reply:
        """The reply as the rule may see it (InvalidReply when it is malformed)."""

    def unmask(self, strategy: Strategy[Any], outcome: Outcome, exchange: Exchange) -> bool:
        """Add the released buffer's weighted sum to the rule's model; False: dropped."""

    def forget(self, task_id: int) -> None: ...

    def stop(self) -> str:
        """Why the run cannot go on ("" while it can)."""

    def summary(self) -> dict[str, Any]: ...

    def state(self) -> dict[str, Any]: ...

    def load_state(self, state: dict[str, Any]) -> None: ...


class NoSecureAggregation:
    """Updates in the clear, as Flower sends them."""

    def started(self, exchange: Exchange, clients: list[int]) -> None:
        return None

    def task_parts(
        self, task_id: int, client: int, carries: str
    ) -> tuple[dict[str, Any], dict[str, Any]]:
        return {}, {}

    def sent(self, task_id: int, start: np.ndarray, returns: str) -> None:
        return None

    def take(self, task_id: int, client: int, reply: Reply) -> Reply:
        return reply

    def unmask(self, strategy: Strategy[Any], outcome: Outcome, exchange: Exchange) -> bool:
        return True

    def forget(self, task_id: int) -> None:
        return None

    def stop(self) -> str:
        return ""

    def summary(self) -> dict[str, Any]:
        return {}

    def state(self) -> dict[str, Any]:
        return {}

    def load_state(self, state: dict[str, Any]) -> None:
        """Nothing to restore."""


@dataclass
class Masked:
    """What the server keeps of one update until its buffer is released."""

    client: int
    vector: np.ndarray  # field elements
    shares: list[np.ndarray]  # sealed, one per holder
    public_key: bytes


@dataclass
class Counts:
    buffers: int = 0
    dropped: int = 0
    dropped_in_a_row: int = 0
    bytes_in: int = 0
    bytes_out: int = 0
    refusals: int = 0
    unmask_seconds: float = 0.0
    errors: list[float] = field(default_factory=list)


class SecureAggregation:
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

    # ---------------------------------------------------------------- keys
    def started(self, exchange: Exchange, clients: list[int]) -> None:
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
        self.code = MaskCode(holders, privacy, recovery, self.length)
        log.info(
            "secure aggregation: %d holders, any %d recover a buffer, any %d learn nothing",
            holders,
            recovery,
            privacy,
        )

    def ask_keys(self, exchange: Exchange, clients: list[int]) -> None:
        requests: list[Request] = [(client, {wire.STAGE: wire.KEYS}, {}) for client in clients]
        answered = {}
        # the nodes may still be starting (worker processes, SuperNodes): node-wait-seconds
        for client, reply in exchange(requests, len(requests), self.run.node_wait_seconds):
            key = reply.sets.get(wire.SET, {}).get(wire.PUBLIC_KEY)
            if reply.error_code is None and _is_key(key):
                answered[client] = bytes(np.asarray(key, np.uint8))
        self.holders = sorted(answered)
        self.keys = [answered[client] for client in self.holders]

    def thresholds(self, holders: int) -> tuple[int, int, int]:
        """(N, T, U): T and U as set, else T = N // 3 and U = N - N // 3 (a third may drop)."""
        privacy = self.run.secagg_privacy if self.run.secagg_privacy >= 0 else holders // 3
        recovery = self.run.secagg_recovery or holders - holders // 3
        return holders, privacy, max(recovery, privacy + 1)

    # ---------------------------------------------------------------- tasks
    def task_parts(
        self, task_id: int, client: int, carries: str
    ) -> tuple[dict[str, Any], dict[str, Any]]:
        code = self.ready()
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
        sets = {wire.SET: wire.keys_array(self.keys)}
        self.counts.bytes_out += sum(len(k) for k in self.keys)
        return config, sets

    def sent(self, task_id: int, start: np.ndarray, returns: str) -> None:
        if returns == RETURN_MODEL:
            self.starts[task_id] = np.array(start, dtype=np.float32, copy=True)

    def take(self, task_id: int, client: int, reply: Reply) -> Reply:
        """Keep the masked update; the reply the rule sees carries its placeholder."""
        code = self.ready()
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
    def unmask(self, strategy: Strategy[Any], outcome: Outcome, exchange: Exchange) -> bool:
        code = self.ready()
        started = time.perf_counter()
        tasks = [int(record["task"]) for record in outcome.records]
        weights = [float(record["weight"]) for record in outcome.records]
        lost = [task for task in tasks if task not in self.kept]
        kept = [self.kept.pop(task) for task in tasks if task in self.kept]
        if lost:
            self.dropped()
            log.warning(
                "secure aggregation: buffer of %d updates dropped: the masked updates of "
                "task(s) %s were lost with the keys they were shared under",
                len(tasks),
                lost,
            )
            return False
        units, top = self.quantiser.weight_units(weights)
        factors = [unit % PRIME for unit in units]
        answers = self.ask(code, tasks, kept, factors, exchange)
        if len(answers) < code.recovery:
            self.dropped()
            log.warning(
                "secure aggregation: buffer of %d updates dropped: %d of the %d holders "
                "answered, %d needed (secagg-recovery)",
                len(tasks),
                len(answers),
                code.holders,
                code.recovery,
            )
            return False
        holders = sorted(answers)[: code.recovery]
        mask = code.decode(holders, np.stack([answers[j] for j in holders]))
        total = subtract(weighted_sum([k.vector for k in kept], factors), mask)
        summed = self.quantiser.decode(total, top)
        strategy.model = (strategy.model.astype(np.float64) + summed).astype(np.float32)
        self.counts.buffers += 1
        self.counts.dropped_in_a_row = 0
        self.counts.errors.append(self.quantiser.error_bound(weights))
        self.counts.unmask_seconds += time.perf_counter() - started
        return True

    def ask(
        self,
        code: MaskCode,
        tasks: Sequence[int],
        kept: Sequence[Masked],
        factors: Sequence[int],
        exchange: Exchange,
    ) -> dict[int, np.ndarray]:
        """The holders' shares of the buffer's weighted mask: {holder index: share}."""
        config = {
            wire.STAGE: wire.UNMASK,
            wire.UPDATES: list(tasks),
            wire.SENDERS: [k.client for k in kept],
            wire.FACTORS: list(factors),
            wire.MIN_CLIENTS: self.run.secagg_min_clients,
            wire.LENGTH: code.length,
            wire.HOLDERS: code.holders,
            wire.PRIVACY: code.privacy,
            wire.RECOVERY: code.recovery,
        }
        # U holders first, starting where the last buffer stopped (the work spreads); the
        # others only when fewer than U of those answered
        first = self.counts.buffers % code.holders
        order = [(first + k) % code.holders for k in range(code.holders)]
        answers: dict[int, np.ndarray] = {}
        for wave in (order[: code.recovery], order[code.recovery :]):
            needed = code.recovery - len(answers)
            if needed <= 0 or not wave:
                break
            requests = [self.request(j, config, tasks, kept) for j in wave]
            for client, reply in exchange(requests, needed, self.run.secagg_timeout):
                j = self.holders.index(client)
                share = self.checked_share(j, client, reply, code)
                if share is not None:
                    answers[j] = share
        return answers

    def request(
        self, j: int, config: dict[str, Any], tasks: Sequence[int], kept: Sequence[Masked]
    ) -> Request:
        sets = {wire.SET: self.holder_parts(j, tasks, kept)}
        self.counts.bytes_out += sum(a.nbytes for a in sets[wire.SET].values())
        return self.holders[j], {**config, wire.HOLDER: j}, sets

    def checked_share(self, j: int, client: int, reply: Reply, code: MaskCode) -> Any:
        """A holder's answer as field elements, or None (logged) when it gave none."""
        share = reply.sets.get(wire.SET, {}).get(wire.AGGREGATE)
        if reply.error_code is not None or share is None:
            self.counts.refusals += 1
            log.warning(
                "secure aggregation: holder %d (client %d) did not give its share: %s",
                j,
                client,
                reply.error or "no aggregate in its reply",
            )
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

    @staticmethod
    def holder_parts(holder: int, tasks: Sequence[int], kept: Sequence[Masked]) -> dict:
        parts: dict[str, np.ndarray] = {}
        for task, masked in zip(tasks, kept, strict=True):
            parts[wire.update_share_name(task)] = masked.shares[holder]
            parts[wire.update_key_name(task)] = np.frombuffer(masked.public_key, np.uint8)
        return parts

    def ready(self) -> MaskCode:
        if self.code is None:
            raise RuntimeError("secure aggregation used before its key round")
        return self.code

    def state(self) -> dict[str, Any]:
        """The holders and their keys, and the masked updates of the buffer in progress
        (masked and sealed: nothing in them is readable without the holders)."""
        return {"holders": list(self.holders), "keys": list(self.keys), "kept": dict(self.kept)}

    def load_state(self, state: dict[str, Any]) -> None:
        self.holders = list(state.get("holders", []))
        self.keys = list(state.get("keys", []))
        self.kept = dict(state.get("kept", {}))

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
                "bytes_in": counts.bytes_in,
                "bytes_out": counts.bytes_out,
                "unmask_seconds": round(counts.unmask_seconds, 3),
                "error_bound_max": max(counts.errors, default=0.0),
                "clip_range": self.quantiser.clip_range,
                "precision_bits": self.quantiser.precision_bits,
                "weight_bits": self.quantiser.weight_bits,
            }
        }


class SecureAggregationError(RuntimeError):
    """Secure aggregation cannot start (too few holders)."""


def secure_stage(run: RunConfig, layout: ParamLayout) -> SecureStage:
    return SecureAggregation(run, layout) if run.secure_aggregation else NoSecureAggregation()


def _is_key(key: Any) -> bool:
    return key is not None and np.asarray(key).dtype == np.uint8 and np.asarray(key).size == 32
