"""One simulated worker: the engine's own ``Scheduler`` and ``BlockManager`` stepping on
the virtual clock, each step lasting what the profile's ``StepModel`` says.

What runs is the real scheduling: continuous batching, chunked prefill, preemption under
KV pressure, prefix caching over the real chained block hashes of the prompts' token ids,
reservations for KV written from outside (``reserve`` / ``admit_with_kv``) and prefill-only
requests pinned until their KV has travelled. What is not run is the model: a sampled
token is a made-up id (outputs are fixed-length, ``ignore_eos``, as in ``bench.serve``).
The pool publishes its KV events into a ``KVEventLog``, as a real worker's does, for the
router's KV index, and reports its free blocks at each heartbeat (``reported_free_blocks``),
as a real worker's registry record does, for the routers' ranking of decode workers.
"""

from __future__ import annotations

import functools
from collections.abc import Callable

from cluster.registry import DEFAULT_HEARTBEAT_S
from engine.config import CacheConfig, SchedulerConfig
from engine.core.request import FinishReason, Request
from engine.core.scheduler import Scheduler, SchedulerOutput, StepUpdate
from engine.kvcache import BlockManager
from engine.kvcache.events import KVEventLog
from sim.events import EventQueue
from sim.profile import StepModel

FIRST_TOKEN_ID = 16  # made-up sampled ids start here (as the workloads' prompt ids do)
NUM_TOKEN_IDS = 30000

OnOutputs = Callable[["SimWorker", list[StepUpdate]], None]  # a step's updates, in order


class SimWorker:
    """A worker of ``role`` ("prefill" or "decode"; the planner may change it: what it
    holds of the old role goes on) with the step model ``step``. ``queue_waits``: when each
    request queued here had its first chunk computed, and how long it had waited."""

    def __init__(self, worker_id: str, role: str, step: StepModel, *, block_size: int,
                 max_model_len: int, max_num_seqs: int, max_num_batched_tokens: int,
                 events: EventQueue, on_outputs: OnOutputs) -> None:
        self.worker_id = worker_id
        self.role = role
        self.step = step
        self.blocks = BlockManager(step.num_kv_blocks, block_size)
        self.kv_events = KVEventLog()
        self.blocks.publish_events(self.kv_events)
        self.scheduler = Scheduler(
            SchedulerConfig(max_num_seqs=max_num_seqs,
                            max_num_batched_tokens=max_num_batched_tokens),
            CacheConfig(block_size=block_size, num_kv_blocks=step.num_kv_blocks),
            self.blocks, max_model_len)
        self._events = events
        self._on_outputs = on_outputs
        self.busy_s = 0.0  # virtual seconds spent stepping
        self.num_steps = 0
        self._stepping = False
        self._step_end_s = 0.0  # when the step in flight ends
        self.dead = False  # killed (a fault): it does nothing more
        self._added_at: dict[str, float] = {}  # queued here, no chunk computed yet
        self.queue_waits: list[tuple[float, float]] = []  # (started at, waited) per request
        self._heartbeat_s = DEFAULT_HEARTBEAT_S  # a real worker's default
        self._next_beat_s = events.now + self._heartbeat_s
        self._reported_free = self.blocks.num_free_blocks

    # ------------------------------------------------------------------ requests

    def reported_free_blocks(self) -> int:
        """The pool's free blocks as the worker's last heartbeat reported them: what a real
        router ranks decode workers by (``DecodeCandidate.free_kv_blocks``, read from the
        registry), not the count now."""
        self._beat()
        return self._reported_free

    def beat_now(self) -> None:
        """A heartbeat out of turn (a real worker sends one when its role changes)."""
        self._reported_free = self.blocks.num_free_blocks

    def _beat(self) -> None:
        """Called before anything changes the pool: a heartbeat that fell since the last
        change saw the pool as it still is."""
        now = self._events.now
        if now >= self._next_beat_s:
            self._reported_free = self.blocks.num_free_blocks
            beats = int((now - self._next_beat_s) // self._heartbeat_s) + 1
            self._next_beat_s += beats * self._heartbeat_s

    def add(self, request: Request) -> None:
        """Queue a request to compute here (a prefill-only one, or a local attempt)."""
        self.scheduler.add(request)
        self._added_at[request.request_id] = self._events.now
        self.kick()

    def reserve(self, request: Request, max_reused: int | None = None) -> int | None:
        """Reserve blocks for ``request``'s prompt KV, written from outside, reusing the
        leading blocks the prefix cache holds (at most ``max_reused``): how many it reused,
        or None (nothing held) when they do not fit now."""
        self._beat()
        cached = self.scheduler.cached_prefix(request)[:max_reused]
        if self.scheduler.reserve(request, request.num_prompt_tokens, cached) is None:
            return None
        return len(cached)

    def admit_with_kv(self, request_id: str, first_token_id: int) -> StepUpdate:
        """The reserved request's prompt KV arrived and its first token was sampled by the
        prefill worker: it joins the running batch."""
        self._beat()
        request = self.scheduler.reserved[request_id]
        update = self.scheduler.admit_with_kv(request_id, request.num_prompt_tokens,
                                              first_token_id)
        if update.finished:
            self.scheduler.forget([request_id])
        self.kick()
        return update

    def release_pinned(self, request_id: str) -> None:
        """A prefill-only request's KV has been received: its blocks stay cached."""
        self._beat()
        self.blocks.unpin(request_id)
        self.kick()  # freed room may let a waiting request in

    def abort(self, request_id: str) -> None:
        """The router gave up the attempt ``request_id``: whatever it holds here is freed
        (queued, running, reserved or pinned)."""
        self._beat()
        self._added_at.pop(request_id, None)
        self.scheduler.finish(request_id, FinishReason.ABORT)
        self.scheduler.forget([request_id])
        if self.blocks.is_pinned(request_id):
            self.blocks.unpin(request_id)
        self.kick()

    def kill(self) -> None:
        """A fault: the worker dies now (its step in flight never ends)."""
        self.dead = True

    # ------------------------------------------------------------------ stepping

    def kick(self) -> None:
        """Start a step if none is running and there is work."""
        if self.dead or self._stepping or not self.scheduler.has_unfinished():
            return
        self._beat()
        out = self.scheduler.schedule()
        if not (out.decodes or out.prefills):  # waiting for room (blocks held for KV on its way, or pinned)
            return
        self._stepping = True
        for chunk in out.prefills:  # its first chunk: the queue wait ends
            if (added := self._added_at.pop(chunk.request_id, None)) is not None:
                self.queue_waits.append((self._events.now, self._events.now - added))
        duration = self.step.step_s(out)
        self.busy_s += duration
        self.num_steps += 1
        self._step_end_s = self._events.now + duration
        self._events.after(duration, self._done, out)

    def _done(self, out: SchedulerOutput) -> None:
        if self.dead:
            return
        # a made-up sampled token per sampling chunk, from its request and position
        # (deterministic: the same run samples the same ids)
        chunks = out.chunks
        sampled = [FIRST_TOKEN_ID + (_id_sum(request_id) * 7919
                                     + (start + len(token_ids)) * 104729) % NUM_TOKEN_IDS
                   for request_id, token_ids, start, _, sample, _, _ in chunks if sample]
        self._beat()
        updates = self.scheduler.update(out, sampled)
        finished = [u.request.request_id for u in updates if u.finished]
        if finished:
            self.scheduler.forget(finished)
        self._stepping = False
        self._on_outputs(self, updates)
        self.kick()

    def residual_s(self) -> float:
        """Virtual seconds until the step in flight ends (0 with none). A real worker's
        loop runs commands and notices arrived KV between steps: a Reserve's reply, or a
        first token that came with the KV, waits this long."""
        if self.dead or not self._stepping:
            return 0.0
        return max(0.0, self._step_end_s - self._events.now)

    def idle(self) -> bool:
        """Nothing queued, running, reserved or pinned here."""
        usage = self.blocks.usage()
        return not (self.scheduler.has_unfinished() or self.scheduler.reserved
                    or usage.pinned or usage.in_use)


@functools.lru_cache(maxsize=4096)
def _id_sum(request_id: str) -> int:
    return sum(map(ord, request_id))
