"""The paged decode attention's Python face (``attention.c``), and the KV write beside it
(``pointwise.c``)."""

from __future__ import annotations

import ctypes

import torch

from engine.kernels.cpu._ffi import bind, cint, f32, i64, ptr
from engine.kernels.cpu.stack_layout import KV_KINDS

_FP8 = (torch.float8_e4m3fn, torch.float8_e5m2)


class AttentionKernels:
    """``NativeKernels``' KV write and paged decode attention."""

    def _bind_attention(self, library: ctypes.CDLL) -> None:
        self._attn = bind(library, "pd_paged_decode_attention",
                          [ptr, i64, ptr, ptr, i64, i64, i64, i64, i64, ptr, i64, ptr, i64, f32,
                           ptr, cint, cint])
        self._write_kv = bind(library, "pd_write_kv_f32",
                              [ptr, i64, ptr, i64, i64, i64, ptr, i64, ptr, ptr])
        self._write_kv_i8 = bind(library, "pd_write_kv_i8",
                                 [ptr, i64, ptr, i64, i64, i64, i64, ptr, i64, ptr, ptr])
        self._write_kv_fp8 = bind(library, "pd_write_kv_fp8",
                                  [ptr, i64, ptr, i64, i64, i64, ptr, i64, ptr, ptr, cint])
        self._quantize_kv = bind(library, "pd_quantize_kv_slots", [ptr, i64, i64, ptr])
        self._dequantize_kv = bind(library, "pd_dequantize_kv_slots", [ptr, i64, i64, ptr])

    def quantize_kv(self, x: torch.Tensor) -> torch.Tensor | None:
        """``kv_quant.quantize`` of ``x [..., head_dim]`` (the same bytes), on one thread;
        ``None`` unless ``x`` is a contiguous fp32 CPU tensor."""
        if not (x.dtype == torch.float32 and x.device.type == "cpu" and x.is_contiguous()
                and x.dim() >= 1 and x.shape[-1] >= 1):
            return None
        head_dim = x.shape[-1]
        out = torch.empty(*x.shape[:-1], head_dim + 4, dtype=torch.uint8)
        self._quantize_kv(x.data_ptr(), x.numel() // head_dim, head_dim, out.data_ptr())
        return out

    def dequantize_kv(self, slots: torch.Tensor) -> torch.Tensor | None:
        """``kv_quant.dequantize`` of int8 slots ``[..., head_dim + 4]`` to fp32 (the same
        values), on one thread; ``None`` unless ``slots`` is a contiguous uint8 CPU tensor."""
        if not (slots.dtype == torch.uint8 and slots.device.type == "cpu"
                and slots.is_contiguous() and slots.dim() >= 1 and slots.shape[-1] > 4):
            return None
        head_dim = slots.shape[-1] - 4
        out = torch.empty(*slots.shape[:-1], head_dim, dtype=torch.float32)
        self._dequantize_kv(slots.data_ptr(), slots.numel() // (head_dim + 4), head_dim,
                            out.data_ptr())
        return out

    def write_kv(self, kv_cache: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                 slot_mapping: torch.Tensor) -> bool:
        """Write ``k``, ``v [T, Hk, D]`` into slots ``slot_mapping [T]`` of ``kv_cache
        [2, num_blocks, block_size, Hk, D]`` (or, quantised as ``kv_quant.quantize`` does,
        of an int8 cache's ``D + 4``-byte slots, or into an fp8 cache: the same bytes as
        torch's conversion); ``False`` (nothing written) unless ``k``
        and ``v`` are fp32 CPU tensors with each token's heads contiguous, the cache
        contiguous, and ``slot_mapping`` a 1-d int32/int64 CPU tensor. Raises
        ``IndexError`` (as ``index_copy_`` does) for a slot outside the cache, before
        writing anything."""
        int8 = kv_cache.dtype == torch.uint8
        if not (k.dim() == v.dim() == 3 and kv_cache.dim() == 5 and kv_cache.shape[0] == 2
                and k.dtype == v.dtype == torch.float32 and kv_cache.dtype in KV_KINDS
                and k.device.type == v.device.type == kv_cache.device.type == "cpu"
                and slot_mapping.dim() == 1 and slot_mapping.device.type == "cpu"
                and slot_mapping.dtype in (torch.int32, torch.int64)
                and kv_cache.is_contiguous() and k.shape == v.shape
                and k.shape[1] == kv_cache.shape[3]
                and k.shape[2] + (4 if int8 else 0) == kv_cache.shape[4]
                and k.shape[0] == slot_mapping.shape[0]
                and k.stride(2) == v.stride(2) == 1
                and k.stride(1) == v.stride(1) == k.shape[2]):
            return False
        tokens, width = k.shape[0], k.shape[1] * k.shape[2]
        slots = slot_mapping.to(torch.int64).contiguous()
        strides = (k.stride(0) if tokens > 1 else width, v.stride(0) if tokens > 1 else width)
        num_slots = kv_cache.shape[1] * kv_cache.shape[2]
        if kv_cache.dtype in _FP8:
            rc = self._write_kv_fp8(k.data_ptr(), strides[0], v.data_ptr(), strides[1], tokens,
                                    width, slots.data_ptr(), num_slots, kv_cache[0].data_ptr(),
                                    kv_cache[1].data_ptr(), int(kv_cache.dtype == torch.float8_e5m2))
        elif int8:
            rc = self._write_kv_i8(k.data_ptr(), strides[0], v.data_ptr(), strides[1], tokens,
                                   k.shape[1], k.shape[2], slots.data_ptr(), num_slots,
                                   kv_cache[0].data_ptr(), kv_cache[1].data_ptr())
        else:
            rc = self._write_kv(k.data_ptr(), strides[0], v.data_ptr(), strides[1], tokens,
                                width, slots.data_ptr(), num_slots, kv_cache[0].data_ptr(),
                                kv_cache[1].data_ptr())
        if rc == -3:
            raise IndexError("write_kv: a slot outside the cache")
        return rc == 0

    @staticmethod
    def supports_decode_attention(q: torch.Tensor, kv_cache: torch.Tensor) -> bool:
        """Whether ``paged_decode_attention`` takes q ``[B, Hq, D]`` over this cache (fp32,
        int8: uint8 slots of ``D + 4`` bytes, or fp8 (e4m3fn, e5m2) values,
        ``engine.attention.kv_quant``)."""
        if q.dim() != 3 or kv_cache.dim() != 5 or q.numel() == 0:
            return False
        _, _, block_size, num_kv_heads, width = kv_cache.shape
        int8 = kv_cache.dtype == torch.uint8
        head_dim = width - 4 if int8 else width
        num_q_heads = q.shape[1]
        return (q.dtype == torch.float32 and kv_cache.dtype in KV_KINDS
                and q.device.type == "cpu"
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
        ``kv_cache [2, num_blocks, block_size, Hk, D]`` (or an int8 cache's ``D + 4``-byte
        slots, or fp8 values) → ``[B, Hq, D]``. Query heads ``h * Hq/Hk .. (h+1) * Hq/Hk - 1`` share KV head
        ``h`` (GQA/MQA)."""
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
                        lens.data_ptr(), num_seqs, scale, out.data_ptr(), torch.get_num_threads(),
                        KV_KINDS[kv_cache.dtype])
        if rc != 0:
            what = {-2: "a context length outside its block table",
                    -3: "a block id outside the cache"}.get(rc, f"code {rc}")
            raise ValueError(f"paged_decode_attention refused its arguments: {what}")
        return out
