"""The CPU attention backend's batching of fresh prefill chunks."""

from __future__ import annotations

import torch

from engine.attention.metadata import PrefillSpan
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
