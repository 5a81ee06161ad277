"""The client side of a serving benchmark, in the manner of ``vllm bench serve``: send a
list of ``loadtest.workloads.Request``s to a running cluster with Poisson arrivals (or all
at once) and time every token into an ``Outcome``; ``sim.metrics`` (where the metrics'
definitions are) turns the outcomes into vLLM's metrics under vLLM's key names.

Backends: ``GrpcBackend`` (``pdserve.AsyncClient``, token ids in, one timestamp per
streamed message: every message carries tokens) and ``HttpBackend`` (``/v1/completions``
with ``stream``, server-sent events: a chunk is sent when it has text, so TTFT there is the
first *text*, as vLLM measures it; the output length comes from the streamed usage).
Both send token-id prompts with ``ignore_eos``, so the lengths are exact.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import AsyncIterator, Callable, Sequence
from typing import Any, Protocol

from loadtest.workloads import Request
from sim.metrics import CUT_OFF, Outcome, arrival_times

TIMEOUT_S = 600.0


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
