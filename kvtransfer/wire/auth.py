"""Authentication of KV channels: the handshake's proofs and every part's MAC (torch-free).

With keys configured (``TransferConfig.auth_keys``, derived from the cluster token, see
``cluster.token``), a channel opens only between two ends that prove they hold the same
key, and every part and acknowledgement on it carries a MAC under a key of that channel
alone:

1. the sender's ``OpenRequest`` carries a fresh random nonce ``ns``;
2. the receiver answers with its own fresh nonce ``nr`` and one proof per key it holds,
   ``HMAC(key, "receiver" | channel | ns | nr)`` (it holds two while a token rotates);
3. the sender checks them against its keys (no match: the channel is refused, nothing is
   sent), picks the first of its keys that matches, and writes its own proof
   ``HMAC(key, "sender" | channel | ns | nr)`` and that key's index in the reply's list
   (``proof_key``); the receiver checks it before it joins the channel's groups;
4. both derive the channel key ``HMAC(key, "channel" | channel | ns | nr)``; every part's
   MAC is Poly1305 over its header words and its payload, every acknowledgement's over
   its words, under a one-time key ``HMAC(channel key, "part"|"ack" | seq)`` (tags are
   used once per channel, so no one-time key is ever used twice). Poly1305 runs at
   about 11 GB/s on one core here, against 0.9 GB/s for BLAKE2b and 1.7 GB/s for
   HMAC-SHA256. A part that fails its MAC fails its transfer and closes the channel.

So neither a peer that can reach the rendezvous store or the groups' ports without the
token, nor a replayed handshake (fresh nonces), nor a part injected into an established
channel can place KV. The KV is authenticated, not encrypted. Payloads on a separate
device group (nccl) are covered through their header's device checksum only (a MAC over
device memory would cost a copy to the host per part).
"""

from __future__ import annotations

import hashlib
import hmac
import os
import struct
from collections.abc import Sequence

from cryptography.hazmat.primitives.poly1305 import Poly1305

NONCE_BYTES = 16
MAC_BYTES = 16  # Poly1305's tag


class AuthError(ValueError):
    """A proof or a MAC did not verify (the message says which, never a key)."""


def nonce() -> str:
    """A fresh random nonce, hex."""
    return os.urandom(NONCE_BYTES).hex()


def _handshake_mac(key: bytes, label: str, channel_id: int, sender_nonce: str,
                   receiver_nonce: str) -> bytes:
    message = f"{label}|{channel_id}|{sender_nonce}|{receiver_nonce}".encode()
    return hmac.new(key, message, hashlib.sha256).digest()


def receiver_proofs(keys: Sequence[bytes], channel_id: int, sender_nonce: str,
                    receiver_nonce: str) -> list[str]:
    """The receiver's proofs, one per key it holds (hex)."""
    return [_handshake_mac(k, "receiver", channel_id, sender_nonce, receiver_nonce).hex()
            for k in keys]


def sender_key(keys: Sequence[bytes], proofs: Sequence[str], channel_id: int,
               sender_nonce: str, receiver_nonce: str) -> tuple[bytes, int]:
    """The sender's side of step 3: the first of its ``keys`` that one of the receiver's
    ``proofs`` proves, and that proof's index. ``AuthError`` when none does."""
    for key in keys:
        expected = _handshake_mac(key, "receiver", channel_id, sender_nonce, receiver_nonce)
        for index, proof in enumerate(proofs):
            try:
                given = bytes.fromhex(proof)
            except ValueError:
                continue
            if hmac.compare_digest(given, expected):
                return key, index
    raise AuthError("the receiver did not prove the cluster token (tokens differ, or it "
                    "has none)")


def sender_proof(key: bytes, channel_id: int, sender_nonce: str, receiver_nonce: str,
                 index: int) -> bytes:
    """The sender's proof, as written to the store: ``"<index>:<hex>"``."""
    mac = _handshake_mac(key, "sender", channel_id, sender_nonce, receiver_nonce)
    return f"{index}:{mac.hex()}".encode()


def check_sender_proof(keys: Sequence[bytes], raw: bytes, channel_id: int,
                       sender_nonce: str, receiver_nonce: str) -> bytes:
    """The receiver's side of step 3: the key the sender proved (``AuthError`` if not)."""
    try:
        index_text, _, mac_hex = raw.decode("ascii").partition(":")
        index, given = int(index_text), bytes.fromhex(mac_hex)
    except (UnicodeDecodeError, ValueError):
        raise AuthError("the sender's proof is malformed") from None
    if not 0 <= index < len(keys):
        raise AuthError("the sender's proof names no key of this receiver")
    key = keys[index]
    expected = _handshake_mac(key, "sender", channel_id, sender_nonce, receiver_nonce)
    if not hmac.compare_digest(given, expected):
        raise AuthError("the sender did not prove the cluster token")
    return key


def channel_key(key: bytes, channel_id: int, sender_nonce: str, receiver_nonce: str) -> bytes:
    """The channel's MAC key (step 4)."""
    return _handshake_mac(key, "channel", channel_id, sender_nonce, receiver_nonce)


class ChannelMac:
    """MACs of one channel's parts and acknowledgements (Poly1305, a one-time key per
    message: see the module docstring)."""

    def __init__(self, key: bytes) -> None:
        self._key = key

    def words_mac(self, label: bytes, seq: int, words: Sequence[int],
                  payload: memoryview | bytes | None = None) -> tuple[int, int]:
        """The MAC of message ``label`` (b"part" or b"ack") number ``seq``: its ``words``
        (MAC fields zero) and ``payload``, as two int64."""
        one_time = hmac.new(self._key, label + struct.pack("<q", seq), hashlib.sha256).digest()
        mac = Poly1305(one_time)
        mac.update(struct.pack(f"<{len(words)}q", *words))
        if payload is not None:
            mac.update(payload)
        return _as_words(mac.finalize())

    def check(self, label: bytes, seq: int, words: Sequence[int], mac: tuple[int, int],
              payload: memoryview | bytes | None = None) -> bool:
        expected = self.words_mac(label, seq, words, payload)
        return hmac.compare_digest(struct.pack("<2q", *expected), struct.pack("<2q", *mac))


def _as_words(digest: bytes) -> tuple[int, int]:
    first, second = struct.unpack("<2q", digest)
    return first, second
