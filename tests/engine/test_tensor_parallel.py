"""Tensor parallelism on CPU: gloo on loopback, ranks as spawned processes."""

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
        "    pids = [p.pid for p in llm.core.executor._procs]\n"
        f"    open({str(pid_file)!r}, 'w').write(' '.join(map(str, pids)))\n"
        "    time.sleep(120)\n"
    )
    leader = subprocess.Popen([sys.executable, "-c", script], cwd=Path(__file__).parents[2])
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
