"""Several routers, one stream: how ``Client`` and ``AsyncClient`` spread their calls over
a cluster's routers, fail over, and resume a broken stream (``GenerateRequest.resume``).

Calls go to the routers in turn. A call that fails with ``UNAVAILABLE`` (the router died
or was cut off, is shutting down, or its workers failed the stream), or with a
``CANCELLED`` this client did not ask for (a router that stops cancels the calls that
reached it while it closed its port: grpc/grpc#41785), is made again on the
next router (once its channel is connected, or after a moment for it to reconnect), at
most ``max_resumes`` times per call, within the call's one deadline: before
any token, as it was; after some, as a resume — the same request with every token id
received and the last message's ``resume_token`` — so the stream goes on with exactly
the rest (``offset`` of the first new message checked), after a short jittered backoff.
With one address the same router is asked again (an address that resolves to several
reaches the others). A stream whose last message (``finish_reason``) arrived is whole:
a failure after it is no failure.
"""

from __future__ import annotations

import itertools
import random
import time
from collections.abc import Sequence

import grpc

from pdserve.v1 import generate_pb2

CLOSED = "the client was closed"  # a stream's error after close() (CANCELLED)

DEFAULT_MAX_RESUMES = 3
BACKOFF_S = 0.05
MAX_BACKOFF_S = 1.0
READY_WAIT_S = 1.5  # how long a failover waits for the next router's channel to connect


def as_addresses(address: str | Sequence[str]) -> tuple[str, ...]:
    """``address`` as a non-empty tuple of ``"host:port"`` strings (``ValueError`` else)."""
    addresses = (address,) if isinstance(address, str) else tuple(address)
    if not addresses or not all(isinstance(a, str) and a for a in addresses):
        raise ValueError(f"give a router address or a list of them, got {address!r}")
    return addresses


class RouterTurns:
    """The routers in turn: ``first()`` the one a new call goes to, ``after(i)`` the one
    a failed call on ``i`` goes to next."""

    def __init__(self, count: int) -> None:
        self.count = count
        self._turns = itertools.count()

    def first(self) -> int:
        return next(self._turns) % self.count

    def after(self, index: int) -> int:
        return (index + 1) % self.count


class StreamProgress:
    """What the client received of one stream, and the call that goes on after it."""

    def __init__(self, request: generate_pb2.GenerateRequest, timeout: float | None,
                 max_resumes: int) -> None:
        self.request = request
        self.max_resumes = max_resumes
        self.token_ids: list[int] = []
        self.resume_token = b""
        self.resumes = 0
        self.finished = False  # its last message (finish_reason) arrived: nothing to resume
        self._deadline = None if timeout is None else time.monotonic() + timeout

    def timeout(self) -> float | None:
        """Seconds left of the call's one deadline (None: no deadline)."""
        return None if self._deadline is None else max(0.0, self._deadline - time.monotonic())

    def next_request(self) -> generate_pb2.GenerateRequest:
        """The request of the next call: the original, or its resume."""
        if not self.token_ids:
            return self.request
        resumed = generate_pb2.GenerateRequest()
        resumed.CopyFrom(self.request)
        resumed.resume.token = self.resume_token
        resumed.resume.token_ids.extend(self.token_ids)
        return resumed

    def received(self, response: generate_pb2.GenerateResponse) -> None:
        """A message arrived; ``ValueError`` if it is not the one expected next (a resumed
        stream that does not continue where it broke; checked where the router sealed it,
        ``resume_token``)."""
        if response.resume_token and response.offset != len(self.token_ids):
            raise ValueError(f"the stream went on at token {response.offset}, not "
                             f"{len(self.token_ids)}")
        self.token_ids.extend(response.token_ids)
        if response.resume_token:
            self.resume_token = response.resume_token
        if response.HasField("usage"):  # the stream's last message (n > 1: every choice's
            self.finished = True          # ends with a finish_reason; only the last has usage)

    def may_go_on(self, error: grpc.RpcError, *, closed: bool = False) -> bool:
        """Whether the stream that failed with ``error`` goes on on another call (counts
        the resume); ``closed``: the client closed the stream or its channels, so a
        CANCELLED is its own doing, not the router's."""
        code = error.code() if hasattr(error, "code") else None
        broken = code is grpc.StatusCode.UNAVAILABLE or code is grpc.StatusCode.CANCELLED
        if closed or self.finished or not broken or self.resumes >= self.max_resumes:
            return False
        if self.token_ids and not self.resume_token:  # a router that gives no tokens
            return False
        if self.timeout() == 0.0:
            return False
        self.resumes += 1
        return True

    def backoff_s(self) -> float:
        """How long to wait before the next call (after ``may_go_on``): a jittered 50 ms
        doubling per resume, at most 1 s and within the deadline, so a router that is
        restarting (or a channel still reconnecting) gets a moment."""
        wait = min(MAX_BACKOFF_S, BACKOFF_S * 2 ** (self.resumes - 1)) * random.uniform(0.5, 1.0)
        left = self.timeout()
        return wait if left is None else min(wait, left / 2)

    def ready_wait_s(self) -> float:
        """How long to wait, after the backoff, for the next router's channel to be ready
        (it may be reconnecting to a router that restarted; the SDK's reconnect backoff
        is at most 1 s): ``READY_WAIT_S``, within the deadline. A router still down then
        is called anyway and fails fast, as one more try."""
        left = self.timeout()
        return READY_WAIT_S if left is None else min(READY_WAIT_S, left / 2)
