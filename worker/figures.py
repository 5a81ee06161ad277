"""``LoopFigures``: what an engine loop reports of itself — the metrics' snapshot of its
gauges and data-plane totals, the preemption counter, ``Info``, and the prefill rate its
steps ran at (``worker.prefill_rate``, timed in ``step``) — computed on the loop thread
from the engine, the KV plane and the loop's own counters."""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import TYPE_CHECKING

from worker.commands import LoopInfo
from worker.leases import LeaseBook
from worker.metrics import Snapshot, WorkerMetrics
from worker.prefill_rate import PrefillRate

if TYPE_CHECKING:
    from engine.core.engine_core import EngineCore, RequestOutput
    from worker.kv.plane import KVPlane
    from worker.kv.reports import RankTotals

SNAPSHOT_S = 0.25  # how often the metrics' gauges are refreshed (while the loop runs)
TOTALS_S = 1.0  # ... and the data plane's totals (a call to every rank)


class LoopFigures:
    """The figures of one loop over ``core`` and ``kv`` (the loop thread only)."""

    def __init__(self, core: EngineCore, kv: KVPlane, metrics: WorkerMetrics) -> None:
        self.core, self.kv, self.metrics = core, kv, metrics
        self._snapshot_at = self._totals_at = 0.0
        self._totals: RankTotals | None = None
        self._counted: dict[str, int] = {}  # the scheduler's totals already counted
        # measured on its steps of half its token budget in prompt tokens or more
        self.prefill_rate = PrefillRate(core.config.scheduler.max_num_batched_tokens // 2)
        # the last snapshot was taken idle, with the ranks' totals, and nothing ran since
        self.settled = False

    def step(self, prefill: bool) -> list[RequestOutput]:
        """One engine step; while the loop serves ``prefill``, its time measured into
        ``prefill_rate`` (else the rate is forgotten: a decode step's figure is not one)."""
        started = time.monotonic()
        outputs = self.core.step()
        if prefill:
            self.prefill_rate.add(self.core.last_step_prompt_tokens, time.monotonic() - started)
        elif self.prefill_rate.tokens_per_s:
            self.prefill_rate.reset()
        return outputs

    def due(self, idle: bool) -> bool:
        """Whether to refresh now: the snapshot is older than ``SNAPSHOT_S``, or the loop
        goes ``idle`` after work (then the snapshot is what the loop leaves, until its
        next work: a scrape of an idle worker reads its final figures)."""
        return time.monotonic() - self._snapshot_at >= SNAPSHOT_S or idle and not self.settled

    def refresh(self, num_unadmitted: int, idle: bool = False) -> None:
        """The gauges' snapshot (the ranks' totals every ``TOTALS_S``, and whenever
        ``idle``) and the scheduler's counters (preemptions, speculative decoding's guesses
        and those kept); ``num_unadmitted``: requests held that the
        scheduler does not count yet."""
        now = self._snapshot_at = time.monotonic()
        self.settled = idle
        if self._totals is None or idle or now - self._totals_at >= TOTALS_S:
            self._totals, self._totals_at = self.kv.rank_totals(), now
        sched, kv, totals = self.core.scheduler, self.core.kv_usage(), self._totals
        self.metrics.snapshot = Snapshot(
            running=len(sched.running), waiting=len(sched.waiting) + num_unadmitted,
            kv_usage=(kv.in_use + kv.pinned) / kv.total if kv.total else 0.0,
            pinned_blocks=kv.pinned, open_channels=totals.open_channels,
            bytes_sent=totals.bytes_sent, bytes_received=totals.bytes_received,
            checksum_failures=totals.checksum_failures, unexpected_acks=totals.unexpected_acks)
        m, stats = self.metrics, sched.stats
        for name, counter in (("num_preemptions", m.preemptions),
                              ("num_draft_tokens", m.draft_tokens),
                              ("num_accepted_tokens", m.accepted_tokens)):
            total, seen = getattr(stats, name), self._counted.get(name, 0)
            if total > seen:
                m.label(counter).inc(total - seen)
                self._counted[name] = total

    def info(self, *, live_ids: Sequence[str], num_unadmitted: int, num_expired: int,
             num_expired_commands: int, queued_commands: int, leases: LeaseBook) -> LoopInfo:
        """The loop's state for ``Info`` (and the leak checks): asks every rank."""
        totals = self.kv.rank_totals()
        sched = self.core.scheduler
        return LoopInfo(
            kv=self.core.kv_usage(), pending_transfers=self.kv.num_pending + totals.pending,
            open_kv_channels=totals.open_channels, running=len(sched.running),
            waiting=len(sched.waiting) + num_unadmitted,
            num_preemptions=sched.stats.num_preemptions, num_expired=num_expired,
            num_started=sched.stats.num_started, num_failed_transfers=self.kv.num_failed,
            attempt_ids=tuple(live_ids), watched_leases=len(leases),
            queued_commands=queued_commands, num_lease_aborts=leases.num_aborted,
            num_expired_commands=num_expired_commands,
            num_unexpected_acks=totals.unexpected_acks)
