"""A request waits for a prefix in flight (the rooms: ``router.lifecycle``): when this
router is already bringing to a decode worker a prompt that covers all of this request's
prompt but a short tail (``router.inflight_kv``), the request waits for that KV to land
before it is placed, and conditional disaggregation then computes the tail on that
decode worker (``Placement``: the short tail, by what the router saw land there,
``router.recent_kv``). A request that does not wait is in flight itself from then on,
until its first token or its end: ``Handoff`` calls ``wait_for_prefix`` before the
request takes its turn in the router's queue (never while holding it), ``landed`` at its
first token and ``ended`` when it ends.

Only where conditional disaggregation is on (kv-aware, ``local_prefill_max_tokens`` > 0,
a trusted index, not colocated), for a request's first placement (not a resumed stream,
nor a later choice of n > 1, which has its own way to its sibling's decode worker), and
for at most ``router.inflight_kv.MAX_WAIT_S`` and the request's own deadline. Counted in
``pdserve:router_prefix_waits_total{outcome}`` (landed or timeout).
"""

from __future__ import annotations

import asyncio

from cluster import pause_points
from router.inflight_kv import MAX_WAIT_S
from router.lifecycle.conditional import prefill_len
from router.lifecycle.placement import Placement
from router.policy import short_tail


async def wait_for_prefix(placement: Placement) -> None:
    """Wait for a prompt in flight covering this one but a short tail (see the module
    docstring), unless a decode worker holds that much of it already; or else note this
    one in flight."""
    ctx = placement.ctx
    limit = ctx.config.local_prefill_max_tokens
    if not limit or ctx.config.prefill_routing != "kv-aware" or ctx.calls.num_resumed \
            or ctx.choice or ctx.config.local_prefill == "always" \
            or not placement.prompt_kv.trusted():
        return
    hashes, num_tokens = placement.prompt_kv.block_hashes(), prefill_len(ctx)
    entry = placement.gate.in_flight.covering(hashes, num_tokens, ctx.block_size, limit)
    if entry is None:
        if not ctx.received_kv_salt:  # a lossy wire's KV is keyed apart: no use to others
            placement.gate.in_flight.sent(placement, hashes)
        return
    decode_ids = [r.worker_id for r in ctx.pool.routable("decode")]
    held = max(placement.prompt_kv.cached_blocks(decode_ids, "", placement.gate.recent
                                                 ).values(), default=0)
    if short_tail(limit, num_tokens, ctx.block_size, held):
        return  # a decode worker holds that much already
    wait_s = min(MAX_WAIT_S, ctx.timeout())
    if pause_points.enabled():
        pause_points.record("router.prefix_wait", request_id=ctx.client_request_id)
    try:
        await asyncio.wait_for(entry.arrived.wait(), wait_s)
    except TimeoutError:
        ctx.metrics.prefix_waits.labels("timeout").inc()
        ctx.log.info("a prompt in flight covering this one did not land in %.2fs", wait_s)
        return
    ctx.metrics.prefix_waits.labels("landed").inc()
    ctx.log.info("waited for a prompt in flight covering all of this one but a short tail")


def ended(placement: Placement) -> None:
    """The request's KV landed on a decode worker (its first token), or it ended: the
    requests waiting for it go on."""
    placement.gate.in_flight.ended(placement)
