"""Rotary position embedding (the "rotate half" layout Hugging Face Llama uses),
with optional Llama-3 frequency scaling."""

from __future__ import annotations

import math

import torch
from torch import nn

from engine.config import RopeScaling
from engine.kernels.cpu import native


def rope_inv_freq(head_dim: int, theta: float, scaling: RopeScaling | None) -> torch.Tensor:
    """Inverse frequencies ``[head_dim // 2]`` in fp32."""
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim))
    if scaling is None:
        return inv_freq
    old_ctx = scaling.original_max_position_embeddings
    low_freq_wavelen = old_ctx / scaling.low_freq_factor
    high_freq_wavelen = old_ctx / scaling.high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    # Long wavelengths are divided by the factor, short ones kept, the middle band blended.
    scaled = torch.where(wavelen > low_freq_wavelen, inv_freq / scaling.factor, inv_freq)
    smooth = (old_ctx / wavelen - scaling.low_freq_factor) / (
        scaling.high_freq_factor - scaling.low_freq_factor
    )
    blended = (1 - smooth) * scaled / scaling.factor + smooth * scaled
    is_medium = (wavelen >= high_freq_wavelen) & (wavelen <= low_freq_wavelen)
    return torch.where(is_medium, blended, scaled)


class RotaryEmbedding(nn.Module):
    """Applies RoPE to q ``[T, Hq, D]`` and k ``[T, Hk, D]`` at integer ``positions [T]``."""

    cos: torch.Tensor
    sin: torch.Tensor

    def __init__(self, head_dim: int, max_positions: int, theta: float,
                 scaling: RopeScaling | None) -> None:
        super().__init__()
        inv_freq = rope_inv_freq(head_dim, theta, scaling)
        freqs = torch.outer(torch.arange(max_positions, dtype=torch.float32), inv_freq)
        # [max_positions, D/2] each; not parameters, moved with the module.
        self.register_buffer("cos", freqs.cos(), persistent=False)
        self.register_buffer("sin", freqs.sin(), persistent=False)

    def cos_sin(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """Per-token factors ``[T, 1, D]`` each, ``(cos | cos, -sin | sin)``: looked up once
        per forward, used by every layer's ``rotate``."""
        cos = self.cos[positions].unsqueeze(1).to(dtype)
        sin = self.sin[positions].unsqueeze(1).to(dtype)
        return torch.cat((cos, cos), dim=-1), torch.cat((-sin, sin), dim=-1)

    @staticmethod
    def rotate(x: torch.Tensor, cos_sin: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        """RoPE on ``x [T, H, D]`` — any heads, e.g. a layer's q and k heads side by side,
        rotated in one pass: ``[x1 | x2] -> [x1 cos - x2 sin | x2 cos + x1 sin]``; by
        pdserve's compiled kernel for fp32 CPU tensors where it was built."""
        cos, signed_sin = cos_sin
        if x.device.type == "cpu" and x.dtype == torch.float32:
            kernels = native()
            out = kernels.rope(x, cos, signed_sin) if kernels is not None else None
            if out is not None:
                return out
        x1, x2 = x.chunk(2, dim=-1)
        return x * cos + torch.cat((x2, x1), dim=-1) * signed_sin
