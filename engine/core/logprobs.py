"""The log-probabilities a request asked for (``SamplingParams.logprobs``): of each
sampled token and of the likeliest alternatives at its position.

Values are the log-softmax of the model's raw logits (vLLM's default): before
``logit_bias``, the penalties, temperature and the top-k/top-p/min-p filters, so they
say what the model thinks, whatever the sampler then did. The sampled token is always
reported, with its rank (1: the likeliest; ties share the better rank), even where it
is not among the top ones. The same function runs where the prompt ran (a prefill
worker, for the first token) and where the rest is decoded, so the two agree.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from engine.sampling_params import TokenLogprobs


def token_logprobs(logits: torch.Tensor, token_ids: Sequence[int],
                   num_top: Sequence[int]) -> list[TokenLogprobs]:
    """Row ``i`` of ``logits`` (``[rows, vocab]``, raw) sampled ``token_ids[i]``; report
    it and its ``num_top[i]`` likeliest alternatives. Computed in fp32."""
    logprobs = torch.log_softmax(logits.float(), dim=-1)
    chosen = torch.tensor(list(token_ids), device=logprobs.device).unsqueeze(1)
    chosen_lp = logprobs.gather(1, chosen)  # [rows, 1]
    ranks = (logprobs > chosen_lp).sum(dim=-1).add_(1).tolist()
    k = max(num_top, default=0)
    top_lp, top_ids = (logprobs.topk(k, dim=-1) if k else (None, None))
    out: list[TokenLogprobs] = []
    values = chosen_lp.squeeze(1).tolist()
    for i, (token_id, n) in enumerate(zip(token_ids, num_top, strict=True)):
        top: tuple[tuple[int, float], ...] = ()
        if n:
            assert top_ids is not None and top_lp is not None
            top = tuple(zip(top_ids[i, :n].tolist(), top_lp[i, :n].tolist(), strict=True))
        out.append(TokenLogprobs(int(token_id), values[i], int(ranks[i]), top))
    return out
