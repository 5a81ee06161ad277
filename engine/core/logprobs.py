"""The log-probabilities a request asked for (``SamplingParams.logprobs``): of each
sampled token and of the likeliest alternatives at its position.

Values are the log-softmax of the model's raw logits (vLLM's default): before
``logit_bias``, the penalties, temperature and the top-k/top-p/min-p filters, so they
say what the model thinks, whatever the sampler then did. The sampled token is always
reported, with its rank (1: the likeliest; ties share the better rank), even where it
is not among the top ones. The same function runs where the prompt ran (a prefill
worker, for the first token) and where the rest is decoded, so the two agree.

Prompt logprobs (``SamplingParams.prompt_logprobs``) are the same values for the prompt's
own tokens: the logits at position p say how likely prompt token p + 1 was. A chunk whose
request wants them comes back with a logits row per token (``ScheduledChunk.all_logits``);
``prompt_logprobs`` records them on the request and leaves the sampling rows.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING

import torch

from engine.kernels.cpu import native
from engine.sampling_params import TokenLogprobs

if TYPE_CHECKING:
    from engine.core.request import Request
    from engine.core.scheduler import ScheduledChunk


def token_logprobs(logits: torch.Tensor, token_ids: Sequence[int],
                   num_top: Sequence[int]) -> list[TokenLogprobs]:
    """Row ``i`` of ``logits`` (``[rows, vocab]``, raw) sampled ``token_ids[i]``; report
    it and its ``num_top[i]`` likeliest alternatives. Computed in fp32 (on the CPU by the
    compiled kernel where it runs: one call, no log-softmax of the whole batch kept)."""
    kernels = native() if logits.device.type == "cpu" else None
    k = max(num_top, default=0)
    found = kernels.token_logprobs(logits.float(), token_ids, k) if kernels is not None else None
    if found is None:
        logprobs = torch.log_softmax(logits.float(), dim=-1)
        chosen = torch.tensor(list(token_ids), device=logprobs.device).unsqueeze(1)
        chosen_lp = logprobs.gather(1, chosen)  # [rows, 1]
        top_lp, top_ids = logprobs.topk(k, dim=-1)
        found = (chosen_lp.squeeze(1), (logprobs > chosen_lp).sum(dim=-1).add_(1), top_ids,
                 top_lp)
    values, ranks, ids, tops = (t.tolist() for t in found)
    return [TokenLogprobs(int(token_id), values[i], int(ranks[i]),
                          tuple(zip(ids[i][:n], tops[i][:n], strict=True)))
            for i, (token_id, n) in enumerate(zip(token_ids, num_top, strict=True))]


def prompt_logprobs(logits: torch.Tensor, chunks: Sequence[ScheduledChunk],
                    requests: Mapping[str, Request]) -> torch.Tensor:
    """Record on each request of an ``all_logits`` chunk the logprobs its rows give of
    its prompt's next tokens (``Request.prompt_logprobs``, in prompt order: positions
    already recorded, e.g. before a preemption, are not recorded twice); returns the
    sampling rows of ``logits``, one per chunk with ``sample`` (a speculated chunk's
    ``1 + num_draft_tokens``), in chunk order."""
    keep: list[int] = []
    row = 0
    for chunk in chunks:
        num_rows = chunk.num_logit_rows
        if chunk.all_logits:
            request = requests[chunk.request_id]
            prompt, start = request.prompt_token_ids, chunk.start_position
            # row j predicts position start + j + 1, a prompt token while that is < len
            num = min(num_rows, len(prompt) - 1 - start)
            # recorded up to here already (a recompute after a preemption, whose chunks
            # need not end where the first run's did): only the rows past that
            skip = len(request.prompt_logprobs) - start
            if 0 <= skip < num:
                request.prompt_logprobs.extend(token_logprobs(
                    logits[row + skip:row + num], prompt[start + 1 + skip:start + 1 + num],
                    [request.params.prompt_logprobs or 0] * (num - skip)))
        if chunk.sample:  # a speculated chunk samples from each of its rows
            keep.extend(range(row + num_rows - 1 - chunk.num_draft_tokens, row + num_rows))
        row += num_rows
    return logits[torch.tensor(keep, dtype=torch.int64, device=logits.device)]


def delivered_prompt_logprobs(request: Request, new_token: bool) -> list[TokenLogprobs] | None:
    """What an output of ``request`` carries of its prompt's logprobs: all of them with
    the first token sampled here (``new_token``: the output has a token), when asked for
    and computed here; None otherwise (a resumed request, or a first token sampled
    elsewhere and admitted with its KV)."""
    if (request.params.prompt_logprobs is None or request.num_resumed_tokens or not new_token
            or len(request.output_token_ids) != 1
            or len(request.prompt_logprobs) != request.num_prompt_tokens - 1):
        return None
    return list(request.prompt_logprobs)
