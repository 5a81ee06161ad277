"""Clusters the serving benchmarks start on this machine, and the load they send them.

A cluster is ``pdserve up`` as a library (``deploy.local.LocalLauncher``) on
loopback with free ports, no HTTP API, its logs in a temporary folder (``log_folder``:
removed when the benchmark is done with it, kept and named when it fails). The load goes
through ``bench.serving`` over gRPC.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import shutil
import signal
import sys
import tempfile
import threading
import time
import urllib.request
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import replace
from pathlib import Path
from typing import Any

from bench.serving import GrpcBackend, run
from deploy.local import LocalLauncher
from deploy.spec import ClusterSpec
from loadtest.workloads import Request
from sim.metrics import Outcome


class Terminated(SystemExit):
    """SIGTERM arrived while a benchmark cluster ran (``log_folder``): the exit status is
    a SIGTERM'd process's, 143."""

    def __init__(self) -> None:
        super().__init__(128 + signal.SIGTERM)


@contextlib.contextmanager
def log_folder() -> Iterator[Path]:
    """A temporary folder for one benchmark cluster's logs (``ClusterSpec.log_dir``):
    removed when the block ends, kept when it raises (its path on stderr, for the
    post-mortem), so benchmarks and the tests that run them leave nothing behind.

    SIGTERM in the block raises ``Terminated`` (where the main thread's handler for it is
    still the default), as Ctrl-C raises ``KeyboardInterrupt``: the blocks around unwind,
    so the cluster is stopped the way ``LocalLauncher`` stops it (the Redis URL and a
    generated cluster token removed from the folder, the logs kept and named)."""
    path = Path(tempfile.mkdtemp(prefix="pdserve-bench-"))
    with _sigterm_raises():
        try:
            yield path
        except BaseException:
            print(f"the cluster's logs are kept in {path}", file=sys.stderr)
            raise
    shutil.rmtree(path, ignore_errors=True)


@contextlib.contextmanager
def _sigterm_raises() -> Iterator[None]:
    """SIGTERM raises ``Terminated`` in the main thread while the block runs, unless the
    program handles SIGTERM itself (or this is not the main thread)."""
    if (threading.current_thread() is not threading.main_thread()
            or signal.getsignal(signal.SIGTERM) is not signal.SIG_DFL):
        yield
        return

    def terminated(signum: int, frame: object) -> None:
        signal.signal(signal.SIGTERM, signal.SIG_DFL)  # a second SIGTERM kills at once
        raise Terminated

    signal.signal(signal.SIGTERM, terminated)
    try:
        yield
    finally:
        if signal.getsignal(signal.SIGTERM) is terminated:
            signal.signal(signal.SIGTERM, signal.SIG_DFL)


@contextlib.contextmanager
def launched(spec: ClusterSpec) -> Iterator[LocalLauncher]:
    """``spec`` running (``LocalLauncher``, no progress lines), its logs in a
    ``log_folder``; stopped, and the folder gone, when the block ends."""
    with log_folder() as logs, LocalLauncher(replace(spec, log_dir=logs),
                                             progress=lambda line: None) as running:
        yield running


def bench_model(quick: bool) -> Path:
    """The 55M-parameter ``bench55m`` Llama, or (``quick``) the built-in tiny model."""
    if quick:
        from engine.testing.tiny_model import ensure_demo_model

        return Path(ensure_demo_model())
    from bench.engine import ensure_bench_model

    return ensure_bench_model()


def two_cpus() -> tuple[int, int]:
    """The first and last CPU this process may use (the two cores a comparison pins)."""
    cpus = sorted(os.sched_getaffinity(0))
    if len(cpus) < 2:
        raise SystemExit(f"this benchmark pins two processes to two cores; only CPUs {cpus} "
                         "are available")
    return cpus[0], cpus[-1]


@contextlib.contextmanager
def cluster(model_dir: Path, *, num_prefill: int, num_decode: int,
            local_prefill: str = "never", cpu_affinity: Mapping[str, tuple[int, ...]] | None = None,
            num_kv_blocks: int | None = None, router_args: Sequence[str] = (),
            worker_args: Sequence[str] = (), num_routers: int = 1,
            planner_args: Sequence[str] | None = None,
            decode_args: Sequence[str] = ()) -> Iterator[LocalLauncher]:
    """A running ``LocalLauncher`` of these processes (stopped on exit); with
    ``planner_args``, the planner too; ``decode_args``: the decode workers' own flags."""
    with launched(ClusterSpec(
        model_dir=model_dir, num_prefill=num_prefill, num_decode=num_decode, port=0,
        http_port=None, local_prefill=local_prefill, cpu_affinity=dict(cpu_affinity or {}),
        num_kv_blocks=num_kv_blocks, router_args=tuple(router_args),
        worker_args=tuple(worker_args), decode_args=tuple(decode_args), max_inflight=4096,
        num_routers=num_routers,
        planner_args=None if planner_args is None else tuple(planner_args))) as running:
        yield running


def describe(running: LocalLauncher) -> dict[str, Any]:
    """What a reader needs to check two arms differ only where they should: each process,
    its CPUs and threads, and the workers' and router's flags."""
    cfg = running.spec
    processes = {}
    for name in [*cfg.worker_names, "router"]:
        cpus = cfg.cpu_affinity.get(name)
        processes[name] = {
            "cpus": list(cpus) if cpus else "unpinned (any)",
            "torch_threads": int(running.child_env(cpus)["OMP_NUM_THREADS"]) if name != "router"
            else None}
    return {"processes": processes, "local_prefill": cfg.local_prefill,
            "num_kv_blocks_per_worker": cfg.num_kv_blocks, "worker_args": list(cfg.worker_args),
            "decode_args": list(cfg.decode_args), "router_args": list(cfg.router_args)}


def send(address: str, requests: Sequence[Request], *, request_rate: float, seed: int = 0,
         max_concurrency: int | None = None,
         limit_s: Callable[[Request], float] | None = None) -> tuple[list[Outcome], float]:
    """``requests`` to the router at ``address`` (Poisson arrivals at ``request_rate``;
    ``limit_s`` as for ``bench.serving.run``)."""

    async def go() -> tuple[list[Outcome], float]:
        backend = GrpcBackend(address)
        try:
            return await run(backend, requests, request_rate=request_rate, seed=seed,
                             max_concurrency=max_concurrency, limit_s=limit_s)
        finally:
            await backend.close()

    return asyncio.run(go())


def one_by_one(address: str, requests: Sequence[Request]) -> list[Outcome]:
    """Each request alone (the next is sent once the last finished): unloaded latencies."""
    outcomes, _ = send(address, requests, request_rate=float("inf"), max_concurrency=1)
    return outcomes


def prefill_counters(running: LocalLauncher) -> tuple[dict[str, float], float]:
    """(prompt tokens each prefill worker computed so far, not served from its cache; KV
    bytes the prefill workers sent), from their metrics (``--metrics-port``)."""
    computed: dict[str, float] = {}
    sent = 0.0
    for worker in running.workers:
        if not worker.name.startswith("prefill") or worker.ready is None:
            continue
        url = f"http://{worker.ready['metrics_address']}/metrics"
        value = 0.0
        for line in urllib.request.urlopen(url, timeout=10).read().decode().splitlines():
            number = line.rsplit(" ", 1)[-1]
            if line.startswith("vllm:prompt_tokens_total"):  # every prompt token ...
                value += float(number)
            elif line.startswith("vllm:prefix_cache_hits_total"):  # ... less the cached
                value -= float(number)
            elif line.startswith("pdserve:kv_transfer_bytes_total") and '"sent"' in line:
                sent += float(number)
        computed[worker.name] = value
    return computed, sent


def settled_prefill_counters(running: LocalLauncher, tries: int = 20, pause_s: float = 0.05
                             ) -> tuple[dict[str, float], float]:
    """``prefill_counters`` once two reads ``pause_s`` apart agree (at most ``tries``): a
    worker refreshes its ranks' totals as its loop goes idle, just after a request ends."""
    last = prefill_counters(running)
    for _ in range(tries):
        time.sleep(pause_s)
        if (now := prefill_counters(running)) == last:
            break
        last = now
    return last
