"""Scheduler lifecycles without a model: schedule → fake execute → update → assert.

The fake model "samples" either a token the test picks or ``fake_token(chunk)``, which
depends only on the chunk's last token and its position — so a request recomputed at
the wrong positions (or from the wrong tokens) produces different outputs. Torch-free.
"""

from __future__ import annotations

import itertools
from collections.abc import Mapping, Sequence
from typing import Any

import pytest

from engine.config import CacheConfig, SchedulerConfig
from engine.core.chunks import decode_chunk, next_chunk
from engine.core.request import FinishReason, Request, RequestStatus
from engine.core.scheduler import ScheduledChunk, Scheduler, SchedulerOutput, StepUpdate
from engine.kvcache import BlockManager
from engine.sampling_params import SamplingParams
from tests.factories import run_without_torch

BLOCK_SIZE = 4
EOS = 2

_prompt_starts = itertools.count(100, 1000)


# --------------------------------------------------------------------- factories
def make_request(request_id: str = "r0", num_prompt_tokens: int = 6, *,
                 prompt: Sequence[int] | None = None, max_tokens: int = 4,
                 ignore_eos: bool = False, stop_token_ids: Sequence[int] = (),
                 prefill_only: bool = False) -> Request:
    """A request with EOS ``EOS``; without ``prompt``, fresh token ids no other request shares."""
    if prompt is None:
        start = next(_prompt_starts)
        prompt = range(start, start + num_prompt_tokens)
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=ignore_eos,
                            stop_token_ids=tuple(stop_token_ids))
    return Request(request_id, list(prompt), params, eos_token_ids=(EOS,),
                   prefill_only=prefill_only)


def make_scheduler(num_blocks: int = 32, block_size: int = BLOCK_SIZE, max_num_seqs: int = 8,
                   max_num_batched_tokens: int = 64, *, enable_prefix_caching: bool = True,
                   max_model_len: int = 1024) -> Scheduler:
    cache = CacheConfig(block_size=block_size, enable_prefix_caching=enable_prefix_caching)
    blocks = BlockManager(num_blocks, block_size, enable_prefix_caching=enable_prefix_caching)
    sched = SchedulerConfig(max_num_seqs=max_num_seqs,
                            max_num_batched_tokens=max_num_batched_tokens)
    return Scheduler(sched, cache, blocks, max_model_len)


# -------------------------------------------------------------------- fake model
def fake_token(chunk: ScheduledChunk) -> int:
    """The fake model's next token: a function of the last token and its position (never EOS)."""
    position = chunk.start_position + len(chunk.token_ids)
    return 10 + (chunk.token_ids[-1] * 31 + position * 17) % 997


def check_chunk(sched: Scheduler, chunk: ScheduledChunk) -> None:
    """A chunk continues its request exactly where its KV ends, in the request's blocks."""
    request = sched.requests[chunk.request_id]
    end = chunk.start_position + len(chunk.token_ids)
    assert request.status is RequestStatus.RUNNING
    assert chunk.token_ids and chunk.start_position == request.num_computed_tokens
    assert chunk.token_ids == tuple(request.all_token_ids[chunk.start_position : end])
    assert chunk.sample == (end == request.num_tokens)
    assert chunk.block_ids == tuple(sched.blocks.block_ids(chunk.request_id))
    assert len(chunk.block_ids) == sched.blocks.num_blocks_needed(end)
    assert len(set(chunk.block_ids)) == len(chunk.block_ids)


def fake_execute(sched: Scheduler, out: SchedulerOutput,
                 tokens: Mapping[str, int] | None = None) -> list[int]:
    """One sampled token per sampling chunk, in ``out.chunks`` order: ``tokens[request_id]``
    where given, else ``fake_token``. Checks every chunk first."""
    tokens = tokens or {}
    sampled = []
    for chunk in out.chunks:
        check_chunk(sched, chunk)
        if chunk.sample:
            sampled.append(tokens.get(chunk.request_id, fake_token(chunk)))
    return sampled


def step(sched: Scheduler, tokens: Mapping[str, int] | None = None
         ) -> tuple[SchedulerOutput, list[StepUpdate]]:
    out = sched.schedule()
    assert out.num_tokens <= sched.config.max_num_batched_tokens
    assert len({c.request_id for c in out.chunks}) == len(out.chunks)
    updates = sched.update(out, fake_execute(sched, out, tokens))
    sched.blocks.check_integrity()
    return out, updates


def drain(sched: Scheduler, max_steps: int = 500) -> list[SchedulerOutput]:
    """Step until nothing is unfinished; fails instead of looping forever."""
    outs: list[SchedulerOutput] = []
    while sched.has_unfinished():
        assert len(outs) < max_steps, "scheduler made no progress (deadlock?)"
        outs.append(step(sched)[0])
    return outs


def assert_all_released(sched: Scheduler) -> None:
    sched.blocks.check_integrity()
    usage = sched.blocks.usage()
    assert usage.in_use == 0 and usage.pinned == 0, usage
    assert usage.free + usage.cached == usage.total
    assert not (sched.waiting or sched.running or sched.kv_ready or sched.reserved)


def generate(prompts: Mapping[str, Sequence[int]], max_tokens: int,
             **sched_kwargs: Any) -> tuple[dict[str, list[int]], Scheduler]:
    """Run every prompt to completion; returns each request's output tokens."""
    sched = make_scheduler(**sched_kwargs)
    requests = [make_request(rid, prompt=p, max_tokens=max_tokens, ignore_eos=True)
                for rid, p in prompts.items()]
    for request in requests:
        sched.add(request)
    drain(sched)
    assert all(r.finish_reason is FinishReason.LENGTH for r in requests)
    assert_all_released(sched)
    return {r.request_id: r.output_token_ids for r in requests}, sched


def summary(updates: list[StepUpdate]) -> list[tuple[str, int | None, bool]]:
    return [(u.request.request_id, u.new_token_id, u.finished) for u in updates]


# ------------------------------------------------------------------ single request
def test_single_request_prefills_then_decodes_until_max_tokens() -> None:
    sched = make_scheduler(num_blocks=8)
    request = make_request("a", 6, max_tokens=3)
    sched.add(request)
    # 1. prefill: the whole prompt in one chunk, which samples the first token
    out = sched.schedule()
    assert not out.decodes and len(out.prefills) == 1
    (prefill,) = out.prefills
    assert (prefill.start_position, len(prefill.token_ids), prefill.sample) == (0, 6, True)
    assert len(prefill.block_ids) == 2
    assert summary(sched.update(out, fake_execute(sched, out, {"a": 50}))) == [("a", 50, False)]
    assert request.num_computed_tokens == 6
    # 2. decode: one token at position 6, in the same blocks
    out = sched.schedule()
    (decode,) = out.decodes
    assert decode.is_decode and (decode.start_position, decode.token_ids) == (6, (50,))
    assert decode.block_ids == prefill.block_ids
    assert summary(sched.update(out, fake_execute(sched, out, {"a": 51}))) == [("a", 51, False)]
    # 3. the third token reaches max_tokens: finished with "length", blocks released
    out = sched.schedule()
    assert [(c.start_position, c.token_ids) for c in out.chunks] == [(7, (51,))]
    assert summary(sched.update(out, fake_execute(sched, out, {"a": 52}))) == [("a", 52, True)]
    assert request.finish_reason is FinishReason.LENGTH
    assert request.output_token_ids == [50, 51, 52]
    assert not sched.has_unfinished() and not sched.blocks.has_request("a")
    assert_all_released(sched)
    assert sched.blocks.usage().cached == 2  # the 8 computed tokens stay in the prefix cache


@pytest.mark.parametrize("ignore_eos", [False, True])
def test_eos_stops_unless_ignore_eos(ignore_eos: bool) -> None:
    sched = make_scheduler()
    request = make_request("a", 5, max_tokens=4, ignore_eos=ignore_eos)
    sched.add(request)
    # 1. the first sampled token is EOS
    _, updates = step(sched, {"a": EOS})
    if not ignore_eos:
        assert summary(updates) == [("a", EOS, True)]
        assert request.finish_reason is FinishReason.STOP
    else:
        # 2. ignored: generation goes on (and may emit EOS again) until max_tokens
        assert summary(updates) == [("a", EOS, False)]
        while sched.has_unfinished():
            step(sched, {"a": EOS})
        assert request.output_token_ids == [EOS] * 4
        assert request.finish_reason is FinishReason.LENGTH
    assert_all_released(sched)


def test_stop_token_ids_stop_even_when_eos_is_ignored() -> None:
    sched = make_scheduler()
    request = make_request("a", 5, max_tokens=8, ignore_eos=True, stop_token_ids=[77])
    sched.add(request)
    assert summary(step(sched, {"a": 30})[1]) == [("a", 30, False)]
    assert summary(step(sched, {"a": 77})[1]) == [("a", 77, True)]
    assert request.finish_reason is FinishReason.STOP
    assert request.output_token_ids == [30, 77]
    assert_all_released(sched)


def test_context_limit_finishes_with_length() -> None:
    sched = make_scheduler(max_model_len=8)
    request = make_request("a", 6, max_tokens=100)
    sched.add(request)
    drain(sched)
    assert request.finish_reason is FinishReason.LENGTH
    assert len(request.output_token_ids) == 2 and request.num_tokens == 8
    assert_all_released(sched)


# ------------------------------------------------------------------------ batching
def test_chunked_prefill_splits_prompt_under_token_budget() -> None:
    sched = make_scheduler(max_num_batched_tokens=8)
    request = make_request("a", 19, max_tokens=2)
    sched.add(request)
    layout = []
    # 1. three prefill chunks of at most 8 tokens; only the last one samples
    for _ in range(3):
        out, updates = step(sched, {"a": 40})
        (chunk,) = out.prefills
        layout.append((chunk.start_position, len(chunk.token_ids), chunk.sample,
                       len(chunk.block_ids)))
        assert [u.new_token_id for u in updates] == ([40] if chunk.sample else [])
    assert layout == [(0, 8, False, 2), (8, 8, False, 4), (16, 3, True, 5)]
    assert request.num_prefill_chunks == 3 and request.num_computed_tokens == 19
    # 2. then one decode finishes it
    out, updates = step(sched, {"a": 41})
    assert [c.is_decode for c in out.chunks] == [True]
    assert summary(updates) == [("a", 41, True)]
    assert_all_released(sched)


def test_decode_chunks_come_before_prefill_chunks() -> None:
    sched = make_scheduler(max_num_batched_tokens=8)
    old = make_request("old", 12, max_tokens=2)
    sched.add(old)
    # 1. "old" prefills its first 8 tokens
    step(sched)
    # 2. "new" arrives with its KV and first token: it runs behind "old" but decodes
    new = make_request("new", 5, max_tokens=3)
    assert sched.reserve(new, 5) is not None
    sched.admit_with_kv("new", 5, first_token_id=40)
    out = sched.schedule()
    assert [r.request_id for r in sched.running] == ["old", "new"]
    assert [(c.request_id, c.is_decode) for c in out.chunks] == [("new", True), ("old", False)]
    # 3. sampled tokens are matched to chunks in out.chunks order
    updates = sched.update(out, [41, 42])
    assert summary(updates) == [("new", 41, False), ("old", 42, False)]
    assert new.output_token_ids == [40, 41] and old.output_token_ids == [42]
    drain(sched)
    assert_all_released(sched)


def test_max_num_seqs_is_respected() -> None:
    sched = make_scheduler(max_num_seqs=2)
    requests = [make_request(f"r{i}", 5, max_tokens=3) for i in range(5)]
    for request in requests:
        sched.add(request)
    # 1. only two requests are admitted
    out, _ = step(sched)
    assert [c.request_id for c in out.chunks] == ["r0", "r1"]
    # 2. never more than two running or scheduled, and all finish
    while sched.has_unfinished():
        out, _ = step(sched)
        assert len(out.chunks) <= 2 and len(sched.running) <= 2
    assert all(r.finish_reason is FinishReason.LENGTH for r in requests)
    assert_all_released(sched)


def test_waiting_request_admitted_while_another_decodes() -> None:
    sched = make_scheduler()
    first = make_request("a", 5, max_tokens=4)
    sched.add(first)
    # 1. "a" prefills, then decodes once; nothing else was waiting
    step(sched)
    step(sched)
    assert sched.stats.num_admissions_during_decode == 0
    # 2. "b" is admitted in the same step as a's next decode
    second = make_request("b", 5, max_tokens=4)
    sched.add(second)
    out, _ = step(sched)
    assert [(c.request_id, c.is_decode) for c in out.chunks] == [("a", True), ("b", False)]
    assert sched.stats.num_admissions_during_decode == 1
    drain(sched)
    assert first.finish_reason is second.finish_reason is FinishReason.LENGTH
    assert_all_released(sched)


# ---------------------------------------------------------------------- preemption
def _two_requests_in_four_blocks() -> tuple[dict[str, range], Scheduler, Request, Request]:
    """Requests a and b of 7 tokens (2 blocks each) in a pool of 4 blocks, added in that
    order: the third step preempts b."""
    prompts = {"a": range(100, 107), "b": range(200, 207)}
    sched = make_scheduler(num_blocks=4, enable_prefix_caching=False)
    a, b = (make_request(rid, prompt=p, max_tokens=6) for rid, p in prompts.items())
    sched.add(a)
    sched.add(b)
    return prompts, sched, a, b


def test_preemption_frees_newest_request_and_recomputes_it() -> None:
    prompts, sched, a, b = _two_requests_in_four_blocks()
    # 1. both prefill, then both decode: the 4 blocks are all held
    step(sched)
    step(sched)
    assert sched.blocks.usage().in_use == 4 and b.num_tokens == 9
    # 2. a's 9th token needs a third block: b (the newest) is preempted and freed
    out, _ = step(sched)
    assert out.preempted == ["b"] and [c.request_id for c in out.chunks] == ["a"]
    assert b.status is RequestStatus.WAITING and b.num_computed_tokens == 0
    assert not sched.blocks.has_request("b") and list(sched.waiting) == [b]
    assert sched.blocks.usage().in_use == 3 and sched.blocks.num_free_blocks == 1
    assert sched.stats.num_preemptions == 1 and b.num_preemptions == 1
    b_tokens = tuple(b.all_token_ids)
    # 3. once a finishes, b recomputes prompt + its 2 outputs at positions 0..8
    outs = drain(sched)
    recompute = next(c for o in outs for c in o.chunks if c.request_id == "b")
    assert (recompute.start_position, recompute.token_ids, recompute.sample) == (0, b_tokens, True)
    assert sched.stats.num_preemptions == 1
    # 4. the outputs are those of a run that never preempted
    reference, _ = generate(prompts, max_tokens=6, num_blocks=32)
    assert {"a": a.output_token_ids, "b": b.output_token_ids} == reference
    assert_all_released(sched)


def test_a_preempted_request_gets_the_freed_blocks_before_new_reservations() -> None:
    # a decode worker near capacity: KV arriving for new requests between steps must not
    # take every block that frees up while a preempted request waits to be readmitted
    _, sched, _, b = _two_requests_in_four_blocks()
    for _ in range(3):
        out, _ = step(sched)
    assert out.preempted == ["b"] and list(sched.waiting) == [b]
    assert sched.reserve(make_request("new", 3), 3) is None  # one block free, but b waits
    drain(sched)
    assert b.is_finished and sched.reserve(make_request("later", 3), 3) is not None


def test_tight_pool_never_deadlocks() -> None:
    lengths = [3, 9, 5, 14, 7, 11]
    prompts = {f"r{i}": range(1000 * (i + 1), 1000 * (i + 1) + n) for i, n in enumerate(lengths)}
    # 1. 8 blocks of 4 for six requests growing to 11..22 tokens: preemption is certain
    outputs, sched = generate(prompts, max_tokens=8, num_blocks=8, max_num_batched_tokens=16)
    assert sched.stats.num_preemptions > 0
    # 2. everything finished with the tokens of an unconstrained run
    reference, relaxed = generate(prompts, max_tokens=8, num_blocks=64)
    assert relaxed.stats.num_preemptions == 0
    assert outputs == reference
    assert all(len(tokens) == 8 for tokens in outputs.values())


# ------------------------------------------------------------------- prefix caching
@pytest.mark.parametrize("prompt_len", [8, 10])
def test_prefix_cache_hit_on_same_prompt(prompt_len: int) -> None:
    sched = make_scheduler()
    prompt = list(range(100, 100 + prompt_len))
    first = make_request("first", prompt=prompt, max_tokens=3)
    sched.add(first)
    # 1. the first request computes everything and caches its full blocks
    out, _ = step(sched)
    first_blocks = out.chunks[0].block_ids
    drain(sched)
    assert first.num_cached_tokens == 0
    # 2. same prompt: whole cached blocks are reused, but the last token is computed
    second = make_request("second", prompt=prompt, max_tokens=3)
    sched.add(second)
    out = sched.schedule()
    (chunk,) = out.chunks
    num_cached = (prompt_len - 1) // BLOCK_SIZE * BLOCK_SIZE
    assert second.num_cached_tokens == num_cached == chunk.start_position
    assert 0 < num_cached < prompt_len and num_cached % BLOCK_SIZE == 0
    assert chunk.token_ids == tuple(prompt[num_cached:]) and chunk.sample
    num_hits = num_cached // BLOCK_SIZE
    assert chunk.block_ids[:num_hits] == first_blocks[:num_hits]
    # 3. same fake model, same prompt: same tokens
    sched.update(out, fake_execute(sched, out))
    drain(sched)
    assert second.output_token_ids == first.output_token_ids
    assert_all_released(sched)


def test_prefix_cache_hit_shares_blocks_with_running_request() -> None:
    sched = make_scheduler()
    prompt = list(range(100, 113))  # 13 tokens: 3 full blocks
    first = make_request("first", prompt=prompt, max_tokens=4)
    sched.add(first)
    step(sched)
    # 1. while "first" decodes, "second" reuses its 3 full blocks (now held by both)
    second = make_request("second", prompt=prompt, max_tokens=4)
    sched.add(second)
    step(sched)
    assert second.num_cached_tokens == 12
    shared = sched.blocks.block_ids("first")[:3]
    assert sched.blocks.block_ids("second")[:3] == shared
    assert sched.blocks.usage().in_use == 3 + 1 + 1  # shared, then one own block each
    # 2. both finish; shared blocks are released once per holder
    drain(sched)
    assert second.output_token_ids == first.output_token_ids
    assert_all_released(sched)


@pytest.mark.parametrize("caching", [True, False])
def test_prompts_sharing_a_prefix_that_arrive_together_compute_it_once(caching: bool) -> None:
    sched = make_scheduler(enable_prefix_caching=caching)
    shared = list(range(900_000, 900_013))  # 13 tokens (3 full blocks), no one else's
    first, second = (make_request(rid, prompt=shared, max_tokens=3) for rid in ("a", "b"))
    other = make_request("c", 9, max_tokens=3)  # shares nothing
    for request in (first, second, other):
        sched.add(request)
    # 1. the budget holds all three, but "b" would compute "a"'s blocks beside it: it waits
    #    a step in its place ("c", after it, goes ahead); without a prefix cache it would
    #    find nothing there, so it does not wait
    out, _ = step(sched)
    assert [c.request_id for c in out.chunks] == (["a", "c"] if caching else ["a", "b", "c"])
    if caching:
        assert list(sched.waiting) == [second]
        # 2. the next step finds "a"'s blocks cached: only the last token is computed
        out, _ = step(sched)
        (chunk,) = [c for c in out.chunks if c.request_id == "b"]
        assert chunk.start_position == second.num_cached_tokens == 12
        assert sched.blocks.block_ids("b")[:3] == sched.blocks.block_ids("a")[:3]
    drain(sched)
    assert second.output_token_ids == first.output_token_ids
    assert_all_released(sched)


def test_a_prompt_follows_a_shared_prefix_computed_chunk_by_chunk() -> None:
    sched = make_scheduler(max_num_batched_tokens=10)
    shared = list(range(900_100, 900_113))  # 13 tokens: computed 10, then 3
    first, second = (make_request(rid, prompt=shared, max_tokens=2) for rid in ("a", "b"))
    sched.add(first)
    sched.add(second)
    # each step "a" completes the next block "b" lacks: "b" waits, and then computes only
    # its last token (a block holding the last token is computed, never waited for)
    for num_cached_after in (2, 3):
        out, _ = step(sched)
        assert [c.request_id for c in out.chunks] == ["a"]
        assert sched.cached_prefix(second) == sched.blocks.block_ids("a")[:num_cached_after]
    out, _ = step(sched)
    (chunk,) = [c for c in out.chunks if c.request_id == "b"]
    assert chunk.start_position == second.num_cached_tokens == 12
    drain(sched)
    assert second.output_token_ids == first.output_token_ids
    assert_all_released(sched)


# --------------------------------------------------------------------------- abort
def _bring_to(sched: Scheduler, state: str) -> Request:
    """A 10-token request in ``state`` (the scheduler's token budget is 4)."""
    request = make_request("x", 10, max_tokens=6)
    if state in ("waiting_for_kv", "kv_ready"):
        assert sched.reserve(request, 10) is not None
        if state == "kv_ready":
            sched.admit_with_kv("x", 10, first_token_id=40)
        return request
    sched.add(request)
    if state == "running_mid_prefill":
        step(sched)
        assert 0 < request.num_computed_tokens < request.num_prompt_tokens
    elif state == "running_decoding":
        while len(request.output_token_ids) < 2:
            step(sched)
    return request


@pytest.mark.parametrize("state", ["waiting", "running_mid_prefill", "running_decoding",
                                   "waiting_for_kv", "kv_ready"])
def test_abort_frees_blocks_in_every_state(state: str) -> None:
    sched = make_scheduler(max_num_batched_tokens=4)
    # 1. bring the request to `state`; all but a waiting request hold blocks
    request = _bring_to(sched, state)
    holds_blocks = state != "waiting"
    assert sched.blocks.has_request("x") == holds_blocks
    assert (sched.blocks.usage().in_use > 0) == holds_blocks
    # 2. abort: finished, blocks freed, nothing left to schedule
    assert sched.finish("x", FinishReason.ABORT) is request
    assert request.is_finished and request.finish_reason is FinishReason.ABORT
    assert not sched.blocks.has_request("x")
    assert not sched.has_unfinished() and not sched.schedule().chunks
    assert_all_released(sched)
    # 3. idempotent: a second finish (any reason) changes nothing
    assert sched.finish("x", FinishReason.ABORT) is None
    assert sched.finish("x", FinishReason.STOP) is None
    assert request.finish_reason is FinishReason.ABORT
    assert_all_released(sched)


@pytest.mark.parametrize("forget", [False, True])
def test_update_ignores_request_aborted_during_the_step(forget: bool) -> None:
    sched = make_scheduler()
    a, b = make_request("a", 5), make_request("b", 5)
    sched.add(a)
    sched.add(b)
    # 1. both are scheduled and "executed"
    out = sched.schedule()
    sampled = fake_execute(sched, out, {"a": 60, "b": 61})
    # 2. "a" is aborted (and maybe forgotten) before the step's results arrive
    sched.finish("a", FinishReason.ABORT)
    if forget:
        sched.forget(["a"])
        assert "a" not in sched.requests
    # 3. update skips "a" but still hands b its own token
    assert summary(sched.update(out, sampled)) == [("b", 61, False)]
    assert a.output_token_ids == [] and not sched.blocks.has_request("a")
    assert a.finish_reason is FinishReason.ABORT
    drain(sched)
    assert_all_released(sched)


# ----------------------------------------------------------- KV written from outside
def test_reserve_and_admit_with_kv_lifecycle() -> None:
    sched = make_scheduler(num_blocks=8)
    request = make_request("kv", 10, max_tokens=3)
    # 1. reserve blocks for the prompt's KV; nothing to compute until it arrives
    block_ids = sched.reserve(request, 10)
    assert block_ids is not None and len(block_ids) == 3
    assert request.status is RequestStatus.WAITING_FOR_KV
    assert sched.blocks.usage().in_use == 3
    assert not sched.schedule().chunks
    # 2. the KV arrived with the first token sampled elsewhere: it joins the batch
    update = sched.admit_with_kv("kv", 10, first_token_id=40)
    assert (update.request, update.new_token_id, update.finished) == (request, 40, False)
    assert request.status is RequestStatus.KV_READY and request.num_computed_tokens == 10
    # 3. decoding continues at position 10 in the reserved blocks, now RUNNING
    out = sched.schedule()
    assert request.status is RequestStatus.RUNNING
    (chunk,) = out.decodes
    assert (chunk.start_position, chunk.token_ids, chunk.block_ids) == (10, (40,), tuple(block_ids))
    sched.update(out, fake_execute(sched, out))
    drain(sched)
    assert request.finish_reason is FinishReason.LENGTH and len(request.output_token_ids) == 3
    assert_all_released(sched)


def test_reserve_that_does_not_fit_holds_nothing() -> None:
    sched = make_scheduler(num_blocks=2)
    request = make_request("kv", 10)
    assert sched.reserve(request, 10) is None  # needs 3 blocks
    assert request.status is RequestStatus.WAITING and "kv" not in sched.requests
    assert not sched.blocks.has_request("kv") and not sched.reserved
    assert_all_released(sched)


@pytest.mark.parametrize(("max_tokens", "first_token", "reason"), [
    (5, EOS, FinishReason.STOP), (1, 40, FinishReason.LENGTH)], ids=["eos", "max_tokens_1"])
def test_admit_with_kv_first_token_can_finish_at_once(max_tokens: int, first_token: int,
                                                      reason: FinishReason) -> None:
    sched = make_scheduler()
    request = make_request("kv", 10, max_tokens=max_tokens)
    assert sched.reserve(request, 10) is not None
    # 1. the first token already ends the request: it never runs here
    update = sched.admit_with_kv("kv", 10, first_token_id=first_token)
    assert update.finished and update.new_token_id == first_token
    assert request.finish_reason is reason and request.output_token_ids == [first_token]
    assert not sched.kv_ready and not sched.has_unfinished() and not sched.schedule().chunks
    assert not sched.blocks.has_request("kv")
    assert_all_released(sched)


def test_admit_with_partial_kv_computes_the_rest_here() -> None:
    sched = make_scheduler()
    request = make_request("kv", 10, max_tokens=3)
    block_ids = sched.reserve(request, 10)
    assert block_ids is not None
    # 1. only the first 8 tokens' KV arrived (with the first token sampled elsewhere)
    sched.admit_with_kv("kv", 8, first_token_id=40)
    # 2. the rest of the prompt and the first token are computed here, from position 8
    out = sched.schedule()
    (chunk,) = out.chunks
    assert chunk.start_position == 8 and chunk.sample
    assert chunk.token_ids == (*request.prompt_token_ids[8:], 40)
    assert chunk.block_ids == tuple(block_ids)
    sched.update(out, fake_execute(sched, out))
    drain(sched)
    assert len(request.output_token_ids) == 3
    assert_all_released(sched)


# -------------------------------------------------------------------- prefill only
@pytest.mark.parametrize("budget", [64, 4], ids=["one_chunk", "chunked"])
def test_prefill_only_request_pins_its_blocks(budget: int) -> None:
    sched = make_scheduler(max_num_batched_tokens=budget)
    request = make_request("p", 10, max_tokens=5, prefill_only=True)
    sched.add(request)
    # 1. prefill (maybe in chunks): one update, with the first token, that finishes it
    updates: list[StepUpdate] = []
    outs = []
    while sched.has_unfinished():
        out, new_updates = step(sched, {"p": 40})
        outs.append(out)
        updates += new_updates
    assert summary(updates) == [("p", 40, True)]
    assert request.finish_reason is FinishReason.PREFILLED and request.output_token_ids == [40]
    # 2. its blocks moved to a pin: not in use, not evictable
    assert sched.blocks.is_pinned("p") and not sched.blocks.has_request("p")
    assert tuple(sched.blocks.pinned_block_ids("p")) == outs[-1].chunks[0].block_ids
    usage = sched.blocks.usage()
    assert (usage.pinned, usage.in_use) == (3, 0)
    sched.blocks.check_integrity()
    # 3. a late abort does not release the pin
    assert sched.finish("p", FinishReason.ABORT) is None and sched.blocks.is_pinned("p")
    # 4. unpin (exactly once) releases them
    assert sched.blocks.unpin("p") and not sched.blocks.unpin("p")
    assert_all_released(sched)


# ---------------------------------------------------------------------- torch-free
def test_scheduler_modules_import_without_torch() -> None:
    result = run_without_torch(
        "import engine.core.scheduler, engine.core.request, engine.config, engine.sampling_params\n"
        "import engine.kvcache\n"
        "from engine.config import CacheConfig, SchedulerConfig\n"
        "s = engine.core.scheduler.Scheduler(SchedulerConfig(), CacheConfig(block_size=4),\n"
        "    engine.kvcache.BlockManager(8, 4), 64)\n"
        "s.add(engine.core.request.Request('a', [5, 6, 7], engine.sampling_params.SamplingParams()))\n"
        "assert len(s.schedule().chunks) == 1\n"
        "print('ok')\n"
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "ok"


def test_a_speculated_last_step_caches_the_blocks_it_filled() -> None:
    """A request that ends in a speculated step (a stop token among the tokens it kept)
    keys the blocks that step filled, as a one-token step does before its stop check
    (found in review: they were left out of the prefix cache)."""
    cache = CacheConfig(block_size=BLOCK_SIZE)
    blocks = BlockManager(32, BLOCK_SIZE)
    sched = Scheduler(SchedulerConfig(speculative_method="ngram", num_speculative_tokens=3,
                                      prompt_lookup_max=2), cache, blocks, 1024)
    prompt = [5, 6, 7, 5, 6, 7, 5]
    sched.add(make_request("r0", prompt=prompt, max_tokens=16, stop_token_ids=(9,)))
    sched.update(sched.schedule(), [6])  # the prefill: 7 tokens computed, 6 sampled
    out = sched.schedule()
    (chunk,) = out.chunks
    assert list(chunk.token_ids) == [6, 7, 5, 6]  # its last token and the three guesses
    # the first two guesses kept, then 9 (a stop token) in the third's place: 3 more
    # tokens computed, 10 in all, so the block of tokens 4..7 filled in this step
    updates = sched.update(out, [(7, 5, 9, 11)])
    assert [u.new_token_id for u in updates] == [7, 5, 9] and updates[-1].finished
    text = prompt + [6, 7, 5, 9]
    again = make_request("r1", prompt=text)
    assert len(sched.cached_prefix(again)) == (len(text) - 1) // BLOCK_SIZE == 2


def test_a_guess_never_takes_the_blocks_a_later_prefill_needs() -> None:
    """A decoding request guesses only with the blocks the running requests after it
    leave: here B, mid-prefill, needs both free blocks for the rest of its prompt, so A
    does not guess (found in review: A's guesses took one of them and B was preempted)."""
    cache = CacheConfig(block_size=BLOCK_SIZE)
    blocks = BlockManager(7, BLOCK_SIZE)
    sched = Scheduler(SchedulerConfig(max_num_batched_tokens=12, speculative_method="ngram",
                                      num_speculative_tokens=3, prompt_lookup_max=2),
                      cache, blocks, 1024)
    sched.add(make_request("a", prompt=[5, 6, 7, 5, 6, 7, 5], max_tokens=32))
    sched.update(sched.schedule(), [6])  # A's prefill: 2 blocks
    sched.add(make_request("b", num_prompt_tokens=13))
    out = sched.schedule()  # A guesses 3 (a third block); B starts: 8 tokens, 2 blocks
    assert [len(c.token_ids) for c in out.chunks] == [4, 8]
    sched.update(out, [(7, 5, 6, 7)])  # every guess kept; B's chunk samples nothing
    assert blocks.num_free_blocks == 2
    out = sched.schedule()
    assert out.preempted == []
    assert [(c.request_id, len(c.token_ids)) for c in out.chunks] == [("a", 1), ("b", 5)]


def test_decode_chunk_is_next_chunks_decode_token_while_its_block_has_room() -> None:
    request = make_request(num_prompt_tokens=6)
    assert decode_chunk(request, (0, 1), BLOCK_SIZE) is None  # its prompt is still to compute
    request.num_computed_tokens = 6
    request.append_output(50)  # 7 tokens: the 7th is the decode token, 8 fit in 2 blocks
    chunk = decode_chunk(request, (0, 1), BLOCK_SIZE)
    assert chunk == next_chunk(request, 1, (), (0, 1)) and chunk is not None and chunk.is_decode
    request.num_computed_tokens = 7
    request.append_output(51)  # the 8th token: the last place in block 1
    assert decode_chunk(request, (0, 1), BLOCK_SIZE) == next_chunk(request, 1, (), (0, 1))
    request.num_computed_tokens = 8
    request.append_output(52)  # the 9th needs a third block: allocate first
    assert decode_chunk(request, (0, 1), BLOCK_SIZE) is None
