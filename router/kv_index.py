"""The router's index of which worker holds which prefix-cache block (I/O-free, torch-free).

Fed by the workers' KV event batches (``cluster.kv_events``) and the snapshots they serve;
read by the routing decision (``match``). No I/O and an injectable clock, so the server
(``router.kv_feed``) and the cluster simulator run the same object.

Per worker it keeps an epoch and the last sequence number applied:

- a batch of the same epoch with the next sequence number is applied;
- an older or repeated one is a duplicate (ignored);
- a sequence gap means events were lost (the stream trimmed them, Redis lost them, the
  router started late): the worker's blocks are kept, as a best guess, and it wants a
  snapshot (``wanted``); batches that arrive meanwhile wait for it;
- a later epoch means the worker's cache started empty again (a restart): its blocks
  are forgotten; sequence 1 of the new epoch is applied from empty, a later one waits
  for a snapshot;
- an earlier epoch, or a worker the router does not know (``watch``), is a bad event:
  counted by the caller and ignored.

A worker first watched wants a snapshot. ``watch`` with the live workers forgets the
rest. Memory is bounded: a block no worker holds is forgotten, and past ``max_blocks``
distinct blocks the least recently stored or matched ones are dropped (LRU; of a chain,
its later blocks before the ones they follow).

``trusted()`` is False until the feed read the stream once, and after ``stale_after_s``
without a successful read (Redis down): routing then falls back to rendezvous hashing.
A stale index is never an error: a miss only costs a slower prefill.
"""

from __future__ import annotations

import time
from collections import OrderedDict
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field

from cluster.kv_events import EventBatch
from engine.kvcache.events import STORED

DEFAULT_MAX_BLOCKS = 1_000_000
DEFAULT_STALE_AFTER_S = 10.0
MAX_PENDING = 1024
MAX_PENDING_OPS = 65_536
"""Batches of one worker kept while it waits for its snapshot, at most ``MAX_PENDING`` of
them and ``MAX_PENDING_OPS`` block operations in all (a batch holds up to 4,096); past it
they are dropped (the snapshot, once it comes, supersedes them; a gap after it asks
again)."""

# outcomes of ``apply`` / ``load_snapshot`` (metric labels)
APPLIED, DUPLICATE, WAITING, GAP, NEW_EPOCH = "applied", "duplicate", "waiting", "gap", "new_epoch"
UNKNOWN_WORKER, EPOCH_BACKWARDS = "unknown_worker", "epoch_backwards"
BAD_OUTCOMES = (UNKNOWN_WORKER, EPOCH_BACKWARDS)


@dataclass
class _Worker:
    epoch: int = 0
    seq: int = 0
    synced: bool = False  # has a baseline: a snapshot, or sequence 1 of its epoch
    wanted: bool = True  # wants a snapshot that nobody asked for yet
    asked: bool = False  # a snapshot was asked for and has not come
    blocks: set[bytes] = field(default_factory=set)
    pending: list[EventBatch] = field(default_factory=list)
    pending_ops: int = 0  # the block operations of ``pending``


class KVIndex:
    """Which workers hold which blocks, from their events (see the module docstring)."""

    def __init__(self, *, max_blocks: int = DEFAULT_MAX_BLOCKS,
                 stale_after_s: float = DEFAULT_STALE_AFTER_S,
                 clock: Callable[[], float] = time.monotonic) -> None:
        if max_blocks < 1:
            raise ValueError(f"max_blocks must be >= 1, got {max_blocks}")
        self.max_blocks = max_blocks
        self.stale_after_s = stale_after_s
        self._clock = clock
        self._workers: dict[str, _Worker] = {}
        self._holders: OrderedDict[bytes, set[str]] = OrderedDict()  # LRU: first is oldest
        self._heard_at: float | None = None
        self.resyncs = 0  # snapshots loaded

    # ------------------------------------------------------------------ feeding
    def watch(self, worker_ids: Iterable[str]) -> None:
        """The live workers: new ones want a snapshot; the others are forgotten."""
        live = set(worker_ids)
        for worker_id in [w for w in self._workers if w not in live]:
            self._clear(worker_id)
            del self._workers[worker_id]
        for worker_id in live - self._workers.keys():
            self._workers[worker_id] = _Worker()

    def restarted(self, worker_id: str) -> None:
        """``worker_id`` is a new process (its registration says so): forget what the
        index knew of it; it wants a snapshot."""
        if worker_id in self._workers:
            self._clear(worker_id)
            self._workers[worker_id] = _Worker()

    def heard(self) -> None:
        """The feed read the stream (events or none): the index is current."""
        self._heard_at = self._clock()

    def apply(self, batch: EventBatch) -> str:
        """Apply one batch; returns its outcome (see the module docstring)."""
        state = self._workers.get(batch.worker_id)
        if state is None:
            return UNKNOWN_WORKER
        if state.synced or state.epoch:
            if batch.epoch < state.epoch:
                return EPOCH_BACKWARDS
            if batch.epoch == state.epoch and batch.seq <= state.seq:
                return DUPLICATE
        if batch.epoch > state.epoch:
            self._clear(batch.worker_id)
            state.epoch, state.seq, state.synced = batch.epoch, 0, False
            if batch.seq == 1:
                state.synced, state.wanted, state.pending, state.pending_ops = \
                    True, False, [], 0
                self._apply_ops(batch.worker_id, state, batch)
                return NEW_EPOCH
            self._want(state, batch)
            return NEW_EPOCH
        if not state.synced:
            self._want(state, batch)
            return WAITING
        if batch.seq != state.seq + 1:
            state.synced = False
            self._want(state, batch)
            return GAP
        self._apply_ops(batch.worker_id, state, batch)
        return APPLIED

    def wanted(self) -> list[str]:
        """Workers that want a snapshot nobody asked for yet; they count as asked now."""
        out = [w for w, s in self._workers.items() if s.wanted and not s.asked]
        for worker_id in out:
            self._workers[worker_id].asked = True
        return out

    def load_snapshot(self, worker_id: str, epoch: int, seq: int,
                      block_hashes: Iterable[bytes]) -> str:
        """Replace what the index knows of ``worker_id`` with its snapshot (batch ``seq``
        of ``epoch``), then apply the batches that waited for it."""
        state = self._workers.get(worker_id)
        if state is None:
            return UNKNOWN_WORKER
        if epoch < state.epoch:  # still asked: the caller waits, then ``snapshot_failed``
            return EPOCH_BACKWARDS
        state.asked = False
        if epoch == state.epoch and (seq < state.seq or state.synced and seq == state.seq):
            # the batches applied meanwhile are ahead of it (past a gap since, it would
            # roll the worker back: it stays wanted, and is asked for again)
            return DUPLICATE
        self._clear(worker_id)
        pending = sorted(state.pending, key=lambda b: (b.epoch, b.seq))
        state.epoch, state.seq, state.synced, state.wanted, state.pending = \
            epoch, seq, True, False, []
        state.pending_ops = 0
        for block_hash in block_hashes:
            self._store(worker_id, state, block_hash)
        self.resyncs += 1
        for batch in pending:  # those that follow on; one past a gap is dropped, not
            # waited for again (a batch from nowhere would otherwise resync for ever)
            if batch.epoch == epoch and batch.seq == state.seq + 1:
                self._apply_ops(worker_id, state, batch)
        return APPLIED

    def snapshot_failed(self, worker_id: str) -> None:
        """The asked-for snapshot did not come: ask again at the next ``wanted``."""
        state = self._workers.get(worker_id)
        if state is not None:
            state.asked = False

    # ------------------------------------------------------------------ reading
    def trusted(self) -> bool:
        return self._heard_at is not None and \
            self._clock() - self._heard_at <= self.stale_after_s

    def age_s(self) -> float:
        return float("inf") if self._heard_at is None else self._clock() - self._heard_at

    def match(self, block_hashes: Sequence[bytes], worker_ids: Iterable[str]) -> dict[str, int]:
        """For each of ``worker_ids``: how many leading blocks of ``block_hashes`` it holds."""
        found = {w: 0 for w in worker_ids}
        alive = set(found)
        matched = 0
        for index, block_hash in enumerate(block_hashes):
            holders = self._holders.get(block_hash)
            if holders is None:
                break
            alive &= holders
            if not alive:
                break
            matched = index + 1
            for worker_id in alive:
                found[worker_id] = matched
        self._touch(block_hashes[:matched])
        return found

    @property
    def num_blocks(self) -> int:
        """Distinct blocks indexed."""
        return len(self._holders)

    def num_blocks_of(self, worker_id: str) -> int:
        state = self._workers.get(worker_id)
        return 0 if state is None else len(state.blocks)

    def workers(self) -> list[str]:
        return list(self._workers)

    def seq_of(self, worker_id: str) -> int:
        """The last batch applied of ``worker_id`` (0: none, or unknown)."""
        state = self._workers.get(worker_id)
        return 0 if state is None else state.seq

    def is_synced(self, worker_id: str) -> bool:
        state = self._workers.get(worker_id)
        return state is not None and state.synced

    # ------------------------------------------------------------------ internals
    def _want(self, state: _Worker, batch: EventBatch) -> None:
        state.wanted = True
        if len(state.pending) < MAX_PENDING \
                and state.pending_ops + len(batch.ops) <= MAX_PENDING_OPS:
            state.pending.append(batch)
            state.pending_ops += len(batch.ops)

    def _apply_ops(self, worker_id: str, state: _Worker, batch: EventBatch) -> None:
        for op, block_hash in batch.ops:
            if op == STORED:
                self._store(worker_id, state, block_hash)
            else:
                self._remove(worker_id, state, block_hash)
        self._touch([h for op, h in batch.ops if op == STORED])
        state.seq = batch.seq

    def _touch(self, chain: Sequence[bytes]) -> None:
        """Mark ``chain``'s blocks most recently used, its first block last: a prefix is
        matched from its first block, so the LRU drops a chain's later blocks before the
        ones they follow (dropping the first would leave the rest unmatchable)."""
        for block_hash in reversed(chain):
            if block_hash in self._holders:
                self._holders.move_to_end(block_hash)

    def _store(self, worker_id: str, state: _Worker, block_hash: bytes) -> None:
        holders = self._holders.get(block_hash)
        if holders is None:
            holders = self._holders[block_hash] = set()
            while len(self._holders) > self.max_blocks:
                self._evict_oldest()
        else:
            self._holders.move_to_end(block_hash)
        holders.add(worker_id)
        state.blocks.add(block_hash)

    def _remove(self, worker_id: str, state: _Worker, block_hash: bytes) -> None:
        state.blocks.discard(block_hash)
        holders = self._holders.get(block_hash)
        if holders is not None:
            holders.discard(worker_id)
            if not holders:
                del self._holders[block_hash]

    def _evict_oldest(self) -> None:
        block_hash, holders = self._holders.popitem(last=False)
        for worker_id in holders:
            self._workers[worker_id].blocks.discard(block_hash)

    def _clear(self, worker_id: str) -> None:
        state = self._workers[worker_id]
        for block_hash in state.blocks:
            holders = self._holders.get(block_hash)
            if holders is not None:
                holders.discard(worker_id)
                if not holders:
                    del self._holders[block_hash]
        state.blocks = set()
