"""What a request's history does to its logits before sampling: ``logit_bias``, the
``min_tokens`` mask and the repetition, presence and frequency penalties, in vLLM's order
(``engine.sampling_params.SamplingParams`` says what each does). A pure function of the
logits, the parameters and the token history, so the first token (sampled where the
prompt ran, a prefill worker) and the rest (a decode worker) get the same treatment, and
so does a stream continued elsewhere after a migration (its resumed tokens are output).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from engine.sampling_params import SamplingParams


@dataclass(frozen=True)
class History:
    """One row's tokens: the client's prompt and the output so far (resumed tokens
    included), and the ids that end it (EOS unless ignored, and the stop token ids)."""

    prompt_token_ids: Sequence[int]
    output_token_ids: Sequence[int]
    eos_token_ids: Sequence[int] = ()


def process_logits(logits: torch.Tensor, params: Sequence[SamplingParams],
                   histories: Sequence[History]) -> torch.Tensor:
    """``logits`` (``[num_rows, vocab]``) with each penalized row's bias, mask and
    penalties applied (fp32; rows without any are returned as they were)."""
    rows = [i for i, p in enumerate(params) if p.penalized]
    if not rows:
        return logits
    logits = logits.float().clone()
    vocab_size = logits.shape[1]
    for i in rows:
        p, history, row = params[i], histories[i], logits[i]
        for token_id, bias in p.logit_bias:
            if token_id < vocab_size:
                row[token_id] += bias
        if len(history.output_token_ids) < p.min_tokens:
            ends = [t for t in (*history.eos_token_ids, *p.stop_token_ids) if t < vocab_size]
            if ends:
                row[torch.tensor(ends, dtype=torch.long)] = float("-inf")
        _penalize(row, p, history, vocab_size)
    return logits


def _penalize(row: torch.Tensor, p: SamplingParams, history: History, vocab_size: int) -> None:
    """The repetition penalty over prompt and output, then presence and frequency over
    the output, in place."""
    output = torch.tensor([t for t in history.output_token_ids if t < vocab_size],
                          dtype=torch.long)
    if p.repetition_penalty != 1.0:
        prompt = torch.tensor([t for t in history.prompt_token_ids if t < vocab_size],
                              dtype=torch.long)
        seen = torch.unique(torch.cat((prompt, output)))
        values = row[seen]
        row[seen] = torch.where(values > 0, values / p.repetition_penalty,
                                values * p.repetition_penalty)
    if (p.presence_penalty or p.frequency_penalty) and output.numel():
        counts = torch.bincount(output, minlength=vocab_size).to(row.dtype)
        row -= p.frequency_penalty * counts + p.presence_penalty * (counts > 0).to(row.dtype)
