"""Tensor parallelism on CPU: gloo on loopback, follower ranks as processes of their own
(``python -m engine.tp.rank_main``)."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest

from engine import LLM, SamplingParams
from engine.models.layers import kv_head_range
from tests.factories import PROMPTS

GREEDY = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)
SEEDED = SamplingParams(max_tokens=16, temperature=0.9, top_p=0.9, seed=7, ignore_eos=True)


@pytest.mark.parametrize("kv_heads", [2, 1], ids=["gqa", "mqa-replicated"])
def test_tp2_matches_tp1(model_factory: Callable[..., Path], kv_heads: int) -> None:
    model_dir = model_factory("llama", num_key_value_heads=kv_heads)
    prompts = PROMPTS[:6]
    with LLM(model_dir, num_kv_blocks=256) as llm1:
        ref = llm1.generate(prompts, GREEDY)
        ref_seeded = llm1.generate(prompts[:2], SEEDED)
        full = llm1.core.executor.rank_num_parameters[0]
    with LLM(model_dir, num_kv_blocks=256, tensor_parallel_size=2) as llm2:
        out = llm2.generate(prompts, GREEDY)
        out_seeded = llm2.generate(prompts[:2], SEEDED)
        per_rank = llm2.core.executor.rank_num_parameters
        llm2.core.check_integrity()
    assert [r.token_ids for r in out] == [r.token_ids for r in ref]
    assert [r.text for r in out] == [r.text for r in ref]
    assert [r.token_ids for r in out_seeded] == [r.token_ids for r in ref_seeded]
    # each rank holds about half: norms are replicated (and with MQA the single KV head too)
    assert len(per_rank) == 2
    for n in per_rank:
        assert 0.45 * full < n < 0.6 * full, (n, full)


def test_kv_head_rule() -> None:
    assert [kv_head_range(8, r, 4) for r in range(4)] == [(0, 2), (2, 4), (4, 6), (6, 8)]
    # more ranks than KV heads: rank i holds head floor(i * H / t)
    assert [kv_head_range(2, r, 4) for r in range(4)] == [(0, 1), (0, 1), (1, 2), (1, 2)]
    assert [kv_head_range(1, r, 2) for r in range(2)] == [(0, 1), (0, 1)]


def test_follower_dies_with_leader_process(model_factory: Callable[..., Path], tmp_path: Path) -> None:
    """A leader killed with SIGKILL takes its follower ranks with it."""
    import os
    import signal
    import subprocess
    import sys
    import time

    model_dir = model_factory("llama")
    pid_file = tmp_path / "pids"
    script = (
        "import os, sys, time\n"
        "from engine import LLM\n"
        "if __name__ == '__main__':\n"
        f"    llm = LLM({str(model_dir)!r}, num_kv_blocks=32, tensor_parallel_size=2)\n"
        "    pids = llm.core.executor.follower_pids\n"
        f"    open({str(pid_file)!r}, 'w').write(' '.join(map(str, pids)))\n"
        "    time.sleep(120)\n"
    )
    leader = subprocess.Popen([sys.executable, "-c", script], cwd=Path(__file__).parents[3])
    try:
        deadline = time.monotonic() + 120
        while not pid_file.exists() or not pid_file.read_text():
            assert leader.poll() is None, "leader exited early"
            assert time.monotonic() < deadline, "leader did not start its follower"
            time.sleep(0.2)
        follower = int(pid_file.read_text().split()[0])
        leader.send_signal(signal.SIGKILL)
        leader.wait(timeout=10)
        deadline = time.monotonic() + 10
        while _alive(follower) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert not _alive(follower), "follower outlived its leader"
    finally:
        if leader.poll() is None:
            leader.kill()
            leader.wait(timeout=10)
    del os


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split()[2] != "Z"
    except FileNotFoundError:
        return False


def test_failing_layer_hook_keeps_ranks_in_step(llama_dir: Path) -> None:
    """A hook error surfaces after the step completed on every rank: the engine stays usable."""
    from engine.core.runner import LayerHookError

    with LLM(llama_dir, num_kv_blocks=64, tensor_parallel_size=2) as llm:
        expected = llm.generate(PROMPTS[:2], GREEDY)

        def failing_hook(layer: int) -> None:
            raise RuntimeError(f"boom at layer {layer}")

        llm.core.layer_hook = failing_hook
        with pytest.raises(LayerHookError, match="boom at layer 0"):
            llm.generate(PROMPTS[:2], GREEDY)
        llm.core.layer_hook = None
        again = llm.generate(PROMPTS[:2], GREEDY)
        assert [r.token_ids for r in again] == [r.token_ids for r in expected]
        llm.core.check_integrity()
        assert llm.core.kv_usage().in_use == 0


def test_dead_follower_fails_the_engine_fast_and_for_good(llama_dir: Path) -> None:
    """A follower killed between steps: the next step fails within seconds (gloo sees the
    closed connection), the group is torn down, and later calls fail at once."""
    import time

    from engine.tp.executor import ExecutorFailed

    llm = LLM(llama_dir, num_kv_blocks=64, tensor_parallel_size=2)
    try:
        follower = llm.core.executor._ranks[0]
        follower.kill()
        follower.join(timeout=10)
        assert not follower.is_alive()
        start = time.monotonic()
        with pytest.raises(ExecutorFailed):
            llm.generate(PROMPTS[:2], GREEDY)
        assert time.monotonic() - start < 30
        start = time.monotonic()
        with pytest.raises(ExecutorFailed, match="unusable"):
            llm.generate(PROMPTS[:2], GREEDY)
        assert time.monotonic() - start < 1
        llm.core.check_integrity()
        assert llm.core.kv_usage().in_use == 0
    finally:
        llm.shutdown()


def test_use_after_shutdown_raises_instead_of_running_one_rank(llama_dir: Path) -> None:
    from engine.tp.executor import ExecutorFailed

    llm = LLM(llama_dir, num_kv_blocks=64, tensor_parallel_size=2)
    llm.shutdown()
    with pytest.raises(ExecutorFailed, match="shut down"):
        llm.generate(PROMPTS[:1], GREEDY)


def test_engine_built_on_a_short_lived_thread_keeps_its_followers(llama_dir: Path) -> None:
    import threading

    holder: dict[str, LLM] = {}
    thread = threading.Thread(
        target=lambda: holder.setdefault("llm", LLM(llama_dir, num_kv_blocks=64,
                                                    tensor_parallel_size=2)))
    thread.start()
    thread.join(timeout=120)
    llm = holder["llm"]
    try:
        assert len(llm.generate(PROMPTS[:2], GREEDY)[0].token_ids) == GREEDY.max_tokens
    finally:
        llm.shutdown()
