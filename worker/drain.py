"""A draining worker's planned moves (``cluster.moves``), from its gRPC side: once it is
NOT_SERVING and before its server stops taking calls, the engine loop parks its decoding
requests and offers their moves (``OfferMoves``), and the drain waits, bounded, until
every offer was taken and its KV acknowledged, or expired (``MovesPending``). First its
record says it is draining (``Heartbeat.set_draining``: routers stop routing to it, and
draining peers do not move work to it); then moves are offered only when the registry
lists another decode worker that is not draining: with none (the whole cluster stopping,
the last decode worker), a move has nowhere to go and the streams finish in place within
the grace period instead, as before moves.
"""

from __future__ import annotations

import asyncio
import logging
import time

from cluster.heartbeat import Heartbeat
from worker.commands import CALL_TIMEOUT_S, MovesPending, OfferMoves, WorkerError
from worker.loop import EngineLoop

log = logging.getLogger(__name__)

POLL_S = 0.02  # how often the drain asks whether moves are pending
OFFER_TIMEOUT_S = 2.0  # an engine loop that does not take the offer by then (held, hung): none


async def move_out(loop: EngineLoop, heartbeat: Heartbeat, worker_id: str, wait_s: float
                   ) -> int:
    """Offer the moves of ``loop``'s decoding requests (each parked at most ``wait_s``)
    and wait until none is pending, at most ``wait_s`` (the drain's grace: what is left of
    it then goes to the server's stop, so a drain takes the grace at most, as without
    moves; a move still sending then is cut, and replayed). A request that starts decoding
    meanwhile (its KV arrived for a reservation made before the drain) is offered too.
    Returns how many were offered; 0 when no other decode worker is registered, or the
    loop cannot move (it is not a ``role_worker`` loop) — never raises for that. Only a
    worker serving decode offers: one switched to prefill keeps what it still decodes,
    and waits only for what it parked at the switch (if asked to move)."""
    if getattr(loop, "role", "decode") != "decode":
        await _wait_pending(loop, time.monotonic() + wait_s, offer=False)
        return 0
    try:
        if not await asyncio.to_thread(heartbeat.set_draining):
            raise RuntimeError("its record was not written")
        serving = await asyncio.to_thread(others_decoding, heartbeat, worker_id)
    except Exception as exc:  # noqa: BLE001 - Redis down: nowhere known to move to
        log.warning("draining: the registry did not answer (%s); streams finish in place", exc)
        return 0
    if not serving:
        log.info("draining: no other decode worker is serving; streams finish here")
        return 0
    started = time.monotonic()
    try:
        offered = await loop.acall(OfferMoves(wait_s), OFFER_TIMEOUT_S)
    except (WorkerError, TypeError) as exc:
        log.warning("draining: no planned moves: %s", exc)
        return 0
    offered, pending = await _wait_pending(loop, started + wait_s, offered=offered)
    log.info("draining: %d requests offered to move, %d still pending after %.2fs",
             offered, pending, time.monotonic() - started)
    return offered


async def _wait_pending(loop: EngineLoop, deadline: float, *, offer: bool = True,
                        offered: int = 0) -> tuple[int, int]:
    """Poll ``MovesPending`` until nothing is pending or ``deadline``; ``offer``: first
    offering what started decoding since (each its move parked until ``deadline``). The
    requests offered in all, and those still pending."""
    pending = 1
    while time.monotonic() < deadline:
        try:
            if offer:
                offered += await loop.acall(OfferMoves(deadline - time.monotonic()),
                                            CALL_TIMEOUT_S)
            pending = await loop.acall(MovesPending(), CALL_TIMEOUT_S)
        except TypeError:  # a loop that cannot move: nothing of it is pending
            return offered, 0
        except WorkerError as exc:  # the loop died or hangs: the drain goes on without it
            log.warning("draining: the engine loop did not answer: %s", exc)
            break
        if not pending:
            break
        await asyncio.sleep(POLL_S)
    return offered, pending


def others_decoding(heartbeat: Heartbeat, worker_id: str) -> bool:
    """Whether the registry lists a decode worker other than ``worker_id`` that is not
    draining: somewhere a move can go (raises what the registry raises)."""
    return any(r.worker_id != worker_id and not r.draining
               for r in heartbeat.registry.list_workers("decode"))
