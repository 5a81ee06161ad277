"""The ways a linear layer can multiply, and the plan saying which one each layer uses.

Every kernel computes ``y = x W^T + b`` for a checkpoint-layout weight ``W [out, in]``
from a copy of ``W`` it prepared once after loading (or ``W`` itself):

- ``torch``: ``F.linear`` on ``W`` (MKL's sgemm/sgemv on x86 builds); no copy.
- ``onednn``: oneDNN's pre-packed blocked layout (``mkldnn._linear_pointwise``); CPU fp32.
- ``mm_t``: ``torch.mm``/``addmm`` on a contiguous ``W^T [in, out]`` (the "NN" GEMM
  layout rather than "NT"); any device.
- ``onednn_gemv``: ``onednn``, except that one to three rows of ``x`` (a small decode
  batch) go to pdserve's compiled GEMV (``engine.kernels.cpu``) on ``W`` itself, which
  keeps more of the memory bus busy than oneDNN does at batch 1; CPU fp32, where the
  compiled kernels could be built.
- ``packed``: pdserve's own kernels only (``engine.kernels.cpu``): the GEMV on ``W``
  itself for one to three rows, and for more rows its GEMM over a copy of ``W`` packed in
  panels of 32 output features (16 without AVX-512; ``NativeKernels.pack_panels``), which
  keeps a block of up to 14 rows' sums (6 without AVX-512) in registers per panel; CPU
  fp32, where the compiled kernels could be built (no oneDNN needed).
- ``packed_gemm``: ``packed`` without the GEMV: its GEMM over the panels at every row
  count. Not a candidate of the measured choice: a speculating engine's plan
  (``engine.kernels.choice``), whose steps alternate between a few rows and a verifying
  step's ``1 + num_speculative_tokens``; with ``packed`` those read two copies of each
  weight (``W`` by the GEMV, the panels by the GEMM), and a step after a step of the
  other kind finds little of its copy in the caches (measured on bench55m's linears,
  2 threads on an Intel Xeon: 3.4–3.6 ms a step alternating 1 and 5 rows, against
  2.2–2.3 ms for either alone; the GEMM takes 1 row as fast as the GEMV there).

With ``quantization="int8"`` (``engine.kernels.quant``) a layer multiplies by its
weight quantised to int8 with a scale per output feature, by one of the kernels of their
own (``LinearKernel.quantization``), ``y = (x q^T) * scale + b``:

- ``int8_woq``: torch's own weight-only int8 matmul (``torch._weight_int8pack_mm``: the
  int8 weight and its scales in, the sum scaled per output), wherever torch has that op
  for the device and ``x`` is fp32, fp16 or bf16. Only where a plan names it
  (``linear_kernel="int8_woq"``), never a default: torch's CPU kernel took fp32 rows 13×
  (1 row) to 68× (32 rows) longer than ``int8_packed`` (a [2048, 512] weight, 2 threads,
  an Intel Xeon), and its CUDA kernel, in torch's source as read in December 2026, gives each output its own
  thread, which walks its weight row alone (no tiling, no tensor cores, the weight reads
  not coalesced): a prefill chunk's rows would each read every weight again. Off the CPU
  the default is ``int8_torch``, on cuBLAS.
- ``int8_torch``: ``F.linear`` on the int8 weight widened to ``x``'s dtype, then the
  scales; any device (a fallback: it widens the whole weight every call).
- ``int8_packed``: ``packed`` over the int8 weight: the GEMV on ``q`` itself, the GEMM on
  ``q`` packed in int8 panels, the weights widened to fp32 in registers (a quarter of
  the bytes from memory); CPU fp32, where the compiled kernels could be built.
- ``int8_packed_gemm``: ``int8_packed`` without the GEMV, as ``packed_gemm``.

Which is fastest depends on the CPU (MKL is slow on AMD, tuned on Intel), the shape
and the batch size, so ``engine.kernels.choice`` times them and writes a
``KernelPlan``; every tensor-parallel rank applies the leader's plan.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F

from engine.kernels.cpu import ENV as CPU_KERNELS_ENV
from engine.kernels.cpu import NativeKernels, native
from engine.kernels.quant import Int8Weight, quantize_int8

# Batch size oneDNN tunes the packed layout for; any batch size works.
_ONEDNN_BATCH_HINT = 32


@dataclass(frozen=True)
class LinearKernel:
    """``prepare(W [out, in]) -> prepared`` once (a tensor, or what the kernel needs; a
    quantising kernel also takes ``W`` already quantised, an ``Int8Weight``);
    ``apply(x [..., in], prepared, bias)``."""

    name: str
    prepare: Callable[[Any], Any]
    apply: Callable[[torch.Tensor, Any, torch.Tensor | None], torch.Tensor]
    available: Callable[[torch.device, torch.dtype], bool]
    uses_native: bool = False  # runs pdserve's compiled kernels (engine.kernels.cpu)
    # a candidate of the measured choice (else only where a plan names it)
    measured: bool = True
    # hands a few rows to the GEMV (else its GEMM takes every row count)
    gemv: bool = True
    # the weights it multiplies by: None, the weight as loaded, or a QUANTIZATIONS name
    quantization: str | None = None


def _onednn_available(device: torch.device, dtype: torch.dtype) -> bool:
    return (device.type == "cpu" and dtype == torch.float32
            and torch.backends.mkldnn.is_available()
            and hasattr(torch.ops.mkldnn, "_linear_pointwise"))


def _onednn_prepare(weight: torch.Tensor) -> torch.Tensor:
    return torch.ops.mkldnn._reorder_linear_weight(weight.contiguous(), _ONEDNN_BATCH_HINT)


def _onednn_apply(x: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    # oneDNN reads the bias as contiguous whatever its strides (a strided one gave wrong
    # sums): .contiguous() is free for the usual, contiguous, bias
    bias = None if bias is None else bias.contiguous()
    return torch.ops.mkldnn._linear_pointwise(x, packed, bias, "none", [], "")


@dataclass(frozen=True)
class _GemvPrepared:
    """``onednn_gemv``'s copy: ``W`` itself for the GEMV, oneDNN's packing for the rest."""

    weight: torch.Tensor
    packed: torch.Tensor
    kernels: NativeKernels


def _onednn_gemv_available(device: torch.device, dtype: torch.dtype) -> bool:
    return _onednn_available(device, dtype) and native() is not None


def _native_kernels(kernel: str) -> NativeKernels:
    """The compiled kernels for ``kernel``; ``RuntimeError`` where they are unavailable."""
    kernels = native()
    if kernels is None:
        raise RuntimeError(f"linear kernel {kernel} needs pdserve's compiled CPU kernels, "
                           f"which are unavailable here ({CPU_KERNELS_ENV}=0, or the build "
                           "failed: see the log)")
    return kernels


def _native_weight(kernel: str, weight: torch.Tensor) -> tuple[NativeKernels, torch.Tensor]:
    """The compiled kernels and ``weight`` (contiguous) for a kernel that needs both;
    ``RuntimeError`` where the kernels are unavailable, ``ValueError`` for a weight that
    is not a 2-d fp32 CPU tensor."""
    kernels = _native_kernels(kernel)
    if weight.dtype != torch.float32 or weight.device.type != "cpu" or weight.dim() != 2:
        raise ValueError(f"linear kernel {kernel} takes a 2-d fp32 CPU weight, got "
                         f"{tuple(weight.shape)} {weight.dtype} on {weight.device}")
    return kernels, weight.contiguous()


def _onednn_gemv_prepare(weight: torch.Tensor) -> _GemvPrepared:
    kernels, weight = _native_weight("onednn_gemv", weight)
    return _GemvPrepared(weight, _onednn_prepare(weight), kernels)


def _onednn_gemv_apply(x: torch.Tensor, prepared: _GemvPrepared,
                       bias: torch.Tensor | None) -> torch.Tensor:
    if bias is None or (bias.is_contiguous() and bias.dtype == torch.float32):
        y = prepared.kernels.gemv_checked_weight(x, prepared.weight, bias)
        if y is not None:
            return y
    return _onednn_apply(x, prepared.packed, bias)


@dataclass(frozen=True)
class _PackedPrepared:
    """``packed``'s copies: ``W`` itself for the GEMV, its panels for the GEMM."""

    weight: torch.Tensor
    panels: torch.Tensor
    kernels: NativeKernels


def _packed_available(device: torch.device, dtype: torch.dtype) -> bool:
    return device.type == "cpu" and dtype == torch.float32 and native() is not None


def _packed_prepare(weight: torch.Tensor, kernel: str = "packed") -> _PackedPrepared:
    kernels, weight = _native_weight(kernel, weight)
    return _PackedPrepared(weight, kernels.pack_panels(weight), kernels)


def _packed_apply(x: torch.Tensor, prepared: _PackedPrepared,
                  bias: torch.Tensor | None, gemv: bool = True) -> torch.Tensor:
    if bias is None or (bias.is_contiguous() and bias.dtype == torch.float32):
        kernels, weight = prepared.kernels, prepared.weight
        y = kernels.gemv_checked_weight(x, weight, bias) if gemv else None
        if y is None:
            y = kernels.gemm_packed_checked(x, prepared.panels, weight.shape[0], bias)
        if y is not None:
            return y
    return F.linear(x, prepared.weight, bias)  # a strided x, or another dtype of bias


def _int8_torch_apply(x: torch.Tensor, weight: Int8Weight,
                      bias: torch.Tensor | None) -> torch.Tensor:
    if x.dtype == torch.float16:
        # scaled before the product: the unscaled sums (up to 127 / a row's largest
        # weight times the output) pass float16's 65504 and become inf
        return F.linear(x, weight.dequantize(x.dtype), bias)
    y = F.linear(x, weight.q.to(x.dtype)) * weight.scales.to(x.dtype)
    return y if bias is None else y + bias


_WOQ_OP = "aten::_weight_int8pack_mm"
_WOQ_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
_DISPATCH_KEYS = {"cpu": "CPU", "cuda": "CUDA"}


def _woq_available(device: torch.device, dtype: torch.dtype) -> bool:
    """Whether torch has ``_weight_int8pack_mm`` for ``device`` and it multiplies ``dtype``
    rows there: its dispatcher is asked, then one small product is tried (once per device
    and dtype), so a build whose kernel refuses these inputs is never planned for."""
    key = _DISPATCH_KEYS.get(device.type)
    return (dtype in _WOQ_DTYPES and key is not None and hasattr(torch, "_weight_int8pack_mm")
            and torch._C._dispatch_has_kernel_for_dispatch_key(_WOQ_OP, key)
            and _woq_runs(str(device), dtype))


@functools.cache
def _woq_runs(device: str, dtype: torch.dtype) -> bool:
    try:
        x = torch.ones(2, 64, dtype=dtype, device=device)
        q = torch.ones(32, 64, dtype=torch.int8, device=device)
        y = torch._weight_int8pack_mm(x, q, torch.full((32,), 0.5, dtype=dtype, device=device))
        return bool(torch.all(y == 32))
    except Exception:  # any refusal (the device missing, the inputs refused): not here
        return False


def _woq_apply(x: torch.Tensor, weight: Int8Weight, bias: torch.Tensor | None) -> torch.Tensor:
    flat = x.reshape(-1, x.shape[-1]).contiguous()
    if flat.shape[0] == 0:
        y = flat.new_empty(0, weight.q.shape[0])
    else:
        y = torch._weight_int8pack_mm(flat, weight.q, weight.scales.to(x.dtype))
    y = y.view(*x.shape[:-1], weight.q.shape[0])
    return y if bias is None else y + bias


@dataclass(frozen=True)
class _Int8Prepared:
    """``int8_packed``'s copies: the int8 weight and scales for the GEMV, its int8
    panels for the GEMM."""

    weight: Int8Weight
    panels: torch.Tensor
    kernels: NativeKernels


def _as_int8(weight: torch.Tensor | Int8Weight) -> Int8Weight:
    """What a quantising kernel prepares from: the weight as loaded, or already quantised
    (``_Linear.set_kernel`` quantises a row-parallel shard with its whole rows' scales)."""
    return weight if isinstance(weight, Int8Weight) else quantize_int8(weight)


def _int8_packed_prepare(weight: torch.Tensor | Int8Weight,
                         kernel: str = "int8_packed") -> _Int8Prepared:
    kernels = _native_kernels(kernel)
    quantized = _as_int8(weight)
    if quantized.q.device.type != "cpu":
        raise ValueError(f"linear kernel {kernel} takes a CPU weight, got one on "
                         f"{quantized.q.device}")
    return _Int8Prepared(quantized, kernels.pack_panels(quantized.q), kernels)


def _int8_packed_apply(x: torch.Tensor, prepared: _Int8Prepared,
                       bias: torch.Tensor | None, gemv: bool = True) -> torch.Tensor:
    if bias is None or (bias.is_contiguous() and bias.dtype == torch.float32):
        kernels, weight = prepared.kernels, prepared.weight
        y = kernels.gemv_i8_checked(x, weight.q, weight.scales, bias) if gemv else None
        if y is None:
            y = kernels.gemm_packed_i8_checked(x, prepared.panels, weight.scales,
                                               weight.q.shape[0], bias)
        if y is not None:
            return y
    return _int8_torch_apply(x, prepared.weight, bias)  # a strided x, or another dtype of bias


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
    "onednn_gemv": LinearKernel("onednn_gemv", _onednn_gemv_prepare, _onednn_gemv_apply,
                                _onednn_gemv_available, uses_native=True),
    "packed": LinearKernel("packed", _packed_prepare, _packed_apply, _packed_available,
                           uses_native=True),
    "int8_woq": LinearKernel("int8_woq", _as_int8, _woq_apply, _woq_available,
                             quantization="int8", measured=False),
    "int8_torch": LinearKernel("int8_torch", _as_int8, _int8_torch_apply,
                               lambda device, dtype: True, quantization="int8"),
    "int8_packed": LinearKernel("int8_packed", _int8_packed_prepare, _int8_packed_apply,
                                _packed_available, uses_native=True, quantization="int8"),
    "packed_gemm": LinearKernel("packed_gemm", lambda w: _packed_prepare(w, "packed_gemm"),
                                lambda x, p, b: _packed_apply(x, p, b, gemv=False),
                                _packed_available, uses_native=True, measured=False,
                                gemv=False),
    "int8_packed_gemm": LinearKernel("int8_packed_gemm",
                                     lambda w: _int8_packed_prepare(w, "int8_packed_gemm"),
                                     lambda x, p, b: _int8_packed_apply(x, p, b, gemv=False),
                                     _packed_available, uses_native=True,
                                     quantization="int8", measured=False, gemv=False),
}


def available_kernels(device: torch.device, dtype: torch.dtype,
                      quantization: str | None = None) -> list[str]:
    """Names of the kernels that run on ``device`` in ``dtype`` over weights quantised
    as ``quantization`` (``None``: as loaded), in ``KERNELS`` order."""
    return [name for name, k in KERNELS.items()
            if k.quantization == quantization and k.available(device, dtype)]


@dataclass(frozen=True)
class KernelPlan:
    """Which kernel each linear weight shape ``(out_features, in_features)`` uses on
    this rank's shard (identical on every rank of a TP group, which holds equal shards),
    and where the choice came from: ``"config"`` (``EngineConfig.linear_kernel``),
    ``"env"`` (``PDSERVE_LINEAR_KERNEL``), ``"speculative"`` (a speculating engine's),
    ``"cache"``, ``"measured"`` or ``"default"``."""

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
