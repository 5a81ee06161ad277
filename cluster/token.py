"""The cluster token: the shared secret of the internal plane (standard library only, so
the command-line option modules can name it).

Every internal gRPC call (router → worker) carries the token in ``x-pdserve-cluster-token``
metadata and every worker checks it in constant time (``cluster.auth``); the KV data
plane's handshake proves it and keys a MAC of every KV payload from it
(``kv_keys``). Without a token the internal plane is open, as before: fine on a loopback
cluster, not on a shared network.

Where it comes from: ``--cluster-token-file PATH`` (one token per line), else
``$PDSERVE_CLUSTER_TOKEN`` (one token, or two separated by a comma or a newline) — never
a command-line value, so it is not on any process's argv. Each token is 16 to 512
printable ASCII characters without whitespace (``generate_token`` makes a good one).

Rotation: two tokens may be given. The first is the one this process sends; both are
accepted. To replace OLD by NEW without downtime: give every process "OLD,NEW" (sends OLD,
accepts both), then "NEW,OLD" (sends NEW, accepts both), then "NEW".
"""

from __future__ import annotations

import argparse
import hashlib
import hmac
import os
import re
import secrets
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

CLUSTER_TOKEN_ENV = "PDSERVE_CLUSTER_TOKEN"
TOKEN_METADATA = "x-pdserve-cluster-token"
MAX_TOKENS = 2  # the current one and, while rotating, one more
_TOKEN_RE = re.compile(r"[\x21-\x7e]{16,512}")
_KV_KEY_LABEL = b"pdserve kv plane v1"


class TokenError(ValueError):
    """The token file or variable is unreadable, empty or malformed (the message says
    which and why, never the token)."""


@dataclass(frozen=True)
class ClusterToken:
    """One process's cluster token(s): ``tokens[0]`` is sent, every one is accepted."""

    tokens: tuple[str, ...]

    def __post_init__(self) -> None:
        if not 1 <= len(self.tokens) <= MAX_TOKENS:
            raise TokenError(f"give one cluster token, or two while rotating; got "
                             f"{len(self.tokens)}")
        for i, token in enumerate(self.tokens):
            if not _TOKEN_RE.fullmatch(token):
                raise TokenError(f"cluster token {i + 1} must be 16 to 512 printable ASCII "
                                 f"characters without spaces (got {len(token)} characters)")

    @property
    def current(self) -> str:
        """The token this process sends."""
        return self.tokens[0]

    def accepts(self, given: str | bytes) -> bool:
        """Whether ``given`` is one of the tokens (constant time in what it compares)."""
        raw = given.encode() if isinstance(given, str) else bytes(given)
        ok = False
        for token in self.tokens:
            ok |= hmac.compare_digest(raw, token.encode())
        return ok

    def kv_keys(self) -> tuple[bytes, ...]:
        """The KV data plane's keys, one per token, in the same order (a key derived
        from the token, never the token itself, enters the KV plane)."""
        return tuple(hmac.new(t.encode(), _KV_KEY_LABEL, hashlib.sha256).digest()
                     for t in self.tokens)

    def __repr__(self) -> str:
        return f"ClusterToken(<{len(self.tokens)} redacted>)"


def parse_tokens(text: str) -> ClusterToken:
    """The tokens of ``text``: one per line or comma-separated, blanks ignored."""
    return ClusterToken(tuple(t.strip() for t in re.split(r"[,\n]", text) if t.strip()))


def load_cluster_token(path: str | None, environ: Mapping[str, str] = os.environ
                       ) -> ClusterToken | None:
    """The token(s) from ``path`` if given, else ``$PDSERVE_CLUSTER_TOKEN``, else None.

    Raises ``TokenError`` for an unreadable, empty or malformed file or variable (a typo
    must not silently leave the internal plane open)."""
    if path is not None:
        try:
            text = Path(path).read_text()
        except OSError as exc:
            raise TokenError(f"cannot read the cluster token file {path}: {exc.strerror}"
                             ) from None
        if not text.strip():
            raise TokenError(f"the cluster token file {path} is empty")
        try:
            return parse_tokens(text)
        except TokenError as exc:
            raise TokenError(f"the cluster token file {path}: {exc}") from None
    text = environ.get(CLUSTER_TOKEN_ENV, "")
    if not text.strip():
        return None
    try:
        return parse_tokens(text)
    except TokenError as exc:
        raise TokenError(f"${CLUSTER_TOKEN_ENV}: {exc}") from None


def add_token_arg(parser: argparse.ArgumentParser) -> None:
    """``--cluster-token-file``, which the router and the workers share."""
    parser.add_argument("--cluster-token-file",
                        help="the cluster's shared secret, one token per line (two while "
                             "rotating: the first is sent, both are accepted): every internal "
                             "call and KV channel must prove it (default: "
                             f"${CLUSTER_TOKEN_ENV} if set, else none: the internal plane is "
                             "open, fit only for a private network)")


def generate_token() -> str:
    """A fresh random token (256 bits, URL-safe)."""
    return secrets.token_urlsafe(32)
