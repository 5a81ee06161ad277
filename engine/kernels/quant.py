"""Weight-only int8 quantisation: what ``quantization="int8"`` does to every linear
weight at load (the LM head included; the input embedding stays as loaded, as vLLM and
SGLang leave it).

Each output feature (row of a ``[out, in]`` weight) gets one fp32 scale, its largest
magnitude / 127, and its weights are rounded to the nearest int8 multiple of it
(symmetric, no zero point, -127..127): ``W ≈ q * scale[:, None]``, so ``x W^T ≈ (x q^T)
* scale`` and the kernels multiply by the scale once per output, after the sum. A rank
quantises its own shard of a tensor-parallel weight (a row-parallel shard's rows are
part rows, so their scales are its own): TP 1 and TP 2 agree to the rounding, as fp32
ranks do, not to the bit.

Torch only (no compiled code); the kernels that multiply by such a weight are
``engine.kernels.linear``'s ``int8_*``.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from engine.config import QUANTIZATIONS

__all__ = ["QUANTIZATIONS", "Int8Weight", "quantize_int8"]
INT8_MAX = 127


@dataclass(frozen=True)
class Int8Weight:
    """An int8 weight ``q [out, in]`` and its fp32 ``scales [out]`` (contiguous, on the
    weight's device)."""

    q: torch.Tensor
    scales: torch.Tensor

    @property
    def shape(self) -> tuple[int, int]:
        out_features, in_features = self.q.shape
        return int(out_features), int(in_features)

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """``q * scales[:, None]`` in ``dtype``: the weight the kernels multiply by."""
        return (self.q.to(torch.float32) * self.scales[:, None]).to(dtype)


def quantize_int8(weight: torch.Tensor, row_amax: torch.Tensor | None = None) -> Int8Weight:
    """``weight [out, in]`` (any float dtype) quantised per output feature; a row of
    zeros gets scale 1 (its int8 weights are zeros). ``row_amax [out]``: each row's
    largest magnitude where ``weight`` holds only part of its rows (a row-parallel
    shard: with its whole rows' magnitudes, a shard's int8 weights and scales are those of
    the whole weight quantised, then sharded); default: ``weight``'s own. Raises
    ``ValueError`` for a tensor that is not a 2-d float weight or holds a NaN or an
    infinity, or a ``row_amax`` of another shape or below the rows' own."""
    if weight.dim() != 2 or not weight.dtype.is_floating_point:
        raise ValueError(f"int8 quantisation takes a 2-d float weight, got "
                         f"{tuple(weight.shape)} {weight.dtype}")
    w = weight.detach().to(torch.float32)
    if not bool(torch.isfinite(w).all()):
        raise ValueError(f"a [{w.shape[0]}, {w.shape[1]}] weight holds a NaN or an infinity: "
                         "it cannot be quantised")
    amax = w.abs().amax(dim=1)
    if row_amax is not None:
        row_amax = row_amax.detach().to(device=w.device, dtype=torch.float32)
        if row_amax.shape != amax.shape or bool((row_amax < amax).any()):
            raise ValueError(f"row_amax must be [{amax.shape[0]}] and at least each row's own "
                             f"largest magnitude, got {tuple(row_amax.shape)}")
        amax = row_amax
    scales = torch.where(amax > 0, amax / INT8_MAX, torch.ones_like(amax))
    q = torch.round(w / scales[:, None]).clamp_(-INT8_MAX, INT8_MAX).to(torch.int8)
    return Int8Weight(q.contiguous(), scales.contiguous())
