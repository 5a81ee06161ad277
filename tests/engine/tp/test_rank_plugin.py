"""Rank plugins: worker code on every TP rank, with access to that rank's KV shard."""

from __future__ import annotations

import struct
from array import array
from pathlib import Path

import pytest
import torch

from engine import SamplingParams
from engine.config import CacheConfig, EngineConfig, ParallelConfig, load_model_config
from engine.core.engine_core import EngineCore
from engine.text.tokenizer import load_tokenizer
from engine.tp.rank_plugin import RankCallError
from tests.factories import PROMPTS

PLUGIN = "tests.engine.tp.rank_plugin_example:make"
GREEDY = SamplingParams(max_tokens=4, temperature=0, ignore_eos=True)


def make_core(model_dir: Path, tp: int, plugin: str | None) -> EngineCore:
    config = EngineConfig(model=load_model_config(model_dir), cache=CacheConfig(num_kv_blocks=64),
                          parallel=ParallelConfig(tensor_parallel_size=tp), rank_plugin=plugin)
    return EngineCore(config, load_tokenizer(model_dir))


def prefill(core: EngineCore, prompt: list[int]) -> tuple[int, ...]:
    core.add_request("p", prompt, GREEDY, prefill_only=True)
    outs = []
    while core.has_unfinished():
        outs += core.step()
    assert outs[-1].block_ids is not None
    return outs[-1].block_ids


@pytest.mark.parametrize("tp", [1, 2])
def test_plugins_see_every_step_and_their_own_kv_shard(llama_dir: Path, tp: int) -> None:
    # 1. the reference: the full KV of a prompt on a single-rank engine
    ref_core = make_core(llama_dir, 1, None)
    try:
        prompt = ref_core.tokenizer.tokenizer.encode(PROMPTS[3]).ids  # type: ignore[union-attr]
        ref_blocks = list(prefill(ref_core, prompt))
        full_k = ref_core.executor.runner.kv_cache[0, 0, ref_blocks].clone()  # [n, bs, H, D]
    finally:
        ref_core.shutdown()
    # 2. the same prompt on a plugin engine; every rank sees each step and its payload
    core = make_core(llama_dir, tp, PLUGIN)
    try:
        core.step_payload = lambda out: b"payload-%d" % len(out.chunks)
        blocks = prefill(core, prompt)
        num_layers = core.config.model.num_layers
        for rank, reply in enumerate(core.call_ranks(b"stats")):
            got_rank, layers_seen = struct.unpack_from("<qq", reply)
            assert (got_rank, layers_seen) == (rank, num_layers)
            assert reply[16:] == b"payload-1"
        # 3. each rank reads its own heads; together they are the full KV
        shards = [torch.frombuffer(bytearray(r), dtype=torch.float32)
                  for r in core.call_ranks(b"read:" + array("q", blocks).tobytes())]
        n, bs, heads, dim = full_k.shape
        per_rank = heads // tp
        joined = torch.cat([s.view(n, bs, per_rank, dim) for s in shards], dim=2)
        torch.testing.assert_close(joined, full_k, atol=1e-5, rtol=1e-5)
        assert core.release_pinned("p")
        # 4. a plugin error names the rank and leaves the engine usable
        with pytest.raises(RankCallError, match="rank 0: ValueError: asked to fail"):
            core.call_ranks(b"fail")
        core.add_request("after", prompt, GREEDY)
        while core.has_unfinished():
            core.step()
        core.check_integrity()
        assert core.kv_usage().in_use == 0
    finally:
        core.shutdown()


def test_calling_without_a_plugin_is_an_error(llama_dir: Path) -> None:
    core = make_core(llama_dir, 1, None)
    try:
        with pytest.raises(RuntimeError, match="no rank_plugin"):
            core.call_ranks(b"stats")
    finally:
        core.shutdown()


def test_bad_plugin_spec_is_refused(llama_dir: Path) -> None:
    with pytest.raises(ValueError, match="package.module:factory"):
        make_core(llama_dir, 1, "no-colon-here")
