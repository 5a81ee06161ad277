"""The router's Prometheus metrics (prometheus-client), one registry per ``Router``.

Names are ``pdserve:router_*`` (vLLM has no router; the workers export vLLM's names).
Latencies are what the client sees from the router: time to first token, the gaps between
streamed chunks, end-to-end, and the time a request waited in the router's queue.
``render()`` is the exposition the HTTP API serves on ``/metrics`` (and ``--metrics-port``).

- ``pdserve:router_time_to_first_token_seconds``, ``..._inter_token_latency_seconds``,
  ``..._e2e_request_latency_seconds``, ``..._queue_time_seconds`` (histograms);
- ``pdserve:router_requests_total{status, finish_reason}``: finished requests by their final
  gRPC status name (OK, CANCELLED, ...) and finish reason ("" unless OK);
- ``pdserve:router_rejections_total{limit}``: refused at admission (max_inflight,
  max_queued_tokens, invalid, deadline, unavailable);
- ``pdserve:router_attempts_total``, ``pdserve:router_retries_total{cause}``: handoff
  attempts, and the ones that failed before the first token and were retried, by cause
  (reserve, prefill, generate, worker_left, health, busy);
- ``pdserve:router_routed_total{role, worker}``: calls placed on each worker;
- ``pdserve:router_prompt_tokens_total``, ``..._generation_tokens_total``,
  ``..._cached_tokens_total``: over finished requests;
- a request of n > 1 choices is one request (its prompt counted once, its time to first
  token and latency choice 0's); its generation tokens and gaps are every choice's;
- ``pdserve:router_requests_running``, ``pdserve:router_requests_waiting`` (gauges);
- ``pdserve:migrations_total{cause}``: streams continued on another decode worker after
  theirs failed mid-stream (cause: ``died`` — the call failed —, ``health``, ``draining``,
  ``ended`` — the stream ended without a finish reason); ``pdserve:migration_stall_seconds``
  (histogram): the gap a migration left between the tokens around it, as the router saw it;
- ``pdserve:kv_moves_total{outcome}``: migrations a draining decode worker offered to move
  with their KV (``cluster.moves``): ``moved`` (its KV went to the next decode worker, no
  token recomputed) or ``replayed`` (the move failed or was not possible: replayed);
- ``pdserve:router_resumed_streams_total``: broken streams their clients resumed here
  (``GenerateRequest.resume``, ``router.resume``);
- ``pdserve:router_decisions_total{kind, reason}``: routing decisions (kind ``prefill`` or
  ``decode``) by why the first choice won: ``kv_hit`` (the KV index said it holds the
  longest prefix), ``kv_cost`` (the index was used and it had the least predicted work),
  ``affinity``, ``round_robin``, ``index_stale`` (kv-aware without a trusted index: it
  fell back to affinity), ``load``; conditional disaggregation's prefills on the decode
  worker: ``local_short_tail``, ``local_queue_wait`` (``router.lifecycle.conditional``;
  also when, the decode worker reserved, no prefill worker was worth asking),
  ``local_queue_refused`` (its prefill worker refused it: ``cluster.prefill_queue``);
- ``pdserve:router_queue_refusals_total{limit}``: Prefills a prefill worker refused for its
  queue (``cluster.prefill_queue``), by the limit it was over: ``bound``, what this
  router's choice assumed of it (``router.policy.queue_bounds``), or ``local``, the queue
  rule's local side (``router.lifecycle.prefill``);
- ``pdserve:router_prefix_waits_total{outcome}``: requests that waited for a prompt on its
  way to a decode worker that covers theirs but a short tail (``router.lifecycle.coalesce``),
  ``landed`` or ``timeout``;
- ``pdserve:router_kv_events_total{outcome}``: KV event batches read (``router.kv_index``'s
  outcomes; bad ones: ``malformed``, ``hash_length``, ``op``, ``unknown_worker``,
  ``epoch_backwards``), ``pdserve:router_kv_resyncs_total``: snapshots loaded,
  ``pdserve:router_kv_index_blocks`` (gauge): distinct blocks indexed,
  ``pdserve:router_kv_index_worker_blocks{worker}`` (gauge): blocks indexed per worker,
  ``pdserve:router_kv_index_trusted`` (gauge): 1 while routing uses the index, 0 while
  it falls back to affinity (the stream unread for 10 s),
  ``pdserve:router_kv_event_lag_seconds`` (histogram): publish to apply;
- ``pdserve:router_event_loop_lag_seconds`` (histogram): how much later than asked the
  router's event loop ran a task that wakes every 50 ms (``router.loop_lag``): its stalls;
- ``pdserve:router_worker_prefill_rate{worker}`` (gauge): the prompt tokens per second each
  worker last reported computing (``worker.prefill_rate``; kv-aware routing's speeds).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.core import GaugeMetricFamily
from prometheus_client.exposition import CONTENT_TYPE_LATEST
from prometheus_client.registry import Collector

LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0,
                   120.0, 300.0, 600.0)
GAP_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0)
LAG_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0)


class RouterMetrics:
    """Every metric of one router (see module doc)."""

    def __init__(self, registry: CollectorRegistry | None = None) -> None:
        self.registry = registry or CollectorRegistry()
        r, p = self.registry, "pdserve:router_"
        self.ttft = Histogram(p + "time_to_first_token_seconds",
                              "Request received to first token sent", registry=r,
                              buckets=LATENCY_BUCKETS)
        self.itl = Histogram(p + "inter_token_latency_seconds",
                             "Gap between consecutive chunks sent to a client", registry=r,
                             buckets=GAP_BUCKETS)
        self.e2e = Histogram(p + "e2e_request_latency_seconds",
                             "Request received to its last chunk sent", registry=r,
                             buckets=LATENCY_BUCKETS)
        self.queue = Histogram(p + "queue_time_seconds",
                               "Time a request waited in the router's queue", registry=r,
                               buckets=LATENCY_BUCKETS)
        self.requests = Counter(p + "requests", "Finished requests",
                                ["status", "finish_reason"], registry=r)
        self.rejections = Counter(p + "rejections", "Requests refused at admission",
                                  ["limit"], registry=r)
        self.attempts = Counter(p + "attempts", "Handoff attempts", registry=r)
        self.retries = Counter(p + "retries", "Attempts retried before the first token",
                               ["cause"], registry=r)
        self.routed = Counter(p + "routed", "Calls placed on a worker", ["role", "worker"],
                              registry=r)
        self.prompt_tokens = Counter(p + "prompt_tokens", "Prompt tokens of finished requests",
                                     registry=r)
        self.generation_tokens = Counter(p + "generation_tokens",
                                         "Tokens generated for finished requests", registry=r)
        self.cached_tokens = Counter(p + "cached_tokens",
                                     "Prompt tokens served from a prefix cache", registry=r)
        self.running = Gauge(p + "requests_running", "Requests placed on workers", registry=r)
        self.waiting = Gauge(p + "requests_waiting", "Requests in the router's queue",
                             registry=r)
        self.migrations = Counter("pdserve:migrations",
                                  "Streams continued on another decode worker mid-stream",
                                  ["cause"], registry=r)
        self.resumes = Counter(p + "resumed_streams",
                               "Broken streams resumed here by their clients", registry=r)
        self.kv_moves = Counter("pdserve:kv_moves", "Migrations offered a planned move by a "
                                "draining decode worker, by outcome", ["outcome"], registry=r)
        self.migration_stall = Histogram("pdserve:migration_stall_seconds",
                                         "Gap between the tokens around a migration",
                                         registry=r, buckets=LATENCY_BUCKETS)
        self.decisions = Counter(p + "decisions", "Routing decisions by why the first "
                                 "choice won", ["kind", "reason"], registry=r)
        self.queue_refusals = Counter(p + "queue_refusals", "Prefills refused for the prefill "
                                      "worker's queue, by the limit it was over", ["limit"],
                                      registry=r)
        self.prefix_waits = Counter(p + "prefix_waits", "Requests that waited for a prompt "
                                    "in flight covering theirs, by outcome", ["outcome"],
                                    registry=r)
        self.kv_events = Counter(p + "kv_events", "KV event batches read, by outcome",
                                 ["outcome"], registry=r)
        self.kv_resyncs = Counter(p + "kv_resyncs", "KV index snapshots loaded", registry=r)
        self.kv_index_blocks = Gauge(p + "kv_index_blocks", "Distinct blocks in the KV index",
                                     registry=r)
        self.kv_worker_blocks = Gauge(p + "kv_index_worker_blocks",
                                      "Blocks the KV index says a worker holds", ["worker"],
                                      registry=r)
        self.kv_index_trusted = Gauge(p + "kv_index_trusted",
                                      "1 while kv-aware routing trusts its KV index",
                                      registry=r)
        self.kv_event_lag = Histogram(p + "kv_event_lag_seconds",
                                      "KV event batch published to applied", registry=r,
                                      buckets=LAG_BUCKETS)
        self.loop_lag = Histogram(p + "event_loop_lag_seconds",
                                  "How much later than asked the event loop woke a task",
                                  registry=r, buckets=LAG_BUCKETS)

    def watch_rates(self, read: Callable[[], Mapping[str, float]]) -> None:
        """Export ``pdserve:router_worker_prefill_rate{worker}``: at each scrape, the
        prefill rates (prompt tokens per second) ``read()`` returns, as workers reported
        them (``WorkerPool.reported_rates``)."""
        self.registry.register(_RatesCollector(read))

    def render(self) -> tuple[bytes, str]:
        """The text exposition and its content type."""
        return generate_latest(self.registry), CONTENT_TYPE_LATEST


class _RatesCollector(Collector):
    """``RouterMetrics.watch_rates``'s gauge, read at scrape time."""

    def __init__(self, read: Callable[[], Mapping[str, float]]) -> None:
        self._read = read

    def collect(self) -> Iterator[GaugeMetricFamily]:
        family = GaugeMetricFamily("pdserve:router_worker_prefill_rate",
                                   "Prompt tokens per second a worker last reported "
                                   "computing (kv-aware routing's speeds)", labels=["worker"])
        for worker_id, rate in sorted(self._read().items()):
            family.add_metric([worker_id], rate)
        yield family
