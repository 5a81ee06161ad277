"""An outside benchmark client against the HTTP API: NVIDIA's AIPerf (``aiperf profile``)
drives a ``pdserve up`` cluster (``LocalLauncher``) through ``/v1/chat/completions`` and
``/v1/completions``, streaming, and must see every request succeed. Slow (marked ``slow``).

AIPerf has many dependencies of its own, so it lives in its own environment:
``python3.11 -m venv .venv-aiperf && .venv-aiperf/bin/pip install aiperf==0.13.0`` (or set
``$PDSERVE_AIPERF`` to an ``aiperf`` executable); without one the test skips, saying so.
AIPerf 0.13 mis-resolves a local tokenizer path when ``HF_HUB_OFFLINE=1`` is set, so that
variable is removed from its environment.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest

from cluster.internal.v1 import worker_pb2_grpc as wpb_grpc
from deploy.local import LocalLauncher
from deploy.spec import ClusterSpec
from tests.auth import with_token
from tests.factories import REPO_ROOT
from tests.worker.procs import assert_idle

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]

NUM_REQUESTS = 32
OUTPUT_TOKENS = 16


def aiperf_command() -> str:
    """The ``aiperf`` executable (skips the test when there is none)."""
    found = (os.environ.get("PDSERVE_AIPERF") or shutil.which("aiperf", path=str(
        REPO_ROOT / ".venv-aiperf" / "bin")) or shutil.which("aiperf"))
    if not found:
        pytest.skip("aiperf is not installed: python3.11 -m venv .venv-aiperf && "
                    ".venv-aiperf/bin/pip install aiperf==0.13.0 (or set $PDSERVE_AIPERF)")
    return found


@pytest.fixture(scope="module")
def served(llama_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalLauncher]:
    config = ClusterSpec(model_dir=llama_dir, port=0, http_port=0, num_kv_blocks=256,
                                log_dir=tmp_path_factory.mktemp("aiperf-cluster"),
                                stop_grace_s=5.0)
    with LocalLauncher(config) as cluster:
        yield cluster


@pytest.mark.parametrize("endpoint", ["chat", "completions"])
def test_aiperf_streams_without_errors(served: LocalLauncher, llama_dir: Path, tmp_path: Path,
                                       endpoint: str) -> None:
    aiperf = aiperf_command()
    out = tmp_path / "artifacts"
    argv = [aiperf, "profile", "--model", llama_dir.name, "--url", served.http_url,
            "--endpoint-type", endpoint, "--streaming", "--tokenizer", str(llama_dir),
            "--request-count", str(NUM_REQUESTS), "--concurrency", "4",
            "--synthetic-input-tokens-mean", "64", "--output-tokens-mean", str(OUTPUT_TOKENS),
            "--extra-inputs", "ignore_eos:true", "--use-server-token-count",
            "--output-artifact-dir", str(out), "--ui-type", "none"]
    env = {k: v for k, v in os.environ.items() if k != "HF_HUB_OFFLINE"}
    env["HF_HOME"] = str(tmp_path / "hf-home")  # nothing is fetched; keep caches here
    result = subprocess.run(argv, capture_output=True, text=True, timeout=480, env=env,
                            cwd=tmp_path)
    assert result.returncode == 0, result.stdout[-4000:] + result.stderr[-4000:]
    report = json.loads((out / "profile_export_aiperf.json").read_text())
    assert report["error_summary"] == [], report["error_summary"]
    assert report["request_count"]["avg"] == NUM_REQUESTS
    assert report["request_error_rate"]["avg"] == 0.0
    assert report["usage_completion_tokens"]["min"] == OUTPUT_TOKENS  # every one complete
    assert report["time_to_first_token"]["avg"] > 0  # it saw a stream
    for worker in served.workers:
        raw = grpc.insecure_channel(str(worker.ready["grpc_address"]))
        with with_token(raw, served.cluster_token) as channel:
            stub = (wpb_grpc.PrefillWorkerStub(channel) if worker.name.startswith("prefill")
                    else wpb_grpc.DecodeWorkerStub(channel))
            assert_idle(stub)
