"""The bursts of ``bench.load``: far more requests at once than the router admits, and many
long prompts at once.

``burst``: ``total`` streams (256 tokens each) from ``clients`` client processes, one
channel each, all released at one instant; every answer's status and seconds. The router
admits ``--max-inflight`` of them; the rest must be refused (RESOURCE_EXHAUSTED) at once —
never CANCELLED or anything else. While the admitted ones still stream, ``PROBES`` single
requests one after another measure a refusal on its own.

``lag_burst``: ``n`` requests with prompts of about ``words`` words each, at once, and the
router's event-loop lag meanwhile (``pdserve:router_event_loop_lag_seconds``): how long
tokenising a burst of long prompts stalls the loop every other request runs on.
"""

from __future__ import annotations

import asyncio
import multiprocessing as mp
import time
import urllib.request
from multiprocessing.connection import Connection
from typing import Any

import grpc
from prometheus_client.parser import text_string_to_metric_families

from pdserve import AsyncClient, PdserveError
from pdserve.v1 import generate_pb2, generate_pb2_grpc

PROMPT = "The quick brown fox jumps over the lazy dog"
PROBES = 100  # single refused requests sent one after another while the router is full
BURST_TOKENS = 256


async def _streams(address: str, n: int, first: int, start_at: float) -> list[tuple[str, float]]:
    """``n`` streams on one channel, sent at wall-clock ``start_at``: (status, seconds)."""
    async def one(stub: generate_pb2_grpc.GenerationStub, i: int) -> tuple[str, float]:
        request = generate_pb2.GenerateRequest(text=f"{PROMPT} {i}", sampling=generate_pb2.
                                               SamplingParams(max_tokens=BURST_TOKENS,
                                                              temperature=0.0, top_p=1.0,
                                                              top_k=-1, ignore_eos=True))
        start = time.monotonic()
        try:
            async for _ in stub.Generate(request, timeout=600.0):
                pass
        except grpc.aio.AioRpcError as exc:
            return exc.code().name, time.monotonic() - start
        return "OK", time.monotonic() - start

    async with grpc.aio.insecure_channel(address) as channel:
        await channel.channel_ready()
        stub = generate_pb2_grpc.GenerationStub(channel)
        await asyncio.sleep(max(0.0, start_at - time.time()))
        return list(await asyncio.gather(*(one(stub, first + i) for i in range(n))))


def _client_main(address: str, n: int, first: int, start_at: float, conn: Connection) -> None:
    conn.send(asyncio.run(_streams(address, n, first, start_at)))
    conn.close()


async def _probes(address: str) -> list[float]:
    """``PROBES`` single requests, one after another: the refused ones' seconds."""
    refused = []
    async with AsyncClient(address) as client:
        for i in range(PROBES):
            start = time.monotonic()
            try:
                await client.complete(f"{PROMPT} probe {i}", max_tokens=1, timeout=60.0)
            except PdserveError as exc:
                if exc.code.name == "RESOURCE_EXHAUSTED":
                    refused.append(time.monotonic() - start)
    return refused


def burst(address: str, metrics_url: str, total: int, clients: int, limit: int
          ) -> tuple[list[tuple[str, float]], list[float]]:
    """See the module docstring: (every burst stream's status and seconds, each refused
    probe's seconds)."""
    ctx = mp.get_context("spawn")
    start_at = time.time() + 3.0 + 0.5 * clients  # every client connected by then
    procs, pipes = [], []
    for c in range(clients):
        n = total // clients + (1 if c < total % clients else 0)
        here, there = ctx.Pipe(duplex=False)
        proc = ctx.Process(target=_client_main, args=(address, n, c * total, start_at, there),
                           daemon=True)
        proc.start()
        procs.append(proc)
        pipes.append(here)
    deadline = time.monotonic() + 300.0
    excess = max(0, total - limit)
    while rejections(metrics_url) < 0.9 * excess and time.monotonic() < deadline:
        time.sleep(0.05)
    probes = asyncio.run(_probes(address))
    outcomes: list[tuple[str, float]] = []
    for here, proc in zip(pipes, procs, strict=True):
        if here.poll(600.0):
            outcomes += here.recv()
        proc.join(30)
        if proc.is_alive():
            proc.kill()
    return outcomes, probes


def rejections(metrics_url: str) -> float:
    """Requests the router refused at admission so far."""
    return sum(s.value for family in _families(metrics_url)
               if family.name == "pdserve:router_rejections" for s in family.samples
               if s.name.endswith("_total"))


def lag_buckets(metrics_url: str) -> list[tuple[float, float]]:
    """The router's event-loop lag histogram: (upper bound, cumulative count)."""
    for family in _families(metrics_url):
        if family.name == "pdserve:router_event_loop_lag_seconds":
            return sorted((float(s.labels["le"]), s.value) for s in family.samples
                          if s.name.endswith("_bucket"))
    return []


def _families(metrics_url: str) -> Any:
    text = urllib.request.urlopen(metrics_url, timeout=10).read().decode()
    return list(text_string_to_metric_families(text))


def lag_burst(address: str, n: int, words: int) -> int:
    """``n`` requests with ~``words``-word prompts at once; how many completed."""
    async def run() -> int:
        async with AsyncClient(address) as client:
            async def one(i: int) -> bool:
                text = f"{i} " + " ".join([PROMPT] * (words // 9))
                try:
                    await client.complete(text, max_tokens=1, timeout=600.0)
                except PdserveError:
                    return False
                return True

            return sum(await asyncio.gather(*(one(i) for i in range(n))))

    return asyncio.run(run())
