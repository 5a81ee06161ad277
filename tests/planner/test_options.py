"""``pdserve up``'s planner options: what reaches ``pdserve planner``'s command line."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from deploy.ray.options import planner_scale_args
from pdserve.cli import _parser
from planner.options import up_planner_args
from tests.factories import REPO_ROOT


def _planner_argv(*words: str) -> tuple[str, ...] | None:
    args = _parser().parse_args(["up", *words])
    return up_planner_args(args, lambda: planner_scale_args(args))


def test_up_passes_the_profile_slos_bounds_and_per_role_caps_to_the_planner() -> None:
    argv = _planner_argv("--planner", "p.json", "--ray", "--max-workers", "4",
                         "--max-prefill", "1", "--max-decode", "3", "--ttft-slo-ms", "800")
    assert argv is not None
    assert argv[:2] == ("--profile", os.path.abspath("p.json"))
    words = " ".join(argv)
    assert "--max-workers 4" in words and "--max-prefill 1" in words
    assert "--max-decode 3" in words and "--ttft-slo-ms 800.0" in words
    assert "--tpot-slo-ms 100.0" in words  # the default SLO
    plain = _planner_argv("--planner", "p.json")
    assert plain is not None and "--max-prefill" not in plain and "--max-decode" not in plain
    assert _planner_argv() is None
    # the planner's floor binds a planner only: a launcher's own bounds may go below it
    assert _planner_argv("--ray", "--min-workers", "1", "--max-workers", "3") is None


def test_a_cap_without_the_planner_exits_2_before_starting_anything(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="--max-decode is the planner's"):
        _planner_argv("--max-decode", "2")
    result = subprocess.run([sys.executable, "-m", "pdserve", "up", "--log-dir",
                             str(tmp_path / "logs"), "--max-prefill", "1"], cwd=REPO_ROOT,
                            capture_output=True, text=True, timeout=60)
    assert result.returncode == 2, result.stderr
    assert "--max-prefill is the planner's" in result.stderr
    assert not (tmp_path / "logs").exists()
