"""The messages of secure aggregation, one protocol for every door (the same keys in the
task config and the same named array set, "secagg", in both directions):

- keys: a train message with `secagg-stage=keys`; the client answers with its X25519
  public key (generated once per run and kept in its state). The server sends it to every
  node before the first task: those that answer are the holders, in client order.
- roster: still in the key round, every holder is sent the roster (the holders' client ids
  and keys) and the code (N, T, U). It checks the code against its own policy (T at least
  its floor, 2U > N, U + T >= N) and its own key at its own id, and pins both for the run;
  it refuses any other roster later. Every share is sealed under the pinned roster's
  digest, so nothing the server sends after the key round can change whose keys count.
- mask: every train task carries `secagg-stage=mask`, the code, the quantiser and the
  update's id. The client trains as usual, then replies,
  instead of its model or delta, with its quantised delta plus a fresh random mask (field
  elements, `masked`), the mask's N shares each sealed for its holder (`share-<j>`), and
  its public key. Its metrics go unchanged.
- unmask: to release a buffer, the server sends U + f holders the buffer's updates (ids,
  senders, integer weights W_i) and each holder's sealed share of each update. The holder
  opens each share with the sender's key as pinned in the key round (never a key the
  request names). If all open, it answers sum_i W_i [z_i]_j
  (`aggregate`) under its own policy (`HolderPolicy`, set on the client side, never by the
  request): at least `secagg-min-clients` distinct senders, every W_i within
  [ratio 2^g, 2^g] with the largest 2^g, and each update answered once, ever (claimed
  atomically: `claim`). If one does not open (altered, replayed, sealed for another
  update, or from a sender it holds no key for), it answers nothing and reports the
  updates that opened (`opened`) and those that did not (`failed`). Any U answers give the
  buffer's mask; more than U let the server find answers that do not fit.
- check (after a failed share only): the holders that have not answered are sent their
  shares again; each opens and keeps them and reports, giving nothing of a mask; then an
  unmask without shares asks those at which all the remaining updates opened, and each
  answers from the shares it kept.
"""

from __future__ import annotations

import hashlib
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from fedstale.common.secagg.coding import MaskCode
from fedstale.common.secagg.field import Quantiser

SET = "secagg"  # the named array set of every secure message, both ways
STAGE = "secagg-stage"
KEYS, ROSTER_STAGE, MASK, CHECK, UNMASK = "keys", "roster", "mask", "check", "unmask"
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
SENDERS = "secagg-senders"  # check: their senders (client ids)
ROSTER = "secagg-roster"  # the holders' client ids, in holder order (with their keys)
FACTORS = "secagg-factors"  # unmask: the integer weights W_i, as field elements
MIN_CLIENTS = "secagg-min-clients"
MIN_WEIGHT_RATIO = "secagg-min-weight-ratio"
LENGTH = "secagg-length"  # d
PUBLIC_KEY = "public-key"
MASKED = "masked"
AGGREGATE = "aggregate"
PINNED = "pinned"  # roster: the digest of what the client pinned
OPENED = "opened"  # check: the update ids whose shares opened at this holder
FAILED = "failed"  # check: the update ids whose shares did not


class Refused(ValueError):
    """A holder will not give its share for this request."""


@dataclass(frozen=True)
class HolderPolicy:
    """What a holder requires of an unmask request, set on the client's side (fedstale's
    run config, or `secagg_mod`'s arguments), never taken from the request."""

    min_clients: int = 2  # distinct senders in a buffer
    min_weight_ratio: float = 1 / 16  # the smallest W_i over the largest
    weight_bits: int = 10  # g: the largest W_i is 2^g
    rule: str = ""  # the run's rule, named in a refusal where the holder knows it
    privacy: int = -1  # the least T this client accepts; -1: a third of the holders

    def code_refusal(self, holders: int, privacy: int, recovery: int) -> str:
        """Why this client refuses the code (N, T, U) the server names, or "": T below its
        floor leaks masks to fewer colluders; U at most N/2 lets two disjoint sets of U
        holders each decode a different sum of one update; U + T < N lets the N - U holders
        left after a decode give a second combination of it, more than T shares."""
        floor = self.privacy if self.privacy >= 0 else holders // 3
        if not 0 <= privacy < recovery <= holders:
            return f"the code T={privacy}, U={recovery}, N={holders} is not 0 <= T < U <= N"
        if privacy < floor:
            return f"secagg-privacy {privacy} is below this client's {floor}"
        if 2 * recovery <= holders or recovery + privacy < holders:
            return (
                f"secagg-recovery {recovery} with secagg-privacy {privacy} and {holders} "
                "holders: U must exceed N/2 and U + T reach N"
            )
        return ""

    def refusal(self, senders: Sequence[int], factors: Sequence[int]) -> str:
        """Why a holder refuses to answer for updates of `senders` weighed by `factors`
        (integers as the request sends them), or "" when it answers."""
        top, least = 2**self.weight_bits, self.least_factor
        if len(set(senders)) < self.min_clients:
            return (
                f"a buffer of {len(set(senders))} client(s), fewer than secagg-min-clients "
                f"{self.min_clients}: it would show one client's update"
            )
        if len(factors) != len(senders) or any(not least <= f <= top for f in factors):
            rule = f"{self.rule} " if self.rule else ""
            return (
                f"weights {sorted(set(factors))} outside [{least}, {top}] "
                f"({rule}secagg-min-weight-ratio {self.min_weight_ratio:g} of "
                f"2^{self.weight_bits}): a weight that small, or zero in the field, would "
                "single out one update"
            )
        if max(factors) != top:
            return f"the largest weight is {max(factors)}, not 2^{self.weight_bits}"
        return ""

    @property
    def least_factor(self) -> int:
        return max(1, math.ceil(self.min_weight_ratio * 2**self.weight_bits - 1e-9))

    @classmethod
    def of_run(cls, run: Any) -> HolderPolicy:
        """The policy from a parsed run config (fedstale's RunConfig)."""
        return cls(
            min_clients=run.secagg_min_clients,
            min_weight_ratio=run.secagg_min_weight_ratio,
            weight_bits=run.secagg_weight_bits,
            rule=run.strategy,
            privacy=run.secagg_privacy,
        )

    @classmethod
    def of(cls, config: Mapping[str, Any]) -> HolderPolicy:
        """The policy from a run config's keys (those absent keep their defaults)."""
        default = cls()
        return cls(
            min_clients=int(config.get(MIN_CLIENTS, default.min_clients)),
            min_weight_ratio=float(config.get(MIN_WEIGHT_RATIO, default.min_weight_ratio)),
            weight_bits=int(config.get(WEIGHT_BITS, default.weight_bits)),
            rule=str(config.get("strategy", "")),
            privacy=int(config.get(PRIVACY, default.privacy)),
        )


def share_name(holder: int) -> str:
    return f"share-{holder}"


def key_name(holder: int) -> str:
    return f"key-{holder}"


def update_share_name(update: int) -> str:
    return f"share-of-{update}"


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


def roster_digest(clients: Sequence[int], keys: Sequence[bytes], code: Sequence[int]) -> str:
    """What binds a share to one roster and code (sealing's context)."""
    text = ",".join(str(int(c)) for c in [*clients, *code]).encode() + b"".join(keys)
    return hashlib.sha256(text).hexdigest()


def keys_array(keys: Sequence[bytes]) -> dict[str, np.ndarray]:
    """The holders' public keys as an array set, `key-<j>` each."""
    return {key_name(j): np.frombuffer(key, dtype=np.uint8) for j, key in enumerate(keys)}
