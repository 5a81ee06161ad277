"""The CPU attention backend: batching of fresh prefill chunks, and decode attention."""

from __future__ import annotations

import pytest
import torch

from engine.attention.metadata import AttentionMetadata, PrefillSpan
from engine.attention.torch_backend import TorchAttentionBackend, fresh_runs

BLOCKS = torch.arange(4)


def span(start: int, n: int, ctx: int | None = None) -> PrefillSpan:
    return PrefillSpan(start, n, n if ctx is None else ctx, BLOCKS)


def test_fresh_runs_group_adjacent_equal_chunks_with_nothing_cached() -> None:
    spans = [span(0, 4), span(4, 4), span(8, 4, ctx=12), span(12, 4), span(16, 4), span(20, 3),
             span(24, 3)]
    runs = fresh_runs(spans)
    # a cached chunk breaks a run and is alone; so is a length change; a gap too
    assert [[s.query_start for s in run] for run in runs] == [[0, 4], [8], [12, 16], [20], [24]]
    assert fresh_runs([]) == []


def test_a_batched_run_is_bitwise_the_per_chunk_attention() -> None:
    torch.manual_seed(0)
    num_seqs, n, hq, hk, d = 5, 7, 4, 2, 16
    qk = torch.randn(num_seqs * n, hq + hk, d)
    q, k = qk[:, :hq], qk[:, hq:]  # head slices, as the model passes them
    v = torch.randn(num_seqs * n, hk, d)
    kv_cache = torch.zeros(2, 8, 4, hk, d)
    per_chunk = torch.cat([
        TorchAttentionBackend._prefill(q[i * n:(i + 1) * n], k[i * n:(i + 1) * n],
                                       v[i * n:(i + 1) * n], kv_cache, span(i * n, n), 0.25)
        for i in range(num_seqs)])
    batched = TorchAttentionBackend._prefill_fresh(q, k, v, num_seqs, 0.25)
    assert torch.equal(batched, per_chunk)


@pytest.mark.parametrize("device,dtype", [
    ("cpu", torch.float32),
    pytest.param("cuda", torch.float32, marks=pytest.mark.gpu),
    pytest.param("cuda", torch.bfloat16, marks=pytest.mark.gpu),
])
@pytest.mark.parametrize("num_q_heads,num_kv_heads", [(4, 4), (4, 2), (6, 1)])
def test_decode_attention_matches_dense_attention_per_sequence(
        num_q_heads: int, num_kv_heads: int, device: str, dtype: torch.dtype) -> None:
    """Each decode row attends over exactly its own context (padded table entries and
    slots past its length ignored), with query head h using KV head h // (Hq / Hk)."""
    torch.manual_seed(0)
    torch.set_default_device(device)
    try:
        _check_decode_attention(num_q_heads, num_kv_heads, dtype)
    finally:
        torch.set_default_device(None)


def _check_decode_attention(num_q_heads: int, num_kv_heads: int, dtype: torch.dtype) -> None:
    block_size, head_dim, num_blocks, scale = 4, 8, 16, 0.3
    kv_cache = torch.randn(2, num_blocks, block_size, num_kv_heads, head_dim, dtype=dtype)
    context_lens = [9, 3, 12]  # 3, 1 and 3 blocks
    width = 3
    perm = torch.randperm(num_blocks).tolist()
    tables = [perm[0:3], perm[3:4] + [0, 0], perm[4:7]]
    lens = torch.tensor(context_lens)
    past = torch.arange(width * block_size) >= lens.unsqueeze(1)
    meta = AttentionMetadata(
        slot_mapping=torch.empty(0, dtype=torch.int64), num_decode_tokens=3,
        decode_block_tables=torch.tensor(tables), decode_context_lens=lens,
        max_decode_context_len=max(context_lens),
        decode_key_bias=torch.zeros(past.shape, dtype=dtype).masked_fill_(past, float("-inf")))
    # a slice of the q|k heads, as the model passes it
    q = torch.randn(3, num_q_heads + num_kv_heads, head_dim, dtype=dtype)[:, :num_q_heads]

    out = TorchAttentionBackend._decode(q, kv_cache, meta, scale).float()

    group = num_q_heads // num_kv_heads
    atol = 1e-5 if dtype == torch.float32 else 2e-2
    for i, (blocks, n) in enumerate(zip(tables, context_lens)):
        keys = kv_cache[0][blocks].flatten(0, 1)[:n].float()  # [n, Hk, D]
        values = kv_cache[1][blocks].flatten(0, 1)[:n].float()
        for h in range(num_q_heads):
            weights = torch.softmax(keys[:, h // group] @ q[i, h].float() * scale, dim=0)
            assert torch.allclose(out[i, h], weights @ values[:, h // group], atol=atol)
