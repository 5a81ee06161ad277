"""The CPU attention backends: batching of fresh prefill chunks, and decode attention
(torch SDPA, and pdserve's compiled paged decode kernel)."""

from __future__ import annotations

import pytest
import torch

from engine.attention.cpu_backend import CpuAttentionBackend
from engine.attention.metadata import AttentionMetadata, PrefillSpan
from engine.attention.torch_backend import TorchAttentionBackend, fresh_runs
from engine.kernels.cpu import native

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


def _compiled() -> CpuAttentionBackend:
    kernels = native()
    if kernels is None:
        pytest.skip("pdserve's compiled CPU kernels could not be built here")
    return CpuAttentionBackend(kernels)


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
        _check_decode_attention(TorchAttentionBackend(), num_q_heads, num_kv_heads, dtype,
                                block_size=4, head_dim=8)
    finally:
        torch.set_default_device(None)


@pytest.mark.parametrize("block_size,head_dim", [(4, 16), (32, 32), (16, 64)])
@pytest.mark.parametrize("num_q_heads,num_kv_heads", [(4, 4), (8, 2), (6, 1)])
def test_compiled_decode_attention_matches_dense_attention_per_sequence(
        num_q_heads: int, num_kv_heads: int, block_size: int, head_dim: int) -> None:
    """The compiled kernel, over runs of 16 keys that end at a block's end (block size
    4), fill part of a block (32) or exactly one (16), contexts ending mid-run."""
    torch.manual_seed(1)
    _check_decode_attention(_compiled(), num_q_heads, num_kv_heads, torch.float32,
                            block_size=block_size, head_dim=head_dim)


@pytest.mark.parametrize("block_size", [1, 64])
def test_compiled_decode_attention_with_many_sequences(block_size: int) -> None:
    """Enough sequences that a task takes all KV heads of one (the split the kernel
    makes when every thread gets two tasks anyway), one-slot and 64-slot blocks."""
    torch.manual_seed(3)
    _check_decode_attention(_compiled(), 8, 2, torch.float32, block_size=block_size,
                            head_dim=32, num_seqs=9)


@pytest.mark.parametrize("kind", ["fp32", "int8"])
def test_compiled_decode_attention_reads_a_speculated_chunks_rows_as_one(kind: str) -> None:
    """Rows with the same block table (a speculated chunk's tokens, each up to its own
    position) are attended in one task, each run of keys read once for all of them: the
    output is bitwise each row's alone. 18 rows of one table are more than a task holds
    (16 at 4 query heads per KV head and head_dim 64), then a row of another table, then
    two more of the first; contexts end mid-run, on a block's end and past the others'."""
    from engine.attention.kv_quant import quantize

    torch.manual_seed(7)
    kernels = _compiled().kernels
    hq, hk, d, bs, num_blocks = 8, 2, 64, 16, 12
    cache = torch.randn(2, num_blocks, bs, hk, d)
    if kind == "int8":
        cache = quantize(cache)
    table, other = [3, 7, 1, 9, 0], [5, 2, 11, 0, 0]
    lens = [40 + i for i in range(18)] + [33, 64, 65]
    tables = torch.tensor([table] * 18 + [other] + [table] * 2)
    q = torch.randn(len(lens), hq, d)
    together = kernels.paged_decode_attention(q, cache, tables, torch.tensor(lens), 0.125)
    for i, n in enumerate(lens):
        alone = kernels.paged_decode_attention(q[i:i + 1], cache, tables[i:i + 1],
                                               torch.tensor([n]), 0.125)
        assert torch.equal(together[i], alone[0]), i


def test_compiled_backend_runs_a_mixed_step_as_the_torch_backend() -> None:
    """Two decodes, a fresh prefill chunk and one over cached keys in one forward: the
    same output and the same cache as the torch backend, each token's K/V written
    once."""
    torch.manual_seed(5)
    hq, hk, d, bs = 4, 2, 16, 4
    blocks = {0: [3, 7], 1: [1, 9, 12], 2: [4, 5], 3: [2, 6, 8]}
    decodes = [(0, 6), (1, 10)]  # (sequence, context length including the new token)
    # sequence 2: a fresh 5-token chunk; sequence 3: 3 new tokens after 6 cached ones
    spans = [PrefillSpan(2, 5, 5, torch.tensor(blocks[2])),
             PrefillSpan(7, 3, 9, torch.tensor(blocks[3]))]
    positions = [n - 1 for _, n in decodes] + list(range(5)) + list(range(6, 9))
    owners = [s for s, _ in decodes] + [2] * 5 + [3] * 3
    slots = torch.tensor([blocks[s][p // bs] * bs + p % bs for s, p in zip(owners, positions)])
    lens = torch.tensor([n for _, n in decodes])
    tables = torch.tensor([blocks[0] + [0], blocks[1]])
    meta = AttentionMetadata(
        slot_mapping=slots, num_decode_tokens=2, decode_block_tables=tables,
        decode_context_lens=lens, max_decode_context_len=10, prefills=spans)
    qk = torch.randn(10, hq + hk, d)
    q, k = qk[:, :hq], qk[:, hq:]
    v = torch.randn(10, (hq + 2 * hk) * d)[:, (hq + hk) * d:].view(10, hk, d)
    cache = torch.randn(2, 16, bs, hk, d)
    theirs, ours = cache.clone(), cache.clone()
    expected = TorchAttentionBackend().forward(q, k, v, theirs, meta, 0.25)
    got = _compiled().forward(q, k, v, ours, meta, 0.25)
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)
    assert torch.equal(ours, theirs)
    assert not torch.equal(ours, cache)


def test_compiled_backend_hands_shapes_it_does_not_take_to_torch() -> None:
    """head_dim 8 is not a multiple of the kernel's 16 lanes, and a q whose tokens
    overlap (stride 0) or interleave with its heads is not a layout it reads: the torch
    path answers."""
    torch.manual_seed(2)
    backend = _compiled()
    cache = torch.empty(2, 16, 4, 2, 16)
    for q in (torch.empty(3, 4, 8), torch.randn(1, 4, 16).expand(3, 4, 16),
              torch.randn(4, 1, 16).transpose(0, 1).expand(2, 4, 16)):
        assert not backend.kernels.supports_decode_attention(
            q, cache if q.shape[2] == 16 else torch.empty(2, 16, 4, 2, 8))
    _check_decode_attention(backend, 4, 2, torch.float32, block_size=4, head_dim=8)


def _check_decode_attention(backend: TorchAttentionBackend, num_q_heads: int, num_kv_heads: int,
                            dtype: torch.dtype, *, block_size: int, head_dim: int,
                            num_seqs: int = 3) -> None:
    width = 3
    num_blocks, scale = max(16, num_seqs * width), 0.3
    kv_cache = torch.randn(2, num_blocks, block_size, num_kv_heads, head_dim, dtype=dtype)
    # 3, 1 and 3 blocks (at block size 4); longer contexts where blocks are larger
    pattern = [2 * block_size + 1, min(3, block_size), 3 * block_size]
    context_lens = [pattern[i % 3] for i in range(num_seqs)]
    perm = torch.randperm(num_blocks).tolist()
    tables = [perm[width * i:width * i + -(-n // block_size)] for i, n in enumerate(context_lens)]
    tables = [t + [0] * (width - len(t)) for t in tables]
    lens = torch.tensor(context_lens)
    meta = AttentionMetadata(
        slot_mapping=torch.empty(0, dtype=torch.int64), num_decode_tokens=num_seqs,
        decode_block_tables=torch.tensor(tables), decode_context_lens=lens,
        max_decode_context_len=max(context_lens))
    # a slice of the q|k heads, as the model passes it
    q = torch.randn(num_seqs, num_q_heads + num_kv_heads, head_dim, dtype=dtype)[:, :num_q_heads]

    out = backend._decode(q, kv_cache, meta, scale).float()

    group = num_q_heads // num_kv_heads
    atol = 1e-5 if dtype == torch.float32 else 2e-2
    for i, (blocks, n) in enumerate(zip(tables, context_lens)):
        keys = kv_cache[0][blocks].flatten(0, 1)[:n].float()  # [n, Hk, D]
        values = kv_cache[1][blocks].flatten(0, 1)[:n].float()
        for h in range(num_q_heads):
            weights = torch.softmax(keys[:, h // group] @ q[i, h].float() * scale, dim=0)
            assert torch.allclose(out[i, h], weights @ values[:, h // group], atol=atol)
