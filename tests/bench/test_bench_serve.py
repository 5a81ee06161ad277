"""``python -m bench.serve --quick`` through real processes: against a cluster's gRPC API
and its HTTP API, and against a cluster it starts itself. Checks the JSON has vLLM's keys
with plausible values (positive, percentiles ordered, counts that add up), the workload's
exact lengths and the plots; never a speed."""

from __future__ import annotations

import asyncio
import json
import math
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest

from bench import serve
from bench.serving import sse_lines
from deploy.local import LocalLauncher
from sim.metrics import CUT_OFF, Outcome, arrival_times, metrics, parse_goodput

pytestmark = pytest.mark.timeout(180)

METRIC_KEYS = [f"{stat}_{name}_ms" for name in ("ttft", "tpot", "itl", "e2el")
               for stat in ("mean", "median", "std", "p90", "p99")]
KEYS = ("duration", "completed", "failed", "total_input_tokens", "total_output_tokens",
        "request_throughput", "output_throughput", "total_token_throughput",
        "request_goodput", "slo_attainment", "max_concurrent_requests", *METRIC_KEYS,
        "input_lens", "output_lens", "ttfts", "itls", "errors", "machine")


def check_result(data: dict[str, Any], num_prompts: int) -> None:
    """Every key, each plausible."""
    missing = [k for k in KEYS if k not in data]
    assert not missing, missing
    assert data["completed"] == num_prompts and data["failed"] == 0, data["errors"]
    for key in ("duration", "request_throughput", "output_throughput", "total_token_throughput",
                "request_goodput"):
        assert data[key] > 0, key
    for key in METRIC_KEYS:
        assert math.isfinite(data[key]) and data[key] >= 0, key
    for name in ("ttft", "tpot", "itl", "e2el"):
        assert data[f"median_{name}_ms"] <= data[f"p90_{name}_ms"] <= data[f"p99_{name}_ms"]
        assert data[f"mean_{name}_ms"] > 0, name
    assert data["mean_ttft_ms"] <= data["mean_e2el_ms"]
    assert data["request_goodput"] <= data["request_throughput"] + 1e-9
    assert 0 <= data["slo_attainment"] <= 1
    assert data["total_output_tokens"] == sum(data["output_lens"])
    assert data["total_input_tokens"] == sum(data["input_lens"])
    assert data["total_token_throughput"] == pytest.approx(
        data["request_throughput"] * (data["total_input_tokens"] + data["total_output_tokens"])
        / data["completed"])
    assert len(data["ttfts"]) == len(data["itls"]) == num_prompts
    assert 1 <= data["max_concurrent_requests"] <= num_prompts
    assert data["machine"]["cpu_model"] and data["machine"]["bandwidth_gbps"] > 0


def test_quick_over_grpc(up: LocalLauncher, tmp_path: Path) -> None:
    out = tmp_path / "grpc.json"
    serve.main(["--quick", "--address", up.router_address, "--model", str(up.model_dir),
                "--goodput", "ttft:60000", "tpot:60000", "--json", str(out),
                "--plot", str(tmp_path / "plots"), "--no-progress"])
    data = json.loads(out.read_text())
    check_result(data, 12)
    assert data["backend"] == "grpc" and data["request_rate"] == 20.0
    assert data["output_lens"] == [8] * 12 and data["input_lens"] == [32] * 12  # exact
    assert data["slo_attainment"] == 1.0  # SLOs no run misses
    assert data["model"]["parameters"] > 0 and data["model"]["weights_dtype"] == "F32"
    for name in ("ttft_cdf.png", "tpot_cdf.png"):
        assert (tmp_path / "plots" / name).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_quick_over_http_with_shared_prefixes(up: LocalLauncher, tmp_path: Path) -> None:
    out = tmp_path / "http.json"
    serve.main(["--quick", "--base-url", up.http_url, "--vocab-size", "700",
                "--dataset-name", "prefix-repetition", "--max-concurrency", "2",
                "--request-rate", "inf", "--goodput", "ttft:0.001", "--json", str(out),
                "--no-progress"])
    data = json.loads(out.read_text())
    assert data["slo_attainment"] == 0.0 and data["request_goodput"] == 0.0  # nothing meets 1 µs
    data["request_goodput"] = 1.0  # the rest of the check as usual
    check_result(data, 12)
    assert data["backend"] == "openai-http" and data["max_concurrent_requests"] <= 2
    assert data["input_lens"] == [64 + 16] * 12
    assert data["total_cached_tokens"] > 0  # 3 prefixes, 12 requests: the cache served some


def test_quick_on_a_cluster_of_its_own(llama_dir: Path, tmp_path: Path) -> None:
    out = tmp_path / "own.json"
    result = serve.main(["--quick", "--model", str(llama_dir), "--num-prompts", "4",
                         "--goodput", "e2el:60000", "--json", str(out), "--no-progress"])
    data = json.loads(out.read_text())
    assert data["completed"] == 4 and result["completed"] == 4
    assert data["cluster"]["num_prefill"] == 1 and data["cluster"]["threads_per_process"] >= 1


def test_metrics_follow_vllms_definitions() -> None:
    a = Outcome(10, 3, success=True, output_len=3, ttft=0.1, latency=0.5, itl=[0.2, 0.2])
    b = Outcome(20, 1, success=True, output_len=1, ttft=0.3, latency=0.3)
    c = Outcome(5, 4, error="UNAVAILABLE: x")
    m = metrics([a, b, c], 2.0, slo_ms={"ttft": 200, "tpot": 250})
    assert m["completed"] == 2 and m["failed"] == 1
    assert m["mean_tpot_ms"] == pytest.approx(200.0)  # (0.5 - 0.1) / 2, b has no TPOT
    assert m["mean_ttft_ms"] == pytest.approx(200.0) and m["median_itl_ms"] == pytest.approx(200)
    assert m["request_goodput"] == 0.5 and m["slo_attainment"] == pytest.approx(1 / 3)  # a only
    assert m["output_throughput"] == 2.0 and m["total_token_throughput"] == 17.0
    # a run that lasted no time (every request refused at once): rates 0, not a crash
    instant = metrics([c], 0.0, slo_ms={"ttft": 200})
    assert instant["request_throughput"] == 0.0 and instant["request_goodput"] == 0.0
    assert parse_goodput(["ttft:5", "e2el:7.5"]) == {"ttft": 5.0, "e2el": 7.5}
    with pytest.raises(ValueError, match="NAME:MS"):
        parse_goodput(["itl:5"])


def test_arrivals_are_poisson_at_the_rate() -> None:
    times = arrival_times(4000, 10.0, seed=1)
    assert times[0] == 0 and times == sorted(times)
    gaps = [b - a for a, b in zip(times, times[1:], strict=False)]
    assert sum(gaps) / len(gaps) == pytest.approx(0.1, rel=0.05)
    assert arrival_times(3, float("inf"), seed=1) == [0.0, 0.0, 0.0]
    assert arrival_times(50, 5.0, seed=2) == arrival_times(50, 5.0, seed=2)


def test_a_request_past_its_limit_is_cut_off() -> None:
    import asyncio

    from bench.serving import run
    from loadtest.workloads import Request

    class Slow:
        cancelled = 0

        async def send(self, request: Request, outcome: Outcome) -> None:
            try:
                await asyncio.sleep(request.max_tokens / 100)  # 10 ms per token
            except asyncio.CancelledError:
                Slow.cancelled += 1
                raise
            outcome.success, outcome.output_len = True, request.max_tokens

        async def close(self) -> None:
            pass

    requests = [Request((20, 21), 1), Request((20, 21), 50)]
    outcomes, _ = asyncio.run(run(Slow(), requests, request_rate=float("inf"),
                                  limit_s=lambda r: 0.2))
    assert outcomes[0].success and not outcomes[1].success
    assert outcomes[1].error.startswith(CUT_OFF) and Slow.cancelled == 1


def test_sse_lines_split_at_line_ends_only() -> None:
    """Generated text may hold U+2028, U+0085 or a form feed, which JSON carries unescaped
    and ``str.splitlines`` would break a data line at; chunks end anywhere."""
    event = json.dumps({"choices": [{"text": "a\u2028b\x85c\u2029d"}]}, ensure_ascii=False)
    body = f"data: {event}\r\n\r\ndata: [DONE]\n\n".encode()

    async def lines(chunk_size: int) -> list[str]:
        async def chunks() -> AsyncIterator[bytes]:
            for i in range(0, len(body), chunk_size):
                yield body[i:i + chunk_size]
        return [line async for line in sse_lines(chunks())]

    for size in (1, 3, 7, len(body)):
        data = [line for line in asyncio.run(lines(size)) if line]
        assert data == [f"data: {event}", "data: [DONE]"], size
        assert json.loads(data[0][5:])["choices"][0]["text"] == "a\u2028b\x85c\u2029d"
