"""Per-forward attention metadata and the context that carries it to the layers.

The flat token batch of one step is laid out as::

    [ decode tokens: one per decoding sequence | prefill chunk of seq a | prefill chunk of seq b ... ]
      0 .. num_decode_tokens-1                  query_start ..

``slot_mapping[t] = block_id * block_size + offset`` is where token t's K/V is written.
"""

from __future__ import annotations

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
    slot_mapping: torch.Tensor  # [num_tokens] int64
    num_decode_tokens: int
    decode_block_tables: torch.Tensor  # [num_decodes, max_blocks] int64, padded with 0
    decode_context_lens: torch.Tensor  # [num_decodes] int64, including the new token
    max_decode_context_len: int
    # [num_decodes, max_blocks * block_size] bool: key slot j of sequence i is valid
    decode_key_mask: torch.Tensor
    prefills: list[PrefillSpan] = field(default_factory=list)


LayerHook = Callable[[int], None]


@dataclass
class ForwardContext:
    """What a model forward needs besides its inputs. ``layer_hook(layer_idx)`` runs
    after each decoder layer has written its K/V (used for layer-wise KV sending)."""

    attn: AttentionMetadata
    layer_hook: LayerHook | None = None


_current: ForwardContext | None = None


@contextmanager
def forward_context(ctx: ForwardContext) -> Iterator[ForwardContext]:
    """Install ``ctx`` for one forward pass; refuses nesting and always clears."""
    global _current
    if _current is not None:
        raise RuntimeError("forward_context is already set: nested forward passes are not allowed")
    _current = ctx
    try:
        yield ctx
    finally:
        _current = None


def get_forward_context() -> ForwardContext:
    if _current is None:
        raise RuntimeError("no forward_context is set: attention must run inside a model forward")
    return _current
