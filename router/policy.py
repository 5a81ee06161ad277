"""The routing decision of one attempt, apart from the calls that carry it out (I/O-free).

``Placement`` (``router.lifecycle.placement``) feeds it what the router knows — the
workers' loads, the KV index's word on what each holds — and makes the calls; the cluster
simulator (``sim``) feeds it the same figures on its virtual clock. One decision code,
two drivers, so what the simulator predicts is what the router does.

- ``choose_prefill``: the prefill workers to ask, best first, and why the first won
  (``pdserve:router_decisions_total{kind="prefill"}``): in turn (``round-robin``); the
  least predicted work (``kv-aware`` with a trusted index: tokens queued there plus the
  prompt tokens it lacks, over its ``relative_speeds``, ``router.routing.rank_by_cost``);
  else rendezvous order of the affinity key with bounded load (``affinity``, or
  ``kv-aware`` while the index cannot be trusted: ``index_stale``).
- ``PrefillChoice.queue_bounds`` (kv-aware): how much each worker but the last may really
  have queued for its place in the order to hold. A router sees the other routers' load
  as last exchanged: requests that reach several routers at once all look at idle
  workers and, tied, rank them alike. The worker, which holds every router's requests,
  refuses a Prefill over its bound (``cluster.prefill_queue``), and the router asks the
  next.
- Conditional disaggregation, the decode worker prefilling the prompt itself:
  ``short_tail`` — it holds all but at most ``limit`` tokens of the prompt;
  ``prefill_outwaits_local`` — every prefill worker's queue and what it lacks of the
  prompt come to more than ``decode_side``: what the decode worker lacks of it, counted
  twice, and its own backlog.

Predictions are in prompt tokens over each worker's relative speed
(``relative_speeds``): workers report the rate at which they drain a backlog
(``worker.prefill_rate``); one clearly slower than the fastest candidate (another
accelerator, another TP size) has its tokens count for more, while workers alike — their
rates within ``ALIKE`` of each other, as measurement noise leaves them — count as equally
fast, so noise never reorders them.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

from router.routing import pick_prefill, rank_by_cost, round_robin, uncached_tokens

ALIKE = 1.5
"""Workers whose measured prefill rates are within this factor of the fastest's count as
equally fast (``relative_speeds``)."""


@dataclass(frozen=True)
class PrefillChoice:
    """The order to ask prefill workers in, why its first won, and (kv-aware) the leading
    prompt blocks each holds and its ``queue_bounds``."""

    order: list[str]
    reason: str
    cached: Mapping[str, int] = field(default_factory=dict)
    # prompt tokens each worker but the last may really have queued for the order to hold
    queue_bounds: Mapping[str, int] = field(default_factory=dict)
    speeds: Mapping[str, float] = field(default_factory=dict)  # ``relative_speeds``, kv-aware


def choose_prefill(mode: str, *, key: bytes, loads: Mapping[str, int],
                   queued_tokens: Mapping[str, int], num_prompt_tokens: int,
                   block_size: int, cached: Mapping[str, int] | None,
                   turn: int = 0, epsilon: float,
                   speeds: Mapping[str, float] | None = None) -> PrefillChoice:
    """The prefill decision (see the module doc). ``loads``: requests in flight on each
    candidate (the whole cluster's, as far as this router knows); ``queued_tokens``:
    prompt tokens waiting there for their first token; ``cached``: the KV index's leading
    blocks per worker, or None when it cannot be trusted (or is not kept); ``turn``: the
    request's round-robin turn; ``speeds``: ``relative_speeds`` (None: all alike)."""
    if mode == "round-robin":
        return PrefillChoice(round_robin(list(loads), turn), "round_robin")
    if mode == "kv-aware" and cached is not None:
        costs = {w: predicted_cost(queued_tokens.get(w, 0), uncached_tokens(
                     num_prompt_tokens, block_size, cached.get(w, 0)), _speed(speeds, w))
                 for w in loads}
        order = rank_by_cost(key, costs)
        reason = "kv_hit" if order and cached.get(order[0]) else "kv_cost"
        slack = {w: block_size * (1 + loads[w]) for w in loads}
        return PrefillChoice(order, reason, cached, queue_bounds(
            order, costs, queued_tokens, speeds, slack), dict(speeds or {}))
    order = pick_prefill(key, loads, epsilon)
    return PrefillChoice(order, "affinity" if mode == "affinity" else "index_stale")


def predicted_cost(queued_tokens: int, tokens: int, speed: float) -> float:
    """A prefill worker's predicted work for a prompt: the tokens queued there plus the
    ``tokens`` it computes of the prompt, over its relative ``speed``."""
    return (queued_tokens + tokens) / speed


def queue_bounds(order: Sequence[str], costs: Mapping[str, float],
                 queued_tokens: Mapping[str, int], speeds: Mapping[str, float] | None,
                 slack: Mapping[str, int]) -> dict[str, int]:
    """For each worker of ``order`` (ranked by ``costs``, in tokens over speed) but the
    last, the most prompt tokens it may really have queued for it still to cost no more
    than the next one: its queue as this router sees it (``queued_tokens``) plus its
    margin over the next, in its own tokens, plus its ``slack`` (a block per request this
    router sees there, and one: the router and the worker count a prefix cache's share a
    little apart, a request at a time). At least 1 (0 means none)."""
    return {w: max(1, int(queued_tokens.get(w, 0) + (costs[nxt] - costs[w]) * _speed(speeds, w))
                   + slack.get(w, 0))
            for w, nxt in zip(order, order[1:], strict=False)}


def relative_speeds(worker_ids: Sequence[str], rates: Mapping[str, float]
                    ) -> dict[str, float]:
    """Each worker's prefill speed against the fastest of ``worker_ids`` that reported a
    rate (``rates``, prompt tokens per second): 1.0 within ``ALIKE`` of it (alike: the
    difference is noise) or without a rate; below, ``ALIKE`` times its rate over the
    fastest's (continuous: a few percent of noise moves a speed by a few percent, never
    across a step)."""
    fastest = max((rates.get(w, 0.0) for w in worker_ids), default=0.0)
    return {w: min(1.0, ALIKE * rates[w] / fastest) if rates.get(w, 0.0) > 0.0 else 1.0
            for w in worker_ids}


def decode_side(lacks: int, queued: int) -> int:
    """The decode worker's side of the queue rule, in prompt tokens: what it lacks of the
    prompt counted twice (the request waits for it, and so do the decode worker's streams,
    whose steps it joins), plus the local prefills already under way there (``queued``).
    For a prompt that every worker lacks alike, on prefill workers as fast as the decode
    worker, a prefill worker's side is its queue and the same tokens, so the rule reads:
    its queue is longer than the local backlog and the prompt. A slower prefill worker's
    side is its queue and the prompt, both over its speed."""
    return 2 * lacks + queued


def prefill_outwaits_local(limit: int, prefill_work: Mapping[str, int], local: int,
                           speeds: Mapping[str, float] | None = None) -> bool:
    """Whether the decode worker should prefill the prompt itself because every prefill
    worker would take longer: even the least predicted work on one (``prefill_work``: the
    prompt tokens queued there, cluster-wide, plus those of this prompt it would compute,
    over its ``speeds``: ``predicted_cost``) is more than the ``local`` side
    (``decode_side``; the decode worker is taken to compute as fast as the fastest prefill
    worker, the same model on the same kind of accelerator). A chat's next turn whose
    history only its decode worker holds thus stays there, rather than a prefill worker
    computing that history again. ``limit`` 0 (conditional disaggregation off) or no
    prefill worker: never."""
    return bool(limit) and bool(prefill_work) and min(
        predicted_cost(tokens, 0, _speed(speeds, w))
        for w, tokens in prefill_work.items()) > local


def _speed(speeds: Mapping[str, float] | None, worker_id: str) -> float:
    return speeds.get(worker_id, 1.0) if speeds else 1.0


def short_tail(limit: int, num_prompt_tokens: int, block_size: int, held_blocks: int) -> bool:
    """Whether the decode worker holding ``held_blocks`` leading blocks of the prompt
    should compute its tail itself: it holds some and lacks at most ``limit`` tokens
    (``limit`` 0: never)."""
    return bool(limit) and held_blocks > 0 and uncached_tokens(
        num_prompt_tokens, block_size, held_blocks) <= limit
