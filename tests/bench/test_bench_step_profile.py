"""``python -m bench.step_profile`` at a tiny setting: every part of a decode step is
measured, the parts add up to the stopwatched step, and bad arguments are refused."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

import pytest

from bench import step_profile


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
        assert parts["attention core"] > 0 and parts["rms_norm"] > 0
        # the disjoint parts are the stopwatched step, by construction of the last one
        assert sum(parts.values()) == pytest.approx(batch["timed_step_ms"], rel=1e-6)
        assert parts["outside the forward"] > 0 and batch["step_ms"] > 0
        # GFLOP/s scale with the batch (same time base): 2 * batch * weights per byte read
        for role in step_profile.LINEAR_ROLES:
            flops_per_byte = batch["linear_gflops"][role] / batch["linear_gbps"][role]
            assert flops_per_byte == pytest.approx(2 * batch["batch_size"] / 4)  # fp32
    printed = capsys.readouterr().out
    assert "attention core" in printed and data["machine"]["cpu_model"] in printed
    assert data["linear_kernel"] in printed


@pytest.mark.parametrize("argv", [["--batch-sizes", "1,x"], ["--batch-sizes", "0"],
                                  ["--steps", "1"]])
def test_step_profile_refuses_bad_arguments(argv: list[str]) -> None:
    with pytest.raises(SystemExit) as exc:
        step_profile.parse_args(argv)
    assert exc.value.code == 2
