"""Conditional disaggregation (kv-aware): whether an attempt prefills on its decode worker
instead of a prefill worker, and the queue limit its Prefill carries.

- ``local_short_tail``: the decode worker holds all of the prompt but at most
  ``local_prefill_max_tokens`` (``router.policy.short_tail``).
- ``local_queue_wait``: every prefill worker's predicted work — its queue, all routers',
  plus what it lacks of the prompt, over its relative speed — is more than the decode
  worker's side: what it lacks of the prompt, twice, plus the local prefills under way
  there (``router.policy.prefill_outwaits_local``, ``router.policy.decode_side``).
- ``queue_limit``: the same comparison from the prefill worker's side, as the most prompt
  tokens a Prefill may wait behind there (``cluster.prefill_queue``), for the worker,
  which holds every router's requests, to refuse what this router's view missed.

``Placement`` (``router.lifecycle.placement``) asks these for each attempt; the simulator
(``sim.router``) makes the same decision from the same ``router.policy`` functions.
"""

from __future__ import annotations

from typing import Protocol

from router.lifecycle.ahead import AheadGate
from router.lifecycle.context import RequestContext
from router.lifecycle.prompt_kv import PromptKV
from router.policy import decode_side, prefill_outwaits_local, short_tail
from router.routing import uncached_tokens


class Placement(Protocol):
    """What these read of ``router.lifecycle.placement.Placement``: the request, what the
    KV index says of its prompt, and what this router saw land lately."""

    ctx: RequestContext
    prompt_kv: PromptKV
    gate: AheadGate

DEARER = -1
"""``queue_limit``'s answer for a prefill worker that lacks so much of the prompt that it
would cost more than the decode worker's prefill even idle: do not ask it."""

_WHY_LOCAL = {"local_short_tail": "it holds the prompt but a short tail",
              "local_queue_wait": "every prefill worker has more to compute first",
              "local_queue_refused": "the prefill workers had more to compute first"}


def conditional_reason(placement: Placement, decode_id: str, held_blocks: int) -> str | None:
    """Why the decode worker ``decode_id``, holding ``held_blocks`` leading prompt blocks
    (as ``Placement``'s decode ranking counts them), should prefill the prompt itself, if
    it should: ``local_short_tail`` (by a trusted index) or ``local_queue_wait``, as the
    module doc says; the router's own view of the queues."""
    ctx = placement.ctx
    limit = ctx.config.local_prefill_max_tokens
    if placement.prompt_kv.trusted() and short_tail(
            limit, len(ctx.request.prompt_token_ids), ctx.block_size, held_blocks):
        return "local_short_tail"
    workers = [r.worker_id for r in ctx.pool.routable("prefill")
               if r.worker_id not in ctx.excluded]
    work = {w: ctx.pool.cluster_tokens(w) + n for w, n in lacked_tokens(placement, workers).items()}
    local = decode_side(uncached_tokens(prefill_len(ctx), ctx.block_size, held_blocks),
                        ctx.pool.cluster_tokens(decode_id))
    speeds = ctx.pool.prefill_speeds(work)
    return "local_queue_wait" if prefill_outwaits_local(limit, work, local, speeds) else None


def why_local(colocated: bool, sibling: bool, conditional: str | None) -> str:
    """Why an attempt prefills on its decode worker, for the log."""
    if colocated:
        return "colocated mode"
    if sibling:
        return "its prompt is cached there"
    return _WHY_LOCAL.get(conditional or "", "no prefill worker left")


def queue_limit(placement: Placement, decode_id: str, prefill_id: str) -> int:
    """The most prompt tokens the attempt's Prefill on ``prefill_id`` may wait behind
    there (``cluster.prefill_queue``), the queue rule's *local side*: the decode worker's
    side (``router.policy.decode_side``) at ``prefill_id``'s relative speed, less what
    ``prefill_id`` lacks of the prompt (``lacked_tokens``); at least 1 (an idle worker
    takes it), or ``DEARER`` where even idle it would cost more. 0 (no limit) where
    conditional disaggregation is off and for a resumed stream (as
    ``Placement._conditional``)."""
    ctx = placement.ctx
    if not ctx.config.local_prefill_max_tokens or ctx.calls.num_resumed \
            or ctx.config.prefill_routing != "kv-aware":
        return 0
    local = decode_side(local_tokens(placement, decode_id), ctx.pool.cluster_tokens(decode_id))
    workers = {r.worker_id for r in ctx.pool.routable("prefill")
               if r.worker_id not in ctx.excluded} | {prefill_id}
    speed = ctx.pool.prefill_speeds(workers).get(prefill_id, 1.0)
    limit = int(local * speed) - lacked_tokens(placement, [prefill_id])[prefill_id]
    return DEARER if limit < 0 else max(1, limit)


def lacked_tokens(placement: Placement, workers: list[str], recent: bool = False
                  ) -> dict[str, int]:
    """The prompt tokens each of ``workers`` would compute for ``placement``'s request, as
    far as the router knows (kv-aware: less the leading blocks the KV index says it holds,
    or with ``recent`` what this router saw land there lately, ``router.recent_kv``; all
    of them while the index cannot be trusted)."""
    held = placement.prompt_kv.cached_blocks(workers, recent=placement.gate.recent
                                             if recent else None)
    return {w: uncached_tokens(prefill_len(placement.ctx), placement.ctx.block_size,
                               held.get(w, 0)) for w in workers}


def local_tokens(placement: Placement, decode_id: str) -> int:
    """The prompt tokens a local attempt on ``decode_id`` computes (``lacked_tokens``,
    counting what landed there lately, as the decode ranking does)."""
    return lacked_tokens(placement, [decode_id], recent=True)[decode_id]


def prefill_len(ctx: RequestContext) -> int:
    """The tokens an attempt's prefill computes at most: the prompt, and a migrated
    stream's tokens sent before it."""
    return len(ctx.request.prompt_token_ids) + ctx.calls.num_resumed
