"""What a request's history does to its logits before sampling: ``logit_bias``, the
``min_tokens`` mask and the repetition, presence and frequency penalties, in vLLM's order
(``engine.sampling_params.SamplingParams`` says what each does). A pure function of the
logits, the parameters and the token history, so the first token (sampled where the
prompt ran, a prefill worker) and the rest (a decode worker) get the same treatment, and
so does a stream continued elsewhere after a migration (its resumed tokens are output).
"""

from __future__ import annotations

from array import array
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from engine.kernels.cpu import native
from engine.sampling_params import SamplingParams


@dataclass(frozen=True)
class History:
    """One row's tokens: the client's prompt and the output so far (resumed tokens
    included), and the ids that end it (EOS unless ignored, and the stop token ids)."""

    prompt_token_ids: Sequence[int] | torch.Tensor  # a tensor: kept by the caller per request
    output_token_ids: Sequence[int]
    eos_token_ids: Sequence[int] = ()


@torch.inference_mode()  # the engine's logits are inference tensors (changed in place)
def process_logits(logits: torch.Tensor, params: Sequence[SamplingParams],
                   histories: Sequence[History], *, in_place: bool = False) -> torch.Tensor:
    """``logits`` (``[num_rows, vocab]``) with each penalized row's bias, mask and
    penalties applied (a copy in fp32 — ``logits`` itself, changed, with ``in_place`` and
    fp32 logits —; ``logits`` unchanged when no row has any). Only the penalized rows'
    ``histories`` are read. Sparse: the work grows with the rows' histories, not with the
    vocabulary (on the CPU the compiled kernel reads the histories where they lie)."""
    rows = [i for i, p in enumerate(params) if p.penalized]
    if not rows:
        return logits
    logits = logits.float() if in_place else logits.float().clone()
    flat = logits.view(-1)
    vocab_size = logits.shape[1]
    bias = [(r * vocab_size + t, b) for r in rows for t, b in params[r].logit_bias
            if t < vocab_size]
    device = logits.device
    if bias:
        index, values = zip(*bias, strict=True)
        flat.index_add_(0, torch.tensor(index, device=device),
                        torch.tensor(values, dtype=flat.dtype, device=device))
    ends = [r * vocab_size + t for r in rows
            if len(histories[r].output_token_ids) < params[r].min_tokens
            for t in (*histories[r].eos_token_ids, *params[r].stop_token_ids) if t < vocab_size]
    if ends:
        flat[torch.tensor(ends, device=device)] = float("-inf")
    if not _compiled_penalties(logits, rows, params, histories):
        _repetition(flat, rows, params, histories, vocab_size)
        _presence_frequency(flat, rows, params, histories, vocab_size)
    return logits


def _compiled_penalties(logits: torch.Tensor, all_rows: Sequence[int],
                        params: Sequence[SamplingParams], histories: Sequence[History]) -> bool:
    """The repetition, presence and frequency penalties by the compiled CPU kernel, in
    place (one pass over each row's history, no tensor built from it); False where it
    does not run (not the CPU, no compiled kernels), nothing then changed."""
    kernels = native() if logits.device.type == "cpu" else None
    if kernels is None:
        return False
    rows = [r for r in all_rows if params[r].repetition_penalty != 1.0
            or params[r].presence_penalty or params[r].frequency_penalty]
    return kernels.penalties(
        logits, rows,
        [histories[r].prompt_token_ids if params[r].repetition_penalty != 1.0 else ()
         for r in rows],
        [histories[r].output_token_ids for r in rows],
        [params[r].repetition_penalty for r in rows],
        [params[r].presence_penalty for r in rows],
        [params[r].frequency_penalty for r in rows])


def _flat_ids(rows: Sequence[int], lists: Sequence[Sequence[int] | torch.Tensor],
              vocab_size: int) -> torch.Tensor:
    """Each row's tokens as indices into the flattened ``[rows, vocab]`` logits, in no
    particular order (the callers count and deduplicate them). A handful of tensor ops
    whatever the number of rows: the lists are joined in Python, the tensors concatenated."""
    lists = [torch.frombuffer(t, dtype=torch.int32) if isinstance(t, array) and t.typecode == "i"
             and len(t) else t for t in lists]  # the engine's histories: read where they lie
    tensors = [(r, t.to("cpu", torch.long)) for r, t in zip(rows, lists, strict=True)
               if isinstance(t, torch.Tensor)]
    plain = [(r, t) for r, t in zip(rows, lists, strict=True) if not isinstance(t, torch.Tensor)]
    parts = [t for _, t in tensors]
    if plain:
        parts.append(torch.tensor([v for _, t in plain for v in t], dtype=torch.long))
    if not parts:
        return torch.zeros(0, dtype=torch.long)
    ids = torch.cat(parts)
    row = torch.repeat_interleave(
        torch.tensor([r for r, _ in tensors] + [r for r, _ in plain]),
        torch.tensor([len(t) for _, t in tensors] + [len(t) for _, t in plain]))
    return (ids + row * vocab_size)[ids < vocab_size]


def _repetition(flat: torch.Tensor, all_rows: Sequence[int], params: Sequence[SamplingParams],
                histories: Sequence[History], vocab_size: int) -> None:
    """HF's repetition penalty over each row's prompt and output tokens, in place."""
    rows = [r for r in all_rows if params[r].repetition_penalty != 1.0]
    if not rows:
        return
    seen = torch.unique(torch.cat((
        _flat_ids(rows, [histories[r].prompt_token_ids for r in rows], vocab_size),
        _flat_ids(rows, [histories[r].output_token_ids for r in rows], vocab_size))))
    penalty = torch.ones(max(rows) + 1)
    penalty[torch.tensor(rows)] = torch.tensor([params[r].repetition_penalty for r in rows])
    factor = penalty[seen // vocab_size].to(flat.device)
    seen = seen.to(flat.device)
    values = flat[seen]
    flat[seen] = torch.where(values > 0, values / factor, values * factor)


def _presence_frequency(flat: torch.Tensor, all_rows: Sequence[int],
                        params: Sequence[SamplingParams], histories: Sequence[History],
                        vocab_size: int) -> None:
    """Presence (once per token present) and frequency (per occurrence) penalties over
    each row's output, in place."""
    rows = [r for r in all_rows if params[r].presence_penalty or params[r].frequency_penalty]
    if not rows:
        return
    ids = _flat_ids(rows, [histories[r].output_token_ids for r in rows], vocab_size)
    if not ids.numel():
        return
    unique, counts = torch.unique(ids, return_counts=True)
    presence, frequency = torch.zeros(max(rows) + 1), torch.zeros(max(rows) + 1)
    index = torch.tensor(rows)
    presence[index] = torch.tensor([params[r].presence_penalty for r in rows])
    frequency[index] = torch.tensor([params[r].frequency_penalty for r in rows])
    row = unique // vocab_size
    delta = -(frequency[row] * counts.to(torch.float32) + presence[row])
    flat.index_add_(0, unique.to(flat.device), delta.to(device=flat.device, dtype=flat.dtype))
