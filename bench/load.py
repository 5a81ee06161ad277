"""How much load the default ``pdserve up`` holds (issue "Hold load"), with figures.

    python -m bench.load [--levels 100,200,300,400] [--max-tokens 128] [--json out.json]

Starts ``pdserve up`` on the built-in tiny model (one prefill and one decode worker,
defaults, ``--max-inflight`` above the highest level), then for each concurrency level
opens that many streams at once (``pdserve.AsyncClient``, one channel) and counts the
requests that completed with all their tokens. While the level the issue names (300)
runs, both workers' ``grpc.health.v1`` is polled at 10 Hz and the router's queue-time
histogram is read. Then (``bench.burst``) a burst of 10× ``--burst-limit`` streams
(default 3,200 against ``--max-inflight 320``) from ``--burst-clients`` client processes
at one instant: every request must end OK or RESOURCE_EXHAUSTED, and the refusals' client
side p50/p99 are reported; single requests sent one at a time while the accepted ones still
stream measure one refusal on its own. Last, ``--lag-requests`` requests with prompts of
``--lag-words`` words at once, and the router's worst event-loop stall meanwhile
(``pdserve:router_event_loop_lag_seconds``). Prints tables and the machine facts;
``--json`` writes them.
"""

from __future__ import annotations

import argparse
import asyncio
import math
import sys
import threading
import time
import urllib.request
from collections.abc import Sequence
from typing import Any

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc
from prometheus_client.parser import text_string_to_metric_families

from bench.burst import PROBES, burst, lag_buckets, lag_burst
from bench.clusters import launched
from bench.common import format_table, machine_info, percentile, write_json
from deploy.spec import ClusterSpec
from pdserve import AsyncClient, PdserveError

PROMPT = "The quick brown fox jumps over the lazy dog"


class HealthPoller:
    """10 Hz health checks of ``addresses`` on a thread; every answer's latency."""

    def __init__(self, addresses: Sequence[str]) -> None:
        self.addresses = list(addresses)
        self.latencies_s: list[float] = []
        self.failures = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def __enter__(self) -> HealthPoller:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join(10)

    def _run(self) -> None:
        channels = [grpc.insecure_channel(a) for a in self.addresses]
        stubs = [health_pb2_grpc.HealthStub(c) for c in channels]
        while not self._stop.wait(0.1):
            for stub in stubs:
                start = time.monotonic()
                try:
                    reply = stub.Check(health_pb2.HealthCheckRequest(), timeout=10.0)
                    ok = reply.status == health_pb2.HealthCheckResponse.SERVING
                except grpc.RpcError:
                    ok = False
                self.latencies_s.append(time.monotonic() - start)
                self.failures += not ok
        for channel in channels:
            channel.close()


async def run_level(address: str, concurrency: int, max_tokens: int) -> dict[str, Any]:
    async def one(client: AsyncClient, i: int) -> str:
        tokens = 0
        try:
            async for chunk in client.generate(f"{PROMPT} {i}", max_tokens=max_tokens,
                                               ignore_eos=True, temperature=0.8, seed=i,
                                               timeout=600.0):
                tokens += len(chunk.token_ids)
        except PdserveError as exc:
            return exc.code.name
        return "ok" if tokens == max_tokens else "short"

    start = time.monotonic()
    async with AsyncClient(address) as client:
        outcomes = await asyncio.gather(*(one(client, i) for i in range(concurrency)))
    elapsed = time.monotonic() - start
    failed = [o for o in outcomes if o != "ok"]
    return {"concurrency": concurrency, "completed": len(outcomes) - len(failed),
            "failed": len(failed), "failures": sorted(set(failed)), "seconds": elapsed,
            "output_tokens_per_s": (len(outcomes) - len(failed)) * max_tokens / elapsed}


def histogram_quantile(buckets: list[tuple[float, float]], q: float) -> float:
    """Prometheus' ``histogram_quantile``: linear within the bucket that holds ``q``."""
    total = buckets[-1][1] if buckets else 0
    if not total:
        return math.nan
    rank, lower, below = q * total, 0.0, 0.0
    for bound, count in buckets:
        if count >= rank:
            if math.isinf(bound):
                return lower
            return lower + (bound - lower) * (rank - below) / max(count - below, 1e-12)
        lower, below = bound, count
    return lower


def queue_buckets(metrics_url: str) -> list[tuple[float, float]]:
    text = urllib.request.urlopen(metrics_url, timeout=10).read().decode()
    for family in text_string_to_metric_families(text):
        if family.name == "pdserve:router_queue_time_seconds":
            return sorted((float(s.labels["le"]), s.value) for s in family.samples
                          if s.name.endswith("_bucket"))
    return []


def minus(after: list[tuple[float, float]], before: list[tuple[float, float]]
          ) -> list[tuple[float, float]]:
    earlier = dict(before)
    return [(bound, count - earlier.get(bound, 0.0)) for bound, count in after]


def worst_bound(buckets: list[tuple[float, float]]) -> float:
    """The smallest bucket bound below which every observation fell."""
    total = buckets[-1][1] if buckets else 0
    return next((bound for bound, count in buckets if count >= total), math.nan)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.load", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--levels", default="100,200,300,400",
                        help="concurrency levels, comma-separated")
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--burst-limit", type=int, default=320,
                        help="the burst's router --max-inflight (the burst is 10x it)")
    parser.add_argument("--burst-clients", type=int, default=4,
                        help="client processes the burst is sent from")
    parser.add_argument("--lag-requests", type=int, default=200)
    parser.add_argument("--lag-words", type=int, default=1500)
    parser.add_argument("--json", help="write the figures here")
    args = parser.parse_args(argv)
    levels = [int(x) for x in args.levels.split(",")]
    report: dict[str, Any] = {"machine": machine_info(), "max_tokens": args.max_tokens,
                              "levels": []}
    print("starting pdserve up (tiny model, 1 prefill + 1 decode worker) ...", flush=True)
    config = ClusterSpec(port=0, http_port=0, max_inflight=max(levels) + 64,
                         router_args=("--metrics-port", "0"))
    with launched(config) as cluster:
        assert cluster.router is not None and cluster.router.ready is not None
        metrics_url = f"http://{cluster.router.ready['metrics_address']}/metrics"
        for level in levels:
            before = queue_buckets(metrics_url)
            with HealthPoller([c.address for c in cluster.workers]) as health:
                result = asyncio.run(run_level(cluster.router_address, level, args.max_tokens))
            waits = minus(queue_buckets(metrics_url), before)
            result.update(
                queue_wait_p50_ms=1000 * histogram_quantile(waits, 0.5),
                queue_wait_p99_ms=1000 * histogram_quantile(waits, 0.99),
                health_p99_ms=1000 * percentile(health.latencies_s, 99),
                health_max_ms=1000 * max(health.latencies_s),
                health_not_serving=health.failures)
            report["levels"].append(result)
            print(f"  {level:4d} streams: {result['completed']} completed, "
                  f"{result['failed']} failed in {result['seconds']:.1f}s", flush=True)
    held = [r["concurrency"] for r in report["levels"] if r["failed"] == 0]
    report["max_concurrency_without_failures"] = max(held) if held else 0
    print(f"burst: {10 * args.burst_limit} requests at --max-inflight {args.burst_limit} "
          f"from {args.burst_clients} client processes ...", flush=True)
    with launched(ClusterSpec(port=0, http_port=0, max_inflight=args.burst_limit,
                              router_args=("--metrics-port", "0"))) as cluster:
        assert cluster.router is not None and cluster.router.ready is not None
        metrics_url = f"http://{cluster.router.ready['metrics_address']}/metrics"
        lag_before = lag_buckets(metrics_url)
        outcomes, probes = burst(cluster.router_address, metrics_url, 10 * args.burst_limit,
                                 args.burst_clients, args.burst_limit)
        burst_lag = minus(lag_buckets(metrics_url), lag_before)
        print(f"long prompts: {args.lag_requests} of ~{args.lag_words} words at once ...",
              flush=True)
        lag_before = lag_buckets(metrics_url)
        completed = lag_burst(cluster.router_address, args.lag_requests, args.lag_words)
        long_lag = minus(lag_buckets(metrics_url), lag_before)
    report["event_loop_lag"] = {
        "burst_p99_ms": 1000 * histogram_quantile(burst_lag, 0.99),
        "burst_worst_below_ms": 1000 * worst_bound(burst_lag),
        "long_prompts_completed": completed,
        "long_prompts_p99_ms": 1000 * histogram_quantile(long_lag, 0.99),
        "long_prompts_worst_below_ms": 1000 * worst_bound(long_lag)}
    refused = [s for o, s in outcomes if o == "RESOURCE_EXHAUSTED"]
    report["burst"] = {
        "requests": len(outcomes), "completed": sum(o == "OK" for o, _ in outcomes),
        "refused": len(refused),
        "other": sorted({o for o, _ in outcomes} - {"OK", "RESOURCE_EXHAUSTED"}),
        "rejection_p50_ms": 1000 * percentile(refused, 50) if refused else math.nan,
        "rejection_p99_ms": 1000 * percentile(refused, 99) if refused else math.nan,
        "probes_refused": len(probes),
        "probe_rejection_p50_ms": 1000 * percentile(probes, 50) if probes else math.nan,
        "probe_rejection_p99_ms": 1000 * percentile(probes, 99) if probes else math.nan}
    rows = [[r["concurrency"], r["completed"], r["failed"], f"{r['seconds']:.1f}",
             f"{r['output_tokens_per_s']:.0f}", f"{r['queue_wait_p50_ms']:.1f}",
             f"{r['queue_wait_p99_ms']:.1f}", f"{r['health_p99_ms']:.1f}",
             f"{r['health_max_ms']:.1f}"] for r in report["levels"]]
    print(format_table(rows, ["streams", "completed", "failed", "seconds", "tok/s",
                              "queue p50 ms", "queue p99 ms", "health p99 ms",
                              "health max ms"]))
    b = report["burst"]
    print(f"highest concurrency with zero failures: {report['max_concurrency_without_failures']}")
    print(f"burst: {b['completed']} completed, {b['refused']} refused "
          f"(RESOURCE_EXHAUSTED p50 {b['rejection_p50_ms']:.1f} ms, p99 "
          f"{b['rejection_p99_ms']:.1f} ms, all {b['refused']} sent at once), other outcomes: "
          f"{b['other'] or 'none'}")
    print(f"one request at a time while full: {b['probes_refused']} of {PROBES} refused "
          f"(RESOURCE_EXHAUSTED p50 {b['probe_rejection_p50_ms']:.1f} ms, "
          f"p99 {b['probe_rejection_p99_ms']:.1f} ms)")
    lag = report["event_loop_lag"]
    print(f"router event-loop lag: during the burst p99 {lag['burst_p99_ms']:.1f} ms, worst "
          f"< {lag['burst_worst_below_ms']:.0f} ms; during {args.lag_requests} long prompts "
          f"({lag['long_prompts_completed']} completed) p99 {lag['long_prompts_p99_ms']:.1f} ms, "
          f"worst < {lag['long_prompts_worst_below_ms']:.0f} ms")
    print(f"machine: {report['machine']}")
    if args.json:
        write_json(args.json, report)
    return 0


if __name__ == "__main__":
    sys.exit(main())
