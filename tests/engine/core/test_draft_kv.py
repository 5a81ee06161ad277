"""``engine.core.draft_kv.DraftBlocks``: which blocks hold the draft's KV of which content
(the real prefix-cache block hashes; the drafter's use of it runs in test_draft_model)."""

from __future__ import annotations

from pathlib import Path

from engine import SamplingParams
from engine.core.chunks import ScheduledChunk
from engine.core.draft_kv import DraftBlocks
from engine.core.request import Request

BS = 4


def _request(rid: str, tokens: list[int]) -> Request:
    request = Request(rid, tokens, SamplingParams(max_tokens=4))
    request.full_block_hashes(len(tokens) // BS, BS, seed=0)
    return request


def test_recorded_blocks_are_found_by_a_request_with_the_same_prefix_only() -> None:
    blocks = DraftBlocks(BS)
    first = _request("a", list(range(12)))
    table = (7, 3, 9)
    # the draft's KV of 10 tokens: two whole blocks
    assert blocks.record(first, table, 0, 10) == 2
    assert blocks.record(first, table, 2, 12) == 3 and len(blocks) == 3
    same = _request("b", list(range(12)) + [50, 51])
    assert blocks.prefix(same, table, limit=12) == 12
    assert blocks.prefix(same, table, limit=11) == 8  # whole blocks within the limit
    assert blocks.prefix(same, (7, 3, 2), limit=12) == 8  # another block id: not held
    other_start = _request("c", [99] + list(range(1, 12)))  # chained: nothing after differs
    assert blocks.prefix(other_start, table, limit=12) == 0


def test_a_write_into_a_block_forgets_it_until_recorded_again() -> None:
    blocks = DraftBlocks(BS)
    request = _request("a", list(range(12)))
    table = (7, 3, 9)
    blocks.record(request, table, 0, 12)
    # a one-token chunk at position 5 writes into block 3 only
    blocks.writing([ScheduledChunk("x", (1,), 5, (7, 3), sample=True)])
    assert blocks.prefix(request, table, limit=12) == 4
    blocks.record(request, table, 1, 12)
    assert blocks.prefix(request, table, limit=12) == 12
    # block 3 reused for other content: its record stays, but no longer matches
    reused = _request("b", list(range(4)) + [60, 61, 62, 63] + list(range(8, 12)))
    assert blocks.prefix(reused, table, limit=12) == 4
    # a write made around the drafter names its blocks: their records go
    blocks.forget([3])
    assert blocks.prefix(request, table, limit=12) == 4


def test_on_the_cpu_a_tp_groups_pool_fits_the_budget_all_ranks_together(llama_dir: Path) -> None:
    """The ranks of a CPU TP group share the host's memory: max_kv_bytes bounds their KV
    together (each rank's pool was sized to all of it, TP times the budget in all)."""
    from engine.config import CacheConfig, EngineConfig, ParallelConfig, load_model_config
    from engine.core.runner import kv_bytes_per_block, resolve_num_kv_blocks

    budget = 1 << 20
    for tp in (1, 2):
        config = EngineConfig(model=load_model_config(llama_dir),
                              cache=CacheConfig(max_kv_bytes=budget),
                              parallel=ParallelConfig(tensor_parallel_size=tp))
        group = sum(kv_bytes_per_block(config, rank) for rank in range(tp))
        blocks = resolve_num_kv_blocks(config)
        assert blocks * group <= budget < (blocks + 1) * group, tp
