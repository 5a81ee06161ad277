"""The pointwise kernels' Python face (``pointwise.c``): RoPE, greedy argmax, RMSNorm,
SwiGLU."""

from __future__ import annotations

import ctypes

import torch

from engine.kernels.cpu._ffi import bind, cint, f32, i64, ptr


class PointwiseKernels:
    """``NativeKernels``' RoPE, argmax, RMSNorm and SwiGLU."""

    def _bind_pointwise(self, library: ctypes.CDLL) -> None:
        self._rms_norm = bind(library, "pd_rms_norm_f32", [ptr, i64, i64, ptr, f32, ptr, cint])
        self._silu_mul = bind(library, "pd_silu_mul_f32", [ptr, i64, i64, ptr, cint])
        self._argmax = bind(library, "pd_argmax_rows_f32", [ptr, i64, i64, i64, ptr, cint])
        self._rope = bind(library, "pd_rope_f32", [ptr, i64, i64, i64, i64, ptr, ptr, ptr, cint])

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
