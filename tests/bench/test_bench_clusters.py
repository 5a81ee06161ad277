"""``bench.clusters.log_folder``: a benchmark cluster's logs go when it is done with them,
and stay (named) when it fails or is stopped."""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from bench.clusters import log_folder
from tests.factories import REPO_ROOT
from tests.processes import wait_until


def test_the_logs_of_a_run_that_ends_are_removed() -> None:
    with log_folder() as logs:
        (logs / "router.log").write_text("served\n")
        assert logs.is_dir()
    assert not logs.exists()


def test_the_logs_of_a_run_that_fails_are_kept_and_named(capsys: pytest.CaptureFixture[str]
                                                          ) -> None:
    kept: Path | None = None
    with pytest.raises(RuntimeError), log_folder() as logs:
        kept = logs
        (logs / "decode-0.log").write_text("Traceback ...\n")
        raise RuntimeError("the cluster failed")
    assert kept is not None and (kept / "decode-0.log").exists()
    assert str(kept) in capsys.readouterr().err
    for path in kept.iterdir():
        path.unlink()
    kept.rmdir()


_RUN_A_CLUSTER = """
import sys, time
from pathlib import Path
from bench.clusters import launched
from deploy.spec import ClusterSpec

spec = ClusterSpec(model_dir=Path(sys.argv[1]), num_prefill=1, num_decode=1, port=0,
                   http_port=None)
with launched(spec) as running:
    print("LOGS", running.log_dir, flush=True)
    time.sleep(300)
"""


def test_sigterm_stops_a_benchmark_cluster_and_leaves_no_secret(llama_dir: Path) -> None:
    """A benchmark stopped with SIGTERM (a CI timeout, ``kill``): its cluster stops as
    after Ctrl-C, the logs are kept and named, the Redis URL and the token are gone, and
    no process of it is left."""
    proc = subprocess.Popen([sys.executable, "-c", _RUN_A_CLUSTER, str(llama_dir)],
                            cwd=REPO_ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True)
    try:
        assert proc.stdout is not None
        line = proc.stdout.readline()  # the cluster is up (or the script died: "")
        assert line.startswith("LOGS "), line + proc.communicate(timeout=30)[1]
        logs = Path(line.split(" ", 1)[1].strip())
        assert (logs / "redis.url").exists() and _processes_naming(logs)
        proc.send_signal(signal.SIGTERM)
        _, err = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(timeout=30)
    assert proc.returncode == 128 + signal.SIGTERM, err
    assert f"the cluster's logs are kept in {logs}" in err
    assert (logs / "decode-0.log").exists()
    assert not (logs / "redis.url").exists() and not (logs / "cluster.token").exists()
    wait_until(lambda: not _processes_naming(logs), 10.0, "the cluster's processes to end")
    shutil.rmtree(logs)


def _processes_naming(path: Path) -> list[int]:
    """Live processes whose command line names ``path`` (every process a launcher
    starts is given a file in its log folder)."""
    found = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit() and entry.name != str(os.getpid()):
            try:
                if str(path).encode() in (entry / "cmdline").read_bytes():
                    found.append(int(entry.name))
            except OSError:
                continue  # gone meanwhile
    return found
