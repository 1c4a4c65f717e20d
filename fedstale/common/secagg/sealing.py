"""Shares sealed from one client to another through the server: each client keeps an X25519
key pair for the run; the sender derives a key from its private key and the holder's public
key (Diffie-Hellman, then HKDF-SHA256 bound to the update and both parties) and seals the
share with ChaCha20-Poly1305, so the server, which relays it, reads nothing and cannot
alter it unnoticed. The server relays the public keys too: a server that swapped them
could read the shares (an honest-but-curious server does not; docs/privacy.md)."""

from __future__ import annotations

import os
from functools import lru_cache

import numpy as np
from cryptography.exceptions import InvalidTag
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric.x25519 import X25519PrivateKey, X25519PublicKey
from cryptography.hazmat.primitives.ciphers.aead import ChaCha20Poly1305
from cryptography.hazmat.primitives.kdf.hkdf import HKDF

from fedstale.common.secagg.field import FIELD_DTYPE, WIRE_DTYPE

NONCE_BYTES = 12
KEY_BYTES = 32
INFO = b"fedstale secure aggregation share"


class Unsealable(ValueError):
    """A sealed share that does not open: altered, or not sealed for this holder."""


def new_private_key() -> bytes:
    return X25519PrivateKey.generate().private_bytes(
        serialization.Encoding.Raw, serialization.PrivateFormat.Raw, serialization.NoEncryption()
    )


def public_key(private: bytes) -> bytes:
    return (
        X25519PrivateKey.from_private_bytes(private)
        .public_key()
        .public_bytes(serialization.Encoding.Raw, serialization.PublicFormat.Raw)
    )


def context(update: int, sender: int, holder: int, roster: str = "") -> bytes:
    """What a sealed share is bound to: the update it masks, who sealed it, for whom, and
    the roster and code both pinned (a digest): a share sealed under another roster than
    the holder's own does not open."""
    return f"update={update};sender={sender};holder={holder};roster={roster}".encode()


@lru_cache(maxsize=1024)
def _shared(private: bytes, peer: bytes) -> bytes:
    """The Diffie-Hellman secret of a pair, kept: a client seals for the same holders at
    every task (each key derived from it is still bound to its update)."""
    return X25519PrivateKey.from_private_bytes(private).exchange(
        X25519PublicKey.from_public_bytes(peer)
    )


def _key(private: bytes, peer: bytes, bound_to: bytes) -> bytes:
    derive = HKDF(algorithm=hashes.SHA256(), length=KEY_BYTES, salt=None, info=INFO + bound_to)
    return derive.derive(_shared(private, peer))


def seal(share: np.ndarray, private: bytes, peer: bytes, bound_to: bytes) -> np.ndarray:
    """`share` (field elements) sealed for the holder of public key `peer`, as uint8."""
    nonce = os.urandom(NONCE_BYTES)
    sealed = ChaCha20Poly1305(_key(private, peer, bound_to)).encrypt(
        nonce, np.ascontiguousarray(share, WIRE_DTYPE).tobytes(), bound_to
    )
    return np.frombuffer(nonce + sealed, dtype=np.uint8)


def unseal(sealed: np.ndarray, private: bytes, peer: bytes, bound_to: bytes) -> np.ndarray:
    """The share sealed by the holder of public key `peer` for this private key."""
    data = np.asarray(sealed, np.uint8).tobytes()
    try:
        opened = ChaCha20Poly1305(_key(private, peer, bound_to)).decrypt(
            data[:NONCE_BYTES], data[NONCE_BYTES:], bound_to
        )
    except (InvalidTag, ValueError) as err:
        raise Unsealable("a sealed share does not open for this holder") from err
    return np.frombuffer(opened, dtype=WIRE_DTYPE).astype(FIELD_DTYPE)
