"""``NativeKernels``: the loaded library's kernels as torch functions, one family per
module (``linear``, ``attention``, ``pointwise``, ``sampling``, ``stack``), as the C files are."""

from __future__ import annotations

import ctypes

from engine.kernels.cpu.attention import AttentionKernels
from engine.kernels.cpu.linear import LinearKernels
from engine.kernels.cpu.pointwise import PointwiseKernels
from engine.kernels.cpu.sampling import SamplingKernels
from engine.kernels.cpu.stack import StackKernels


class NativeKernels(LinearKernels, AttentionKernels, PointwiseKernels, SamplingKernels,
                    StackKernels):
    """The loaded library's kernels as torch functions (``path``: the library's file)."""

    def __init__(self, library: ctypes.CDLL, path: str) -> None:
        self.path = path
        self._bind_linear(library)
        self._bind_attention(library)
        self._bind_pointwise(library)
        self._bind_sampling(library)
        self._bind_stack(library)
