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
import logging
from collections.abc import Callable, Mapping, MutableMapping
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
from fedstale.common.secagg.field import add, random_elements, to_wire, weighted_sum
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
STATE_KEY = "fedstale-secagg"  # the ArrayRecord in Context.state


class Refused(ValueError):
    """A holder will not give its share for this buffer."""


def private_key(state: MutableMapping[str, np.ndarray]) -> bytes:
    if PRIVATE not in state:
        state[PRIVATE] = np.frombuffer(new_private_key(), dtype=np.uint8).copy()
    return bytes(np.asarray(state[PRIVATE], np.uint8))


def own_key(state: MutableMapping[str, np.ndarray]) -> np.ndarray:
    return np.frombuffer(public_key(private_key(state)), dtype=np.uint8)


def masked_parts(
    config: Mapping[str, Any], delta: np.ndarray, keys: Mapping[str, np.ndarray], state: Any
) -> dict[str, np.ndarray]:
    """The "secagg" set of a trained task: the quantised delta plus a fresh mask, the
    mask's shares sealed for their holders, and this client's public key."""
    code, quantiser = wire.code_of(config), wire.quantiser_of(config)
    if delta.shape != (code.length,):
        raise ValueError(f"the update has {delta.size} values, the task {code.length}")
    mask = random_elements(code.length)
    shares = code.encode(mask)
    update, sender, own = int(config[wire.UPDATE]), int(config[wire.SENDER]), private_key(state)
    masked = to_wire(add(quantiser.quantise(delta), mask))
    parts = {wire.MASKED: masked, wire.PUBLIC_KEY: own_key(state)}
    for j in range(code.holders):
        holder_key = bytes(np.asarray(keys[wire.key_name(j)], np.uint8))
        parts[wire.share_name(j)] = seal(shares[j], own, holder_key, context(update, sender, j))
    return parts


def aggregate_parts(
    config: Mapping[str, Any], parts: Mapping[str, np.ndarray], state: Any
) -> dict[str, np.ndarray]:
    """This holder's share of the buffer's weighted mask; refused (Refused) for a buffer of
    fewer than `secagg-min-clients` clients or one naming an update it answered for."""
    updates = [int(u) for u in config[wire.UPDATES]]
    senders = [int(s) for s in config[wire.SENDERS]]
    factors = [int(f) for f in config[wire.FACTORS]]
    if len(set(senders)) < int(config[wire.MIN_CLIENTS]):
        raise Refused(
            f"a buffer of {len(set(senders))} client(s), fewer than secagg-min-clients "
            f"{config[wire.MIN_CLIENTS]}: it would show one client's update"
        )
    used = {int(u) for u in np.asarray(state.get(USED, np.zeros(0, np.int64)))}
    again = used.intersection(updates)
    if again:
        raise Refused(f"asked again for update(s) {sorted(again)}: each share is given once")
    holder, own = int(config[wire.HOLDER]), private_key(state)
    shares = []
    for update, sender in zip(updates, senders, strict=True):
        sealed = parts[wire.update_share_name(update)]
        peer = bytes(np.asarray(parts[wire.update_key_name(update)], np.uint8))
        shares.append(unseal(sealed, own, peer, context(update, sender, holder)))
    state[USED] = np.array(sorted(used.union(updates)), dtype=np.int64)
    return {wire.AGGREGATE: to_wire(weighted_sum(shares, factors))}


def secure_work(
    config: Mapping[str, Any],
    arrays: Mapping[str, np.ndarray],
    sets: ArraySets | None,
    state: MutableMapping[str, np.ndarray],
    train: Callable[[], Result],
) -> Result:
    """One message of the protocol: the key, a holder's share, or the task trained and its
    reply masked; a message without `secagg-stage` is the task as it came."""
    stage = config.get(wire.STAGE)
    incoming = dict((sets or {}).get(wire.SET, {}))
    if stage == wire.KEYS:
        return {}, {}, {wire.SET: {wire.PUBLIC_KEY: own_key(state)}}
    if stage == wire.UNMASK:
        try:
            return {}, {}, {wire.SET: aggregate_parts(config, incoming, state)}
        except (Refused, Unsealable) as err:  # the server counts a reply without a share
            log.warning("secure aggregation: no share given: %s", err)
            return {}, {}, {}
    metrics, result, outputs = train()
    if stage != wire.MASK:
        return metrics, result, outputs
    names = list(arrays)
    trained = flat(result, names)
    carries_delta = config.get(wire.RETURNS) == RETURN_DELTA
    delta = trained if carries_delta else trained - flat(arrays, names)
    return metrics, {}, {**outputs, wire.SET: masked_parts(config, delta, incoming, state)}


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
        config, arrays, sets, kept, lambda: train_fn(cfg, partition, config, arrays, own, state)
    )


def secagg_mod() -> Mod:
    """Secure aggregation's client half for a ClientApp's train handler (see above)."""

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
                dict(config), start, decode_sets(msg.content), state, train
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
