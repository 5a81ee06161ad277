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
from engine.kernels.cpu import GEMV_MAX_ROWS, STACK_MAX_ROWS, native
from engine.models.layers import linear_layers

# layers inside the compiled decoder stack, where it runs the step
INSIDE_THE_STACK = ("qkv_proj", "o_proj", "gate_up_proj", "down_proj", "attention core",
                    "mlp activation", "rms_norm")  # the final norm too


@pytest.mark.parametrize("kernel", ["torch", "onednn_gemv", "packed"])
def test_step_profile_splits_a_decode_step_into_parts(model_factory: Callable[..., Path],
                                                      tmp_path: Path, kernel: str,
                                                      capsys: pytest.CaptureFixture[str]) -> None:
    """With torch's linears every step runs layer by layer; with ``onednn_gemv`` a
    batch-1 step runs the compiled decoder stack (where the kernels could be built), with
    ``packed`` every decode step does."""
    if kernel != "torch" and native() is None:
        pytest.skip("pdserve's compiled CPU kernels could not be built here")
    out_path = tmp_path / "profile.json"
    returned = step_profile.main([
        "--model", str(model_factory("llama")), "--batch-sizes", "1,4", "--prompt-len", "5",
        "--steps", "4", "--threads", "1", "--bandwidth-mib", "16", "--linear-kernel", kernel,
        "--json", str(out_path)])
    data = json.loads(out_path.read_text())
    assert data == json.loads(json.dumps(returned))
    assert [b["batch_size"] for b in data["batches"]] == [1, 4]
    stacked = {b["batch_size"]: b["parts_ms"][step_profile.STACK] > 0 for b in data["batches"]}
    # 4: past the GEMV's rows, where only the packed GEMM is also in the compiled stack
    assert stacked == {1: kernel != "torch", 4: kernel == "packed"}
    assert data["decoder_stack_max_batch"] == {"torch": 0, "onednn_gemv": GEMV_MAX_ROWS,
                                               "packed": STACK_MAX_ROWS}[kernel]
    for batch in data["batches"]:
        parts = batch["parts_ms"]
        assert set(parts) == set(step_profile.PARTS)
        inside = INSIDE_THE_STACK if stacked[batch["batch_size"]] else (step_profile.STACK,)
        assert all(parts[part] == 0 for part in inside), parts
        for role in (*step_profile.LINEAR_ROLES, step_profile.STACK):  # each ran and was timed
            if role not in inside:
                assert parts[role] > 0 and batch["linear_gbps"][role] > 0, role
        # parts measured as differences would go negative if anything were counted twice
        assert all(ms > 0 for part, ms in parts.items() if part not in inside), parts
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
        kernels = native()
        assert kernels is None or "decoder_step" not in vars(kernels)
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
