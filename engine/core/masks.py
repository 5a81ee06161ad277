"""The token masks of a step's constrained rows (``engine.core.constrain``), made on a
thread of their own, and applied to the logits.

llguidance computes a batch's masks in one call that releases the GIL, so the masks of
the next step are made on the mask thread while the engine thread does the rest (hands
the tokens out, schedules, runs the forward), and cost a step only what that does not
hide. One thread, and only where torch's threads leave a core free (``spare_core``):
beside torch's threads on every core it competes with them (llguidance's own parallel
executor does so more), and the masks are then made in the step. The bitmask is
llguidance's layout (int32 words, bit b of word w allows token 32 w + b); the compiled
CPU kernel applies it in place, torch elsewhere.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass

import llguidance
import torch

from engine.kernels.cpu import native

_BITS = torch.arange(32, dtype=torch.int32)


@dataclass
class PendingMasks:
    """Masks being made: row ``j`` of ``bitmask`` is request ``request_ids[j]``'s."""

    request_ids: tuple[str, ...]
    bitmask: torch.Tensor  # [len(request_ids), words] int32
    done: Future[None]

    def wait(self, *, raise_errors: bool = True) -> None:
        """Until the masks are made (what making them raised, re-raised unless told not)."""
        error = self.done.exception()
        if error is not None and raise_errors:
            raise error


class MaskMaker:
    """Makes the masks of a vocabulary of ``vocab_size`` tokens: on a thread of its own
    when ``ahead`` (``start`` returns at once), else in the caller's (``start`` returns
    them made)."""

    def __init__(self, vocab_size: int, *, ahead: bool | None = None) -> None:
        """``ahead``: None to decide by the cores (``spare_core``)."""
        self.words = (vocab_size + 31) // 32
        self.ahead = spare_core() if ahead is None else ahead
        self._executor = llguidance.LLExecutor(1)
        self._thread = (ThreadPoolExecutor(max_workers=1, thread_name_prefix="pdserve-masks")
                        if self.ahead else None)

    def start(self, request_ids: tuple[str, ...],
              matchers: Sequence[llguidance.LLMatcher]) -> PendingMasks:
        """Starts making the next mask of each of ``matchers`` (request ``request_ids[j]``'s
        is ``matchers[j]``); they must stay as they are until the masks are waited for."""
        bitmask = torch.full((len(matchers), self.words), -1, dtype=torch.int32)
        batch = [(matcher, j) for j, matcher in enumerate(matchers)]
        args = (batch, bitmask.data_ptr(), self.words * 4, len(batch))
        if self._thread is not None:
            done = self._thread.submit(self._executor.unsafe_compute_mask_ptr, *args)
        else:  # on this thread (the executor's would run them on one of its own)
            done = Future()
            try:
                row_bytes = self.words * 4
                for matcher, j in batch:
                    matcher.unsafe_compute_mask_ptr(bitmask.data_ptr() + j * row_bytes,
                                                    row_bytes)
                done.set_result(None)
            except Exception as exc:  # handed to the waiter, as the thread's would be
                done.set_exception(exc)
        return PendingMasks(request_ids, bitmask, done)

    def shutdown(self) -> None:
        if self._thread is not None:
            self._thread.shutdown(wait=True)


def spare_core() -> bool:
    """Whether this process may run on more cores than torch's threads take (where it
    may not, a mask thread takes its time from the forward: on bench55m at two threads
    the forward lost more than making the masks in the step costs)."""
    try:
        cores = len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        cores = os.cpu_count() or 1
    return torch.get_num_threads() < cores


@torch.inference_mode()  # the engine's logits are inference tensors (changed in place)
def apply_token_bitmask(logits: torch.Tensor, bitmask: torch.Tensor,
                        rows: Sequence[int]) -> None:
    """Logits row ``rows[j]`` set to -inf wherever ``bitmask`` row ``j`` does not allow the
    token (and past the bitmask's last word), in place."""
    kernels = native() if logits.device.type == "cpu" else None
    if kernels is None or not kernels.apply_token_bitmask(logits, bitmask, rows):
        apply_token_bitmask_torch(logits, bitmask, rows)


@torch.inference_mode()
def apply_token_bitmask_torch(logits: torch.Tensor, bitmask: torch.Tensor,
                              rows: Sequence[int]) -> None:
    """``apply_token_bitmask`` in torch ops (any device)."""
    vocab = logits.shape[1]
    allowed = ((bitmask.to(logits.device).unsqueeze(-1) >> _BITS.to(logits.device)) & 1)
    allowed = allowed.flatten(1)[:, :vocab].bool()
    if allowed.shape[1] < vocab:  # tokens past the bitmask: never allowed
        allowed = torch.nn.functional.pad(allowed, (0, vocab - allowed.shape[1]), value=False)
    index = torch.tensor(list(rows), dtype=torch.int64, device=logits.device)
    logits[index] = logits[index].masked_fill(~allowed, float("-inf"))
