"""Secure aggregation's client half, for any ClientApp (a Flower mod on its train handler)
and for fedstale's own in every door (the in-process transports wrap its train function):

    app = ClientApp()

    @app.train(mods=[fedstale.secagg_mod()])
    def train(msg, context): ...  # unchanged

The mod answers the server's key and unmask messages itself, without calling the train
function; on a task with `secagg-stage=mask` it calls the train function, then replaces
the reply's model (or delta) with the masked, quantised delta and the mask's sealed shares
(fedstale/common/secagg/protocol.py). Other messages pass through untouched. What the
client keeps between messages (its X25519 private key, the updates it has answered for)
lives in its state (Flower's Context.state on a node).
"""

from __future__ import annotations

import copy
import fcntl
import hashlib
import logging
import os
import tempfile
from collections.abc import Callable, Mapping, MutableMapping, Sequence
from dataclasses import dataclass
from functools import cached_property
from pathlib import Path
from typing import Any

import numpy as np
from flwr.app import ArrayRecord, Context, Message, MessageType, RecordDict
from flwr.clientapp.typing import ClientAppCallable, Mod

from fedstale.client_app.task import Result
from fedstale.common.records import (
    ArraySets,
    decode_sets,
    flat,
    from_array_record,
    message_content,
    to_array_record,
)
from fedstale.common.schema import ARRAYS, CONFIG, METRICS, RETURN_DELTA, set_key
from fedstale.common.secagg import protocol as wire
from fedstale.common.secagg.field import add, from_wire, random_elements, to_wire, weighted_sum
from fedstale.common.secagg.protocol import Refused
from fedstale.common.secagg.sealing import (
    Unsealable,
    context,
    new_private_key,
    public_key,
    seal,
    unseal,
)

log = logging.getLogger("fedstale")
PRIVATE = "secagg.private-key"
USED = "secagg.used"
ROSTER_CLIENTS = "secagg.roster-clients"  # pinned in the key round
ROSTER_KEYS = "secagg.roster-keys"
ROSTER_CODE = "secagg.roster-code"  # N, T, U
PENDING_UPDATES = "secagg.pending-updates"  # the shares opened at the last check
PENDING_SENDERS = "secagg.pending-senders"
PENDING_SHARES = "secagg.pending-shares"
STATE_KEY = "fedstale-secagg"  # the ArrayRecord in Context.state
ANSWERED_DIR = "FEDSTALE_SECAGG_DIR"  # where holders record what they answered (env)


def private_key(state: MutableMapping[str, np.ndarray]) -> bytes:
    if PRIVATE not in state:
        state[PRIVATE] = np.frombuffer(new_private_key(), dtype=np.uint8).copy()
    return bytes(np.asarray(state[PRIVATE], np.uint8))


def own_key(state: MutableMapping[str, np.ndarray]) -> np.ndarray:
    return np.frombuffer(public_key(private_key(state)), dtype=np.uint8)


def pin_roster(
    config: Mapping[str, Any],
    keys: Mapping[str, np.ndarray],
    state: Any,
    policy: wire.HolderPolicy,
) -> dict[str, np.ndarray]:
    """The key round's last message: the holders (client ids), their keys and the code,
    checked against this client's policy and its own key, pinned for the run. A second
    roster that differs is refused."""
    named_code = [int(config[name]) for name in (wire.HOLDERS, wire.PRIVACY, wire.RECOVERY)]
    refusal = policy.code_refusal(*named_code)
    if refusal:
        raise Refused(refusal)
    code = wire.code_of(config)
    clients = np.asarray([int(c) for c in config[wire.ROSTER]], np.int64)
    named = [bytes(np.asarray(keys[wire.key_name(j)], np.uint8)) for j in range(len(clients))]
    if len(clients) != code.holders or any(len(key) != 32 for key in named):
        raise Refused(f"a roster of {len(clients)} holders and keys for a code of {code.holders}")
    if bytes(own_key(state)) not in named:
        raise Refused("this client's own key is not in the roster")
    pinned = {
        ROSTER_CLIENTS: clients,
        ROSTER_KEYS: np.frombuffer(b"".join(named), np.uint8).reshape(len(clients), 32).copy(),
        ROSTER_CODE: np.array([code.holders, code.privacy, code.recovery], np.int64),
    }
    if ROSTER_CLIENTS in state and any(
        not np.array_equal(state[name], value) for name, value in pinned.items()
    ):
        raise Refused("the holders, their keys or the code differ from those pinned")
    state.update(pinned)
    return {wire.PINNED: np.frombuffer(roster_of(state).digest.encode(), np.uint8)}


@dataclass(frozen=True)
class Roster:
    """What this client pinned in the key round."""

    clients: list[int]
    keys: list[bytes]
    code: tuple[int, int, int]  # N, T, U

    @cached_property
    def digest(self) -> str:
        return wire.roster_digest(self.clients, self.keys, self.code)

    def check_code(self, config: Mapping[str, Any]) -> None:
        code = wire.code_of(config)
        if (code.holders, code.privacy, code.recovery) != self.code:
            raise Refused(f"the code of this message is not the pinned {self.code}")


def roster_of(state: Any) -> Roster:
    """The roster pinned in the key round (Refused when none was)."""
    if ROSTER_CLIENTS not in state:
        raise Refused("no roster was pinned in the key round")
    code = tuple(int(v) for v in state[ROSTER_CODE])
    return Roster(
        [int(c) for c in state[ROSTER_CLIENTS]],
        [bytes(k) for k in np.asarray(state[ROSTER_KEYS], np.uint8)],
        (code[0], code[1], code[2]),
    )


def masked_parts(config: Mapping[str, Any], delta: np.ndarray, state: Any) -> dict[str, np.ndarray]:
    """The "secagg" set of a trained task: the quantised delta plus a fresh mask, the
    mask's shares sealed for their holders (the pinned keys), and this client's key."""
    code, quantiser = wire.code_of(config), wire.quantiser_of(config)
    if delta.shape != (code.length,):
        raise ValueError(f"the update has {delta.size} values, the task {code.length}")
    roster = roster_of(state)
    roster.check_code(config)
    update, sender, own = int(config[wire.UPDATE]), int(config[wire.SENDER]), private_key(state)
    if sender not in roster.clients or roster.keys[roster.clients.index(sender)] != public_key(own):
        raise Refused(f"client {sender}'s own key is not the one the holders were given")
    mask = random_elements(code.length)
    shares = code.encode(mask)
    masked = to_wire(add(quantiser.quantise(delta), mask))
    parts = {wire.MASKED: masked, wire.PUBLIC_KEY: own_key(state)}
    for j in range(code.holders):
        bound = context(update, sender, j, roster.digest)
        parts[wire.share_name(j)] = seal(shares[j], own, roster.keys[j], bound)
    return parts


def checked_parts(
    config: Mapping[str, Any], parts: Mapping[str, np.ndarray], state: Any
) -> dict[str, np.ndarray]:
    """Open this holder's share of each update of a buffer with the sender's pinned key;
    keep those that open for the unmask; say which did not. Gives nothing of a mask."""
    roster = roster_of(state)
    holder, own = int(config[wire.HOLDER]), private_key(state)
    if not 0 <= holder < len(roster.keys) or roster.keys[holder] != public_key(own):
        raise Refused(f"asked as holder {holder}, whose pinned key is not this client's")
    used = answered(state)
    opened: list[tuple[int, int, np.ndarray]] = []
    failed: list[int] = []
    for update, sender in zip(config[wire.UPDATES], config[wire.SENDERS], strict=True):
        share = opened_share(parts, int(update), int(sender), holder, own, roster, used)
        if share is None:
            failed.append(int(update))
        else:
            opened.append((int(update), int(sender), share))
    state[PENDING_UPDATES] = np.array([u for u, _, _ in opened], np.int64)
    state[PENDING_SENDERS] = np.array([s for _, s, _ in opened], np.int64)
    state[PENDING_SHARES] = np.stack([s for _, _, s in opened]) if opened else np.zeros((0, 0))
    return {
        wire.OPENED: np.array([u for u, _, _ in opened], np.int64),
        wire.FAILED: np.array(failed, np.int64),
    }


def opened_share(
    parts: Mapping[str, np.ndarray],
    update: int,
    sender: int,
    holder: int,
    own: bytes,
    roster: Roster,
    used: set[int],
) -> np.ndarray | None:
    """One update's share for this holder, or None (logged) when it cannot be used."""
    why = ""
    sealed = parts.get(wire.update_share_name(update))
    if update in used:
        why = "already answered for"
    elif sender not in roster.clients:
        why = f"its sender, client {sender}, holds no pinned key"
    elif sealed is None:
        why = "no share came with the request"
    else:
        try:
            bound = context(update, sender, holder, roster.digest)
            return unseal(sealed, own, roster.keys[roster.clients.index(sender)], bound)
        except Unsealable:
            why = "its share does not open (altered, replayed, or sealed for another update)"
    log.warning("secure aggregation: update %d of client %d: %s", update, sender, why)
    return None


def aggregate_parts(
    config: Mapping[str, Any], policy: wire.HolderPolicy, state: Any
) -> dict[str, np.ndarray]:
    """This holder's share of the buffer's weighted mask, from the shares it opened at the
    check; refused (Refused) under its policy or for an update it answered for before."""
    updates = [int(u) for u in config[wire.UPDATES]]
    factors = [int(f) for f in config[wire.FACTORS]]
    pending = [int(u) for u in np.asarray(state.get(PENDING_UPDATES, np.zeros(0, np.int64)))]
    missing = [u for u in updates if u not in pending]
    if missing or len(set(updates)) != len(updates):
        named = missing or updates
        raise Refused(f"update(s) {named} not opened at the last check, or named twice")
    senders = [int(state[PENDING_SENDERS][pending.index(u)]) for u in updates]
    refusal = policy.refusal(senders, factors)
    if refusal:
        raise Refused(refusal)
    shares = [from_wire(state[PENDING_SHARES][pending.index(u)]) for u in updates]
    claim(state, updates)
    for name in (PENDING_UPDATES, PENDING_SENDERS, PENDING_SHARES):
        state.pop(name, None)
    return {wire.AGGREGATE: to_wire(weighted_sum(shares, factors))}


def answered(state: Any) -> set[int]:
    """The updates this holder has given a share for (its state and its record on disk)."""
    path = answered_path(state)
    on_disk = path.read_text() if path.is_file() else ""
    return answered_in(state, on_disk)


def answered_in(state: Any, record: str) -> set[int]:
    """The updates answered for by the state's count and a record's text."""
    kept = {int(u) for u in np.asarray(state.get(USED, np.zeros(0, np.int64)))}
    return kept | {int(u) for u in record.split()}


def answered_path(state: Any) -> Path:
    """The holder's record of answered updates, named by its key (one per node and run)."""
    folder = Path(os.environ.get(ANSWERED_DIR) or tempfile.gettempdir())
    digest = hashlib.sha256(bytes(own_key(state))).hexdigest()[:32]
    return folder / f"fedstale-secagg-{os.getuid()}" / f"{digest}.answered"


def claim(state: Any, updates: Sequence[int]) -> None:
    """Record `updates` as answered, atomically: under an exclusive lock on the holder's
    record, so two unmask messages handled at once (two ClientApp processes of one node)
    cannot both find an update unanswered. Refused if any was answered before."""
    path = answered_path(state)
    path.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
    folder = path.parent.stat()
    if folder.st_uid != os.getuid() or folder.st_mode & 0o077:
        raise Refused(f"{path.parent} is not private to this user: no answer is recorded there")
    with path.open("a+") as record:
        fcntl.flock(record, fcntl.LOCK_EX)
        try:
            record.seek(0)
            done = answered_in(state, record.read())
            again = done.intersection(updates)
            if again:
                again_text = sorted(again)
                raise Refused(f"asked again for update(s) {again_text}: each share is given once")
            # flushed, not fsynced: what matters is the next process of this node reading
            # it (the page cache is shared); after a crash of the node its key is gone too
            record.write("".join(f"{u}\n" for u in updates))
            record.flush()
        finally:
            fcntl.flock(record, fcntl.LOCK_UN)
    state[USED] = np.array(sorted(done.union(updates)), dtype=np.int64)


def holder_work(
    stage: str,
    config: Mapping[str, Any],
    incoming: Mapping[str, np.ndarray],
    state: Any,
    policy: wire.HolderPolicy | None,
) -> dict[str, np.ndarray]:
    """A holder's reply: a check's report; an unmask's answer, from the shares opened at the
    last check or, when the request brings them, opened now (all must open: else only the
    report, and nothing of a mask)."""
    report = checked_parts(config, incoming, state) if stage == wire.CHECK or incoming else {}
    if stage == wire.CHECK or (report and len(report[wire.FAILED])):
        return report
    # the policy is the client's own: never read from the request
    return aggregate_parts(config, policy or wire.HolderPolicy(), state)


def secure_work(
    config: Mapping[str, Any],
    arrays: Mapping[str, np.ndarray],
    sets: ArraySets | None,
    state: MutableMapping[str, np.ndarray],
    train: Callable[[], Result],
    policy: wire.HolderPolicy | None = None,
) -> Result:
    """One message of the protocol: the key, a holder's check or share, or the task trained
    and its reply masked; a message without `secagg-stage` is the task as it came."""
    stage = config.get(wire.STAGE)
    incoming = dict((sets or {}).get(wire.SET, {}))
    if stage == wire.KEYS:
        return {}, {}, {wire.SET: {wire.PUBLIC_KEY: own_key(state)}}
    if stage == wire.ROSTER_STAGE:  # refused: an error reply, its reason for the server
        held = policy or wire.HolderPolicy()
        return {}, {}, {wire.SET: pin_roster(config, incoming, state, held)}
    if stage in (wire.CHECK, wire.UNMASK):
        try:
            return {}, {}, {wire.SET: holder_work(stage, config, incoming, state, policy)}
        except Refused as err:  # the server counts a reply without a share
            log.warning("secure aggregation: no share given: %s", err)
            return {}, {}, {}
    metrics, result, outputs = train()
    if stage != wire.MASK:
        return metrics, result, outputs
    names = list(arrays)
    trained = flat(result, names)
    carries_delta = config.get(wire.RETURNS) == RETURN_DELTA
    delta = trained if carries_delta else trained - flat(arrays, names)
    return metrics, {}, {**outputs, wire.SET: masked_parts(config, delta, state)}


TrainFn = Callable[..., Result]


def secure_train(
    train_fn: TrainFn,
    cfg: Any,
    partition: int,
    config: Mapping[str, Any],
    arrays: Mapping[str, np.ndarray],
    sets: ArraySets | None = None,
    state: MutableMapping[str, np.ndarray] | None = None,
) -> Result:
    """fedstale's train function for the in-process transports (`functools.partial(
    secure_train, train_task)`, which worker processes can unpickle): the same protocol,
    the client's kept state being the transport's per-client state."""
    kept = state if state is not None else {}
    own = {name: part for name, part in (sets or {}).items() if name != wire.SET} or None
    return secure_work(
        config,
        arrays,
        sets,
        kept,
        lambda: train_fn(cfg, partition, config, arrays, own, state),
        wire.HolderPolicy.of_run(cfg),
    )


def secagg_mod(
    min_clients: int | None = None,
    min_weight_ratio: float | None = None,
    weight_bits: int | None = None,
    privacy: int | None = None,
) -> Mod:
    """Secure aggregation's client half for a ClientApp's train handler (see above).

    A holder's policy is the client's, never the server's: each argument left None is read
    from the run config (`secagg-min-clients`, `secagg-min-weight-ratio`,
    `secagg-weight-bits`, `secagg-privacy`, as `flwr run` passes them to the ClientApp),
    else its default (2, 1/16, 10, -1: a third of the holders). `privacy` is the least T
    (colluding holders that learn nothing) this client accepts in the key round."""

    def policy_of(context: Context) -> wire.HolderPolicy:
        base = wire.HolderPolicy.of(context.run_config)
        return wire.HolderPolicy(
            min_clients=base.min_clients if min_clients is None else min_clients,
            min_weight_ratio=(
                base.min_weight_ratio if min_weight_ratio is None else min_weight_ratio
            ),
            weight_bits=base.weight_bits if weight_bits is None else weight_bits,
            rule=base.rule,
            privacy=base.privacy if privacy is None else privacy,
        )

    def mod(msg: Message, context: Context, call_next: ClientAppCallable) -> Message:
        if msg.metadata.message_type != MessageType.TRAIN:
            return call_next(msg, context)
        config = msg.content.config_records.get(CONFIG)
        if config is None or wire.STAGE not in config:
            return call_next(msg, context)
        record = context.state.get(STATE_KEY)
        state = from_array_record(record) if isinstance(record, ArrayRecord) else {}
        kept = {name: array.copy() for name, array in state.items()}
        replies: list[Message] = []

        def train() -> Result:
            reply = call_next(without_secagg(msg), context)
            replies.append(reply)
            if reply.has_error():
                raise _Failed
            metrics = reply.content.metric_records.get(METRICS)
            result = from_array_record(reply.content.array_records[ARRAYS])
            return dict(metrics or {}), result, decode_sets(reply.content)

        arrays = msg.content.array_records.get(ARRAYS)
        start = from_array_record(arrays) if arrays is not None else {}
        try:
            metrics, _, outputs = secure_work(
                dict(config), start, decode_sets(msg.content), state, train, policy_of(context)
            )
        except _Failed:
            return replies[-1]
        except (KeyError, ValueError) as err:  # a malformed message
            return Message(error=_error(err), reply_to=msg)
        if state.keys() != kept.keys() or any(
            not np.array_equal(state[name], kept[name]) for name in kept
        ):  # written only when changed: a task that ran beside a holder's answer keeps it
            context.state[STATE_KEY] = to_array_record(state)
        return Message(message_content(None, None, outputs, metrics), reply_to=msg)

    return mod


def without_secagg(msg: Message) -> Message:
    """The task as the train function expects it: the holders' keys taken out."""
    content = RecordDict()
    for key in msg.content:
        if key != set_key(wire.SET):
            content[key] = msg.content[key]
    return Message(metadata=copy.copy(msg.metadata), content=content)


class _Failed(Exception):
    """The train function replied with an error: that reply goes back as it is."""


def _error(err: Exception) -> Any:
    from flwr.app import Error

    return Error(code=0, reason=f"secure aggregation: {err}")
