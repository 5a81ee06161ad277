"""The compiled sampling kernels (``sampling.c``) against torch: a structured output's
token bitmask applied in place (llguidance's bit layout), the logprobs of a step — each
row's log-softmax at the sampled token, its rank, the likeliest entries — including the
rows the kernel leaves to torch, and the penalties against ``engine.core.logits``' torch
rules."""

from __future__ import annotations

import pytest
import torch

from engine.kernels.cpu import NativeKernels


def _allowed(bitmask: torch.Tensor, vocab: int) -> torch.Tensor:
    """``[rows, vocab]`` bools: bit b of word w allows token 32 w + b."""
    bits = torch.arange(32, dtype=torch.int32)
    return ((bitmask.unsqueeze(-1) >> bits) & 1).flatten(1)[:, :vocab].bool()


@pytest.mark.parametrize("vocab", [704, 32000, 37, 64])
def test_the_bitmask_sets_every_disallowed_token_of_the_named_rows_to_minus_inf(
        kernels: NativeKernels, vocab: int) -> None:
    torch.manual_seed(vocab)
    logits = torch.randn(6, vocab)
    bitmask = torch.randint(-2**31, 2**31 - 1, (3, (vocab + 31) // 32), dtype=torch.int32)
    bitmask[0, 0] = -1  # a word that allows all 32 tokens
    rows = [4, 0, 5]
    out = logits.clone()
    assert kernels.apply_token_bitmask(out, bitmask, rows)
    expected = logits.clone()
    for i, row in enumerate(rows):
        expected[row][~_allowed(bitmask, vocab)[i]] = float("-inf")
    assert torch.equal(out, expected)  # rows 1..3 untouched


def test_the_torch_bitmask_is_the_kernels(kernels: NativeKernels) -> None:
    from engine.core.masks import apply_token_bitmask_torch

    torch.manual_seed(1)
    for vocab, words in ((704, 22), (70, 2), (37, 2)):  # 70: tokens past the mask
        logits = torch.randn(5, vocab)
        bitmask = torch.randint(-2**31, 2**31 - 1, (2, words), dtype=torch.int32)
        compiled, torched = logits.clone(), logits.clone()
        assert kernels.apply_token_bitmask(compiled, bitmask, [3, 1])
        apply_token_bitmask_torch(torched, bitmask, [3, 1])
        assert torch.equal(compiled, torched)


def test_tokens_past_the_bitmask_are_not_allowed_and_odd_arguments_are_refused(
        kernels: NativeKernels) -> None:
    logits = torch.zeros(2, 70)
    bitmask = torch.full((1, 2), -1, dtype=torch.int32)  # covers 64 of the 70 tokens
    assert kernels.apply_token_bitmask(logits, bitmask, [1])
    assert torch.isinf(logits[1, 64:]).all() and not torch.isinf(logits[1, :64]).any()
    assert not torch.isinf(logits[0]).any()
    assert not kernels.apply_token_bitmask(logits, bitmask, [2])  # no such row
    assert not kernels.apply_token_bitmask(logits.double(), bitmask, [0])
    assert not kernels.apply_token_bitmask(logits, bitmask.long(), [0])
    assert not kernels.apply_token_bitmask(logits, bitmask, [0, 1])  # one mask row only


@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("vocab,k", [(32000, 5), (704, 20), (37, 3), (8, 8), (100, 0)])
def test_logprobs_are_torchs_log_softmax_at_the_token_its_rank_and_the_top_k(
        kernels: NativeKernels, vocab: int, k: int, threads: int) -> None:
    torch.manual_seed(vocab + k)
    logits = torch.randn(33, vocab) * 4
    logits[3, 5:] = float("-inf")  # masked entries count as nothing
    token_ids = torch.randint(0, 5, (33,)).tolist()
    previous = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        found = kernels.token_logprobs(logits, token_ids, k)
    finally:
        torch.set_num_threads(previous)
    assert found is not None
    values, ranks, top_ids, top_values = found
    reference = torch.log_softmax(logits, dim=-1)
    chosen = reference.gather(1, torch.tensor(token_ids).unsqueeze(1))
    torch.testing.assert_close(values, chosen.squeeze(1), rtol=1e-6, atol=1e-5)
    assert ranks.tolist() == ((reference > chosen).sum(dim=-1) + 1).tolist()
    expected_values, expected_ids = reference.topk(k, dim=-1)
    torch.testing.assert_close(top_values, expected_values, rtol=1e-6, atol=1e-5)
    finite = expected_values.isfinite()  # which of the tied -inf entries is listed: either
    assert torch.equal(top_ids[finite], expected_ids[finite])


def test_logprobs_ties_share_the_better_rank_and_keep_the_lower_id_first(
        kernels: NativeKernels) -> None:
    logits = torch.tensor([[2.0, 1.0, 3.0, 3.0, 0.0] * 4])
    found = kernels.token_logprobs(logits, [3], 3)
    assert found is not None
    _, ranks, top_ids, _ = found
    assert ranks.tolist() == [1] and top_ids.tolist() == [[2, 3, 7]]


def test_logprobs_leave_nan_and_all_masked_rows_and_odd_arguments_to_torch(
        kernels: NativeKernels) -> None:
    logits = torch.randn(2, 50)
    logits[1, 7] = float("nan")
    assert kernels.token_logprobs(logits, [0, 0], 2) is None
    assert kernels.token_logprobs(torch.full((1, 50), float("-inf")), [0], 2) is None
    assert kernels.token_logprobs(torch.randn(2, 50), [0], 2) is None  # a row without a token
    assert kernels.token_logprobs(torch.randn(1, 50).double(), [0], 2) is None
    assert kernels.token_logprobs(torch.randn(1, 50), [0], 51) is None
    with pytest.raises(AssertionError):  # an out-of-range token is the kernel's refusal
        assert kernels.token_logprobs(torch.randn(1, 50), [50], 2) is not None


@pytest.mark.parametrize("threads", [1, 2])
def test_penalties_are_the_torch_rules(kernels: NativeKernels, threads: int) -> None:
    """Against ``engine.core.logits``' torch path, on histories with repeats, shared
    tokens, empty ones and long ones (work enough for both threads), each row its own
    factors; rows not named stay as they were."""
    from engine.core.logits import History, _presence_frequency, _repetition
    from engine.sampling_params import SamplingParams

    torch.manual_seed(threads)
    vocab, num_rows = 1000, 9
    logits = torch.randn(num_rows, vocab) * 3
    lengths = [0, 1, 7, 50, 300, 20000, 5, 64, 9000]
    params = [SamplingParams(repetition_penalty=1.0 + 0.1 * r, presence_penalty=0.3 * (r % 3),
                             frequency_penalty=-0.2 * (r % 2), max_tokens=4) for r in range(num_rows)]
    histories = [History(torch.randint(0, vocab, (n // 3 + 1,)).tolist(),
                         torch.randint(0, vocab // 10, (n,)).tolist()) for n in lengths]
    rows = [r for r in range(num_rows) if r != 2]
    expected = logits.clone()
    _repetition(expected.view(-1), rows, params, histories, vocab)
    _presence_frequency(expected.view(-1), rows, params, histories, vocab)
    out = logits.clone()
    previous = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        assert kernels.penalties(
            out, rows, [histories[r].prompt_token_ids for r in rows],
            [histories[r].output_token_ids for r in rows],
            [params[r].repetition_penalty for r in rows], [params[r].presence_penalty for r in rows],
            [params[r].frequency_penalty for r in rows])
    finally:
        torch.set_num_threads(previous)
    torch.testing.assert_close(out, expected, rtol=1e-6, atol=1e-5)
    assert torch.equal(out[2], logits[2])


def test_penalties_skip_ids_outside_the_vocabulary_and_refuse_odd_arguments(
        kernels: NativeKernels) -> None:
    logits = torch.ones(1, 8)
    assert kernels.penalties(logits, [0], [[3, -1, 99]], [[3, 3, 8]], [2.0], [1.0], [0.5])
    assert logits[0].tolist() == [1, 1, 1, 0.5 - 2.0, 1, 1, 1, 1]
    assert not kernels.penalties(logits.double(), [0], [[]], [[]], [2.0], [0.0], [0.0])
    assert not kernels.penalties(logits, [0], [[]], [], [2.0], [0.0], [0.0])
    assert not kernels.penalties(logits, [1], [[]], [[]], [2.0], [0.0], [0.0])  # no row 1
