"""Serving metrics, as ``vllm bench serve`` computes them under vLLM's key names: what
one request did (``Outcome``), the send times of a workload (``arrival_times``), the
result keys of a run (``metrics``, ``details``), the SLOs of goodput (``parse_goodput``),
vLLM's result table (``render``) and the result as JSON (``write_json``). Standard library
only: ``bench.serving`` measures a real cluster with them, ``sim.runs`` a simulated one.

Definitions (``../shared/BENCHMARKS.md``, the same as vLLM's):

- TTFT: request sent → first token received; TPOT: ``(e2el − ttft) / (output_len − 1)``
  per request with more than one output token; ITL: the gaps between consecutive
  streamed chunks, pooled over all requests; E2EL: request sent → last token.
- ``request_goodput``: completed requests per second that met every SLO given
  (``{"ttft": ms, "tpot": ms, "e2el": ms}``, any subset); ``slo_attainment``: the share of
  all requests sent (failed ones included) that met them.
"""

from __future__ import annotations

import bisect
import functools
import itertools
import json
import math
import random
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

SLO_METRICS = ("ttft", "tpot", "e2el")
METRICS = ("ttft", "tpot", "itl", "e2el")
DEFAULT_PERCENTILES = (90.0, 99.0)
CUT_OFF = "cut off"  # the error of a request cancelled past its time limit


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
    token_times: list[float] = field(default_factory=list)  # since sent, one per message (ascending)

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


def percentile(values: Sequence[float], q: float) -> float:
    """The ``q``-th percentile (0..100), linear interpolation (numpy's default)."""
    if not values:
        raise ValueError("percentile of an empty sequence")
    return _of_sorted(sorted(values), q)


def _of_sorted(ordered: Sequence[float], q: float) -> float:
    rank = (len(ordered) - 1) * q / 100.0
    low = math.floor(rank)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (rank - low)


def _stats(name: str, values_s: Sequence[float], percentiles: Sequence[float]
           ) -> dict[str, float]:
    """Mean, median, population standard deviation and percentiles in milliseconds (one
    sort, float sums: millions of inter-token gaps take a second, not minutes)."""
    ms = [v * 1000 for v in values_s]
    ms.sort()
    if not ms:
        return {f"{k}_{name}_ms": math.nan for k in
                ("mean", "median", "std", *(f"p{p:g}" for p in percentiles))}
    mean = math.fsum(ms) / len(ms)
    out = {f"mean_{name}_ms": mean, f"median_{name}_ms": _of_sorted(ms, 50),
           f"std_{name}_ms": math.sqrt(math.fsum((v - mean) ** 2 for v in ms) / len(ms))}
    out.update({f"p{p:g}_{name}_ms": _of_sorted(ms, p) for p in percentiles})
    return out


def _peaks(outcomes: Sequence[Outcome]) -> tuple[float, int]:
    """Most output tokens in one second (one-second bins), most requests in flight."""
    bins: dict[int, int] = {}
    events: list[tuple[float, int]] = []
    for o in outcomes:
        # the tokens of each second at once: token_times ascend (in the order streamed)
        times, end, i = o.token_times, len(o.token_times), 0
        while i < end:
            second = int(o.sent_at + times[i])
            j = bisect.bisect_right(times, second, i, end,
                                    key=functools.partial(_second, o.sent_at))
            bins[second] = bins.get(second, 0) + j - i
            i = j
        if o.success:
            events += [(o.sent_at, 1), (o.sent_at + o.latency, -1)]
    running = peak = 0
    for _, step in sorted(events):
        running += step
        peak = max(peak, running)
    return float(max(bins.values(), default=0)), peak


def _second(sent_at: float, t: float) -> int:
    """The one-second bin of a token received ``t`` after a send at ``sent_at``."""
    return int(sent_at + t)


def metrics(outcomes: Sequence[Outcome], duration_s: float, *,
            slo_ms: Mapping[str, float] | None = None,
            percentiles: Sequence[float] = DEFAULT_PERCENTILES) -> dict[str, Any]:
    """vLLM's result keys for these outcomes (``request_goodput`` and ``slo_attainment``
    only with ``slo_ms``); rates are 0 over a run that lasted no time (every request
    refused at once, say)."""
    def per_s(n: float) -> float:
        return n / duration_s if duration_s > 0 else 0.0

    done = [o for o in outcomes if o.success]
    total_in = sum(o.prompt_len for o in done)
    total_out = sum(o.output_len for o in done)
    peak_tokens, peak_requests = _peaks(outcomes)
    result: dict[str, Any] = {
        "duration": duration_s, "completed": len(done), "failed": len(outcomes) - len(done),
        "total_input_tokens": total_in, "total_output_tokens": total_out,
        "request_throughput": per_s(len(done)),
        "output_throughput": per_s(total_out),
        "total_token_throughput": per_s(total_in + total_out),
        "max_output_tokens_per_s": peak_tokens, "max_concurrent_requests": peak_requests,
        "total_cached_tokens": sum(o.cached_tokens for o in done),
    }
    if slo_ms:
        good = sum(o.meets(slo_ms) for o in outcomes)
        result["request_goodput"] = per_s(good)
        result["slo_attainment"] = good / len(outcomes) if outcomes else math.nan
    tpots = [t for o in done if (t := o.tpot) is not None]
    series = {"ttft": [o.ttft for o in done], "tpot": tpots,
              "itl": list(itertools.chain.from_iterable(o.itl for o in done)),
              "e2el": [o.latency for o in done]}
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


def _json_safe(value: Any) -> Any:
    if isinstance(value, float) and (math.isnan(value) or math.isinf(value)):
        return None
    if isinstance(value, Mapping):
        return {str(k): _json_safe(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [_json_safe(v) for v in value]
    if isinstance(value, Path):
        return str(value)
    return value


def write_json(path: str | Path, obj: Mapping[str, Any]) -> None:
    """Write ``obj`` as indented JSON (NaN/inf become null), creating parent folders."""
    out = Path(path)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(_json_safe(obj), indent=2) + "\n", encoding="utf-8")
