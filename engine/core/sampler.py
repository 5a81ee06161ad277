"""Choosing the next token of each sequence from its logits.

Greedy rows take the argmax. Random rows apply temperature, then ``min_p``, then top-k,
then top-p on the renormalised top-k distribution, and draw with the exponential race
``argmax(probs / E)``, ``E ~ Exp(1)`` i.i.d. per vocabulary entry, which picks token ``v``
with probability ``probs[v]``. A seeded row draws ``E`` from a CPU generator whose seed
is a stable hash of (request seed, position), so its token is a pure function of
(seed, position, logits): independent of batch composition, order, process and device.
"""

from __future__ import annotations

import struct
from collections.abc import Sequence

import torch
import xxhash

from engine.kernels.cpu import native
from engine.sampling_params import SamplingParams

_SEED_DOMAIN = b"pdserve.sample.v1"
_UINT64_MASK = (1 << 64) - 1
# Entries sorted for top-p rows without top-k before falling back to a full sort.
_NUM_NUCLEUS_CANDIDATES = 1024


def sample(
    logits: torch.Tensor, params: Sequence[SamplingParams], positions: Sequence[int]
) -> list[int]:
    """Sample one token id per row.

    ``logits``: ``[num_seqs, vocab_size]``, any float dtype, any device (computed in fp32).
    ``params[i]`` and ``positions[i]`` belong to row ``i``; ``positions[i]`` is the index
    of the sampled token in its sequence (the number of tokens before it). Unseeded
    random rows use torch's process-wide generator for the logits' device.
    """
    _check_inputs(logits, params, positions)
    if all(p.greedy for p in params):
        kernels = native() if logits.device.type == "cpu" else None
        fast = kernels.argmax_rows(logits) if kernels is not None else None
        return (fast if fast is not None else logits.argmax(dim=-1)).tolist()
    token_ids = logits.argmax(dim=-1)  # [num_seqs]; random rows are overwritten below
    rows = [i for i, p in enumerate(params) if not p.greedy]
    row_params = [params[i] for i in rows]
    row_index = torch.tensor(rows, device=logits.device)
    probs = _filtered_probs(logits[row_index].float(), row_params)  # [num_rows, vocab]
    noise = _exponential_noise(row_params, [positions[i] for i in rows], probs)
    token_ids[row_index] = (probs / noise).argmax(dim=-1)
    return token_ids.tolist()


def seed_for_position(seed: int, position: int) -> int:
    """The 64-bit generator seed for drawing token ``position`` of a request seeded ``seed``.

    A stable hash (xxh64 over a fixed little-endian encoding), identical in every
    process; seeds are taken modulo 2**64.
    """
    data = _SEED_DOMAIN + struct.pack("<QQ", seed & _UINT64_MASK, position & _UINT64_MASK)
    return xxhash.xxh64_intdigest(data)


def _check_inputs(
    logits: torch.Tensor, params: Sequence[SamplingParams], positions: Sequence[int]
) -> None:
    if logits.dim() != 2:
        raise ValueError(f"logits must be [num_seqs, vocab_size], got shape {tuple(logits.shape)}")
    if not logits.is_floating_point():
        raise ValueError(f"logits must be floating point, got {logits.dtype}")
    num_seqs = logits.shape[0]
    if len(params) != num_seqs or len(positions) != num_seqs:
        raise ValueError(
            f"got {num_seqs} logits rows, {len(params)} params and {len(positions)} positions"
        )
    if any(pos < 0 for pos in positions):
        raise ValueError("positions must be non-negative")


def _filtered_probs(logits: torch.Tensor, params: Sequence[SamplingParams]) -> torch.Tensor:
    """Weights proportional to the filtered distribution; excluded entries are zero.

    Temperature, then top-k, then top-p on the renormalised top-k distribution. Both
    filters cut by value, so ties at a cut are all kept and a row's result does not
    depend on tie order or on the other rows in the batch.
    """
    temperatures = torch.tensor([p.temperature for p in params], device=logits.device)
    logits = logits / temperatures.unsqueeze(1)
    if any(p.min_p > 0 for p in params):
        logits = _apply_min_p(logits, params)
    if any(p.top_k != -1 for p in params):
        logits = _apply_top_k(logits, params)
    probs = torch.softmax(logits, dim=-1)
    if any(p.top_p < 1.0 for p in params):
        probs = _apply_top_p(probs, params)
    return probs


def _apply_min_p(logits: torch.Tensor, params: Sequence[SamplingParams]) -> torch.Tensor:
    """Set logits of tokens less likely than ``min_p`` times the likeliest to -inf (after
    temperature; rows with min_p 0 untouched)."""
    probs = torch.softmax(logits, dim=-1)
    min_p = torch.tensor([p.min_p for p in params], device=logits.device).unsqueeze(1)
    threshold = probs.amax(dim=-1, keepdim=True) * min_p
    return logits.masked_fill(probs < threshold, float("-inf"))


def _apply_top_k(logits: torch.Tensor, params: Sequence[SamplingParams]) -> torch.Tensor:
    """Set logits below each row's k-th largest value to -inf (rows with top_k -1 untouched)."""
    vocab_size = logits.shape[1]
    top_k = [vocab_size if p.top_k == -1 else min(p.top_k, vocab_size) for p in params]
    top_values = logits.topk(max(top_k), dim=-1).values  # [num_rows, max_k], descending
    kth_index = torch.tensor(top_k, device=logits.device).sub_(1).unsqueeze(1)
    kth_value = top_values.gather(1, kth_index)
    kth_value[torch.tensor([p.top_k == -1 for p in params], device=logits.device)] = float("-inf")
    return logits.masked_fill(logits < kth_value, float("-inf"))


def _apply_top_p(probs: torch.Tensor, params: Sequence[SamplingParams]) -> torch.Tensor:
    """Zero probabilities outside each row's nucleus (top_p == 1 rows untouched).

    The nucleus is the shortest run of most likely tokens whose mass reaches top_p;
    the top token is always kept. Only the leading candidates are sorted when they
    hold every nucleus (top-k rows have at most k nonzero entries).
    """
    vocab_size = probs.shape[1]
    # top_p == 1 keeps everything (avoids dropping tail tokens to cumsum rounding).
    top_p = torch.tensor([p.top_p if p.top_p < 1.0 else 2.0 for p in params], device=probs.device)
    top_p = top_p.unsqueeze(1)  # [num_rows, 1]
    num_candidates = _num_nucleus_candidates(params, vocab_size)
    sorted_probs = probs.topk(num_candidates, dim=-1).values  # [num_rows, n], descending
    cumulative = sorted_probs.cumsum(dim=-1)
    if num_candidates < vocab_size and bool(((cumulative[:, -1:] < top_p) & (top_p <= 1)).any()):
        sorted_probs = probs.sort(dim=-1, descending=True).values
        cumulative = sorted_probs.cumsum(dim=-1)
    mass_before = cumulative - sorted_probs  # exactly 0 at rank 0
    num_kept = (mass_before < top_p).sum(dim=-1, keepdim=True)  # >= 1 since top_p > 0
    cutoff = sorted_probs.gather(1, num_kept - 1).masked_fill_(top_p > 1, 0.0)
    return probs.masked_fill(probs < cutoff, 0.0)


def _num_nucleus_candidates(params: Sequence[SamplingParams], vocab_size: int) -> int:
    """How many leading entries to sort first: every top-k row's k, or a fixed guess."""
    if all(p.top_k != -1 or p.top_p == 1.0 for p in params):
        return min(vocab_size, max(p.top_k for p in params))
    return min(vocab_size, _NUM_NUCLEUS_CANDIDATES)


def _exponential_noise(
    params: Sequence[SamplingParams], positions: Sequence[int], like: torch.Tensor
) -> torch.Tensor:
    """Exp(1) noise shaped like ``like``; seeded rows from per-(seed, position) generators."""
    num_rows, vocab_size = like.shape
    uniform = torch.empty_like(like)
    unseeded = [i for i, p in enumerate(params) if p.seed is None]
    if unseeded:
        uniform[unseeded] = torch.rand(len(unseeded), vocab_size, device=like.device)
    seeded = [i for i, p in enumerate(params) if p.seed is not None]
    if seeded:
        draws = [_seeded_uniform(params[i].seed, positions[i], vocab_size) for i in seeded]
        uniform[seeded] = torch.stack(draws).to(like.device)
    # u in [0, 1) -> -log(1 - u) ~ Exp(1); clamp so no entry divides by zero.
    return torch.log1p(-uniform).neg_().clamp_(min=torch.finfo(torch.float32).tiny)


def _seeded_uniform(seed: int | None, position: int, vocab_size: int) -> torch.Tensor:
    """``[vocab_size]`` fp32 uniforms on CPU from a generator private to (seed, position)."""
    assert seed is not None
    generator = torch.Generator(device="cpu")
    generator.manual_seed(seed_for_position(seed, position))
    return torch.rand(vocab_size, generator=generator)
