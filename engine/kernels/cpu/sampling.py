"""The sampling kernels' Python face (``sampling.c``): a structured output's token bitmask
applied in place, a step's logprobs in one call, and the repetition, presence and
frequency penalties over each row's history."""

from __future__ import annotations

import ctypes
from array import array
from collections.abc import Sequence

import torch

from engine.kernels.cpu._ffi import bind, cint, i64, ptr


class SamplingKernels:
    """``NativeKernels``' token bitmask, logprobs and penalties."""

    def _bind_sampling(self, library: ctypes.CDLL) -> None:
        self._bitmask = bind(library, "pd_apply_token_bitmask_f32",
                             [ptr, i64, i64, i64, ptr, i64, ptr, i64])
        self._logprobs = bind(library, "pd_token_logprobs_f32",
                              [ptr, i64, i64, i64, ptr, i64, ptr, ptr, ptr, ptr, cint])
        self._penalties = bind(library, "pd_penalties_f32",
                               [ptr, i64, i64, i64, ptr, i64, ptr, ptr, ptr, ptr, ptr, ptr, ptr,
                                cint])

    def apply_token_bitmask(self, logits: torch.Tensor, bitmask: torch.Tensor,
                            rows: Sequence[int]) -> bool:
        """Row ``rows[i]`` of ``logits`` (2-d fp32 CPU, rows contiguous) set to -inf where
        ``bitmask`` row ``i`` (int32 words, llguidance's layout) has a clear bit, in place;
        False (nothing changed) for arguments it does not take."""
        if not (logits.dtype == torch.float32 and logits.device.type == "cpu"
                and logits.dim() == 2 and logits.shape[1] > 0 and logits.stride(1) == 1
                and logits.stride(0) >= logits.shape[1] and bitmask.dtype == torch.int32
                and bitmask.device.type == "cpu" and bitmask.dim() == 2
                and bitmask.is_contiguous() and bitmask.shape[0] == len(rows)
                and bitmask.shape[1] > 0):
            return False
        index = torch.tensor(list(rows), dtype=torch.int64)
        rc = self._bitmask(logits.data_ptr(), logits.shape[0], logits.shape[1],
                           logits.stride(0), bitmask.data_ptr(), bitmask.shape[1],
                           index.data_ptr(), len(rows))
        return rc == 0

    def token_logprobs(self, logits: torch.Tensor, token_ids: Sequence[int], k: int
                       ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor] | None:
        """Of each row's log-softmax (2-d fp32 CPU, rows contiguous): the value and rank of
        ``token_ids[i]`` (1 + the entries larger) and the ``k`` largest entries' ids and
        values (descending; ties by the lower id) — ``([rows], [rows], [rows, k], [rows,
        k])``; ``None`` for arguments it does not take or rows torch must answer (NaN, or
        nothing but -inf)."""
        rows = len(token_ids)
        if not (logits.dtype == torch.float32 and logits.device.type == "cpu"
                and logits.dim() == 2 and logits.shape[0] == rows and logits.shape[1] > 0
                and logits.stride(1) == 1 and logits.stride(0) >= logits.shape[1]
                and 0 <= k <= logits.shape[1]):
            return None
        chosen = torch.tensor(list(token_ids), dtype=torch.int64)
        values = torch.empty(rows, dtype=torch.float32)
        ranks = torch.empty(rows, dtype=torch.int64)
        top_ids = torch.empty(rows, k, dtype=torch.int64)
        top_values = torch.empty(rows, k, dtype=torch.float32)
        rc = self._logprobs(logits.data_ptr(), rows, logits.shape[1], logits.stride(0),
                            chosen.data_ptr(), k, values.data_ptr(), ranks.data_ptr(),
                            top_ids.data_ptr(), top_values.data_ptr(), torch.get_num_threads())
        return (values, ranks, top_ids, top_values) if rc == 0 else None

    def penalties(self, logits: torch.Tensor, rows: Sequence[int],
                  prompts: Sequence[Sequence[int] | torch.Tensor],
                  outputs: Sequence[Sequence[int]],
                  repetition: Sequence[float], presence: Sequence[float],
                  frequency: Sequence[float]) -> bool:
        """Row ``rows[i]`` of ``logits`` (2-d fp32 CPU, rows contiguous) with the repetition
        penalty over ``prompts[i]`` and ``outputs[i]`` (token ids; ``array("i")`` is read
        where it lies, anything else copied), then the presence and frequency penalties
        over ``outputs[i]``, in place (``engine.core.logits``' rules); False (nothing
        changed) for arguments it does not take."""
        n = len(rows)
        if not (logits.dtype == torch.float32 and logits.device.type == "cpu"
                and logits.dim() == 2 and logits.shape[1] > 0 and logits.stride(1) == 1
                and logits.stride(0) >= logits.shape[1]
                and len(prompts) == len(outputs) == len(repetition) == len(presence)
                == len(frequency) == n):
            return False
        prompt_ids = [_int32(p) for p in prompts]
        output_ids = [_int32(o) for o in outputs]
        addresses = torch.tensor([a.buffer_info()[0] for a in (*prompt_ids, *output_ids)] or [0],
                                 dtype=torch.int64)
        lengths = torch.tensor([len(a) for a in (*prompt_ids, *output_ids)] or [0],
                               dtype=torch.int64)
        index = torch.tensor(list(rows), dtype=torch.int64)
        factors = torch.tensor([list(repetition), list(presence), list(frequency)],
                               dtype=torch.float32)
        rc = self._penalties(logits.data_ptr(), logits.shape[0], logits.shape[1],
                             logits.stride(0), index.data_ptr(), n, addresses.data_ptr(),
                             lengths.data_ptr(), addresses.data_ptr() + 8 * n,
                             lengths.data_ptr() + 8 * n, factors.data_ptr(),
                             factors.data_ptr() + 4 * n, factors.data_ptr() + 8 * n,
                             torch.get_num_threads())
        return rc == 0


def _int32(ids: Sequence[int] | torch.Tensor) -> array[int]:
    """``ids`` as a C int array (itself when it is one)."""
    if isinstance(ids, array) and ids.typecode == "i":
        return ids
    if isinstance(ids, torch.Tensor):
        return array("i", ids.tolist())
    return array("i", ids)
