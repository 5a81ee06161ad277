"""Choosing workers: prefix affinity for prefill, load for decode. Pure functions.

Prefill: rendezvous (highest-random-weight) hashing. Every prefill worker gets a weight
``xxh3_64(affinity_key | worker_id)``; the highest weight wins, so a key keeps its worker
while workers come and go (only the keys of a departed worker move). The key is the
chained hash of the prompt's leading full blocks, so requests sharing those blocks
share a worker and find them in its prefix cache. Bounded load ("consistent hashing with
bounded loads"): a worker whose load would exceed ``ceil((1 + epsilon) * mean)`` is
skipped for the next one in rendezvous order, so a hot prefix spills over to a stable
second choice instead of overloading one worker. ``--prefill-routing round-robin``
(``round_robin``) ignores prompts altogether: the baseline affinity is measured against.

Prefill, ``kv-aware`` (``rank_by_cost``): the least predicted work before this prompt's
first token — the prompt tokens already queued on the worker plus those of this prompt
it does not hold (the KV index, ``router.kv_index``, says how many leading blocks each
holds), over the worker's relative speed (``router.policy.relative_speeds``) — ties
in rendezvous order, so an idle cluster with nothing cached routes as ``affinity``
does. Affinity follows from the cost: the worker holding a prompt's prefix computes
least.

Decode: among the workers within the same bounded load, the one holding the longest
prefix of the prompt (decode-side reuse: only the blocks it lacks travel), then the least
running work (the router's own in-flight count on the worker), then the most free KV
blocks (from its last heartbeat).
"""

from __future__ import annotations

import functools
import struct
from collections.abc import Mapping, Sequence
from fractions import Fraction
from typing import NamedTuple

import xxhash

from engine.kvcache.block_hash import BlockHash
from router.config import AFFINITY_BLOCKS, DEFAULT_EPSILON


def affinity_key(block_hashes: Sequence[BlockHash], prompt_token_ids: Sequence[int],
                 num_blocks: int = AFFINITY_BLOCKS) -> bytes:
    """The key of a prompt: its ``num_blocks``-th full-block hash (chained, so it names
    every block before it), or the last one there is; a prompt with no full block is
    keyed by its tokens (it has nothing cacheable, the key only spreads such prompts)."""
    if block_hashes:
        return block_hashes[min(num_blocks, len(block_hashes)) - 1]
    return struct.pack(f"<{len(prompt_token_ids)}q", *prompt_token_ids)


def rendezvous_order(key: bytes, worker_ids: Sequence[str]) -> list[str]:
    """``worker_ids`` from the highest rendezvous weight for ``key`` to the lowest."""
    return sorted(worker_ids, key=lambda w: (_weight(key, w), w), reverse=True)


def pick_prefill(key: bytes, loads: Mapping[str, int],
                 epsilon: float = DEFAULT_EPSILON) -> list[str]:
    """Prefill workers to try, best first: rendezvous order for ``key`` with the workers
    over the load bound moved to the end (in rendezvous order too).

    ``loads`` maps every candidate worker id to its current load (requests in flight).
    The bound for one more request is ``ceil((1 + epsilon) * (total + 1) / n)``: a worker
    is within it when its load + 1 does not exceed it. At least one worker always is.
    """
    if not loads:
        return []
    bound = load_bound(epsilon, sum(loads.values()), len(loads))
    order = rendezvous_order(key, list(loads))
    within = [w for w in order if loads[w] + 1 <= bound]
    return within + [w for w in order if w not in within]


def uncached_tokens(num_prompt_tokens: int, block_size: int, cached_blocks: int) -> int:
    """Prompt tokens a worker holding ``cached_blocks`` leading blocks still computes. Its
    cache serves at most the full blocks before the last token's (whose logits sample the
    first token), as the engine's ``Scheduler.cached_prefix`` takes them: a prompt of
    whole blocks, all cached, still computes its last block."""
    usable = max(0, min(cached_blocks, (num_prompt_tokens - 1) // block_size))
    return num_prompt_tokens - usable * block_size


def rank_by_cost(key: bytes, costs: Mapping[str, float]) -> list[str]:
    """Worker ids from the least cost to the most, ties in rendezvous order of ``key``."""
    return sorted(rendezvous_order(key, list(costs)), key=costs.__getitem__)


def round_robin(worker_ids: Sequence[str], turn: int) -> list[str]:
    """``worker_ids`` (sorted) starting at the ``turn``-th: each request's turn is one more
    than the last one's, so consecutive requests go to consecutive workers."""
    ordered = sorted(worker_ids)
    if not ordered:
        return []
    start = turn % len(ordered)
    return ordered[start:] + ordered[:start]


class DecodeCandidate(NamedTuple):
    """One decode worker as ``rank_decode`` weighs it (a named tuple: one is made per
    decode worker for every request placed)."""

    worker_id: str
    inflight: int  # requests the router has in flight on it
    free_kv_blocks: int  # from its last heartbeat
    total_kv_blocks: int
    cached_blocks: int = 0  # leading prompt blocks it holds (the KV index's word)


def rank_decode(candidates: Sequence[DecodeCandidate], num_blocks: int,
                epsilon: float = DEFAULT_EPSILON) -> list[str]:
    """Decode workers to try, best first: those within the load bound (as in
    ``pick_prefill``) before the others; among them the most cached prompt blocks, then
    least in flight, then most free blocks, then id. With nothing cached anywhere that is
    least in flight first (a worker past the bound has more in flight than any within).

    Workers whose whole KV pool is smaller than ``num_blocks`` can never hold the request
    and are left out.
    """
    fit = [c for c in candidates if c.total_kv_blocks >= num_blocks]
    if not fit:
        return []
    bound = load_bound(epsilon, sum(c.inflight for c in fit), len(fit))
    fit.sort(key=lambda c: (c.inflight + 1 > bound, -c.cached_blocks, c.inflight,
                            -c.free_kv_blocks, c.worker_id))
    return [c.worker_id for c in fit]


def load_bound(epsilon: float, total: int, num_workers: int) -> int:
    """The most requests a worker may hold with one more placed among ``num_workers``
    holding ``total``: ``ceil((1 + epsilon) * (total + 1) / num_workers)``, with
    ``epsilon`` exactly as written (in floats (1 + 0.1) * 50 / 5 is 11.000…02, which would
    ceil to 12), in integers (a Fraction's arithmetic is slow, and the bound is computed
    for every request)."""
    numerator, denominator = _one_plus(epsilon)
    return -(-numerator * (total + 1) // (denominator * num_workers))


@functools.lru_cache(maxsize=16)
def _one_plus(epsilon: float) -> tuple[int, int]:
    """``1 + epsilon`` exactly as written, as a numerator and a denominator (one per
    epsilon: a Fraction of a string is slow to make)."""
    exact = 1 + Fraction(str(epsilon))
    return exact.numerator, exact.denominator


def _weight(key: bytes, worker_id: str) -> int:
    return xxhash.xxh3_64_intdigest(key + b"\x00" + worker_id.encode("utf-8"))
