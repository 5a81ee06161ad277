"""Parking (``engine.core.parking``): a decoding request taken out of the batch keeps its
blocks and its place in the sequence; unparked to send, its one step computes its last
token, samples exactly the token an unparked run samples next, and ends as a prefill-only
request with its blocks pinned — every token's KV computed, none twice."""

from __future__ import annotations

from pathlib import Path

from engine import LLM, SamplingParams
from engine.core.parking import park, unpark_to_send
from engine.core.request import FinishReason, RequestStatus

PARAMS = [SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True),
          SamplingParams(max_tokens=40, temperature=0.8, seed=7, ignore_eos=True,
                         presence_penalty=0.5)]


def _step_until(llm: LLM, rid: str, num_output: int, seen: dict[str, list[int]]) -> None:
    request = llm.core.scheduler.requests[rid]
    while len(request.output_token_ids) < num_output:
        for out in llm.core.step():
            seen.setdefault(out.request_id, []).extend(out.new_token_ids)


def test_a_parked_request_waits_out_of_the_batch_then_sends_its_next_token(
        llama_dir: Path) -> None:
    with LLM(llama_dir) as llm:
        prompts = [llm.encode("the parked one sleeps"), llm.encode("the other one goes on")]
        expected = [r.token_ids for r in llm.generate(prompts, PARAMS)]
        core, scheduler = llm.core, llm.core.scheduler
        for i, (prompt, params) in enumerate(zip(prompts, PARAMS, strict=True)):
            core.add_request(f"r{i}", prompt, params)
        seen: dict[str, list[int]] = {}
        _step_until(llm, "r0", 10, seen)
        parked = scheduler.requests["r0"]
        assert not park(scheduler, "r0-unknown")
        assert park(scheduler, "r0") and parked.status is RequestStatus.PARKED
        assert not park(scheduler, "r0")  # once
        blocks = tuple(core.block_manager.block_table("r0"))
        held = len(seen["r0"])
        while core.has_unfinished():  # the other request runs to its end alone
            for out in core.step():
                assert out.request_id != "r0"
                seen.setdefault(out.request_id, []).extend(out.new_token_ids)
        assert seen["r1"] == expected[1]
        assert not core.has_unfinished() and len(seen["r0"]) == held  # parked: no work
        assert core.block_manager.block_table("r0") == blocks  # its KV stays

        unpark_to_send(scheduler, "r0")
        outputs = core.step()
        assert [o.request_id for o in outputs] == ["r0"]
        out = outputs[0]
        assert out.finished and out.finish_reason == FinishReason.PREFILLED.value
        assert seen["r0"] + out.new_token_ids == expected[0][:held + 1]  # the next one, exactly
        assert out.block_ids == blocks  # pinned, to be sent
        assert parked.num_computed_tokens == parked.num_tokens - 1  # every token's KV but it
        assert core.release_pinned("r0")
        core.check_integrity()
        assert core.kv_usage().in_use == 0


def test_only_a_decoding_request_parks_and_an_abort_frees_a_parked_one(llama_dir: Path) -> None:
    with LLM(llama_dir) as llm:
        core, scheduler = llm.core, llm.core.scheduler
        core.add_request("waiting", llm.encode("not computed yet"), PARAMS[0])
        assert not park(scheduler, "waiting")  # its KV is not there
        seen: dict[str, list[int]] = {}
        _step_until(llm, "waiting", 3, seen)
        assert park(scheduler, "waiting")
        assert core.kv_usage().in_use > 0
        assert core.abort_request("waiting")
        assert "waiting" not in scheduler.parked and core.kv_usage().in_use == 0
        core.check_integrity()
