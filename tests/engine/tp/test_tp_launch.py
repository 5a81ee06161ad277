"""Starting tensor-parallel ranks the way users do: from standard input, from ``-c``,
from a script without a ``__main__`` guard — and ranks that fail while starting.

Every process here runs under a timeout; each test checks that no rank outlives it.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from engine import LLM, SamplingParams
from engine.tp.rank_main import TEST_FAULT_ENV
from engine.tp.rank_process import RankStartError
from tests.factories import PROMPTS
from tests.processes import alive, children, wait_until

pytestmark = pytest.mark.timeout(180)

GREEDY = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
RUN_TIMEOUT_S = 120.0
OLD_RENDEZVOUS_TIMEOUT_S = 120.0  # what a failed start used to cost


def user_script(model_dir: Path) -> str:
    """A user's program: no ``__main__`` guard; prints its tokens and rank pids as JSON."""
    return (
        "import json\n"
        "from engine import LLM, SamplingParams\n"
        f"llm = LLM({str(model_dir)!r}, num_kv_blocks=64, tensor_parallel_size=2)\n"
        f"params = SamplingParams(max_tokens={GREEDY.max_tokens}, temperature=0.0, ignore_eos=True)\n"
        f"results = llm.generate({PROMPTS[:3]!r}, params)\n"
        "print(json.dumps({'tokens': [r.token_ids for r in results],\n"
        "                  'rank_pids': llm.core.executor.follower_pids}))\n"
        "llm.shutdown()\n"
    )


@pytest.fixture(scope="module")
def tp1_tokens(llama_dir: Path) -> list[list[int]]:
    with LLM(llama_dir, num_kv_blocks=64) as llm:
        return [r.token_ids for r in llm.generate(PROMPTS[:3], GREEDY)]


def run_python(args: list[str], cwd: Path, stdin: str | None = None) -> dict:
    """Run ``python ARGS`` (outside the repository) and parse the JSON line it prints."""
    done = subprocess.run([sys.executable, *args], cwd=cwd, input=stdin, capture_output=True,
                          text=True, timeout=RUN_TIMEOUT_S)
    assert done.returncode == 0, done.stderr[-4000:]
    assert "Traceback" not in done.stderr, done.stderr[-4000:]
    out: dict = json.loads(done.stdout.strip().splitlines()[-1])
    return out


@pytest.mark.parametrize("how", ["stdin", "dash-c", "unguarded-script"])
def test_tp2_starts_from_any_kind_of_main(how: str, llama_dir: Path, tmp_path: Path,
                                          tp1_tokens: list[list[int]]) -> None:
    script = user_script(llama_dir)
    if how == "stdin":
        out = run_python(["-"], tmp_path, stdin=script)
    elif how == "dash-c":
        out = run_python(["-c", script], tmp_path)
    else:
        (tmp_path / "generate.py").write_text(script)
        out = run_python([str(tmp_path / "generate.py")], tmp_path)
    assert out["tokens"] == tp1_tokens
    assert len(out["rank_pids"]) == 1
    wait_until(lambda: not any(alive(p) for p in out["rank_pids"]), 10.0, "the rank to exit")


@pytest.fixture
def no_leftover_ranks() -> Iterator[None]:
    """Fails the test if a rank process of this test process is still running after it."""
    before = set(children(os.getpid()))
    yield

    def ranks_left() -> list[int]:
        return [p for p in set(children(os.getpid())) - before
                if alive(p) and b"engine.tp.rank_main" in Path(f"/proc/{p}/cmdline").read_bytes()]

    wait_until(lambda: not ranks_left(), 15.0, "every rank process to exit")


@pytest.mark.parametrize("stage,where", [
    ("start", "before joining the tensor-parallel group"),
    ("group", "while joining the tensor-parallel group"),
    ("load", "before it was ready to run steps"),
])
def test_a_rank_failing_at_start_fails_the_leader_fast_with_its_error(
        stage: str, where: str, llama_dir: Path, monkeypatch: pytest.MonkeyPatch,
        no_leftover_ranks: None) -> None:
    monkeypatch.setenv(TEST_FAULT_ENV, stage)
    start = time.monotonic()
    with pytest.raises(RankStartError) as excinfo:
        LLM(llama_dir, num_kv_blocks=64, tensor_parallel_size=2)
    elapsed = time.monotonic() - start
    message = str(excinfo.value)
    assert f"rank 1 exited during start-up, {where}" in message
    # the rank's own traceback, quoted from its stderr
    assert f"InjectedRankFault: {TEST_FAULT_ENV}={stage}: this rank was told to fail here" \
        in message
    assert "Traceback (most recent call last)" in message
    print(f"{stage}: the leader raised after {elapsed:.1f}s")
    assert elapsed < OLD_RENDEZVOUS_TIMEOUT_S / 4, elapsed  # a liveness bound, not a speed goal


def test_a_rank_that_cannot_start_python_is_reported(llama_dir: Path, monkeypatch: pytest.MonkeyPatch,
                                                     no_leftover_ranks: None) -> None:
    """An error before the rank's own code runs (here: its module cannot be found)."""
    import engine.tp.rank_process

    monkeypatch.setattr(engine.tp.rank_process, "RANK_MAIN_MODULE", "engine.no_such_rank_main")
    with pytest.raises(RankStartError, match="No module named engine.no_such_rank_main"):
        LLM(llama_dir, num_kv_blocks=64, tensor_parallel_size=2)
