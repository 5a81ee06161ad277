"""The decoder stack's data as the compiled code reads it: its sizes (``DecoderShape``),
each layer's weights and cache (``DecoderLayerWeights``), what surrounds the layers
(``DecoderEnds``), and ``DecoderLayers``, all of them checked once and laid out as the
pointer tables ``decoder.c`` takes (``pd_decoder_layer``, ``pd_decoder_ends``)."""

from __future__ import annotations

import ctypes
from collections.abc import Callable
from dataclasses import dataclass

import torch

from engine.kernels.cpu._ffi import GEMV_MAX_ROWS, f32, i64, ptr, ptr_of


class DecoderShape(ctypes.Structure):
    """A decoder stack's sizes (``pd_decoder_shape``): hidden, query heads, KV heads,
    head dim, MLP width, the cache's blocks and block size, RMSNorm's eps, the attention
    scale, and whether the caches are int8 (``engine.attention.kv_quant``)."""

    _fields_ = [("hidden", i64), ("num_q_heads", i64), ("num_kv_heads", i64),
                ("head_dim", i64), ("intermediate", i64), ("num_cache_blocks", i64),
                ("block_size", i64), ("rms_eps", f32), ("scale", f32), ("kv_kind", i64)]


KV_KINDS = {torch.float32: 0, torch.uint8: 1, torch.float8_e4m3fn: 2, torch.float8_e5m2: 3}
"""The kernels' ``kind`` of a KV cache of each dtype (kernels.h's ``KV_F32`` .. ``KV_E5M2``:
the decode attention's last argument, ``DecoderShape.kv_kind``): fp32, int8 slots
(``engine.attention.kv_quant``), fp8 e4m3, fp8 e5m2."""


_LAYER_FIELDS = ("input_norm", "post_norm", "qkv_w", "qkv_b", "q_norm", "k_norm", "o_w", "o_b",
                 "gate_up_w", "down_w", "down_b", "k_cache", "v_cache")
_WEIGHT_FIELDS = ("qkv_w", "o_w", "gate_up_w", "down_w")
_PANEL_FIELDS = ("qkv_p", "o_p", "gate_up_p", "down_p")  # packed copies of qkv_w .. down_w
_SCALE_FIELDS = ("qkv_s", "o_s", "gate_up_s", "down_s")  # their scales, where int8


class _LayerPointers(ctypes.Structure):
    _fields_ = [(name, ptr) for name in _LAYER_FIELDS + _PANEL_FIELDS + _SCALE_FIELDS]


@dataclass(frozen=True)
class DecoderLayerWeights:
    """One Llama-family layer for ``decoder_stack``: weights in the checkpoint layout
    (q | k | v heads fused, gate | up fused), the optional biases and per-head q/k norms,
    the layer's KV cache ``[2, num_blocks, block_size, Hk, D]`` (an int8 cache's last axis
    ``D + 4`` uint8, an fp8 cache's fp8: ``DecoderShape.kv_kind``), and optionally the four
    weights packed by ``NativeKernels.pack_panels`` (all four or none: with them the
    stack takes batches past the GEMV's rows). A weight given with its scales
    (``*_s [out]`` fp32, ``engine.kernels.quant``) is int8, and so are its panels."""

    input_norm: torch.Tensor
    post_norm: torch.Tensor
    qkv_w: torch.Tensor
    qkv_b: torch.Tensor | None
    q_norm: torch.Tensor | None
    k_norm: torch.Tensor | None
    o_w: torch.Tensor
    o_b: torch.Tensor | None
    gate_up_w: torch.Tensor
    down_w: torch.Tensor
    down_b: torch.Tensor | None
    kv_cache: torch.Tensor
    qkv_p: torch.Tensor | None = None
    o_p: torch.Tensor | None = None
    gate_up_p: torch.Tensor | None = None
    down_p: torch.Tensor | None = None
    qkv_s: torch.Tensor | None = None
    o_s: torch.Tensor | None = None
    gate_up_s: torch.Tensor | None = None
    down_s: torch.Tensor | None = None
    gemv: bool = True  # False: the panels (needed then) at every row count, no GEMV


@dataclass(frozen=True)
class DecoderEnds:
    """What ``decoder_step`` reads around the layers: the input embedding ``[vocab,
    hidden]``, the rotary module's cos and sin tables ``[max_positions, head_dim / 2]``
    (of position x inverse frequency) and the final norm's weight ``[hidden]`` and eps."""

    embed: torch.Tensor
    rope_cos: torch.Tensor
    rope_sin: torch.Tensor
    final_norm: torch.Tensor
    final_eps: float


class _EndsPointers(ctypes.Structure):
    _fields_ = [("embed", ptr), ("rope_cos", ptr), ("rope_sin", ptr), ("final_norm", ptr),
                ("vocab", i64), ("max_positions", i64), ("final_eps", f32)]


STACK_MAX_ROWS = 256  # decode rows one decoder_stack call takes where every weight is packed


class DecoderLayers:
    """A decoder stack's weights and caches checked once and laid out for one
    ``decoder_stack`` (or ``decoder_step``) call per step. Holds the tensors, so the pointers it hands the
    kernel stay valid while it lives, and the kernel's work space (so one call at a time,
    as a model's forward runs); ``ValueError`` for any tensor of the wrong shape, type or
    layout. ``max_rows``: ``STACK_MAX_ROWS`` where every layer has its packed weights,
    else ``GEMV_MAX_ROWS``. With ``ends`` it also takes ``decoder_step``."""

    def __init__(self, shape: DecoderShape, layers: list[DecoderLayerWeights],
                 panel_floats: Callable[[int, int], int] | None = None,
                 ends: DecoderEnds | None = None) -> None:
        hidden, d, inter = shape.hidden, shape.head_dim, shape.intermediate
        hq, hk = shape.num_q_heads, shape.num_kv_heads
        if not layers or min(hidden, d, inter, hq, hk) < 1 or hq % hk:
            raise ValueError(f"decoder stack of {len(layers)} layers with sizes {hidden=} "
                             f"{d=} {inter=} {hq=} {hk=}")
        cache = (2, shape.num_cache_blocks, shape.block_size, hk,
                 d + 4 if shape.kv_kind == KV_KINDS[torch.uint8] else d)
        want = {"input_norm": (hidden,), "post_norm": (hidden,),
                "qkv_w": ((hq + 2 * hk) * d, hidden), "qkv_b": ((hq + 2 * hk) * d,),
                "q_norm": (d,), "k_norm": (d,), "o_w": (hidden, hq * d), "o_b": (hidden,),
                "gate_up_w": (2 * inter, hidden), "down_w": (hidden, inter),
                "down_b": (hidden,), "kv_cache": cache}
        self.shape = DecoderShape.from_buffer_copy(shape)  # checked once: not the caller's to change
        self.layers = list(layers)
        self.scratch: torch.Tensor | None = None  # the kernel's work space, grown as needed
        packed = [all(getattr(layer, f) is not None for f in _PANEL_FIELDS) for layer in layers]
        if any(any(getattr(layer, f) is not None for f in _PANEL_FIELDS) and not full
               for layer, full in zip(layers, packed, strict=True)):
            raise ValueError("a layer's packed weights come all four or none")
        self.max_rows = STACK_MAX_ROWS if all(packed) else GEMV_MAX_ROWS
        if self.max_rows > GEMV_MAX_ROWS and panel_floats is None:
            raise ValueError("packed weights need panel_floats to be checked")
        self.ends = ends
        self.ends_table = None if ends is None else _ends_pointers(shape, ends)
        self.table = (_LayerPointers * len(layers))()
        for i, layer in enumerate(layers):
            if (layer.q_norm is None) != (layer.k_norm is None):
                raise ValueError(f"layer {i}: q_norm and k_norm come together")
            int8 = {w: getattr(layer, f) is not None
                    for w, f in zip(_WEIGHT_FIELDS, _SCALE_FIELDS, strict=True)}
            for name, size in want.items():
                t = getattr(layer, name)
                if t is None and name in ("qkv_b", "q_norm", "k_norm", "o_b", "down_b"):
                    continue
                dtype = _dtype(name, int8.get(name, False), shape.kv_kind)
                if not (t.shape == size and t.dtype == dtype and t.is_contiguous()
                        and t.device.type == "cpu"):
                    raise ValueError(f"layer {i}: {name} must be a contiguous {dtype} CPU "
                                     f"tensor {size}, got {tuple(t.shape)} {t.dtype}")
            entry = self.table[i]
            for weight, name in zip(_WEIGHT_FIELDS, _SCALE_FIELDS, strict=True):
                t, rows = getattr(layer, name), want[weight][0]
                if t is not None and not (t.shape == (rows,) and t.dtype == torch.float32
                                          and t.is_contiguous() and t.device.type == "cpu"):
                    raise ValueError(f"layer {i}: {name} must be a contiguous fp32 CPU "
                                     f"tensor ({rows},), got {tuple(t.shape)} {t.dtype}")
                setattr(entry, name, ptr_of(t))
            for name in _LAYER_FIELDS[:-2]:
                setattr(entry, name, ptr_of(getattr(layer, name)))
            entry.k_cache = layer.kv_cache[0].data_ptr()
            entry.v_cache = layer.kv_cache[1].data_ptr()
            if self.max_rows > GEMV_MAX_ROWS:
                assert panel_floats is not None
                _point_at_panels(entry, i, layer, int8, want, panel_floats)
            elif not layer.gemv:
                raise ValueError(f"layer {i}: without the GEMV it needs its packed weights")


def _point_at_panels(entry: _LayerPointers, i: int, layer: DecoderLayerWeights,
                     int8: dict[str, bool], want: dict[str, tuple[int, ...]],
                     panel_floats: Callable[[int, int], int]) -> None:
    """Layer ``i``'s table ``entry`` pointed at its packed weights, checked; without the
    GEMV (``layer.gemv`` False), at them alone: the kernel reads a weight's panels at any
    row count when it has no pointer to the weight itself."""
    for name, weight in zip(_PANEL_FIELDS, _WEIGHT_FIELDS, strict=True):
        t, size = getattr(layer, name), want[weight]
        dtype = torch.int8 if int8[weight] else torch.float32
        rows, cols = size
        if not (t.dim() == 1 and t.numel() == panel_floats(rows, cols)
                and t.dtype == dtype and t.is_contiguous() and t.device.type == "cpu"):
            raise ValueError(f"layer {i}: {name} must be {weight} packed by pack_panels "
                             f"({panel_floats(rows, cols)} contiguous {dtype} CPU values), "
                             f"got {tuple(t.shape)} {t.dtype}")
        setattr(entry, name, t.data_ptr())
        if not layer.gemv:
            setattr(entry, weight, None)


def _dtype(name: str, int8_weight: bool, kv_kind: int) -> torch.dtype:
    """What a layer's tensor ``name`` must hold: int8 weights, the cache's dtype of
    ``kv_kind``, else fp32."""
    if name == "kv_cache":
        return next(dtype for dtype, kind in KV_KINDS.items() if kind == kv_kind)
    return torch.int8 if int8_weight else torch.float32


def _ends_pointers(shape: DecoderShape, ends: DecoderEnds) -> _EndsPointers:
    vocab = ends.embed.shape[0] if ends.embed.dim() == 2 else 0
    max_positions = ends.rope_cos.shape[0] if ends.rope_cos.dim() == 2 else 0
    want = {"embed": (vocab, shape.hidden), "rope_cos": (max_positions, shape.head_dim // 2),
            "rope_sin": (max_positions, shape.head_dim // 2), "final_norm": (shape.hidden,)}
    for name, size in want.items():
        t = getattr(ends, name)
        if not (t.shape == size and min(size) > 0 and t.dtype == torch.float32
                and t.is_contiguous() and t.device.type == "cpu"):
            raise ValueError(f"decoder ends: {name} must be a contiguous fp32 CPU tensor "
                             f"{size}, got {tuple(t.shape)} {t.dtype}")
    return _EndsPointers(ends.embed.data_ptr(), ends.rope_cos.data_ptr(),
                         ends.rope_sin.data_ptr(), ends.final_norm.data_ptr(), vocab,
                         max_positions, ends.final_eps)


def _work_space(layers: DecoderLayers, rows: int, per_row: int) -> torch.Tensor:
    """``layers``' kernel work space, at least ``rows * per_row`` floats: sized for the
    GEMV's rows, then for twice the most rows seen (reused by every step)."""
    if layers.scratch is None or layers.scratch.numel() < rows * per_row:
        most = GEMV_MAX_ROWS if rows <= GEMV_MAX_ROWS else min(2 * rows, layers.max_rows)
        layers.scratch = torch.empty(most * per_row, dtype=torch.float32)
    return layers.scratch


def _int64_cpu(t: torch.Tensor) -> bool:
    return t.dtype == torch.int64 and t.is_contiguous() and t.device.type == "cpu"


def decoder_step_takes(layers: DecoderLayers, token_ids: torch.Tensor, positions: torch.Tensor,
                       slot_mapping: torch.Tensor, block_tables: torch.Tensor,
                       context_lens: torch.Tensor) -> bool:
    """Whether ``NativeKernels.decoder_step`` takes these inputs (their values aside):
    layers built with ends, 1 to ``layers.max_rows`` rows, contiguous int64 CPU tensors,
    ``block_tables [rows, max_blocks >= 1]``."""
    rows = token_ids.shape[0] if token_ids.dim() == 1 else 0
    return (layers.ends_table is not None and 0 < rows <= layers.max_rows
            and all(t.shape == (rows,) and _int64_cpu(t)
                    for t in (token_ids, positions, slot_mapping, context_lens))
            and block_tables.dim() == 2 and block_tables.shape[0] == rows
            and block_tables.shape[1] > 0 and _int64_cpu(block_tables))


_INDEX_ERRORS = {-3: "a slot outside the cache", -4: "a block id outside the cache",
                 -5: "a token id outside the embedding", -6: "a position outside the RoPE tables"}


def _raise_for(kernel: str, rc: int) -> None:
    """The error for a decoder kernel's return code (0: none)."""
    if rc in _INDEX_ERRORS:
        raise IndexError(f"{kernel}: {_INDEX_ERRORS[rc]}")
    if rc != 0:
        what = {-2: "a context length outside its block table"}.get(rc, f"code {rc}")
        raise ValueError(f"{kernel} refused its arguments: {what}")
