"""A draining worker's planned moves (``cluster.moves``), from its gRPC side: once it is
NOT_SERVING and before its server stops taking calls, the engine loop parks its decoding
requests and offers their moves (``OfferMoves``), and the drain waits, bounded, until
every offer was taken and its KV acknowledged, or expired (``MovesPending``). Offered
only when the registry lists another decode worker: with none, a move has nowhere to go
and the streams finish in place within the grace period instead, as before moves.
"""

from __future__ import annotations

import asyncio
import logging
import time

from cluster.registry import Registry
from worker.commands import CALL_TIMEOUT_S, MovesPending, OfferMoves, WorkerError
from worker.loop import EngineLoop

log = logging.getLogger(__name__)

POLL_S = 0.02  # how often the drain asks whether moves are pending


async def move_out(loop: EngineLoop, registry: Registry, worker_id: str, wait_s: float) -> int:
    """Offer the moves of ``loop``'s decoding requests (each parked at most ``wait_s``)
    and wait until none is pending, at most ``wait_s`` plus the time a started move's KV
    needs to be acknowledged (the loop's own bound). Returns how many were offered; 0
    when no other decode worker is registered, or the loop cannot move (it is not a
    ``role_worker`` loop) — never raises for that."""
    try:
        others = await asyncio.to_thread(registry.list_workers, "decode")
    except Exception as exc:  # noqa: BLE001 - Redis down: nowhere known to move to
        log.warning("draining: the registry did not answer (%s); streams finish in place", exc)
        return 0
    if not any(r.worker_id != worker_id for r in others):
        log.info("draining: no other decode worker is registered; streams finish here")
        return 0
    try:
        offered = await loop.acall(OfferMoves(wait_s), CALL_TIMEOUT_S)
    except (WorkerError, TypeError) as exc:
        log.warning("draining: no planned moves: %s", exc)
        return 0
    if not offered:
        log.info("draining: no decoding request to move")
        return 0
    started = time.monotonic()
    deadline = started + wait_s + getattr(loop, "transfer_timeout_s", 0.0)
    pending = offered
    while pending and time.monotonic() < deadline:
        await asyncio.sleep(POLL_S)
        pending = await loop.acall(MovesPending(), CALL_TIMEOUT_S)
    log.info("draining: %d requests offered to move, %d still pending after %.2fs",
             offered, pending, time.monotonic() - started)
    return offered
