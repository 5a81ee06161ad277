"""KV events on the wire: what a worker's prefix cache gained and lost, one batch per
Redis Streams entry (torch-free; the router reads them, workers write them).

Why Redis Streams: the cluster already runs Redis; a stream is an ordered log every
router reads at its own pace (``XREAD`` from its last id, no consumer group: every router
wants every event), bounded by ``MAXLEN ~`` so a router that falls behind, or one started
late, sees a gap in a worker's sequence numbers and resynchronises that worker from the
snapshot it serves (``KVSnapshot`` RPC), rather than Redis holding history forever.

One entry is one ``EventBatch`` of one worker. Its fields (bytes):

    w  worker id
    e  epoch: nanoseconds since the epoch when the worker's cache started empty (process
       start); a router that sees a later epoch forgets what it knew of the worker
    s  sequence number, 1 for the first batch of an epoch, one more for each batch after
    t  wall-clock seconds when the batch was published (for the routers' event lag)
    o  the operations, in order: 17 bytes each, one op byte (``S`` stored, ``R`` removed)
       and a 16-byte chained block hash (``engine.kvcache.block_hash``)

``decode`` refuses anything else with ``BadEvent`` (the router counts and skips it).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

from engine.kvcache.events import REMOVED, STORED, KVOp

HASH_BYTES = 16
OP_BYTES = 1 + HASH_BYTES
MAX_OPS_PER_BATCH = 4096
"""A publisher splits longer runs of operations into several batches."""
STREAM_MAXLEN = 100_000
"""Entries the stream keeps (approximately): about 20 s of 100 busy workers' batches."""
_OPS = {STORED.encode(): STORED, REMOVED.encode(): REMOVED}


class BadEvent(ValueError):
    """An entry that is not a valid ``EventBatch``; ``reason`` is a short label for metrics."""

    def __init__(self, reason: str, message: str) -> None:
        super().__init__(message)
        self.reason = reason


@dataclass(frozen=True)
class EventBatch:
    """What one worker's prefix cache gained and lost since its previous batch."""

    worker_id: str
    epoch: int
    seq: int
    ops: tuple[KVOp, ...]
    sent_at: float = 0.0  # time.time() at publishing


def encode(batch: EventBatch) -> dict[str, bytes]:
    """The stream entry's fields."""
    return {"w": batch.worker_id.encode(), "e": str(batch.epoch).encode(),
            "s": str(batch.seq).encode(), "t": repr(batch.sent_at).encode(),
            "o": b"".join(op.encode() + block_hash for op, block_hash in batch.ops)}


def decode(fields: Mapping[bytes, bytes]) -> EventBatch:
    """The batch an entry holds; ``BadEvent`` for anything malformed."""
    try:
        worker_id = fields[b"w"].decode()
        epoch, seq = int(fields[b"e"]), int(fields[b"s"])
        sent_at = float(fields[b"t"])
        raw = fields[b"o"]
    except (KeyError, ValueError, UnicodeDecodeError) as exc:
        raise BadEvent("malformed", f"a KV event entry lacks or garbles a field: {exc!r}") \
            from None
    if not worker_id or epoch <= 0 or seq <= 0:
        raise BadEvent("malformed", f"a KV event names worker {worker_id!r}, epoch {epoch}, "
                                    f"sequence {seq}")
    if len(raw) % OP_BYTES:
        raise BadEvent("hash_length", f"KV event of {worker_id}: {len(raw)} bytes of "
                                      f"operations, not a multiple of {OP_BYTES}")
    ops = []
    for start in range(0, len(raw), OP_BYTES):
        op = _OPS.get(raw[start:start + 1])
        if op is None:
            raise BadEvent("op", f"KV event of {worker_id}: unknown operation "
                                 f"{raw[start:start + 1]!r}")
        ops.append((op, raw[start + 1:start + OP_BYTES]))
    return EventBatch(worker_id, epoch, seq, tuple(ops), sent_at)


def pack_hashes(hashes: list[bytes]) -> bytes:
    """A snapshot's block hashes as one byte string (16 bytes each)."""
    return b"".join(hashes)


def unpack_hashes(raw: bytes) -> list[bytes]:
    """``pack_hashes``' inverse; ``BadEvent`` when ``raw`` is not whole hashes."""
    if len(raw) % HASH_BYTES:
        raise BadEvent("hash_length", f"a KV snapshot of {len(raw)} bytes is not whole "
                                      f"{HASH_BYTES}-byte hashes")
    return [raw[i:i + HASH_BYTES] for i in range(0, len(raw), HASH_BYTES)]
