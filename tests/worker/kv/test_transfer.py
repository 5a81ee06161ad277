"""A KV transfer between a sending and a receiving engine through their KV rank plugins,
without servers: every rank of the decode engine receives its KV heads, rank 0 the first
token (the transfer's trailer), the request is admitted only when all of it arrived, and
the tokens equal ``engine.LLM``'s. Each scenario ends with the leak check (both engines,
every rank)."""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from engine import LLM, SamplingParams
from engine.tp.rank_plugin import RankCallError
from tests.factories import PROMPTS
from tests.worker.kv.faults import CORRUPT_TRANSFER_ID
from tests.worker.kv.pair import (
    Pair,
    assert_no_leaks,
    dest,
    finish_prefills,
    make_pair,
    new_ids,
    poll_results,
    poll_until,
    rank_stats,
    run_transfers,
)

pytestmark = pytest.mark.timeout(120)

LONG = " ".join(PROMPTS[3:6])  # several prefill chunks


def _workload(llm: LLM) -> tuple[list[list[int]], list[SamplingParams]]:
    texts = [PROMPTS[0], PROMPTS[2], PROMPTS[3], LONG, PROMPTS[1], PROMPTS[6], LONG + "!",
             PROMPTS[9]]
    prompts = [llm.encode(t) for t in texts]
    params = [SamplingParams(max_tokens=6, temperature=0, ignore_eos=True) if i % 2 else
              SamplingParams(max_tokens=7, temperature=0.9, seed=100 + i, ignore_eos=True)
              for i in range(len(prompts))]
    return prompts, params


@pytest.fixture(scope="module")
def reference(llama_dir: Path) -> tuple[list[list[int]], list[SamplingParams], list[list[int]]]:
    with LLM(llama_dir) as llm:
        prompts, params = _workload(llm)
        expected = [r.token_ids for r in llm.generate(prompts, params)]
    return prompts, params, expected


@pytest.fixture(scope="module")
def pair(llama_dir: Path) -> Iterator[Pair]:
    pair = make_pair(llama_dir, prefill_tp=1, decode_tp=2)
    try:
        yield pair
    finally:
        pair.shutdown()


def test_transfer_tp1_to_tp2_matches_llm(pair: Pair, reference: tuple) -> None:
    prompts, params, expected = reference
    # the decode store was told port 0: rank 0 bound one, rank 1 attached to it
    assert pair.d.address.port > 0  # the store bound a port of its own
    assert any(len(p) > 32 for p in prompts)  # some prompts take several chunks
    assert run_transfers(pair, prompts, params) == expected
    assert_no_leaks(pair)


def test_transfer_tp2_to_tp1_matches_llm(llama_dir: Path, reference: tuple) -> None:
    prompts, params, expected = reference
    other = make_pair(llama_dir, prefill_tp=2, decode_tp=1)
    try:
        assert run_transfers(other, prompts[:4], params[:4]) == expected[:4]
        assert_no_leaks(other)
    finally:
        other.shutdown()


def test_abort_between_reserve_and_send_frees_both_sides(pair: Pair, reference: tuple) -> None:
    prompts, params, _ = reference
    # 1. reserved on decode, queued on prefill, nothing sent yet
    rid, tid = new_ids()
    target = pair.d.reserve(rid, prompts[3], params[3], tid)
    assert target is not None and target.tensor_parallel_size == 2
    pair.p.submit(rid, prompts[3], params[3], tid, dest(target))
    assert pair.decode.kv_usage().in_use > 0
    # 2. the router aborts on both sides
    assert pair.p.abort(rid) and pair.d.abort(rid)
    assert not pair.p.abort(rid) and not pair.d.abort(rid)  # idempotent
    assert_no_leaks(pair)


def test_abort_after_kv_arrived_before_admit(pair: Pair, reference: tuple) -> None:
    prompts, params, _ = reference
    rid, tid = new_ids()
    target = pair.d.reserve(rid, prompts[0], params[0], tid)
    assert target is not None
    pair.p.submit(rid, prompts[0], params[0], tid, dest(target))
    assert finish_prefills(pair)[rid].ok
    assert poll_until(pair, {rid}) == {rid: (True, "")}
    assert pair.d.abort(rid)
    with pytest.raises(ValueError, match="no arrived KV"):
        pair.d.admit(rid)
    assert_no_leaks(pair)


def test_reservation_refused_when_decode_is_out_of_blocks(pair: Pair, reference: tuple) -> None:
    prompts, params, _ = reference
    held = []
    usage = pair.decode.kv_usage()
    while True:  # 1. fill the decode pool with reservations
        rid, tid = new_ids()
        if pair.d.reserve(rid, prompts[3], params[3], tid) is None:
            break
        held.append(rid)
        assert len(held) <= usage.total
    # 2. the refused one holds nothing, on the leader or any rank
    assert held and pair.d.num_pending == len(held)
    assert all(s.pending_received == len(held) for s in rank_stats(pair.decode))
    assert rid not in pair.decode.scheduler.requests
    for r in held:
        assert pair.d.abort(r)
    assert_no_leaks(pair)


def test_corrupted_transfer_is_failed_and_never_admitted(pair: Pair, reference: tuple) -> None:
    prompts, params, _ = reference
    rid = "corrupt-1"
    target = pair.d.reserve(rid, prompts[0], params[0], CORRUPT_TRANSFER_ID)
    assert target is not None
    pair.p.submit(rid, prompts[0], params[0], CORRUPT_TRANSFER_ID, dest(target))
    results = list(finish_prefills(pair).values())
    assert [r.ok for r in results] == [False]
    assert "ChecksumMismatch" in results[0].reason
    (ok, reason), = poll_until(pair, {rid}).values()
    assert not ok and "ChecksumMismatch" in reason
    assert rid not in pair.decode.scheduler.requests
    with pytest.raises(ValueError):
        pair.d.admit(rid)
    assert_no_leaks(pair)


def test_layer_l_is_sent_before_layer_l_plus_1_is_computed(pair: Pair, reference: tuple,
                                                            monkeypatch: pytest.MonkeyPatch
                                                            ) -> None:
    _, params, _ = reference
    events: list[tuple[str, int]] = []
    sender = pair.prefill.executor.plugin.sending.sender  # type: ignore[attr-defined]  # rank 0, in process
    real_send = sender.send

    def send(*args: object, layers: range, **kwargs: object) -> None:
        events.append(("send", layers.start))
        real_send(*args, layers=layers, **kwargs)

    monkeypatch.setattr(sender, "send", send)
    pair.prefill.layer_hook = lambda layer: events.append(("computed", layer))
    try:
        # 1. a multi-chunk prompt (not in the prefix cache): only its last chunk's step
        #    sends, one layer at a time
        prompt = [(7 * i + 3) % 200 + 5 for i in range(70)]
        rid, tid = new_ids()
        target = pair.d.reserve(rid, prompt, params[3], tid)
        assert target is not None
        pair.p.submit(rid, prompt, params[3], tid, dest(target))
        num_steps = 0
        while pair.prefill.has_unfinished():
            outs = pair.prefill.step()
            num_steps += 1
            assert all(pair.p.finish(out) is None for out in outs if out.finished)
        assert finish_prefills(pair, step=False)[rid].ok
    finally:
        pair.prefill.layer_hook = None
    num_layers = pair.prefill.config.model.num_layers
    assert num_steps > 1
    sends = [i for i, e in enumerate(events) if e[0] == "send"]
    assert [events[i][1] for i in sends] == list(range(num_layers))
    # 2. layer l's send comes right after layer l is computed, before layer l + 1 is
    for layer, i in enumerate(sends):
        assert events[i - 1] == ("computed", layer)
    assert events[sends[0] - 1 - num_layers * (num_steps - 1):sends[0] - 1] == [
        ("computed", layer) for layer in range(num_layers)] * (num_steps - 1)
    assert poll_until(pair, {rid}) == {rid: (True, "")}
    assert pair.d.abort(rid)
    assert_no_leaks(pair)


def test_kv_that_never_comes_fails_at_its_deadline(pair: Pair, reference: tuple) -> None:
    prompts, params, _ = reference
    rid, tid = new_ids()
    assert pair.d.reserve(rid, prompts[1], params[1], tid, timeout_s=0.5) is not None
    (ok, reason), = poll_until(pair, {rid}, timeout_s=10).values()
    assert not ok and "TransferTimeout" in reason
    assert rid not in pair.decode.scheduler.requests
    assert_no_leaks(pair)


def test_reusing_a_transfer_id_is_refused_and_holds_nothing(pair: Pair, reference: tuple) -> None:
    prompts, params, _ = reference
    rid, tid = new_ids()
    assert pair.d.reserve(rid, prompts[1], params[1], tid) is not None
    # 1. in use by a live transfer: refused before anything is reserved
    with pytest.raises(ValueError, match="in use"):
        pair.d.reserve("again", prompts[1], params[1], tid)
    assert pair.d.abort(rid)
    # 2. finished: every rank's receiver refuses it; the reservation is undone
    with pytest.raises(RankCallError, match="was used before"):
        pair.d.reserve("again", prompts[1], params[1], tid)
    assert "again" not in pair.decode.scheduler.requests
    assert_no_leaks(pair)


def test_first_token_and_cached_count_arrive_with_the_kv(pair: Pair, reference: tuple) -> None:
    prompts, params, _ = reference
    long = [(11 * i + 5) % 300 + 3 for i in range(70)]  # 4 full blocks, never seen before
    results = {}
    for prompt in (long, long[:40] + [9, 8, 7]):  # 1. new prompt, 2. shares 2 blocks
        rid, tid = new_ids()
        target = pair.d.reserve(rid, prompt, params[1], tid)
        assert target is not None
        pair.p.submit(rid, prompt, params[1], tid, dest(target))
        sent = finish_prefills(pair)[rid]
        arrived = poll_results(pair, {rid})[rid]
        # 3. the decode side admits with the trailer: first token and cached count
        assert arrived.ok and arrived.trailer == sent.trailer is not None
        out = pair.d.admit(rid)
        assert out.new_token_ids == [sent.trailer.first_token_id]
        assert out.num_cached_tokens == sent.trailer.num_cached_tokens
        results[rid] = sent.trailer
        assert pair.decode.abort_request(rid)
    assert [t.num_cached_tokens for t in results.values()] == [0, 32]
    assert_no_leaks(pair)


def test_kv_without_its_first_token_is_never_admitted(pair: Pair, reference: tuple) -> None:
    prompts, params, _ = reference
    rid, tid = new_ids()
    assert pair.d.reserve(rid, prompts[0], params[0], tid, timeout_s=1.5) is not None
    pair.p.submit(rid, prompts[0], params[0], tid, pair.d.address)
    # 1. every layer is sent and acknowledged, but the prefill side never sends its trailer
    while pair.prefill.has_unfinished():
        pair.prefill.step()
    sender = pair.prefill.executor.plugin.sending.sender  # type: ignore[attr-defined]  # rank 0
    while not sender.done(tid):
        time.sleep(0.01)
    assert pair.d.poll() == []  # decode rank 1 has its heads; rank 0 waits for the token
    # 2. at the reservation's deadline the transfer fails; nothing is admitted
    (ok, reason), = poll_until(pair, {rid}, timeout_s=10).values()
    assert not ok and "rank 0: TransferTimeout" in reason and "trailer" in reason, reason
    assert rid not in pair.decode.scheduler.requests
    assert pair.p.abort(rid)  # the router's part on the prefill side
    assert_no_leaks(pair)
