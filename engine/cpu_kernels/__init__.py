"""pdserve's compiled CPU kernels: a batch-1 to 3 GEMV that keeps the memory bus busy,
a GEMM over weights packed in panels for larger batches, a paged decode attention that reads K/V where they lie in the cache, RMSNorm and SwiGLU
in one pass each (torch runs several small kernels for either), the rotary embedding,
a row-wise argmax for greedy sampling, and a whole decoder stack's decode step in one
call (those kernels, layer after layer, over ``DecoderLayers``; ``decoder_step`` adds the
token embedding, the RoPE lookup and the final norm around it).

Contract (used by ``engine.linear_kernels``, ``engine.attention.cpu_backend``, the
model's ``RMSNorm``, ``silu_and_mul`` and ``RotaryEmbedding``, ``engine.sampler`` and
``engine.models.decoder_stack``):

- ``native()`` returns the loaded kernels, building them on first use
  (``engine.cpu_kernels.build``), or ``None`` where they cannot run: not x86-64/ARM
  Linux with a C compiler, the build failed (logged once, with the compiler's output),
  or ``PDSERVE_CPU_KERNELS=0`` in the environment. Callers then use their torch path,
  so a machine without a compiler serves exactly as before, only slower.
- Every kernel takes fp32 CPU tensors (and int64 ids, positions, slots and tables), runs on ``torch.get_num_threads()`` threads of
  torch's own OpenMP pool, and returns a new tensor (``decoder_stack`` updates its
  hidden states in place; it and ``decoder_step`` write the KV cache). ``gemv``,
  ``paged_decode_attention``, ``decoder_stack`` and ``decoder_step`` raise ``ValueError``
  for arguments they do not handle (callers
  check ``supports_*`` first), and so does ``gemm_packed``; ``rms_norm``,
  ``silu_and_mul``, ``rope``, ``argmax_rows``, ``gemv_checked_weight`` and
  ``gemm_packed_checked`` return ``None`` instead, and the caller runs its torch path.
"""

from __future__ import annotations

import ctypes
import logging
import os
import threading
from collections.abc import Callable
from dataclasses import dataclass

import torch

from engine.cpu_kernels.build import BuildError, build

__all__ = ["ENV", "STACK_MAX_ROWS", "BuildError", "DecoderEnds", "DecoderLayerWeights",
           "DecoderLayers", "DecoderShape", "NativeKernels", "decoder_step_takes", "native"]

ENV = "PDSERVE_CPU_KERNELS"
GEMV_MAX_ROWS = 3  # above this a GEMM (oneDNN's or gemm_packed) is faster (on AMD EPYC)
_log = logging.getLogger(__name__)
_lock = threading.Lock()
_loaded: dict[str, NativeKernels | None] = {}

_i64, _ptr, _int, _f32 = ctypes.c_int64, ctypes.c_void_p, ctypes.c_int, ctypes.c_float


def _ptr_of(t: torch.Tensor | None) -> int | None:
    return None if t is None else t.data_ptr()


class DecoderShape(ctypes.Structure):
    """A decoder stack's sizes (``pd_decoder_shape``): hidden, query heads, KV heads,
    head dim, MLP width, the cache's blocks and block size, RMSNorm's eps, the attention
    scale."""

    _fields_ = [("hidden", _i64), ("num_q_heads", _i64), ("num_kv_heads", _i64),
                ("head_dim", _i64), ("intermediate", _i64), ("num_cache_blocks", _i64),
                ("block_size", _i64), ("rms_eps", _f32), ("scale", _f32)]


_LAYER_FIELDS = ("input_norm", "post_norm", "qkv_w", "qkv_b", "q_norm", "k_norm", "o_w", "o_b",
                 "gate_up_w", "down_w", "down_b", "k_cache", "v_cache")
_PANEL_FIELDS = ("qkv_p", "o_p", "gate_up_p", "down_p")  # packed copies of qkv_w .. down_w


class _LayerPointers(ctypes.Structure):
    _fields_ = [(name, _ptr) for name in _LAYER_FIELDS + _PANEL_FIELDS]


@dataclass(frozen=True)
class DecoderLayerWeights:
    """One Llama-family layer for ``decoder_stack``: weights in the checkpoint layout
    (q | k | v heads fused, gate | up fused), the optional biases and per-head q/k norms,
    the layer's KV cache ``[2, num_blocks, block_size, Hk, D]``, and optionally the four
    weights packed by ``NativeKernels.pack_panels`` (all four or none: with them the
    stack takes batches past the GEMV's rows)."""

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
    _fields_ = [("embed", _ptr), ("rope_cos", _ptr), ("rope_sin", _ptr), ("final_norm", _ptr),
                ("vocab", _i64), ("max_positions", _i64), ("final_eps", _f32)]


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
        cache = (2, shape.num_cache_blocks, shape.block_size, hk, d)
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
            for name, size in want.items():
                t = getattr(layer, name)
                if t is None and name in ("qkv_b", "q_norm", "k_norm", "o_b", "down_b"):
                    continue
                if not (t.shape == size and t.dtype == torch.float32 and t.is_contiguous()
                        and t.device.type == "cpu"):
                    raise ValueError(f"layer {i}: {name} must be a contiguous fp32 CPU "
                                     f"tensor {size}, got {tuple(t.shape)} {t.dtype}")
            entry = self.table[i]
            for name in _LAYER_FIELDS[:-2]:
                setattr(entry, name, _ptr_of(getattr(layer, name)))
            entry.k_cache = layer.kv_cache[0].data_ptr()
            entry.v_cache = layer.kv_cache[1].data_ptr()
            if self.max_rows == GEMV_MAX_ROWS:
                continue
            assert panel_floats is not None
            for name, weight in zip(_PANEL_FIELDS, ("qkv_w", "o_w", "gate_up_w", "down_w"),
                                    strict=True):
                t, size = getattr(layer, name), want[weight]
                if not (t.dim() == 1 and t.numel() == panel_floats(*size)
                        and t.dtype == torch.float32 and t.is_contiguous()
                        and t.device.type == "cpu"):
                    raise ValueError(f"layer {i}: {name} must be {weight} packed by pack_panels "
                                     f"({panel_floats(*size)} contiguous fp32 CPU floats), "
                                     f"got {tuple(t.shape)} {t.dtype}")
                setattr(entry, name, t.data_ptr())


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


class NativeKernels:
    """The loaded library's kernels as torch functions."""

    def __init__(self, library: ctypes.CDLL, path: str) -> None:
        self.path = path
        self._gemv = library.pd_gemv_f32
        self._gemv.argtypes = [_ptr, _i64, _i64, _ptr, _i64, _ptr, _ptr, _int]
        self._gemv.restype = _int
        self._attn = library.pd_paged_decode_attention_f32
        self._attn.argtypes = [_ptr, _i64, _ptr, _ptr, _i64, _i64, _i64, _i64, _i64,
                               _ptr, _i64, _ptr, _i64, _f32, _ptr, _int]
        self._attn.restype = _int
        self._rms_norm = library.pd_rms_norm_f32
        self._rms_norm.argtypes = [_ptr, _i64, _i64, _ptr, _f32, _ptr, _int]
        self._rms_norm.restype = _int
        self._silu_mul = library.pd_silu_mul_f32
        self._silu_mul.argtypes = [_ptr, _i64, _i64, _ptr, _int]
        self._silu_mul.restype = _int
        self._argmax = library.pd_argmax_rows_f32
        self._argmax.argtypes = [_ptr, _i64, _i64, _i64, _ptr, _int]
        self._argmax.restype = _int
        self._rope = library.pd_rope_f32
        self._rope.argtypes = [_ptr, _i64, _i64, _i64, _i64, _ptr, _ptr, _ptr, _int]
        self._rope.restype = _int
        self._write_kv = library.pd_write_kv_f32
        self._write_kv.argtypes = [_ptr, _i64, _ptr, _i64, _i64, _i64, _ptr, _i64, _ptr, _ptr]
        self._write_kv.restype = _int
        self._gemm = library.pd_gemm_packed_f32
        self._gemm.argtypes = [_ptr, _i64, _i64, _ptr, _i64, _ptr, _ptr, _int]
        self._gemm.restype = _int
        self._panel_floats = library.pd_gemm_panel_floats
        self._panel_floats.argtypes = [_i64, _i64]
        self._panel_floats.restype = _i64
        width = library.pd_gemm_panel_width
        width.restype = _i64
        self.panel_width = int(width())  # output features per panel of gemm_packed's weight
        self._stack = library.pd_decoder_stack_f32
        self._stack.argtypes = [_ptr, _i64, _ptr, _ptr, _i64, _ptr, _ptr, _ptr, _ptr, _i64,
                                _ptr, _ptr, _int]
        self._stack.restype = _int
        self._stack_scratch = library.pd_decoder_scratch_floats
        self._stack_scratch.argtypes = [_ptr]
        self._stack_scratch.restype = _i64
        self._step = library.pd_decoder_step_f32
        self._step.argtypes = [_ptr, _i64, _ptr, _ptr, _ptr, _ptr, _i64, _ptr, _ptr, _i64, _ptr,
                               _ptr, _ptr, _int]
        self._step.restype = _int
        self._step_scratch = library.pd_decoder_step_scratch_floats
        self._step_scratch.argtypes = [_ptr]
        self._step_scratch.restype = _i64
        self._stack_shape_ok = library.pd_decoder_shape_ok
        self._stack_shape_ok.argtypes = [_ptr]
        self._stack_shape_ok.restype = _int

    def supports_decoder_stack(self, shape: DecoderShape) -> bool:
        """Whether ``decoder_stack`` takes a stack of these sizes (the attention kernel's
        limits: head dim a multiple of 16, at most 64 query heads per KV head)."""
        return bool(self._stack_shape_ok(ctypes.byref(shape)))

    def decoder_stack(self, layers: DecoderLayers, h: torch.Tensor, cos: torch.Tensor,
                      sin: torch.Tensor, slot_mapping: torch.Tensor, block_tables: torch.Tensor,
                      context_lens: torch.Tensor) -> None:
        """A decode step of a whole decoder stack in one call (``DecoderLayers``): ``h
        [B, hidden]`` (contiguous fp32, one token for each of ``B <= layers.max_rows``
        sequences) goes in as the embeddings and comes out as the last layer's output,
        each layer's K/V written to its cache;
        ``cos``, ``sin [B, 1, D]`` as ``rope`` takes them; ``slot_mapping [B]``,
        ``block_tables [B, max_blocks]`` and ``context_lens [B]`` (int64) as
        ``write_kv`` and ``paged_decode_attention`` take them. The same kernels in the same
        order as the model's per-layer forward, so the same result to the bit. Raises
        ``ValueError`` for inputs of other shapes or types, ``IndexError`` for a slot or
        block outside the cache (checked before anything is written)."""
        rows = h.shape[0] if h.dim() == 2 else 0
        shape = layers.shape
        width = shape.head_dim
        if not (0 < rows <= layers.max_rows and h.shape[1] == shape.hidden and h.dtype == torch.float32
                and h.is_contiguous() and h.device.type == "cpu"
                and cos.shape == sin.shape == (rows, 1, width) and cos.is_contiguous()
                and sin.is_contiguous() and cos.dtype == sin.dtype == torch.float32
                and cos.device.type == sin.device.type == "cpu"
                and slot_mapping.shape == (rows,) and context_lens.shape == (rows,)
                and block_tables.dim() == 2 and block_tables.shape[0] == rows
                and block_tables.shape[1] > 0
                and all(t.dtype == torch.int64 and t.is_contiguous() and t.device.type == "cpu"
                        for t in (slot_mapping, block_tables, context_lens))):
            raise ValueError(f"decoder_stack does not take h {tuple(h.shape)} {h.dtype} "
                             f"with these cos/sin, slots, tables and lengths")
        scratch = _work_space(layers, rows, self._stack_scratch(ctypes.byref(shape)))
        rc = self._stack(layers.table, len(layers.table), ctypes.byref(shape), h.data_ptr(), rows,
                         cos.data_ptr(), sin.data_ptr(), slot_mapping.data_ptr(),
                         block_tables.data_ptr(), block_tables.shape[1], context_lens.data_ptr(),
                         scratch.data_ptr(), torch.get_num_threads())
        _raise_for("decoder_stack", rc)

    def decoder_step(self, layers: DecoderLayers, token_ids: torch.Tensor,
                     positions: torch.Tensor, slot_mapping: torch.Tensor,
                     block_tables: torch.Tensor, context_lens: torch.Tensor) -> torch.Tensor:
        """A decode step up to the LM head in one call, over ``DecoderLayers`` built with
        ``ends``: the embeddings of ``token_ids [B]``, RoPE at ``positions [B]``,
        ``decoder_stack``, the final norm; returns its output ``[B, hidden]`` (a new
        tensor), the same to the bit as the model's forward, and writes each layer's K/V.
        Slots, tables and lengths as ``decoder_stack`` takes them. Raises ``ValueError``
        for inputs ``decoder_step_takes`` refuses (layers built without ends among them),
        ``IndexError`` for a token id outside the embedding, a position outside the RoPE
        tables, or a slot or block outside the cache (all checked before anything is
        written)."""
        if not decoder_step_takes(layers, token_ids, positions, slot_mapping, block_tables,
                                  context_lens):
            raise ValueError(f"decoder_step does not take token ids {tuple(token_ids.shape)} "
                             "with these positions, slots, tables and lengths"
                             + ("" if layers.ends_table is not None else
                                " (its layers were built without ends)"))
        assert layers.ends_table is not None  # decoder_step_takes said yes
        rows = token_ids.shape[0]
        shape = layers.shape
        scratch = _work_space(layers, rows, self._step_scratch(ctypes.byref(shape)))
        out = torch.empty(rows, shape.hidden, dtype=torch.float32)
        rc = self._step(layers.table, len(layers.table), ctypes.byref(shape),
                        ctypes.byref(layers.ends_table), token_ids.data_ptr(),
                        positions.data_ptr(), rows, slot_mapping.data_ptr(),
                        block_tables.data_ptr(), block_tables.shape[1], context_lens.data_ptr(),
                        out.data_ptr(), scratch.data_ptr(), torch.get_num_threads())
        _raise_for("decoder_step", rc)
        return out

    def write_kv(self, kv_cache: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                 slot_mapping: torch.Tensor) -> bool:
        """Write ``k``, ``v [T, Hk, D]`` into slots ``slot_mapping [T]`` of ``kv_cache
        [2, num_blocks, block_size, Hk, D]``; ``False`` (nothing written) unless all are
        fp32 CPU tensors with each token's heads contiguous and a contiguous cache, and
        ``slot_mapping`` a 1-d int32/int64 CPU tensor. Raises ``IndexError`` (as
        ``index_copy_`` does) for a slot outside the cache, before writing anything."""
        if not (k.dim() == v.dim() == 3 and kv_cache.dim() == 5 and kv_cache.shape[0] == 2
                and k.dtype == v.dtype == kv_cache.dtype == torch.float32
                and k.device.type == v.device.type == kv_cache.device.type == "cpu"
                and slot_mapping.dim() == 1 and slot_mapping.device.type == "cpu"
                and slot_mapping.dtype in (torch.int32, torch.int64)
                and kv_cache.is_contiguous() and k.shape == v.shape
                and k.shape[1:] == kv_cache.shape[3:] and k.shape[0] == slot_mapping.shape[0]
                and k.stride(2) == v.stride(2) == 1
                and k.stride(1) == v.stride(1) == k.shape[2]):
            return False
        tokens, width = k.shape[0], k.shape[1] * k.shape[2]
        slots = slot_mapping.to(torch.int64).contiguous()
        rc = self._write_kv(k.data_ptr(), k.stride(0) if tokens > 1 else width, v.data_ptr(),
                            v.stride(0) if tokens > 1 else width, tokens, width,
                            slots.data_ptr(), kv_cache.shape[1] * kv_cache.shape[2],
                            kv_cache[0].data_ptr(), kv_cache[1].data_ptr())
        if rc == -3:
            raise IndexError("write_kv: a slot outside the cache")
        return rc == 0

    def rope(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor | None:
        """Rotary embedding (rotate-half layout) of ``x [T, H, D]`` with per-token
        ``cos``, ``sin [T, 1, D]`` (``sin`` as ``(-sin | sin)``): ``x * cos + [x2 | x1] *
        sin`` → a new contiguous ``[T, H, D]``; ``None`` unless the heads of each token of
        ``x`` are contiguous and everything is fp32 on the CPU."""
        if not (x.dim() == 3 and x.dtype == cos.dtype == sin.dtype == torch.float32
                and x.device.type == "cpu" and x.shape[2] % 2 == 0 and x.shape[2] > 0
                and x.stride(2) == 1 and x.stride(1) == x.shape[2]
                and cos.shape == sin.shape == (x.shape[0], 1, x.shape[2])
                and cos.is_contiguous() and sin.is_contiguous()):
            return None
        out = torch.empty(x.shape, dtype=x.dtype)
        rc = self._rope(x.data_ptr(), x.shape[0], x.shape[1], x.shape[2],
                        x.stride(0) if x.shape[0] > 1 else x.shape[1] * x.shape[2],
                        cos.data_ptr(), sin.data_ptr(), out.data_ptr(), torch.get_num_threads())
        return out if rc == 0 else None

    def argmax_rows(self, x: torch.Tensor) -> torch.Tensor | None:
        """``x.argmax(dim=-1)`` of a 2-d fp32 CPU tensor whose rows are contiguous (ties and
        NaN as torch: the first largest, the first NaN), or ``None`` for anything else."""
        if not (x.dtype == torch.float32 and x.device.type == "cpu" and x.dim() == 2
                and x.shape[1] > 0 and x.stride(1) == 1 and x.stride(0) >= x.shape[1]):
            return None
        out = torch.empty(x.shape[0], dtype=torch.int64)
        rc = self._argmax(x.data_ptr(), x.shape[0], x.shape[1], x.stride(0), out.data_ptr(),
                          torch.get_num_threads())
        return out if rc == 0 else None

    def rms_norm(self, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor | None:
        """``x / sqrt(mean(x^2, -1) + eps) * weight`` over the last dim, or ``None`` unless
        ``x`` and ``weight`` are contiguous fp32 CPU tensors of matching width."""
        if not (x.dtype == weight.dtype == torch.float32 and x.device.type == "cpu"
                and x.dim() > 0 and x.is_contiguous() and weight.is_contiguous()
                and weight.shape == (x.shape[-1],) and x.shape[-1] > 0):
            return None
        out = torch.empty_like(x)
        rc = self._rms_norm(x.data_ptr(), x.numel() // x.shape[-1], x.shape[-1],
                            weight.data_ptr(), eps, out.data_ptr(), torch.get_num_threads())
        return out if rc == 0 else None

    def silu_and_mul(self, gate_up: torch.Tensor) -> torch.Tensor | None:
        """SwiGLU ``silu(gate) * up`` of ``gate_up [..., 2 * n]`` (gate | up) → ``[..., n]``,
        or ``None`` unless it is a contiguous fp32 CPU tensor with an even last dim."""
        if not (gate_up.dtype == torch.float32 and gate_up.device.type == "cpu"
                and gate_up.dim() > 0 and gate_up.is_contiguous() and gate_up.shape[-1] > 0
                and gate_up.shape[-1] % 2 == 0):
            return None
        half = gate_up.shape[-1] // 2
        out = torch.empty(*gate_up.shape[:-1], half, dtype=gate_up.dtype)
        rc = self._silu_mul(gate_up.data_ptr(), gate_up.numel() // gate_up.shape[-1], half,
                            out.data_ptr(), torch.get_num_threads())
        return out if rc == 0 else None

    @staticmethod
    def supports_gemv(x: torch.Tensor, weight: torch.Tensor) -> bool:
        """Whether ``gemv`` takes these (at most ``GEMV_MAX_ROWS`` rows of ``x``)."""
        return (x.dtype == weight.dtype == torch.float32 and x.device.type == "cpu"
                and weight.device.type == "cpu" and x.numel() > 0 and weight.numel() > 0
                and x.numel() // x.shape[-1] <= GEMV_MAX_ROWS
                and x.is_contiguous() and weight.is_contiguous() and weight.dim() == 2
                and x.shape[-1] == weight.shape[1])

    def gemv(self, x: torch.Tensor, weight: torch.Tensor,
             bias: torch.Tensor | None = None) -> torch.Tensor:
        """``x [..., in] @ weight[out, in]^T + bias``, for a few rows of ``x``."""
        if not self.supports_gemv(x, weight):
            raise ValueError(f"gemv takes contiguous fp32 CPU tensors and at most "
                             f"{GEMV_MAX_ROWS} rows; got x {tuple(x.shape)} {x.dtype}, "
                             f"weight {tuple(weight.shape)} {weight.dtype}")
        if bias is not None:
            bias = bias.contiguous()
            if (bias.shape != (weight.shape[0],) or bias.dtype != torch.float32
                    or bias.device.type != "cpu"):
                raise ValueError(f"gemv bias must be fp32 [{weight.shape[0]}], got "
                                 f"{tuple(bias.shape)} {bias.dtype}")
        y = self.gemv_checked_weight(x, weight, bias)
        assert y is not None  # supports_gemv said yes
        return y

    def gemv_checked_weight(self, x: torch.Tensor, weight: torch.Tensor,
                            bias: torch.Tensor | None) -> torch.Tensor | None:
        """``gemv`` for a caller that checked ``weight`` (contiguous fp32 CPU ``[out, in]``)
        and ``bias`` (``None`` or contiguous fp32 ``[out]``) once, at load: checks only
        ``x`` (per call), and returns ``None`` where ``x`` is not for the GEMV."""
        if x.dim() == 0 or x.shape[-1] == 0 or weight.shape[0] == 0:
            return None
        rows = x.numel() // x.shape[-1]
        if not (0 < rows <= GEMV_MAX_ROWS and x.dtype == torch.float32 and x.is_contiguous()
                and x.device.type == "cpu" and x.shape[-1] == weight.shape[1]):
            return None
        n = weight.shape[0]
        y = torch.empty(*x.shape[:-1], n, dtype=x.dtype)
        rc = self._gemv(x.data_ptr(), rows, x.shape[-1], weight.data_ptr(), n, _ptr_of(bias),
                        y.data_ptr(), torch.get_num_threads())
        if rc != 0:
            raise ValueError(f"gemv refused its arguments (code {rc})")
        return y

    def panel_floats(self, out_features: int, in_features: int) -> int:
        """Floats of ``pack_panels`` of an ``[out_features, in_features]`` weight."""
        return int(self._panel_floats(out_features, in_features))

    def pack_panels(self, weight: torch.Tensor) -> torch.Tensor:
        """``weight [out, in]`` (fp32 CPU) in ``gemm_packed``'s layout: panels of
        ``panel_width`` output features, each ``[in, panel_width]`` (``W^T`` of those
        rows; the last panel padded with zeros), one flat tensor."""
        if weight.dim() != 2 or weight.dtype != torch.float32 or weight.device.type != "cpu":
            raise ValueError(f"pack_panels takes a 2-d fp32 CPU weight, got "
                             f"{tuple(weight.shape)} {weight.dtype} on {weight.device}")
        n, k = weight.shape
        width = self.panel_width
        padded = torch.zeros(-(-n // width) * width, k, dtype=weight.dtype)
        padded[:n] = weight
        panels = padded.view(-1, width, k).transpose(1, 2).contiguous().view(-1)
        assert panels.numel() == self._panel_floats(n, k)
        return panels

    def gemm_packed(self, x: torch.Tensor, panels: torch.Tensor, out_features: int,
                    bias: torch.Tensor | None = None) -> torch.Tensor:
        """``x [..., in] @ W^T + bias`` from ``panels = pack_panels(W)``, any number of
        rows (the decode batches between the GEMV and a prefill chunk are what it is
        for)."""
        k = x.shape[-1] if x.dim() else 0
        if not (x.dtype == panels.dtype == torch.float32 and x.device.type == "cpu"
                and panels.device.type == "cpu" and panels.is_contiguous() and k > 0
                and x.numel() > 0 and out_features > 0 and panels.numel() == self._panel_floats(out_features, k)):
            raise ValueError(f"gemm_packed takes fp32 CPU tensors and panels of a "
                             f"[{out_features}, {k}] weight; got x {tuple(x.shape)} {x.dtype}, "
                             f"{panels.numel()} panel floats")
        if bias is not None and (bias.shape != (out_features,) or bias.dtype != torch.float32
                                 or bias.device.type != "cpu"):
            raise ValueError(f"gemm_packed bias must be fp32 [{out_features}], got "
                             f"{tuple(bias.shape)} {bias.dtype}")
        y = self.gemm_packed_checked(x.contiguous(), panels, out_features,
                                     None if bias is None else bias.contiguous())
        assert y is not None
        return y

    def gemm_packed_checked(self, x: torch.Tensor, panels: torch.Tensor, out_features: int,
                            bias: torch.Tensor | None) -> torch.Tensor | None:
        """``gemm_packed`` for a caller that made ``panels`` with ``pack_panels`` and
        checked ``bias`` once, at load: checks only ``x`` (per call); ``None`` where ``x``
        is not contiguous fp32 on the CPU with the weight's ``in`` features."""
        if x.dim() == 0 or x.numel() == 0 or not (
                x.dtype == torch.float32 and x.is_contiguous() and x.device.type == "cpu"
                and panels.numel() == self._panel_floats(out_features, x.shape[-1])):
            return None
        rows = x.numel() // x.shape[-1]
        y = torch.empty(*x.shape[:-1], out_features, dtype=x.dtype)
        rc = self._gemm(x.data_ptr(), rows, x.shape[-1], panels.data_ptr(), out_features,
                        _ptr_of(bias), y.data_ptr(), torch.get_num_threads())
        if rc != 0:
            raise ValueError(f"gemm_packed refused its arguments (code {rc})")
        return y

    @staticmethod
    def supports_decode_attention(q: torch.Tensor, kv_cache: torch.Tensor) -> bool:
        """Whether ``paged_decode_attention`` takes q ``[B, Hq, D]`` over this cache."""
        if q.dim() != 3 or kv_cache.dim() != 5 or q.numel() == 0:
            return False
        _, _, block_size, num_kv_heads, head_dim = kv_cache.shape
        num_q_heads = q.shape[1]
        return (q.dtype == kv_cache.dtype == torch.float32 and q.device.type == "cpu"
                and kv_cache.device.type == "cpu" and kv_cache.is_contiguous()
                and q.shape[2] == head_dim and num_q_heads % num_kv_heads == 0
                and q.stride(2) == 1 and q.stride(1) == head_dim
                and (q.shape[0] == 1 or q.stride(0) >= num_q_heads * head_dim)
                and num_q_heads // num_kv_heads <= 64 and head_dim % 16 == 0
                and num_q_heads // num_kv_heads * head_dim <= 8192)

    def paged_decode_attention(self, q: torch.Tensor, kv_cache: torch.Tensor,
                               block_tables: torch.Tensor, context_lens: torch.Tensor,
                               scale: float) -> torch.Tensor:
        """Softmax attention of each sequence's one query token ``q [B, Hq, D]`` over the
        first ``context_lens[i]`` slots of its blocks ``block_tables [B, max_blocks]`` in
        ``kv_cache [2, num_blocks, block_size, Hk, D]`` → ``[B, Hq, D]``. Query heads
        ``h * Hq/Hk .. (h+1) * Hq/Hk - 1`` share KV head ``h`` (GQA/MQA)."""
        if not self.supports_decode_attention(q, kv_cache):
            raise ValueError(f"paged_decode_attention does not take q {tuple(q.shape)} "
                             f"{q.dtype} over a cache {tuple(kv_cache.shape)} {kv_cache.dtype}")
        num_seqs, num_q_heads, head_dim = q.shape
        num_blocks, block_size, num_kv_heads = kv_cache.shape[1:4]
        tables = block_tables.to(torch.int64).contiguous()
        lens = context_lens.to(torch.int64).contiguous()
        if tables.shape[0] != num_seqs or lens.shape != (num_seqs,):
            raise ValueError(f"block_tables {tuple(tables.shape)} and context_lens "
                             f"{tuple(lens.shape)} do not match {num_seqs} sequences")
        out = torch.empty(num_seqs, num_q_heads, head_dim, dtype=q.dtype)
        q_stride = q.stride(0) if num_seqs > 1 else num_q_heads * head_dim
        rc = self._attn(q.data_ptr(), q_stride, kv_cache[0].data_ptr(), kv_cache[1].data_ptr(),
                        num_blocks, block_size, num_kv_heads, head_dim,
                        num_q_heads // num_kv_heads, tables.data_ptr(), tables.shape[1],
                        lens.data_ptr(), num_seqs, scale, out.data_ptr(), torch.get_num_threads())
        if rc != 0:
            what = {-2: "a context length outside its block table",
                    -3: "a block id outside the cache"}.get(rc, f"code {rc}")
            raise ValueError(f"paged_decode_attention refused its arguments: {what}")
        return out


def native() -> NativeKernels | None:
    """The compiled kernels, built and loaded on first call, or ``None`` where they are
    switched off or cannot be built here (see the module docstring). Decided once per
    process (``PDSERVE_CPU_KERNELS`` is read at the first call): later calls are a
    dictionary lookup, cheap enough for every layer's forward."""
    if "kernels" in _loaded:
        return _loaded["kernels"]
    with _lock:
        if "kernels" not in _loaded:
            off = os.environ.get(ENV, "1").strip().lower() in ("0", "false", "no", "off")
            _loaded["kernels"] = None if off else _load()
        return _loaded["kernels"]


def _load() -> NativeKernels | None:
    """Build (or find) and load the library; a cached library that does not load (cut
    short, or from another build) is rebuilt once. Any failure is logged, never raised:
    the engine then runs its torch kernels."""
    try:
        for attempt in (0, 1):
            path = build(rebuild=attempt == 1)
            try:
                return NativeKernels(ctypes.CDLL(str(path)), str(path))
            except (OSError, AttributeError) as e:
                if attempt == 1:
                    raise BuildError(f"the built library {path} does not load: {e}") from e
    except Exception as e:  # noqa: BLE001 - whatever went wrong, serve with torch's kernels
        _log.warning("pdserve's compiled CPU kernels are unavailable, using torch kernels: %s", e)
    return None
