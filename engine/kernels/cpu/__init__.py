"""pdserve's compiled CPU kernels: a batch-1 to 3 GEMV that keeps the memory bus busy,
a GEMM over weights packed in panels for larger batches, a paged decode attention that reads K/V where they lie in the cache, RMSNorm and SwiGLU
in one pass each (torch runs several small kernels for either), the rotary embedding,
a row-wise argmax for greedy sampling, and a whole decoder stack's decode step in one
call (those kernels, layer after layer, over ``DecoderLayers``; ``decoder_step`` adds the
token embedding, the RoPE lookup and the final norm around it).

Contract (used by ``engine.kernels.linear``, ``engine.attention.cpu_backend``, the
model's ``RMSNorm``, ``silu_and_mul`` and ``RotaryEmbedding``, ``engine.core.sampler`` and
``engine.models.decoder_stack``):

- ``native()`` returns the loaded kernels, building them on first use
  (``engine.kernels.cpu.build``), or ``None`` where they cannot run: not x86-64/ARM
  Linux with a C compiler, the build failed (logged once, with the compiler's output),
  the kernel cache is one another user could write (logged once, with the path and the
  fix; ``engine.kernels.cpu.cache``), or ``PDSERVE_CPU_KERNELS=0`` in the environment. Callers then use their torch path,
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

import logging
import os
import threading

from engine.kernels.cpu._ffi import GEMV_MAX_ROWS
from engine.kernels.cpu.build import BuildError, build
from engine.kernels.cpu.cache import DamagedLibraryError, load
from engine.kernels.cpu.library import NativeKernels
from engine.kernels.cpu.stack_layout import (
    KV_KINDS,
    STACK_MAX_ROWS,
    DecoderEnds,
    DecoderLayers,
    DecoderLayerWeights,
    DecoderShape,
    decoder_step_takes,
)

__all__ = ["ENV", "GEMV_MAX_ROWS", "KV_KINDS", "STACK_MAX_ROWS", "BuildError", "DecoderEnds",
           "DecoderLayerWeights", "DecoderLayers", "DecoderShape", "NativeKernels",
           "decoder_step_takes", "native"]

ENV = "PDSERVE_CPU_KERNELS"
_log = logging.getLogger(__name__)
_lock = threading.Lock()
_loaded: dict[str, NativeKernels | None] = {}


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
    short, or from another build) is rebuilt once. A cache another user may have written
    is not used (``engine.kernels.cpu.cache``). Any failure is logged, never raised: the
    engine then runs its torch kernels."""
    try:
        for attempt in (0, 1):
            path = build(rebuild=attempt == 1)
            try:
                return NativeKernels(load(path), str(path))
            except (OSError, AttributeError, DamagedLibraryError) as e:
                if attempt == 1:
                    raise BuildError(f"the built library {path} does not load: {e}") from e
    except Exception as e:  # noqa: BLE001 - whatever went wrong, serve with torch's kernels
        _log.warning("pdserve's compiled CPU kernels are unavailable, using torch kernels: %s", e)
    return None
