"""What the Python face of the compiled kernels shares: the ctypes types of their
arguments, binding one C function, and the GEMV's row limit (``GEMV_MAX_X_ROWS`` in
``kernels.h``)."""

from __future__ import annotations

import ctypes
from collections.abc import Sequence
from typing import Any

import torch

GEMV_MAX_ROWS = 3  # above this a GEMM (oneDNN's or gemm_packed) is faster (on AMD EPYC)

i64, ptr, cint, f32 = ctypes.c_int64, ctypes.c_void_p, ctypes.c_int, ctypes.c_float


def ptr_of(t: torch.Tensor | None) -> int | None:
    return None if t is None else t.data_ptr()


def bind(library: ctypes.CDLL, name: str, argtypes: Sequence[Any], restype: Any = cint) -> Any:
    """The library's function ``name`` with its argument and result types set."""
    function = library[name]
    function.argtypes = list(argtypes)
    function.restype = restype
    return function
