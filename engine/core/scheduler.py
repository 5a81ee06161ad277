"""Continuous-batching scheduler: which tokens of which requests one step computes.

Torch-free; works on request state, integer block ids and counts. Each step:
1. running requests continue (one decode token each, or the next prefill chunk), oldest
   first; when blocks run out, the newest running request is preempted (its blocks are
   freed and it is recomputed later);
2. waiting requests are admitted (reusing prefix-cached blocks) while the token budget,
   ``max_num_seqs`` and the free blocks allow — also while others are mid-decode.
A long prompt is prefilled in chunks of at most the remaining token budget. With
speculative decoding (``SchedulerConfig.speculative_method``) a decoding request may
compute its last token and guessed next ones in one chunk (``engine.core.speculative``).
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import cast

from engine.config import CacheConfig, SchedulerConfig
from engine.core.chunks import (
    ScheduledChunk,
    blocks_completed,
    decode_chunk,
    next_block_hash,
    next_chunk,
)
from engine.core.request import FinishReason, Request, RequestStatus
from engine.core.speculative import accepted, blocks_wanted_after, drafts_for
from engine.kvcache import BlockManager

SEQUENCES = (tuple, list)  # a speculated chunk's tokens come as one of these


@dataclass
class SchedulerOutput:
    """One step: decode chunks first, then prefill chunks (the flat batch order)."""

    decodes: list[ScheduledChunk] = field(default_factory=list)
    prefills: list[ScheduledChunk] = field(default_factory=list)
    preempted: list[str] = field(default_factory=list)

    @property
    def chunks(self) -> list[ScheduledChunk]:
        return self.decodes + self.prefills

    @property
    def num_tokens(self) -> int:
        return sum(len(c.token_ids) for c in self.chunks)


@dataclass
class SchedulerStats:
    num_steps: int = 0
    num_preemptions: int = 0
    # admissions of a waiting request in a step where another request was mid-decode
    num_admissions_during_decode: int = 0
    num_started: int = 0  # requests admitted from waiting for the first time
    num_draft_tokens: int = 0  # guessed tokens computed (speculative decoding)
    num_accepted_tokens: int = 0  # of those, kept


@dataclass
class StepUpdate:
    """What a step produced for one request: a sampled token and/or its end."""

    request: Request
    new_token_id: int | None
    finished: bool


class Scheduler:
    """Owns the request queues; the block manager owns the blocks. ``schedule()`` then
    ``update()`` once per step, with the tokens sampled for chunks where ``sample``."""

    def __init__(self, sched: SchedulerConfig, cache: CacheConfig, block_manager: BlockManager,
                 max_model_len: int) -> None:
        self.config = sched
        self.cache = cache
        self.blocks = block_manager
        self.max_model_len = max_model_len
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.kv_ready: deque[Request] = deque()  # KV_READY: written from outside, not yet running
        self.reserved: dict[str, Request] = {}  # WAITING_FOR_KV
        self.parked: dict[str, Request] = {}  # PARKED (engine.core.parking)
        self.requests: dict[str, Request] = {}
        self.stats = SchedulerStats()

    # --- queues -------------------------------------------------------------------
    def add(self, request: Request) -> None:
        self.requests[request.request_id] = request
        self.waiting.append(request)

    def reserve(self, request: Request, num_tokens: int,
                cached_block_ids: Sequence[int] = ()) -> list[int] | None:
        """Reserve blocks for ``num_tokens`` tokens whose KV will be written from outside,
        led by ``cached_block_ids`` (from ``cached_prefix``: KV already here, never
        written). Returns the whole block table, or None (nothing held) when it does not
        fit now, or while a preempted request waits to be readmitted: the blocks freed go
        to it first (else reservations arriving between steps would take every block that
        frees up, and it would wait until its deadline)."""
        if self.waiting and self.waiting[0].num_preemptions:
            return None
        if self.blocks.allocate(request.request_id, num_tokens, cached_block_ids) is None:
            return None
        request.status = RequestStatus.WAITING_FOR_KV
        self.requests[request.request_id] = request
        self.reserved[request.request_id] = request
        return self.blocks.block_ids(request.request_id)

    def admit_with_kv(self, request_id: str, num_computed_tokens: int,
                      first_token_id: int) -> StepUpdate:
        """The reserved request's first ``num_computed_tokens`` KV entries are in its blocks
        and ``first_token_id`` was sampled elsewhere: it is KV_READY and joins the running
        batch at the next ``schedule()`` with room (or finishes at once when that token
        ends it)."""
        request = self.reserved.pop(request_id)
        request.num_computed_tokens = num_computed_tokens
        key_full_blocks(request, self.blocks, self.cache)
        request.append_output(first_token_id)
        reason = request.check_token_stop(self.max_model_len)
        if reason is not None:
            self._finish(request, reason)
        else:
            request.status = RequestStatus.KV_READY
            self.kv_ready.append(request)
        return StepUpdate(request, first_token_id, reason is not None)

    def finish(self, request_id: str, reason: FinishReason) -> Request | None:
        """End a request wherever it is (abort, stop string); frees its blocks. Idempotent."""
        request = self.requests.get(request_id)
        if request is None or request.is_finished:
            return None
        for queue in (self.waiting, self.kv_ready, self.running):
            if request in queue:
                queue.remove(request)
        self.reserved.pop(request_id, None)
        self.parked.pop(request_id, None)
        self._finish(request, reason)
        return request

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running or self.kv_ready)

    # --- one step -----------------------------------------------------------------
    def schedule(self) -> SchedulerOutput:
        out = SchedulerOutput()
        budget = self.config.max_num_batched_tokens
        while self.kv_ready and len(self.running) < self.config.max_num_seqs:
            request = self.kv_ready.popleft()
            request.status = RequestStatus.RUNNING
            self.running.append(request)
        budget = self._schedule_running(out, budget)
        if not out.preempted:
            self._schedule_waiting(out, budget)
        self.stats.num_steps += 1
        return out

    def _schedule_running(self, out: SchedulerOutput, budget: int) -> int:
        i = 0
        limit = self.config.speculative_disable_by_batch_size
        speculate = bool(self.config.speculative_method) and (
            limit is None or len(self.running) <= limit)
        later_blocks = blocks_wanted_after(self.running, self.blocks, budget) if speculate else []
        running, table, size = self.running, self.blocks.block_table, self.blocks.block_size
        while i < len(running) and budget > 0:
            request = running[i]  # the usual chunk first, without the general case's calls
            if not speculate and (chunk := decode_chunk(request, table(request.request_id), size)):
                out.decodes.append(chunk)
                budget, i = budget - 1, i + 1
                continue
            num_new = min(request.num_tokens - request.num_computed_tokens, budget)
            drafts = drafts_for(request, self.config, self.blocks, budget, self.max_model_len,
                                len(self.running) - i - 1, later_blocks[i]) if (
                num_new == 1 and speculate) else []
            num_new += len(drafts)
            while self.blocks.allocate(request.request_id, request.num_computed_tokens + num_new) is None:
                victim = self.running[-1]
                self._preempt(victim)
                out.preempted.append(victim.request_id)
                if victim is request:
                    break
            else:
                _emit(out, request, num_new - len(drafts), table(request.request_id), drafts)
                budget -= num_new
                i += 1
        return budget

    def _schedule_waiting(self, out: SchedulerOutput, budget: int) -> None:
        """Admit waiting requests in order while they fit; one whose next uncached block is
        computed this step for another waits a step in its place, then finds it cached:
        prompts sharing a prefix that arrive together compute it once."""
        if not self.waiting:
            return
        decoding = any(r.output_token_ids and r.num_computed_tokens for r in self.running)
        size, seed = self.blocks.block_size, self.cache.hash_seed
        caching = self.cache.enable_prefix_caching  # (off: nothing is found in the cache)
        coming = blocks_completed(out.prefills, self.requests, size, seed) if caching else None
        waits: list[Request] = []
        while self.waiting and budget > 0 and len(self.running) < self.config.max_num_seqs:
            request = self.waiting[0]
            cached = self.cached_prefix(request)
            if coming and next_block_hash(request, len(cached), size, seed) in coming:
                waits.append(self.waiting.popleft())
                continue
            num_computed = len(cached) * self.blocks.block_size
            num_new = min(request.num_tokens - num_computed, budget)
            if self.blocks.allocate(request.request_id, num_computed + num_new, cached) is None:
                break
            self.waiting.popleft()
            if request.num_preemptions == 0:
                request.num_cached_tokens = num_computed
                self.stats.num_started += 1
            request.num_computed_tokens = num_computed
            request.status = RequestStatus.RUNNING
            self.running.append(request)
            self.stats.num_admissions_during_decode += decoding
            _emit(out, request, num_new, self.blocks.block_table(request.request_id))
            budget -= num_new
            if coming is not None:
                coming |= blocks_completed(out.prefills[-1:], self.requests, size, seed)
        self.waiting.extendleft(reversed(waits))

    def cached_prefix(self, request: Request) -> list[int]:
        """The request's leading blocks in the prefix cache (none when it is off, or when
        its prompt's logprobs are wanted: a cached block has no logits), short of its last
        token's block; takes no reference (valid until the next allocation)."""
        if not self.cache.enable_prefix_caching or request.wants_prompt_logprobs:
            return []
        # At least the last token is always computed, so its logits exist to sample from.
        num_blocks = (request.num_tokens - 1) // self.blocks.block_size
        hashes = request.full_block_hashes(num_blocks, self.blocks.block_size, self.cache.hash_seed)
        return self.blocks.get_cached_prefix(hashes)

    def _preempt(self, request: Request) -> None:
        """Free the request's blocks; it is recomputed from scratch when re-admitted."""
        self.running.remove(request)
        self.blocks.free(request.request_id)
        request.num_computed_tokens = 0
        request.num_preemptions += 1
        request.status = RequestStatus.WAITING
        self.waiting.appendleft(request)
        self.stats.num_preemptions += 1

    # --- after the step -------------------------------------------------------------
    def update(self, out: SchedulerOutput, sampled: Sequence[int | Sequence[int]]
               ) -> list[StepUpdate]:
        """Advance every scheduled request; ``sampled`` holds one token per sampling chunk,
        in ``out.chunks`` order (a speculated chunk's: the ``1 + num_draft_tokens`` drawn
        after each of its tokens, ``engine.core.speculative.per_chunk``). Finished requests
        release (or pin) their blocks. A speculated request may have several updates."""
        samples = iter(sampled)
        updates: list[StepUpdate] = []
        find, running = self.requests.get, RequestStatus.RUNNING
        block_size, max_model_len = self.blocks.block_size, self.max_model_len
        for chunk in out.chunks:
            request = find(chunk.request_id)
            token = next(samples) if chunk.sample else None
            if request is None or request.status is not running:
                continue  # finished (e.g. aborted) while the step ran
            if chunk.num_draft_tokens:
                assert isinstance(token, tuple | list)
                updates += self._update_speculated(request, chunk, token)
                continue
            assert not isinstance(token, SEQUENCES)  # concrete types: ABCs cost per token
            token = cast(int | None, token)
            request.num_computed_tokens += len(chunk.token_ids)
            if len(chunk.token_ids) > 1 or not request.num_computed_tokens % block_size:
                key_full_blocks(request, self.blocks, self.cache)  # one token fills a block
                # only as its last (the blocks before were keyed, or cached and keyed)
            if token is None:
                continue
            request.append_output(token)
            reason = FinishReason.PREFILLED if request.prefill_only else request.check_token_stop(
                max_model_len)
            if reason is not None:
                self.running.remove(request)
                self._finish(request, reason)
            updates.append(StepUpdate(request, token, reason is not None))
        return updates

    def _update_speculated(self, request: Request, chunk: ScheduledChunk,
                           drawn: Sequence[int]) -> list[StepUpdate]:
        """A speculated chunk's tokens: the drafts kept and the token after them, each
        checked for the request's end (``engine.core.speculative``)."""
        drafts = chunk.token_ids[1:]
        self.stats.num_draft_tokens += len(drafts)
        updates = []
        for j, token in enumerate(accepted(drafts, drawn)):
            request.num_computed_tokens += 1  # the token before it: the last, or a kept draft
            self.stats.num_accepted_tokens += j < len(drafts) and token == drafts[j]
            request.append_output(token)
            reason = request.check_token_stop(self.max_model_len)
            updates.append(StepUpdate(request, token, reason is not None))
            if reason is not None:  # the blocks this step filled are keyed first
                key_full_blocks(request, self.blocks, self.cache)
                self.running.remove(request)
                self._finish(request, reason)
                return updates
        key_full_blocks(request, self.blocks, self.cache)
        return updates

    def _finish(self, request: Request, reason: FinishReason) -> None:
        request.status = RequestStatus.FINISHED
        request.finish_reason = reason
        if reason is FinishReason.PREFILLED:
            self.blocks.pin(request.request_id)  # held for the KV transfer; see release_pinned
        else:
            self.blocks.free(request.request_id)

    def forget(self, request_ids: Iterable[str]) -> None:
        """Drop finished requests from the index (after their outputs were read)."""
        for rid in request_ids:
            request = self.requests.get(rid)
            if request is not None and request.is_finished:
                del self.requests[rid]


def _emit(out: SchedulerOutput, request: Request, num_new: int, block_ids: tuple[int, ...],
          drafts: Sequence[int] = ()) -> None:
    """Adds ``request``'s next chunk (``num_new`` tokens, then ``drafts``) to ``out``."""
    chunk = next_chunk(request, num_new, drafts, block_ids)
    if chunk.is_decode or drafts:  # a speculated chunk's tokens are decode rows
        out.decodes.append(chunk)
    else:
        request.num_prefill_chunks += 1
        out.prefills.append(chunk)


def key_full_blocks(request: Request, blocks: BlockManager, cache: CacheConfig) -> None:
    """Key ``request``'s blocks whose KV is all computed in the prefix cache (where it is
    on), so later prompts sharing them find them."""
    if not cache.enable_prefix_caching:
        return
    num_full = request.num_computed_tokens // blocks.block_size
    if num_full <= blocks.num_keyed_blocks(request.request_id):
        return  # no block filled up since the last call (most decode steps)
    hashes = request.full_block_hashes(num_full, blocks.block_size, cache.hash_seed)
    blocks.cache_full_blocks(request.request_id, hashes)
