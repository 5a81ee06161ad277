"""The ways a linear layer can multiply, and the plan saying which one each layer uses.

Every kernel computes ``y = x W^T + b`` for a checkpoint-layout weight ``W [out, in]``
from a copy of ``W`` it prepared once after loading (or ``W`` itself):

- ``torch``: ``F.linear`` on ``W`` (MKL's sgemm/sgemv on x86 builds); no copy.
- ``onednn``: oneDNN's pre-packed blocked layout (``mkldnn._linear_pointwise``); CPU fp32.
- ``mm_t``: ``torch.mm``/``addmm`` on a contiguous ``W^T [in, out]`` (the "NN" GEMM
  layout rather than "NT"); any device.

Which is fastest depends on the CPU (MKL is slow on AMD, tuned on Intel), the shape
and the batch size, so ``engine.kernel_choice`` times them and writes a
``KernelPlan``; every tensor-parallel rank applies the leader's plan.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass

import torch
import torch.nn.functional as F

# Batch size oneDNN tunes the packed layout for; any batch size works.
_ONEDNN_BATCH_HINT = 32


@dataclass(frozen=True)
class LinearKernel:
    """``prepare(W [out, in]) -> prepared`` once; ``apply(x [..., in], prepared, bias)``."""

    name: str
    prepare: Callable[[torch.Tensor], torch.Tensor]
    apply: Callable[[torch.Tensor, torch.Tensor, torch.Tensor | None], torch.Tensor]
    available: Callable[[torch.device, torch.dtype], bool]


def _onednn_available(device: torch.device, dtype: torch.dtype) -> bool:
    return (device.type == "cpu" and dtype == torch.float32
            and torch.backends.mkldnn.is_available()
            and hasattr(torch.ops.mkldnn, "_linear_pointwise"))


def _onednn_prepare(weight: torch.Tensor) -> torch.Tensor:
    return torch.ops.mkldnn._reorder_linear_weight(weight.contiguous(), _ONEDNN_BATCH_HINT)


def _onednn_apply(x: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    return torch.ops.mkldnn._linear_pointwise(x, packed, bias, "none", [], "")


def _mm_t_apply(x: torch.Tensor, weight_t: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    flat = x.reshape(-1, x.shape[-1])
    y = torch.mm(flat, weight_t) if bias is None else torch.addmm(bias, flat, weight_t)
    return y.view(*x.shape[:-1], weight_t.shape[1])


KERNELS: dict[str, LinearKernel] = {
    "torch": LinearKernel("torch", lambda w: w, lambda x, w, b: F.linear(x, w, b),
                          lambda device, dtype: True),
    "onednn": LinearKernel("onednn", _onednn_prepare, _onednn_apply, _onednn_available),
    "mm_t": LinearKernel("mm_t", lambda w: w.t().contiguous(), _mm_t_apply,
                         lambda device, dtype: True),
}


def available_kernels(device: torch.device, dtype: torch.dtype) -> list[str]:
    """Names of the kernels that run on ``device`` in ``dtype``, in ``KERNELS`` order."""
    return [name for name, k in KERNELS.items() if k.available(device, dtype)]


@dataclass(frozen=True)
class KernelPlan:
    """Which kernel each linear weight shape ``(out_features, in_features)`` uses on
    this rank's shard (identical on every rank of a TP group, which holds equal shards),
    and where the choice came from: ``"config"`` (``EngineConfig.linear_kernel``),
    ``"env"`` (``PDSERVE_LINEAR_KERNEL``), ``"cache"``, ``"measured"`` or ``"default"``."""

    kernels: tuple[tuple[int, int, str], ...]
    source: str

    def __post_init__(self) -> None:
        unknown = sorted({k for _, _, k in self.kernels} - set(KERNELS))
        if unknown:
            raise ValueError(f"unknown linear kernels {unknown}; known: {sorted(KERNELS)}")

    @classmethod
    def uniform(cls, shapes: Iterable[tuple[int, int]], kernel: str, source: str) -> KernelPlan:
        return cls(tuple((o, i, kernel) for o, i in sorted(set(shapes))), source)

    def kernel_for(self, out_features: int, in_features: int) -> str:
        for o, i, kernel in self.kernels:
            if (o, i) == (out_features, in_features):
                return kernel
        raise KeyError(f"the kernel plan has no entry for a [{out_features}, {in_features}] weight")

    @property
    def summary(self) -> str:
        """The kernel's name when all shapes share one, else ``"mixed: out x in=kernel, ..."``."""
        names = {k for _, _, k in self.kernels}
        if len(names) == 1:
            return names.pop()
        return "mixed: " + ", ".join(f"{o}x{i}={k}" for o, i, k in self.kernels)
