"""Where one request's time went, as the router saw it and as its workers reported it.

``RouterCore`` makes a ``Trace`` per request; the handoff marks the moments it passes
(``router.lifecycle``: the first call to a worker, the Reserve call and its accepted
reply, the Prefill call and its return with the
prefill worker's own timings, the Generate call and its first chunk with the decode
worker's), and the served request marks each chunk's hop through the router (received from
the decode worker → handed to the edge, which writes it to the client before asking for
the next). A client that sends the ``pdserve-trace: 1`` metadata (gRPC) gets
``Trace.to_json()`` in the ``pdserve-trace`` trailer; nothing else reads it. Of a retried
request, the marks are its last attempt's.

Times are ``time.monotonic()`` of the router process; ``to_json`` gives milliseconds since
the request was received (``marks_ms``), the workers' durations (their own clocks) and
every chunk's relay time.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from dataclasses import dataclass, field

TRACE_METADATA = "pdserve-trace"


@dataclass(frozen=True)
class PrefillTimes:
    """A prefill worker's report of one request, seconds of its clock: queued, computing
    the prompt, and the transfer exposed after its last layer (see ``worker.proto``)."""

    queue_s: float
    compute_s: float
    transfer_s: float


@dataclass
class Trace:
    """The marks of one request (see module doc); ``None`` until passed."""

    received_at: float
    clock: Callable[[], float] = time.monotonic
    attempts: int = 0
    admitted_at: float | None = None  # validated and admitted: it queues from here
    turn_at: float | None = None  # its turn in the router's queue came
    first_call_at: float | None = None  # the first call to any worker (Reserve, GenerateLocal)
    reserve_sent_at: float | None = None  # the Reserve's call started
    reserved_at: float | None = None  # the Reserve's reply (accepted)
    prefill_started_at: float | None = None
    prefill_returned_at: float | None = None
    generate_started_at: float | None = None
    first_chunk_at: float | None = None  # the decode worker's first chunk arrived
    first_sent_at: float | None = None  # ... and the edge had written it
    prefill: PrefillTimes | None = None
    decode_first_chunk_s: float | None = None  # the decode worker's own time to it
    relay_s: list[float] = field(default_factory=list)  # per chunk: arrived → written

    def mark(self, name: str) -> None:
        """Set ``NAME_at`` to now (the last attempt's wins)."""
        setattr(self, f"{name}_at", self.clock())

    def worker_call(self) -> None:
        if self.first_call_at is None:
            self.mark("first_call")

    def chunk_written(self, arrived_at: float) -> None:
        now = self.clock()
        if self.first_sent_at is None:
            self.first_sent_at = now
        self.relay_s.append(now - arrived_at)

    def to_json(self) -> str:
        def ms(at: float | None) -> float | None:
            return None if at is None else round((at - self.received_at) * 1000, 3)

        marks = {name: ms(getattr(self, f"{name}_at")) for name in (
            "admitted", "turn", "first_call", "reserve_sent", "reserved", "prefill_started",
            "prefill_returned", "generate_started", "first_chunk", "first_sent")}
        p = self.prefill
        return json.dumps({
            "attempts": self.attempts, "marks_ms": marks,
            "prefill_ms": None if p is None else {
                "queue": p.queue_s * 1000, "compute": p.compute_s * 1000,
                "transfer": p.transfer_s * 1000},
            "decode_first_chunk_ms": None if self.decode_first_chunk_s is None
            else self.decode_first_chunk_s * 1000,
            "relay_ms": [round(s * 1000, 4) for s in self.relay_s]}, separators=(",", ":"))
