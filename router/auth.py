"""API-key authentication of the public API (row 35 of ``../shared/RELIABILITY.md``).

With a key configured, every call except health checks and server reflection must carry
``authorization: Bearer <key>`` metadata; otherwise it ends with UNAUTHENTICATED before
any handler runs. The key is compared in constant time and never logged or echoed.
Without a key, every call is let through (a private loopback cluster needs none).
"""

from __future__ import annotations

import hmac
import os
from pathlib import Path

from cluster.auth import RequireMetadata
from router.options import API_KEY_ENV


def load_api_key(path: str | None) -> str | None:
    """The key from ``path`` (first line, stripped), else ``$PDSERVE_API_KEY``, else None.

    Raises ``ValueError`` for an unreadable or empty key file (a typo must not silently
    leave the API open)."""
    if path is not None:
        try:
            text = Path(path).read_text().strip()
        except OSError as exc:
            raise ValueError(f"cannot read the API key file {path}: {exc.strerror}") from None
        key = text.splitlines()[0].strip() if text else ""
        if not key:
            raise ValueError(f"the API key file {path} is empty")
        return key
    return os.environ.get(API_KEY_ENV) or None


def api_key_interceptor(api_key: str) -> RequireMetadata:
    """Refuses calls without ``authorization: Bearer <api_key>`` (see the module docstring)."""
    expected = f"Bearer {api_key}".encode()
    return RequireMetadata("authorization", lambda given: hmac.compare_digest(given, expected),
                           "missing or wrong API key (send 'authorization: Bearer <key>')")
