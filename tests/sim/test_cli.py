"""``pdserve simulate`` as a user runs it: a real ``python -m pdserve`` process on a
small hand-written profile, its table on stdout, its JSON, and a one-line error for a
profile it cannot read."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from tests.factories import REPO_ROOT
from tests.sim.profiles import profile_json

NUM_PROMPTS = 50


def pdserve_simulate(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "pdserve", "simulate", *args], cwd=REPO_ROOT,
                          capture_output=True, text=True, timeout=60)


@pytest.fixture
def profile_path(tmp_path: Path) -> Path:
    path = tmp_path / "profile.json"
    path.write_text(json.dumps(profile_json()))
    return path


def test_simulate_prints_the_table_and_writes_the_json(profile_path: Path, tmp_path: Path
                                                       ) -> None:
    out = tmp_path / "sim.json"
    result = pdserve_simulate("--profile", str(profile_path), "--prefill", "1", "--decode", "2",
                              "--dataset-name", "sharegpt-like",
                              "--num-prompts", str(NUM_PROMPTS), "--request-rate", "20",
                              "--json", str(out))
    assert result.returncode == 0, result.stderr
    assert "Simulated Serving Result (derived profile)" in result.stdout
    assert "Median TTFT (ms):" in result.stdout
    assert "s of serving" in result.stdout
    saved = json.loads(out.read_text())
    assert saved["completed"] == NUM_PROMPTS and saved["failed"] == 0
    assert saved["median_ttft_ms"] > 0
    assert saved["backend"] == "simulated" and saved["cluster"]["num_decode"] == 2
    assert "itls" not in saved  # the per-request lists only with --save-detailed (vLLM's)


def test_a_long_run_says_how_far_it_is_on_stderr(profile_path: Path,
                                                 monkeypatch: pytest.MonkeyPatch,
                                                 capsys: pytest.CaptureFixture[str]) -> None:
    import sim.cli
    import sim.events

    monkeypatch.setattr(sim.events, "PROGRESS_S", 0.0)  # as if every look were 10 s apart
    monkeypatch.setattr(sim.events, "PROGRESS_CHECK_EVENTS", 100)
    assert sim.cli.main(["--profile", str(profile_path), "--num-prompts", str(NUM_PROMPTS),
                         "--request-rate", "20"]) == 0
    captured = capsys.readouterr()
    lines = [line for line in captured.err.splitlines() if line.startswith("simulating: ")]
    assert lines and all(f"of {NUM_PROMPTS} requests ended" in line for line in lines)
    assert "simulating:" not in captured.out  # the table's stdout stays clean


def test_save_detailed_adds_the_per_request_lists(profile_path: Path, tmp_path: Path) -> None:
    out = tmp_path / "sim.json"
    result = pdserve_simulate("--profile", str(profile_path), "--num-prompts", "6",
                              "--request-rate", "20", "--save-detailed", "--json", str(out))
    assert result.returncode == 0, result.stderr
    saved = json.loads(out.read_text())
    assert len(saved["ttfts"]) == len(saved["itls"]) == len(saved["output_lens"]) == 6
    assert sum(saved["output_lens"]) == saved["total_output_tokens"]


def test_a_missing_profile_is_one_line_naming_it(tmp_path: Path) -> None:
    missing = tmp_path / "no-such-profile.json"
    result = pdserve_simulate("--profile", str(missing), "--num-prompts", "2")
    assert result.returncode != 0
    assert "Traceback" not in result.stderr
    (line,) = result.stderr.strip().splitlines()
    assert line.startswith("pdserve simulate: ") and str(missing) in line


@pytest.mark.parametrize(("flags", "says"), [
    (["--request-rate", "0"], "--request-rate must be > 0"),
    (["--request-rate", "-1"], "--request-rate must be > 0"),
    (["--request-rate", "3", "--burstiness", "0"], "--burstiness must be > 0"),
    (["--metric-percentiles", "50,120"], "percentiles from 0 to 100"),
    (["--vocab-size", "5"], "--vocab-size: vocab_size must exceed"),
    (["--max-num-seqs", "0"], "max_num_seqs must be >= 1"),
    (["--max-num-batched-tokens", "0"], "max_num_batched_tokens must be >= 1"),
])
def test_a_flag_out_of_range_is_a_usage_error_naming_it(
        profile_path: Path, capsys: pytest.CaptureFixture[str], flags: list[str],
        says: str) -> None:
    import sim.cli

    with pytest.raises(SystemExit) as exit_info:
        sim.cli.main(["--profile", str(profile_path), "--num-prompts", "2", *flags])
    assert exit_info.value.code == 2  # argparse's usage error, no traceback
    assert says in capsys.readouterr().err


def test_the_help_describes_the_command() -> None:
    result = pdserve_simulate("--help")
    assert result.returncode == 0, result.stderr
    assert "usage: pdserve simulate" in result.stdout and "--profile" in result.stdout
    assert "--dataset-name" in result.stdout and "--kill" in result.stdout
