"""Resumable streams, stateless: every message of a stream carries a resume token that
seals (the request, how many tokens were sent, every one of them); a client whose stream
broke sends the same request with the tokens it received and the last token, to any
router of the cluster, and gets the rest (``router.lifecycle.handoff`` continues it like
a migration). No router keeps anything for a stream that may be resumed, so nothing is
held for a client that never comes back.

A token is a keyed BLAKE2b MAC (16 bytes) of ``(the request's digest, n, a hash of the
first n tokens)`` under the cluster's resume key: unguessable without the key, valid for
that request and those tokens only, so neither a request id (not unique, not secret) nor
a made-up output lets anyone resume, or read, what they did not receive. The key:
derived from the cluster token when there is one (every token accepted while rotating);
else a random key shared through Redis (``Registry.resume_key``); with neither, this
router's own (resumes then work on it alone).
"""

from __future__ import annotations

import hashlib
import hmac
import json
import secrets
import struct
from array import array
from collections.abc import Sequence

from router.validation import InvalidRequest, ValidRequest

TOKEN_BYTES = 16
KEY_BYTES = 32
_DOMAIN = b"pdserve resume v1"


def key_from_cluster_token(token: str) -> bytes:
    """The resume key of a cluster token (a hash of it, never the token itself)."""
    return hashlib.blake2b(token.encode(), key=_DOMAIN, digest_size=KEY_BYTES).digest()


def request_digest(request: ValidRequest) -> bytes:
    """What identifies a request across routers: its prompt token ids and every sampling
    parameter (not its id, which clients reuse)."""
    p = request.sampling
    fields: list[object] = [p.max_tokens, p.temperature, p.top_p, p.top_k, p.seed, list(p.stop),
              list(p.stop_token_ids), p.ignore_eos, p.min_p, p.min_tokens,
              p.presence_penalty, p.frequency_penalty, p.repetition_penalty,
              [list(pair) for pair in p.logit_bias]]
    if p.logprobs is not None:  # appended only when set: older routers' seals still hold
        fields.append(p.logprobs)
    if p.structured is not None:
        fields.append([p.structured.kind, p.structured.spec])
    if p.prompt_logprobs is not None:
        fields.append({"prompt_logprobs": p.prompt_logprobs})
    h = hashlib.blake2b(json.dumps(fields).encode(), digest_size=32)
    h.update(_token_bytes(request.prompt_token_ids))
    return h.digest()


def _token_bytes(token_ids: Sequence[int]) -> bytes:
    return array("I", token_ids).tobytes()


class ResumeSeal:
    """Seals and checks resume tokens under ``keys`` (the first seals, every one is
    accepted: a cluster token being rotated)."""

    def __init__(self, keys: Sequence[bytes]) -> None:
        if not keys:
            keys = (secrets.token_bytes(KEY_BYTES),)
        self._keys = tuple(keys)

    @property
    def sealing_key(self) -> bytes:
        return self._keys[0]

    def with_key(self, key: bytes) -> ResumeSeal:
        """A seal that seals with ``key`` and still accepts this one's keys."""
        return ResumeSeal([key, *self._keys])

    def cursor(self, request: ValidRequest, sent: Sequence[int] = ()) -> StreamCursor:
        """The cursor of ``request``'s stream, ``sent`` tokens already with the client."""
        return StreamCursor(self._keys[0], request_digest(request), sent)

    def check(self, request: ValidRequest, token: bytes, token_ids: Sequence[int]) -> None:
        """``InvalidRequest`` unless ``token`` seals ``request`` after ``token_ids``."""
        if len(token) != TOKEN_BYTES:
            raise InvalidRequest(f"resume.token must be the {TOKEN_BYTES}-byte resume_token "
                                 f"of a message of this stream, got {len(token)} bytes")
        if len(token_ids) >= request.sampling.max_tokens:
            raise InvalidRequest(f"resume.token_ids holds {len(token_ids)} tokens: the "
                                 f"stream had at most max_tokens={request.sampling.max_tokens}, "
                                 "so it was whole")
        digest = request_digest(request)
        history = hashlib.blake2b(_token_bytes(token_ids), digest_size=32).digest()
        if not any(hmac.compare_digest(_seal(key, digest, len(token_ids), history), token)
                   for key in self._keys):
            raise InvalidRequest("the resume token does not seal this request with these "
                                 "token ids (resume with the same request, every token id "
                                 "received, and the last message's resume_token)")


class StreamCursor:
    """A stream's position: ``offset`` tokens sent; ``advance`` moves it over the next
    message's tokens and returns that message's resume token."""

    def __init__(self, key: bytes, digest: bytes, sent: Sequence[int] = ()) -> None:
        self._key = key
        self._digest = digest
        self._history = hashlib.blake2b(_token_bytes(sent), digest_size=32)
        self.offset = len(sent)

    def advance(self, token_ids: Sequence[int]) -> bytes:
        if token_ids:
            self._history.update(_token_bytes(token_ids))
            self.offset += len(token_ids)
        return _seal(self._key, self._digest, self.offset, self._history.copy().digest())


def _seal(key: bytes, digest: bytes, offset: int, history: bytes) -> bytes:
    data = _DOMAIN + digest + struct.pack("<Q", offset) + history
    return hashlib.blake2b(data, key=key, digest_size=TOKEN_BYTES).digest()
