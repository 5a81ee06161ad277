"""Per-forward attention metadata and the context that carries it to the layers.

The flat token batch of one step is laid out as::

    [ decode tokens: one per decoding sequence | prefill chunk of seq a | prefill chunk of seq b ... ]
      0 .. num_decode_tokens-1                  query_start ..

``slot_mapping[t] = block_id * block_size + offset`` is where token t's K/V is written.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field

import torch


@dataclass
class PrefillSpan:
    """One sequence's prefill chunk inside the flat batch."""

    query_start: int
    num_query_tokens: int
    context_len: int  # tokens in cache for this sequence after this step (cached + chunk)
    block_table: torch.Tensor  # [num_blocks] int64, the sequence's blocks in order


@dataclass
class AttentionMetadata:
    """Everything attention needs to find each token's sequence and KV, built by the
    model runner once per step from block ids (tensors on the step's device)."""

    slot_mapping: torch.Tensor  # [num_tokens] int64
    num_decode_tokens: int
    decode_block_tables: torch.Tensor  # [num_decodes, max_blocks] int64, padded with 0
    decode_context_lens: torch.Tensor  # [num_decodes] int64, including the new token
    max_decode_context_len: int
    prefills: list[PrefillSpan] = field(default_factory=list)
    _key_bias: torch.Tensor | None = field(default=None, init=False, repr=False, compare=False)

    def decode_key_bias(self, width: int, dtype: torch.dtype) -> torch.Tensor:
        """``[num_decodes, width]`` in ``dtype``, added to the decode attention scores: 0
        where key slot j of sequence i is in its context, -inf past it. Built by the first
        layer that asks (backends that mask by context length never do), shared by the rest."""
        bias = self._key_bias
        if bias is None or bias.shape[1] != width or bias.dtype != dtype:
            lens = self.decode_context_lens
            past = torch.arange(width, device=lens.device) >= lens.unsqueeze(1)
            bias = torch.zeros(past.shape, dtype=dtype, device=lens.device)
            self._key_bias = bias = bias.masked_fill_(past, float("-inf"))
        return bias


LayerHook = Callable[[int], None]


@dataclass
class ForwardContext:
    """What a model forward needs besides its inputs. ``layer_hook(layer_idx)`` runs
    after each decoder layer has written its K/V (used for layer-wise KV sending)."""

    attn: AttentionMetadata
    layer_hook: LayerHook | None = None


# Per thread: two engines in one process (a test, a prefill and a decode engine) may run
# forwards on different threads at the same time.
_local = threading.local()


@contextmanager
def forward_context(ctx: ForwardContext) -> Iterator[ForwardContext]:
    """Install ``ctx`` for one forward pass on this thread; refuses nesting, always clears."""
    if getattr(_local, "ctx", None) is not None:
        raise RuntimeError("forward_context is already set: nested forward passes are not allowed")
    _local.ctx = ctx
    try:
        yield ctx
    finally:
        _local.ctx = None


def get_forward_context() -> ForwardContext:
    ctx: ForwardContext | None = getattr(_local, "ctx", None)
    if ctx is None:
        raise RuntimeError("no forward_context is set: attention must run inside a model forward")
    return ctx
