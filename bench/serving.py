"""The client side of a serving benchmark, in the manner of ``vllm bench serve``: send a
list of ``loadtest.workloads.Request``s to a running cluster with Poisson arrivals (or all
at once), time every token, and compute vLLM's metrics under vLLM's key names.

Definitions (``../shared/BENCHMARKS.md``, the same as vLLM's):

- TTFT: request sent → first token received; TPOT: ``(e2el − ttft) / (output_len − 1)``
  per request with more than one output token; ITL: the gaps between consecutive
  streamed chunks, pooled over all requests; E2EL: request sent → last token.
- ``request_goodput``: completed requests per second that met every SLO given
  (``{"ttft": ms, "tpot": ms, "e2el": ms}``, any subset); ``slo_attainment``: the share of
  all requests sent (failed ones included) that met them.

Backends: ``GrpcBackend`` (``pdserve.AsyncClient``, token ids in, one timestamp per
streamed message: every message carries tokens) and ``HttpBackend`` (``/v1/completions``
with ``stream``, server-sent events: a chunk is sent when it has text, so TTFT there is the
first *text*, as vLLM measures it; the output length comes from the streamed usage).
Both send token-id prompts with ``ignore_eos``, so the lengths are exact.
"""

from __future__ import annotations

import asyncio
import json
import math
import random
import statistics
import time
from collections.abc import AsyncIterator, Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

from bench.common import percentile
from loadtest.workloads import Request

SLO_METRICS = ("ttft", "tpot", "e2el")
METRICS = ("ttft", "tpot", "itl", "e2el")
DEFAULT_PERCENTILES = (90.0, 99.0)
TIMEOUT_S = 600.0
CUT_OFF = "cut off"


@dataclass
class Outcome:
    """What one request did, times in seconds from when it was sent."""

    prompt_len: int
    max_tokens: int
    sent_at: float = 0.0  # seconds since the benchmark started
    success: bool = False
    error: str = ""
    output_len: int = 0
    cached_tokens: int = 0
    ttft: float = 0.0
    latency: float = 0.0
    itl: list[float] = field(default_factory=list)
    token_times: list[float] = field(default_factory=list)  # since sent, one per message

    @property
    def tpot(self) -> float | None:
        if not self.success or self.output_len < 2:
            return None
        return (self.latency - self.ttft) / (self.output_len - 1)

    def meets(self, slo_ms: Mapping[str, float]) -> bool:
        """Completed within every SLO given (a TPOT SLO holds for one-token outputs)."""
        if not self.success:
            return False
        values = {"ttft": self.ttft, "tpot": self.tpot or 0.0, "e2el": self.latency}
        return all(values[k] * 1000 <= limit for k, limit in slo_ms.items())


class Backend(Protocol):
    async def send(self, request: Request, outcome: Outcome) -> None:
        """Sends ``request``, filling ``outcome`` (errors go into it, never raised)."""

    async def close(self) -> None: ...


class _Clock:
    """Token timestamps of one request."""

    def __init__(self, outcome: Outcome) -> None:
        self.outcome = outcome
        self.start = time.perf_counter()
        self.last: float | None = None

    def token(self) -> None:
        now = time.perf_counter() - self.start
        o = self.outcome
        if self.last is None:
            o.ttft = now
        else:
            o.itl.append(now - self.last)
        o.token_times.append(now)
        self.last = now

    def done(self, output_len: int, cached_tokens: int) -> None:
        o = self.outcome
        o.latency = time.perf_counter() - self.start
        o.output_len, o.cached_tokens = output_len, cached_tokens
        o.success = output_len > 0 and self.last is not None


class GrpcBackend:
    """The public gRPC API through ``pdserve.AsyncClient`` (made on the running loop)."""

    def __init__(self, address: str, *, temperature: float = 0.0,
                 api_key: str | None = None) -> None:
        from pdserve import AsyncClient

        self.client = AsyncClient(address, api_key=api_key)
        self.temperature = temperature

    async def send(self, request: Request, outcome: Outcome) -> None:
        from pdserve import PdserveError

        clock, num_tokens, cached = _Clock(outcome), 0, 0
        try:
            async for chunk in self.client.generate(
                    prompt_token_ids=request.prompt_token_ids, max_tokens=request.max_tokens,
                    temperature=self.temperature, ignore_eos=True, timeout=TIMEOUT_S):
                if chunk.token_ids:
                    clock.token()
                    num_tokens += len(chunk.token_ids)
                if chunk.usage is not None:
                    cached = chunk.usage.cached_tokens
        except PdserveError as exc:
            outcome.error = f"{exc.code.name}: {exc.details}"
            return
        clock.done(num_tokens, cached)

    async def close(self) -> None:
        await self.client.close()


async def sse_lines(chunks: AsyncIterator[bytes]) -> AsyncIterator[str]:
    """An SSE body's lines, split at line ends only (LF, CR or CRLF, as the SSE format
    says): not at the other characters ``str.splitlines`` (and httpx's ``aiter_lines``)
    break at, such as U+2028 or U+0085, which JSON carries unescaped in generated text."""
    pending = b""
    async for chunk in chunks:
        lines = (pending + chunk).replace(b"\r\n", b"\n").replace(b"\r", b"\n").split(b"\n")
        pending = lines.pop()
        for line in lines:
            yield line.decode("utf-8")
    if pending:
        yield pending.decode("utf-8")


class HttpBackend:
    """The OpenAI-compatible ``/v1/completions`` with ``stream`` (httpx)."""

    def __init__(self, base_url: str, *, temperature: float = 0.0,
                 api_key: str | None = None, model: str = "") -> None:
        import httpx

        headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self.client = httpx.AsyncClient(base_url=base_url.rstrip("/"), headers=headers,
                                        timeout=httpx.Timeout(TIMEOUT_S),
                                        limits=httpx.Limits(max_connections=None,
                                                            max_keepalive_connections=None))
        self.temperature = temperature
        self.model = model

    async def send(self, request: Request, outcome: Outcome) -> None:
        body = {"model": self.model, "prompt": list(request.prompt_token_ids),
                "max_tokens": request.max_tokens, "temperature": self.temperature,
                "ignore_eos": True, "stream": True, "stream_options": {"include_usage": True}}
        clock, usage = _Clock(outcome), None
        try:
            async with self.client.stream("POST", "/v1/completions", json=body) as response:
                if response.status_code != 200:
                    text = (await response.aread()).decode(errors="replace")
                    outcome.error = f"HTTP {response.status_code}: {text[:200]}"
                    return
                async for line in sse_lines(response.aiter_bytes()):
                    usage = self._event(line, clock, outcome) or usage
        except Exception as exc:  # the connection failed: reported, never raised
            outcome.error = f"{type(exc).__name__}: {exc}"
            return
        if outcome.error:
            return
        if usage is None:
            outcome.error = "the stream ended without usage"
            return
        clock.done(int(usage["completion_tokens"]),
                   int((usage.get("prompt_tokens_details") or {}).get("cached_tokens") or 0))

    @staticmethod
    def _event(line: str, clock: _Clock, outcome: Outcome) -> dict[str, Any] | None:
        """One SSE line: a text chunk is a token event; returns the usage when it comes."""
        if not line.startswith("data:"):
            return None
        data = line[5:].strip()
        if data == "[DONE]":
            return None
        event = json.loads(data)
        if "error" in event:
            outcome.error = f"stream error: {event['error'].get('message', '')}"
            return None
        if event.get("choices") and event["choices"][0].get("text"):
            clock.token()
        usage = event.get("usage")
        return usage if isinstance(usage, dict) else None

    async def close(self) -> None:
        await self.client.aclose()


# ---------------------------------------------------------------- the run


def arrival_times(n: int, request_rate: float, seed: int, burstiness: float = 1.0
                  ) -> list[float]:
    """Send times (seconds from the start) of ``n`` requests: the first at 0, then gaps
    drawn from a gamma distribution of mean ``1 / request_rate`` (shape ``burstiness``;
    1 is a Poisson process, as in vLLM); all at 0 when the rate is infinite."""
    if math.isinf(request_rate):
        return [0.0] * n
    rng = random.Random(seed)
    times, t = [], 0.0
    for i in range(n):
        if i:
            t += rng.gammavariate(burstiness, 1.0 / (request_rate * burstiness))
        times.append(t)
    return times


async def run(backend: Backend, requests: Sequence[Request], *, request_rate: float,
              max_concurrency: int | None = None, seed: int = 0, burstiness: float = 1.0,
              on_done: Callable[[Outcome], None] | None = None,
              limit_s: Callable[[Request], float] | None = None) -> tuple[list[Outcome], float]:
    """Sends every request at its arrival time (at most ``max_concurrency`` in flight: the
    rest wait for a slot, as in vLLM); returns the outcomes in request order and the
    benchmark's duration (first send → last answer). ``limit_s(request)``: a request still
    unfinished that long after it was sent is cancelled and fails ("cut off")."""
    limit = asyncio.Semaphore(max_concurrency) if max_concurrency else None
    start = time.perf_counter()

    async def one(request: Request, at: float) -> Outcome:
        await asyncio.sleep(max(0.0, start + at - time.perf_counter()))
        outcome = Outcome(request.prompt_len, request.max_tokens)
        if limit is not None:
            await limit.acquire()
        try:
            outcome.sent_at = time.perf_counter() - start
            cut_s = limit_s(request) if limit_s is not None else None
            try:
                await asyncio.wait_for(backend.send(request, outcome), cut_s)
            except TimeoutError:
                outcome.success = False
                outcome.error = f"{CUT_OFF}: unfinished {cut_s:.1f}s after it was sent"
        finally:
            if limit is not None:
                limit.release()
        if on_done is not None:
            on_done(outcome)
        return outcome

    times = arrival_times(len(requests), request_rate, seed, burstiness)
    outcomes = await asyncio.gather(*(one(r, t) for r, t in zip(requests, times, strict=True)))
    return list(outcomes), time.perf_counter() - start


# ---------------------------------------------------------------- metrics


def _stats(name: str, values_s: Sequence[float], percentiles: Sequence[float]
           ) -> dict[str, float]:
    ms = [v * 1000 for v in values_s]
    if not ms:
        return {f"{k}_{name}_ms": math.nan for k in
                ("mean", "median", "std", *(f"p{p:g}" for p in percentiles))}
    out = {f"mean_{name}_ms": statistics.fmean(ms), f"median_{name}_ms": statistics.median(ms),
           f"std_{name}_ms": statistics.pstdev(ms)}
    out.update({f"p{p:g}_{name}_ms": percentile(ms, p) for p in percentiles})
    return out


def _peaks(outcomes: Sequence[Outcome]) -> tuple[float, int]:
    """Most output tokens in one second (one-second bins), most requests in flight."""
    bins: dict[int, int] = {}
    events: list[tuple[float, int]] = []
    for o in outcomes:
        for t in o.token_times:
            second = int(o.sent_at + t)
            bins[second] = bins.get(second, 0) + 1
        if o.success:
            events += [(o.sent_at, 1), (o.sent_at + o.latency, -1)]
    running = peak = 0
    for _, step in sorted(events):
        running += step
        peak = max(peak, running)
    return float(max(bins.values(), default=0)), peak


def metrics(outcomes: Sequence[Outcome], duration_s: float, *,
            slo_ms: Mapping[str, float] | None = None,
            percentiles: Sequence[float] = DEFAULT_PERCENTILES) -> dict[str, Any]:
    """vLLM's result keys for these outcomes (``request_goodput`` and ``slo_attainment``
    only with ``slo_ms``)."""
    done = [o for o in outcomes if o.success]
    total_in = sum(o.prompt_len for o in done)
    total_out = sum(o.output_len for o in done)
    peak_tokens, peak_requests = _peaks(outcomes)
    result: dict[str, Any] = {
        "duration": duration_s, "completed": len(done), "failed": len(outcomes) - len(done),
        "total_input_tokens": total_in, "total_output_tokens": total_out,
        "request_throughput": len(done) / duration_s,
        "output_throughput": total_out / duration_s,
        "total_token_throughput": (total_in + total_out) / duration_s,
        "max_output_tokens_per_s": peak_tokens, "max_concurrent_requests": peak_requests,
        "total_cached_tokens": sum(o.cached_tokens for o in done),
    }
    if slo_ms:
        good = sum(o.meets(slo_ms) for o in outcomes)
        result["request_goodput"] = good / duration_s
        result["slo_attainment"] = good / len(outcomes) if outcomes else math.nan
    tpots = [t for o in done if (t := o.tpot) is not None]
    series = {"ttft": [o.ttft for o in done], "tpot": tpots,
              "itl": [g for o in done for g in o.itl], "e2el": [o.latency for o in done]}
    for name in METRICS:
        result.update(_stats(name, series[name], percentiles))
    return result


def details(outcomes: Sequence[Outcome]) -> dict[str, list[Any]]:
    """Per-request lists, as vLLM saves them (``input_lens``, ``output_lens``, ``ttfts``,
    ``itls``, ``errors``), plus ``tpots`` and ``e2els``; times in seconds."""
    return {"input_lens": [o.prompt_len for o in outcomes],
            "output_lens": [o.output_len for o in outcomes],
            "ttfts": [o.ttft if o.success else None for o in outcomes],
            "tpots": [o.tpot for o in outcomes],
            "e2els": [o.latency if o.success else None for o in outcomes],
            "itls": [o.itl for o in outcomes],
            "errors": [o.error for o in outcomes]}


def parse_goodput(items: Sequence[str]) -> dict[str, float]:
    """``["ttft:500", "tpot:50"]`` → ``{"ttft": 500.0, "tpot": 50.0}`` (milliseconds);
    ``ValueError`` naming what is wrong."""
    slo: dict[str, float] = {}
    for item in items:
        name, sep, value = item.partition(":")
        if not sep or name not in SLO_METRICS:
            raise ValueError(f"--goodput takes NAME:MS with NAME one of {', '.join(SLO_METRICS)}"
                             f", got {item!r}")
        slo[name] = float(value)
        if not slo[name] > 0:
            raise ValueError(f"--goodput {name} must be > 0 ms, got {value}")
    return slo


def render(result: Mapping[str, Any], title: str = "Serving Benchmark Result") -> str:
    """The result as ``vllm bench serve`` prints it."""
    lines = [f"{' ' + title + ' ':=^60}"]

    def row(label: str, key: str, fmt: str = ".2f") -> None:
        value = result.get(key)
        if value is not None:
            lines.append(f"{label:<44}{value:>16{fmt if isinstance(value, float) else ''}}")

    row("Successful requests:", "completed")
    row("Failed requests:", "failed")
    row("Benchmark duration (s):", "duration")
    row("Total input tokens:", "total_input_tokens")
    row("Total generated tokens:", "total_output_tokens")
    row("Request throughput (req/s):", "request_throughput")
    row("Request goodput (req/s):", "request_goodput")
    row("SLO attainment:", "slo_attainment", ".3f")
    row("Output token throughput (tok/s):", "output_throughput")
    row("Total token throughput (tok/s):", "total_token_throughput")
    for name, label in (("ttft", "Time to First Token"), ("tpot", "Time per Output Token (excl. 1st token)"),
                        ("itl", "Inter-token Latency"), ("e2el", "End-to-end Latency")):
        lines.append(f"{' ' + label + ' ':-^60}")
        for key in [k for k in result if k.endswith(f"_{name}_ms") and not k.startswith("std")]:
            stat = key.split("_")[0]
            label = {"mean": "Mean", "median": "Median"}.get(stat, stat.upper())
            row(f"{label} {name.upper()} (ms):", key)
    lines.append("=" * 60)
    return "\n".join(lines)
