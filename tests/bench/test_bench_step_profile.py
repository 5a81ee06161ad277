"""``python -m bench.step_profile`` at a tiny setting: every part of a decode step is
measured, each timed step decodes the whole batch, nothing is left behind, and bad
arguments are refused."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

import pytest

import engine
from bench import step_profile
from bench.engine import PromptSource
from engine.models.layers import linear_layers


def test_step_profile_splits_a_decode_step_into_parts(model_factory: Callable[..., Path],
                                                      tmp_path: Path,
                                                      capsys: pytest.CaptureFixture[str]) -> None:
    out_path = tmp_path / "profile.json"
    returned = step_profile.main([
        "--model", str(model_factory("llama")), "--batch-sizes", "1,3", "--prompt-len", "5",
        "--steps", "4", "--threads", "1", "--bandwidth-mib", "16", "--json", str(out_path)])
    data = json.loads(out_path.read_text())
    assert data == json.loads(json.dumps(returned))
    assert [b["batch_size"] for b in data["batches"]] == [1, 3]
    for batch in data["batches"]:
        parts = batch["parts_ms"]
        assert set(parts) == set(step_profile.PARTS)
        for role in step_profile.LINEAR_ROLES:  # every linear ran and was timed
            assert parts[role] > 0 and batch["linear_gbps"][role] > 0, role
        # parts measured as differences would go negative if anything were counted twice
        assert all(ms > 0 for ms in parts.values()), parts
        assert batch["step_ms"] > 0
    printed = capsys.readouterr().out
    assert "attention core" in printed and data["machine"]["cpu_model"] in printed
    assert data["linear_kernel"] in printed


def test_timed_steps_decode_the_whole_batch_and_leave_nothing(
        model_factory: Callable[..., Path]) -> None:
    """Six prompts whose prefill takes six steps (8-token budget): the first ones
    decode while the rest prefill, yet every timed step still decodes all six."""
    with engine.LLM(model_factory("llama"), max_num_batched_tokens=8) as llm:
        core = llm.core
        model = step_profile.model_runner(llm).model
        steps: list[float] = []
        with step_profile.stopwatches_on(llm) as watches:
            step_profile.decode_steps(llm, PromptSource(0, 200, 7).draw(6), 5, steps.append,
                                      watches.seconds.clear)
        assert len(steps) == 5 and watches.seconds["lm_head"] > 0
        assert not core.has_unfinished()
        core.check_integrity()
        usage = core.kv_usage()
        assert usage.in_use == 0 and usage.pinned == 0
        # every stopwatch is gone: no instance attribute shadows a method any more
        for module in [model, *model.modules(), *linear_layers(model)]:
            assert not {"forward", "project", "compute_logits"} & set(vars(module)), module
        with pytest.raises(RuntimeError, match="did not decode all 2 requests"):
            # one request cannot run beside another: the check refuses the timing
            with engine.LLM(model_factory("llama"), max_num_seqs=1) as small:
                step_profile.decode_steps(small, [[5, 6], [7, 8]], 2, steps.append)


@pytest.mark.parametrize("argv", [["--batch-sizes", "1,x"], ["--batch-sizes", "0"],
                                  ["--steps", "1"]])
def test_step_profile_refuses_bad_arguments(argv: list[str]) -> None:
    with pytest.raises(SystemExit) as exc:
        step_profile.parse_args(argv)
    assert exc.value.code == 2
