"""``planner.observe.observation``: two scrapes of the workers' metrics become one
window's traffic, latencies and per-worker queue waits (pure: no process)."""

from __future__ import annotations

import pytest

from planner.observe import (
    GENERATED,
    ITL,
    PREFILLED,
    PROMPT_TOKENS,
    QUEUE,
    TTFT,
    WorkerSample,
    observation,
)

STOP = "vllm:request_success_total{finished_reason=stop}"


def _prefill(metrics: dict[str, float], held: int = 0) -> WorkerSample:
    return WorkerSample("prefill-0", "prefill", held, metrics)


def _decode(metrics: dict[str, float], held: int = 0) -> WorkerSample:
    return WorkerSample("decode-0", "decode", held, metrics)


def test_a_window_is_the_difference_of_two_scrapes() -> None:
    before = [_prefill({PREFILLED: 10, PROMPT_TOKENS: 1000, f"{QUEUE}_sum{{}}": 1.0,
                        f"{QUEUE}_count{{}}": 10, f"{TTFT}_sum{{}}": 2.0,
                        f"{TTFT}_count{{}}": 10}),
              _decode({STOP: 8, GENERATED: 800, f"{ITL}_sum{{}}": 8.0, f"{ITL}_count{{}}": 800})]
    after = [_prefill({PREFILLED: 30, PROMPT_TOKENS: 5000, f"{QUEUE}_sum{{}}": 11.0,
                       f"{QUEUE}_count{{}}": 30, f"{TTFT}_sum{{}}": 12.0,
                       f"{TTFT}_count{{}}": 30}, held=3),
             _decode({STOP: 28, GENERATED: 2800, f"{ITL}_sum{{}}": 28.0,
                      f"{ITL}_count{{}}": 2800}, held=9)]
    obs = observation(before, after, 10.0)
    assert obs.traffic.rate == pytest.approx(2.0)  # 20 prompts in 10 s
    assert obs.traffic.prompt_tokens == pytest.approx(200.0)  # 4000 tokens / 20 prompts
    assert obs.traffic.output_tokens == pytest.approx(100.0)  # 2000 tokens / 20 prompts
    assert obs.itl_s == pytest.approx(0.01) and obs.ttft_s == pytest.approx(0.5)
    waits = {w.worker_id: (w.role, w.held, w.queue_wait_s) for w in obs.workers}
    assert waits == {"prefill-0": ("prefill", 3, pytest.approx(0.5)),
                     "decode-0": ("decode", 9, 0.0)}


def test_a_worker_that_joined_counts_from_zero_and_idle_windows_have_no_latency() -> None:
    obs = observation([], [_decode({STOP: 4, GENERATED: 40})], 2.0)
    assert obs.traffic.rate == 2.0 and obs.traffic.output_tokens == 10.0
    assert obs.itl_s is None and obs.ttft_s is None
    idle = observation([_decode({STOP: 4})], [_decode({STOP: 4})], 2.0)
    assert idle.traffic.rate == 0.0 and idle.traffic.prompt_tokens == 0.0
    with pytest.raises(ValueError, match="more than 0 seconds"):
        observation([], [], 0.0)


def test_a_worker_restarted_under_its_id_counts_from_zero() -> None:
    """Worker ids survive restarts (a pod's name, a Ray slot's): counters that went down
    are a new process's, all counted, not read as nothing done."""
    before = [_prefill({PREFILLED: 10_000, PROMPT_TOKENS: 2_000_000}),
              _decode({STOP: 10, GENERATED: 1000})]
    after = [_prefill({PREFILLED: 100, PROMPT_TOKENS: 20_000}),  # restarted
             _decode({STOP: 110, GENERATED: 11_000})]
    obs = observation(before, after, 20.0)
    assert obs.traffic.rate == pytest.approx(5.0)  # 100 prompts in 20 s
    assert obs.traffic.prompt_tokens == pytest.approx(200.0)
    assert obs.traffic.output_tokens == pytest.approx(100.0)


def test_the_output_is_the_windows_generated_tokens_per_prompt() -> None:
    """Decode demand as generated (rate × output = tokens generated a second), whether or
    not the requests finished within the window (found in review: per finished request it
    read 0 when outputs outlast the window, and 100 times the demand early in a burst)."""
    long_outputs = observation([], [_prefill({PREFILLED: 10}), _decode({GENERATED: 500})], 10.0)
    assert long_outputs.traffic.rate == 1.0 and long_outputs.traffic.output_tokens == 50.0
    burst = observation([], [_prefill({PREFILLED: 100}), _decode({STOP: 1, GENERATED: 1000})],
                        10.0)
    assert burst.traffic.rate * burst.traffic.output_tokens == pytest.approx(100.0)  # tok/s
