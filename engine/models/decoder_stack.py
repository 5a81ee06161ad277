"""The CPU decode step's fast path: a Llama-family model hands its whole forward for a
decode step (the token embedding, the RoPE lookup, every decoder layer, the final norm)
to one call of pdserve's compiled kernels (``NativeKernels.decoder_step``) instead of
about a dozen torch calls per layer. The kernels and their order are the ones the
per-layer forward would run at that batch size (the GEMV or the packed GEMM, RMSNorm,
RoPE, the KV write, the paged attention, SwiGLU), so the hidden states come out the same
to the bit; what goes is the interpreter and dispatch time between them, a large part of
a small model's step (at batch 1, and still at batch 32): after a step has streamed the
weights through the caches, each torch call the interpreter makes runs cold.

Used only where the per-layer forward would run exactly those kernels: fp32 on the CPU,
one rank (no all-reduce between the layers), the compiled attention backend, every
decoder linear on the ``onednn_gemv``, ``packed`` or ``int8_packed`` kernel (the measured
choice, ``engine.kernels.choice``; all hand up to 3 rows to the GEMV) or on
``packed_gemm`` / ``int8_packed_gemm`` (a speculating engine's: their GEMM takes every row
count, and so it does in the stack), a decode-only step of at most ``GEMV_MAX_ROWS``
tokens, or ``STACK_MAX_ROWS`` where every one is on a kernel with panels (``packed``,
``int8_packed`` and those two: the compiled code calls their GEMMs too), and no layer hook (the prefill
worker's layer-wise KV sending needs the forward to stop after each layer).
``PDSERVE_CPU_DECODER_STACK=0`` keeps the per-layer forward (read whenever the stack is
built: at the first small step, and after any linear layer in the process is given a
kernel); ``PDSERVE_CPU_KERNELS=0`` turns off all compiled kernels. A token id outside the
vocabulary, a position outside the RoPE tables, or a slot or block id outside the cache
raises ``IndexError`` before anything is written (the per-layer forward raises once it
reaches the bad one).
"""

from __future__ import annotations

import os
from typing import TYPE_CHECKING, Any

import torch

from engine.attention.metadata import AttentionMetadata
from engine.kernels.cpu import (
    KV_KINDS,
    DecoderEnds,
    DecoderLayers,
    DecoderLayerWeights,
    DecoderShape,
    NativeKernels,
    decoder_step_takes,
    native,
)
from engine.kernels.linear import KERNELS

if TYPE_CHECKING:
    from engine.models.layers import _Linear

# engine.models.llama's model and decoder layer (typed loosely: llama imports this module)
LlamaForCausalLM = Any
DecoderLayer = Any

# the linear kernels the stack runs: rows <= 3 to the GEMV (int8_packed's over int8
# weights), except the *_gemm ones', which their GEMM takes at every row count
GEMV_KERNELS = ("onednn_gemv", "packed", "int8_packed", "packed_gemm", "int8_packed_gemm")
PANEL_KERNELS = ("packed", "int8_packed", "packed_gemm", "int8_packed_gemm")
INT8_KERNELS = ("int8_packed", "int8_packed_gemm")
ENV = "PDSERVE_CPU_DECODER_STACK"  # "0": always the per-layer forward (to compare the two)


class CompiledDecoderStack:
    """The model's layers (and embedding, RoPE tables, final norm) laid out for
    ``decoder_step``: ``build`` makes one where the model can use it (the model builds it
    again after ``set_kernel`` on any linear, and after ``set_kv_cache``), ``takes``
    whether one step's inputs are for it, ``run`` runs it."""

    def __init__(self, kernels: NativeKernels, layers: DecoderLayers) -> None:
        self._kernels = kernels
        self._layers = layers  # holds the weights and caches it points to
        # Qwen3's per-head q/k norms: the per-layer forward norms two tokens' heads with
        # torch (not laid out for the compiled RMSNorm), so the stack takes one token
        self.max_rows = 1 if layers.layers[0].q_norm is not None else layers.max_rows

    @classmethod
    def build(cls, model: LlamaForCausalLM) -> CompiledDecoderStack | None:
        """The compiled stack for ``model``, or ``None`` where it would not run the same
        kernels as the per-layer forward (see the module docstring)."""
        layers = model.decoder_layers
        # the compiled attention backend is chosen only where the kernels loaded (fp32 on
        # the CPU): checked first, so no other model ever builds the library for this
        if not layers or layers[0].self_attn.backend.name != "cpu":
            return None
        if os.environ.get(ENV, "1").strip().lower() in ("0", "false", "no", "off"):
            return None
        kernels = native()
        if kernels is None or layers[0].input_layernorm.weight.dtype != torch.float32:
            return None
        first = layers[0].self_attn
        if first.o_proj.tp.size != 1 or first.kv_cache.numel() == 0:
            return None
        cfg = model.cfg
        shape = DecoderShape(
            hidden=cfg.hidden_size, num_q_heads=cfg.num_heads, num_kv_heads=cfg.num_kv_heads,
            head_dim=cfg.head_dim, intermediate=cfg.intermediate_size,
            num_cache_blocks=first.kv_cache.shape[1], block_size=first.kv_cache.shape[2],
            rms_eps=cfg.rms_norm_eps, scale=first.scale,
            kv_kind=KV_KINDS[first.kv_cache.dtype])
        if not kernels.supports_decoder_stack(shape):
            return None
        names = {linear.kernel_name for layer in layers for linear in _linears(layer)}
        if not names <= set(GEMV_KERNELS) or len({KERNELS[n].gemv for n in names}) > 1:
            return None  # (a GEMV for some weights and not others: not laid out for it)
        try:
            stack = DecoderLayers(shape, [_weights(layer) for layer in layers],
                                  kernels.panel_floats, _ends(model))
        except ValueError:  # a layout the kernel does not take: the per-layer forward
            return None
        return cls(kernels, stack)

    def takes(self, token_ids: torch.Tensor, positions: torch.Tensor,
              meta: AttentionMetadata) -> bool:
        """Whether a step is for the stack: decode tokens only, at most ``max_rows``
        (``GEMV_MAX_ROWS``, ``STACK_MAX_ROWS`` with every weight packed, 1 with per-head
        q/k norms), its integers as ``decoder_step`` takes them (else the per-layer
        forward runs it)."""
        rows = token_ids.shape[0] if token_ids.dim() == 1 else 0
        return (0 < rows <= self.max_rows and meta.num_decode_tokens == rows
                and not meta.prefills
                and decoder_step_takes(self._layers, token_ids, positions, meta.slot_mapping,
                                       meta.decode_block_tables, meta.decode_context_lens))

    def run(self, token_ids: torch.Tensor, positions: torch.Tensor,
            meta: AttentionMetadata) -> torch.Tensor:
        """The model's forward for a decode step ``takes`` said yes to: the final norm's
        output ``[B, hidden]`` for ``token_ids [B]`` at ``positions [B]``."""
        return self._kernels.decoder_step(self._layers, token_ids, positions,
                                          meta.slot_mapping, meta.decode_block_tables,
                                          meta.decode_context_lens)


def _linears(layer: DecoderLayer) -> list[_Linear]:
    attn, mlp = layer.self_attn, layer.mlp
    return [attn.qkv_proj, attn.o_proj, mlp.gate_up_proj, mlp.down_proj]


def _weight(linear: _Linear) -> torch.Tensor:
    """The weight the GEMV reads: ``onednn_gemv``'s or ``packed``'s (``W``, contiguous),
    ``int8_packed``'s int8 ``q`` (and the *_gemm kernels', which the stack hands no GEMV)."""
    if linear.kernel_name in INT8_KERNELS:
        q: torch.Tensor = linear._prepared.weight.q
        return q
    weight: torch.Tensor = linear._prepared.weight
    return weight


def _scales(linear: _Linear) -> torch.Tensor | None:
    """``int8_packed``'s scales (the stack's sign that the weight is int8), else none."""
    if linear.kernel_name not in INT8_KERNELS:
        return None
    scales: torch.Tensor = linear._prepared.weight.scales
    return scales


def _panels(linear: _Linear) -> torch.Tensor | None:
    """The packed copy the compiled GEMM reads (a ``PANEL_KERNELS`` kernel's), else none."""
    if linear.kernel_name not in PANEL_KERNELS:
        return None
    panels: torch.Tensor = linear._prepared.panels
    return panels


def _weights(layer: DecoderLayer) -> DecoderLayerWeights:
    attn, mlp = layer.self_attn, layer.mlp
    panels = [_panels(linear) for linear in _linears(layer)]
    if any(p is None for p in panels):  # all four or none: the stack stops at the GEMV's rows
        panels = [None] * 4
    scales = [_scales(linear) for linear in _linears(layer)]
    return DecoderLayerWeights(
        input_norm=layer.input_layernorm.weight.detach(),
        post_norm=layer.post_attention_layernorm.weight.detach(),
        qkv_w=_weight(attn.qkv_proj), qkv_b=_detached(attn.qkv_proj.bias),
        q_norm=None if attn.q_norm is None else attn.q_norm.weight.detach(),
        k_norm=None if attn.k_norm is None else attn.k_norm.weight.detach(),
        o_w=_weight(attn.o_proj), o_b=_detached(attn.o_proj.bias),
        gate_up_w=_weight(mlp.gate_up_proj), down_w=_weight(mlp.down_proj),
        down_b=_detached(mlp.down_proj.bias), kv_cache=attn.kv_cache,
        gemv=KERNELS[attn.qkv_proj.kernel_name].gemv,
        qkv_p=panels[0], o_p=panels[1], gate_up_p=panels[2], down_p=panels[3],
        qkv_s=scales[0], o_s=scales[1], gate_up_s=scales[2], down_s=scales[3])


def _ends(model: LlamaForCausalLM) -> DecoderEnds:
    """The embedding, RoPE tables and final norm (one rank: the whole vocabulary)."""
    return DecoderEnds(embed=model.embed_tokens.weight.detach(), rope_cos=model.rotary.cos,
                       rope_sin=model.rotary.sin, final_norm=model.norm.weight.detach(),
                       final_eps=model.norm.eps)


def _detached(t: torch.Tensor | None) -> torch.Tensor | None:
    return None if t is None else t.detach()
