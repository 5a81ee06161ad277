"""A worker's Prometheus metrics (prometheus-client), exported once per worker (its rank 0).

vLLM's names and meanings where a worker has the same thing — so dashboards, KEDA scalers
and llm-d's scheduler built for vLLM read them unchanged — every one labelled
``model_name``:

- ``vllm:num_requests_running``, ``vllm:num_requests_waiting`` (gauges): in the running
  batch; queued (decode: also reserved and waiting for KV);
- ``vllm:kv_cache_usage_perc`` (gauge, 0..1): KV blocks in use or pinned, of all;
- ``vllm:prefix_cache_queries_total``, ``vllm:prefix_cache_hits_total``: prompt tokens
  looked up in the prefix cache, and found, where prompts are computed;
- ``vllm:num_preemptions_total``;
- ``vllm:spec_decode_num_draft_tokens_total``, ``vllm:spec_decode_num_accepted_tokens_total``:
  tokens guessed by speculative decoding (``--speculative-config``), and of those kept;
- ``vllm:prompt_tokens_total`` (prompt tokens computed here), ``vllm:generation_tokens_total``
  (tokens generated here: a prefill worker's first tokens, a decode worker's stream);
- ``vllm:time_to_first_token_seconds``, ``vllm:inter_token_latency_seconds``,
  ``vllm:e2e_request_latency_seconds`` (histograms, as this worker sees them: from when it
  got the request — a prefill worker's Prefill, a decode worker's Reserve or local prefill);
- ``vllm:request_success_total{finished_reason}``: requests this worker finished.

pdserve's own, under ``pdserve:``: ``pdserve:kv_transfers_total{direction, outcome}``
(sent/received, ok/failed), ``pdserve:kv_transfer_bytes_total{direction}``,
``pdserve:kv_transfer_seconds{direction}`` (sent: last layer computed → every receiving
rank acknowledged; received: reservation → KV verified on every rank) — labelled by the
direction of the transfer, not by the worker's role: any worker may send and receive —
``pdserve:kv_checksum_failures_total``,
``pdserve:kv_unexpected_acks_total`` (acknowledgements a sender counted and ignored),
``pdserve:prefill_queue_seconds`` (histogram: a prefill's wait from its arrival to its
first chunk's step, a decode worker's local prefills' too; what the planner watches),
``pdserve:kv_blocks_reused_total`` (prompt blocks a decode worker's prefix cache held
at a reservation, so the sender skipped them), ``pdserve:kv_pinned_blocks``,
``pdserve:kv_open_channels`` (gauges), and
``pdserve:worker_info{role, worker_id}`` (1; the role follows a live switch).

Thread model: the engine-loop thread records events (prometheus-client metrics are
thread-safe); gauges and the data plane's totals are read from a snapshot the loop
refreshes (``snapshot``), never by calling into the loop from the scrape.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.exposition import CONTENT_TYPE_LATEST
from prometheus_client.registry import Collector

LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0,
                   120.0, 300.0)
DIRECTIONS = ("sent", "received")  # the label of a KV transfer's direction
GAP_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0)


@dataclass(frozen=True)
class Snapshot:
    """What the loop last saw of itself (for gauges and the data plane's totals)."""

    running: int = 0
    waiting: int = 0
    kv_usage: float = 0.0
    pinned_blocks: int = 0
    open_channels: int = 0
    bytes_sent: int = 0
    bytes_received: int = 0
    checksum_failures: int = 0
    unexpected_acks: int = 0


class _Live(Collector):
    """Gauges and totals from the latest ``Snapshot``."""

    def __init__(self, metrics: WorkerMetrics) -> None:
        self._m = metrics

    def collect(self) -> Iterable[Any]:
        s, labels, m = self._m.snapshot, [self._m.model_name], self._m
        for name, doc, value in (
                ("vllm:num_requests_running", "Requests in the running batch", s.running),
                ("vllm:num_requests_waiting", "Requests waiting", s.waiting),
                ("vllm:kv_cache_usage_perc", "Fraction of KV blocks used (1 = full)", s.kv_usage),
                ("pdserve:kv_pinned_blocks", "KV blocks pinned for transfers", s.pinned_blocks),
                ("pdserve:kv_open_channels", "Open KV channels, all ranks", s.open_channels)):
            family = GaugeMetricFamily(name, doc, labels=["model_name"])
            family.add_metric(labels, value)
            yield family
        moved = CounterMetricFamily("pdserve:kv_transfer_bytes", "KV payload bytes moved",
                                    labels=["model_name", "direction"])
        moved.add_metric([m.model_name, "sent"], s.bytes_sent)
        moved.add_metric([m.model_name, "received"], s.bytes_received)
        yield moved
        failures = CounterMetricFamily("pdserve:kv_checksum_failures",
                                       "KV parts that arrived corrupted", labels=["model_name"])
        failures.add_metric(labels, s.checksum_failures)
        yield failures
        acks = CounterMetricFamily("pdserve:kv_unexpected_acks",
                                   "KV acknowledgements ignored (duplicate, late, unknown)",
                                   labels=["model_name"])
        acks.add_metric(labels, s.unexpected_acks)
        yield acks


class WorkerMetrics:
    """Every metric of one worker (see module doc)."""

    def __init__(self, model_name: str, role: str, worker_id: str,
                 registry: CollectorRegistry | None = None) -> None:
        self.model_name = model_name
        self.registry = registry or CollectorRegistry()
        self.snapshot = Snapshot()
        r, labels = self.registry, ["model_name"]

        def counter(name: str, doc: str, extra: tuple[str, ...] = ()) -> Counter:
            return Counter(name, doc, [*labels, *extra], registry=r)

        def histogram(name: str, doc: str, buckets: tuple[float, ...],
                      extra: tuple[str, ...] = ()) -> Histogram:
            return Histogram(name, doc, [*labels, *extra], registry=r, buckets=buckets)

        self.prefix_queries = counter("vllm:prefix_cache_queries", "Prompt tokens looked up")
        self.prefix_hits = counter("vllm:prefix_cache_hits", "Prompt tokens found cached")
        self.preemptions = counter("vllm:num_preemptions", "Requests preempted")
        self.draft_tokens = counter("vllm:spec_decode_num_draft_tokens",
                                    "Tokens guessed by speculative decoding")
        self.accepted_tokens = counter("vllm:spec_decode_num_accepted_tokens",
                                       "Tokens guessed by speculative decoding and kept")
        self.prompt_tokens = counter("vllm:prompt_tokens", "Prompt tokens computed")
        self.generation_tokens = counter("vllm:generation_tokens", "Tokens generated")
        self.success = counter("vllm:request_success", "Requests finished",
                               ("finished_reason",))
        self.ttft = histogram("vllm:time_to_first_token_seconds", "Request to first token",
                              LATENCY_BUCKETS)
        self.itl = histogram("vllm:inter_token_latency_seconds", "Gap between tokens",
                             GAP_BUCKETS)
        self.e2e = histogram("vllm:e2e_request_latency_seconds", "Request to its end",
                             LATENCY_BUCKETS)
        self.transfers = counter("pdserve:kv_transfers", "KV transfers ended",
                                 ("direction", "outcome"))
        self.transfer_seconds = histogram("pdserve:kv_transfer_seconds", "KV transfer time",
                                          LATENCY_BUCKETS, ("direction",))
        self.prefill_queue = histogram("pdserve:prefill_queue_seconds",
                                       "Prefill: received to its first chunk scheduled",
                                       LATENCY_BUCKETS)
        self.blocks_reused = counter(
            "pdserve:kv_blocks_reused",
            "Prompt KV blocks a decode worker's prefix cache held, so were not transferred")
        for metric in (self.prefix_queries, self.prefix_hits, self.preemptions,
                       self.draft_tokens, self.accepted_tokens, self.prompt_tokens,
                       self.generation_tokens, self.ttft, self.itl, self.e2e,
                       self.blocks_reused, self.prefill_queue):
            metric.labels(model_name)  # exported (at 0) before the first event
        for reason in ("stop", "length", "prefilled"):
            self.success.labels(model_name, reason)
        for direction in DIRECTIONS:
            for outcome in ("ok", "failed"):
                self.transfers.labels(model_name, direction, outcome)
            self.transfer_seconds.labels(model_name, direction)
        self._info = Gauge("pdserve:worker_info", "This worker (its role as it serves now)",
                           [*labels, "role", "worker_id"], registry=r)
        self.worker_id, self.role = worker_id, role
        self._info.labels(model_name, role, worker_id).set(1)
        self.registry.register(_Live(self))

    def set_role(self, role: str) -> None:
        """The worker serves ``role`` now: ``pdserve:worker_info`` follows (one series)."""
        if role == self.role:
            return
        self._info.remove(self.model_name, self.role, self.worker_id)
        self.role = role
        self._info.labels(self.model_name, role, self.worker_id).set(1)

    def label(self, metric: Any, *extra: str) -> Any:
        return metric.labels(self.model_name, *extra)

    def transfer(self, direction: str, ok: bool, seconds: float | None) -> None:
        """A KV transfer of this worker ended (``direction``: "sent" or "received")."""
        self.label(self.transfers, direction, "ok" if ok else "failed").inc()
        if ok and seconds is not None:
            self.label(self.transfer_seconds, direction).observe(seconds)

    def kv_blocks_reused(self, num_blocks: int) -> None:
        """A reservation took ``num_blocks`` prompt blocks from the prefix cache."""
        if num_blocks:
            self.label(self.blocks_reused).inc(num_blocks)

    def render(self) -> tuple[bytes, str]:
        """The text exposition and its content type."""
        return generate_latest(self.registry), CONTENT_TYPE_LATEST


class RequestTimings:
    """Each request's times on this worker, feeding the latency histograms and the token
    and success counters (the loop thread only)."""

    def __init__(self, metrics: WorkerMetrics,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self._m = metrics
        self._clock = clock
        self._times: dict[str, list[float | None]] = {}  # rid -> [received_at, last_token_at]

    def received(self, request_id: str) -> None:
        self._times[request_id] = [self._clock(), None]

    def prompt(self, num_prompt_tokens: int, num_cached_tokens: int) -> None:
        """A prompt was computed here (``num_cached_tokens`` of it from the prefix cache)."""
        m = self._m
        m.label(m.prompt_tokens).inc(num_prompt_tokens)
        m.label(m.prefix_queries).inc(num_prompt_tokens)
        m.label(m.prefix_hits).inc(num_cached_tokens)

    def output(self, request_id: str, num_tokens: int, finished_reason: str | None) -> None:
        """``num_tokens`` more tokens of the request, and its end when ``finished_reason``."""
        times = self._times.get(request_id)
        if times is None:
            return
        m, now = self._m, self._clock()
        received_at, last = times
        assert received_at is not None
        if num_tokens:
            m.label(m.generation_tokens).inc(num_tokens)
            if last is None:
                m.label(m.ttft).observe(now - received_at)
            else:
                m.label(m.itl).observe(now - last)
            times[1] = now
        if finished_reason is not None:
            m.label(m.e2e).observe(now - received_at)
            m.label(m.success, finished_reason).inc()
            del self._times[request_id]

    def forget(self, request_id: str) -> None:
        """The request ended without finishing (aborted, failed)."""
        self._times.pop(request_id, None)
