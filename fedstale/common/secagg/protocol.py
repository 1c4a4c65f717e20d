"""The messages of secure aggregation, one protocol for every door (the same keys in the
task config and the same named array set, "secagg", in both directions):

- keys: a train message with `secagg-stage=keys`; the client answers with its X25519
  public key (generated once per run and kept in its state). The server sends it to every
  node before the first task: those that answer are the holders, in client order.
- mask: every train task carries `secagg-stage=mask`, the code (N, T, U), the quantiser,
  the update's id and the holders' public keys. The client trains as usual, then replies,
  instead of its model or delta, with its quantised delta plus a fresh random mask (field
  elements, `masked`), the mask's N shares each sealed for its holder (`share-<j>`), and
  its public key. Its metrics go unchanged.
- unmask: to release a buffer, the server sends U (or more) holders one message each with
  the buffer's updates (ids, senders, integer weights W_i) and, for this holder, each
  update's sealed share and sender's key; a holder that has not answered for any of these
  updates before, and sees at least `secagg-min-clients` distinct senders, replies with
  sum_i W_i [z_i]_j (`aggregate`). Any U such replies give the buffer's mask.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from fedstale.common.secagg.coding import MaskCode
from fedstale.common.secagg.field import Quantiser

SET = "secagg"  # the named array set of every secure message, both ways
STAGE = "secagg-stage"
KEYS, MASK, UNMASK = "keys", "mask", "unmask"
HOLDERS = "secagg-holders"  # N
PRIVACY = "secagg-privacy"  # T
RECOVERY = "secagg-recovery"  # U
CLIP_RANGE = "secagg-clip-range"
PRECISION_BITS = "secagg-precision-bits"
WEIGHT_BITS = "secagg-weight-bits"
RETURNS = "secagg-returns"  # what the train function's reply holds: "delta" or "model"
UPDATE = "secagg-update"  # the id of the update a mask protects (the task id)
SENDER = "secagg-sender"  # the holder index of the client that masks
HOLDER = "secagg-holder"  # the holder index an unmask message asks
UPDATES = "secagg-updates"  # unmask: the buffer's update ids
SENDERS = "secagg-senders"  # unmask: their senders' holder indices
FACTORS = "secagg-factors"  # unmask: the integer weights W_i, as field elements
MIN_CLIENTS = "secagg-min-clients"
LENGTH = "secagg-length"  # d
PUBLIC_KEY = "public-key"
MASKED = "masked"
AGGREGATE = "aggregate"


def share_name(holder: int) -> str:
    return f"share-{holder}"


def key_name(holder: int) -> str:
    return f"key-{holder}"


def update_share_name(update: int) -> str:
    return f"share-of-{update}"


def update_key_name(update: int) -> str:
    return f"key-of-{update}"


def code_of(config: Mapping[str, Any]) -> MaskCode:
    return MaskCode(
        holders=int(config[HOLDERS]),
        privacy=int(config[PRIVACY]),
        recovery=int(config[RECOVERY]),
        length=int(config[LENGTH]),
    )


def quantiser_of(config: Mapping[str, Any]) -> Quantiser:
    return Quantiser(
        clip_range=float(config[CLIP_RANGE]),
        precision_bits=int(config[PRECISION_BITS]),
        weight_bits=int(config[WEIGHT_BITS]),
    )


def keys_array(keys: Sequence[bytes]) -> dict[str, np.ndarray]:
    """The holders' public keys as an array set, `key-<j>` each."""
    return {key_name(j): np.frombuffer(key, dtype=np.uint8) for j, key in enumerate(keys)}
