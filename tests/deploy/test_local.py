"""``pdserve up`` with real processes on loopback: a taken port fails before anything
starts; Ctrl-C/SIGTERM stop every child (exit 0); SIGKILL of ``pdserve up`` leaves no
descendant alive; a child that dies is reported by name with its log, and everything else
stops; ``pdserve generate`` streams from the cluster and reports gRPC errors.

Every descendant of a ``pdserve up`` process is recorded while it runs (a /proc walk every
50 ms), so the tests can check that none survives it, whatever reparented them since.
"""

from __future__ import annotations

import json
import os
import re
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from urllib.parse import urlsplit

import pytest

from deploy.local import LocalLauncher
from deploy.spec import ChildExited, ClusterError, ClusterSpec
from tests.factories import REPO_ROOT
from tests.processes import alive, wait_until

pytestmark = pytest.mark.timeout(120)

START_TIMEOUT_S = 90.0
STOP_TIMEOUT_S = 30.0
NUM_KV_BLOCKS = 32
READY_LINE = "(Ctrl-C to stop)"


# ------------------------------------------------------------------------ process helpers

def _proc_table() -> dict[int, tuple[int, str, str]]:
    """pid → (ppid, start time, state) of every process."""
    table = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                fields = (entry / "stat").read_text().rpartition(")")[2].split()
            except OSError:
                continue
            table[int(entry.name)] = (int(fields[1]), fields[19], fields[0])
    return table


def _descendants(root: int) -> dict[int, str]:
    """pid → start time of every live descendant of ``root``."""
    table = _proc_table()
    children: dict[int, list[int]] = {}
    for pid, (ppid, _, _) in table.items():
        children.setdefault(ppid, []).append(pid)
    found, todo = {}, list(children.get(root, []))
    while todo:
        pid = todo.pop()
        found[pid] = table[pid][1]
        todo += children.get(pid, [])
    return found


def _alive(pid: int, start_time: str) -> bool:
    """The same process (not a reused pid) still exists and is not a zombie."""
    entry = _proc_table().get(pid)
    return entry is not None and entry[1] == start_time and entry[2] != "Z"


def _cmdline(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode()
    except OSError:
        return ""


def _ignore_sigint() -> None:
    signal.signal(signal.SIGINT, signal.SIG_IGN)


class Up:
    """A ``pdserve up`` process: its output (stdout + stderr) line by line, and every
    descendant seen while it ran (pid → start time, cmdline)."""

    def __init__(self, model_dir: Path, log_dir: Path, *args: str) -> None:
        argv = [sys.executable, "-m", "pdserve", "up", "--model", str(model_dir),
                "--port", "0", "--http-port", "0", "--num-kv-blocks", str(NUM_KV_BLOCKS),
                "--log-dir", str(log_dir), *args]
        # started with SIGINT ignored, as a shell starts a background job (`pdserve up &`):
        # Ctrl-C / SIGINT must stop it all the same, whatever the test runner inherited
        self.proc = subprocess.Popen(argv, cwd=REPO_ROOT, stdout=subprocess.PIPE,
                                     stderr=subprocess.STDOUT, text=True,
                                     preexec_fn=_ignore_sigint)
        self.log_dir = log_dir
        self.lines: list[str] = []
        self.seen: dict[int, tuple[str, str]] = {}
        self._threads = [threading.Thread(target=self._read, daemon=True),
                         threading.Thread(target=self._track, daemon=True)]
        for thread in self._threads:
            thread.start()

    @property
    def output(self) -> str:
        return "".join(self.lines)

    def wait_for(self, text: str, timeout_s: float = START_TIMEOUT_S) -> str:
        """The first output line containing ``text``; fails if ``pdserve up`` exits first."""
        deadline = time.monotonic() + timeout_s
        while True:
            for line in list(self.lines):
                if text in line:
                    return line
            assert self.proc.poll() is None, f"pdserve up exited:\n{self.output}"
            assert time.monotonic() < deadline, f"no {text!r} in:\n{self.output}"
            time.sleep(0.05)

    def exit_code(self, timeout_s: float = STOP_TIMEOUT_S) -> int:
        code = self.proc.wait(timeout_s)
        for thread in self._threads:
            thread.join(5)
        return code

    def survivors(self) -> list[str]:
        return [f"{pid} {cmd}" for pid, (start, cmd) in self.seen.items() if _alive(pid, start)]

    def pids_running(self, fragment: str) -> list[int]:
        return [pid for pid, (start, cmd) in self.seen.items()
                if fragment in cmd and _alive(pid, start)]

    def close(self) -> None:
        """Test cleanup: nothing of ours outlives the test, whatever happened."""
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait(10)
        for pid, (start, _) in self.seen.items():
            if _alive(pid, start):
                os.kill(pid, signal.SIGKILL)

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            self.lines.append(line)

    def _track(self) -> None:
        # the command line is read again on every walk: a child first seen between its
        # fork and its exec still shows the parent's command line
        while self.proc.poll() is None:
            for pid, start in _descendants(self.proc.pid).items():
                cmdline = _cmdline(pid)
                if cmdline or pid not in self.seen:
                    self.seen[pid] = (start, cmdline)
            time.sleep(0.05)


def _generate(address: str, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "pdserve", "generate", *args,
                           "--address", address, "--timeout", "60"],
                          cwd=REPO_ROOT, capture_output=True, text=True, timeout=90)


# ------------------------------------------------------------------------ scenarios

@pytest.mark.parametrize("flag", ["--port", "--http-port"])
def test_a_taken_port_fails_at_once_and_starts_nothing(llama_dir: Path, tmp_path: Path,
                                                       flag: str) -> None:
    log_dir = tmp_path / "logs"
    with socket.create_server(("127.0.0.1", 0)) as squatter:
        taken = squatter.getsockname()[1]
        ports = {"--port": "0", "--http-port": "0", flag: str(taken)}
        result = subprocess.run(
            [sys.executable, "-m", "pdserve", "up", "--model", str(llama_dir),
             *[word for item in ports.items() for word in item], "--log-dir", str(log_dir)],
            cwd=REPO_ROOT, capture_output=True, text=True, timeout=30)
    assert result.returncode != 0
    assert f"port {taken}" in result.stderr and "not available" in result.stderr
    assert f"pick another with {flag}" in result.stderr
    assert "starting" not in result.stdout  # neither Redis nor any worker
    assert not log_dir.exists()  # no child ever wrote a log


@pytest.fixture(scope="module")
def served(llama_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Up]:
    """One cluster (1 prefill, 1 decode) for the client tests; the last test stops it."""
    up = Up(llama_dir, tmp_path_factory.mktemp("up"), "--demo")
    try:
        up.wait_for(READY_LINE)
        yield up
    finally:
        up.close()


def _address(up: Up) -> str:
    match = re.search(r"serving at (\S+:\d+)", up.output)
    assert match, up.output
    return match.group(1)


def test_up_demo_streams_a_completion(served: Up) -> None:
    out = served.output
    assert "decode-0 ready at 127.0.0.1:" in out and "prefill-0 ready at 127.0.0.1:" in out
    assert "router ready at 127.0.0.1:" in out
    completion = re.search(r"^completion: (.*)$", out, re.MULTILINE)
    assert completion and completion.group(1).strip(), out  # some text came back
    assert "finish_reason=length" in out and "completion_tokens=48" in out


def test_generate_streams_text_and_a_summary(served: Up) -> None:
    result = _generate(_address(served), "Hello there", "--max-tokens", "8",
                       "--temperature", "0", "--ignore-eos")
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip()
    assert "finish_reason=length" in result.stderr and "completion_tokens=8" in result.stderr
    assert "prompt_tokens=" in result.stderr and "cached_tokens=" in result.stderr


def test_generate_reports_invalid_argument(served: Up) -> None:
    result = _generate(_address(served), "Hello", "--max-tokens", "0")
    assert result.returncode == 2, result.stderr
    assert "INVALID_ARGUMENT" in result.stderr and "max_tokens" in result.stderr
    assert result.stdout == ""


def test_up_serves_the_openai_api(served: Up) -> None:
    import openai

    match = re.search(r"OpenAI-compatible HTTP API at (http://\S+:\d+/v1)", served.output)
    assert match, served.output
    with openai.OpenAI(base_url=match.group(1), api_key="unused", max_retries=0,
                       timeout=60) as client:
        completion = client.completions.create(model="", prompt="Hello", max_tokens=4,
                                               temperature=0)
        chat = client.chat.completions.create(
            model=client.models.list().data[0].id, max_tokens=3,
            messages=[{"role": "user", "content": "Hi"}])
    assert completion.usage is not None and completion.usage.completion_tokens <= 4
    assert completion.choices[0].finish_reason in ("length", "stop")
    assert chat.choices[0].message.role == "assistant"
    assert chat.usage is not None and chat.usage.completion_tokens <= 3


def test_no_secret_is_on_a_command_line_and_each_is_required(served: Up) -> None:
    import grpc
    import redis

    from cluster.internal.v1 import worker_pb2, worker_pb2_grpc

    url_file, token_file = served.log_dir / "redis.url", served.log_dir / "cluster.token"
    for path in (url_file, token_file):
        assert path.stat().st_mode & 0o777 == 0o600
    url, token = url_file.read_text().strip(), token_file.read_text().strip()
    password = urlsplit(url).password
    assert password and len(token) >= 32
    command_lines = [cmd for _, cmd in served.seen.values()]
    assert any("--worker-id decode-0" in cmd for cmd in command_lines)
    assert any("redis-server" in cmd for cmd in command_lines)
    for cmd in command_lines:  # read from /proc while each ran
        assert password not in cmd and token not in cmd, cmd
    parts = urlsplit(url)
    with redis.Redis(host=parts.hostname, port=parts.port, socket_timeout=5) as anonymous:
        with pytest.raises(redis.AuthenticationError):
            anonymous.ping()
    ready = json.loads((served.log_dir / "decode-0.ready.json").read_text())
    with grpc.insecure_channel(ready["grpc_address"]) as channel:
        with pytest.raises(grpc.RpcError) as caught:
            worker_pb2_grpc.DecodeWorkerStub(channel).Info(worker_pb2.InfoRequest(), timeout=10)
    assert caught.value.code() == grpc.StatusCode.UNAUTHENTICATED


def test_sigint_stops_every_child_with_exit_code_0(served: Up) -> None:
    assert served.pids_running("redis-server") and served.pids_running("--worker-id decode-0")
    served.proc.send_signal(signal.SIGINT)
    assert served.exit_code() == 0, served.output
    assert "all processes stopped" in served.output
    assert served.survivors() == []
    # the logs stay; the stopped cluster's Redis URL (with its password) and token go
    assert (served.log_dir / "decode-0.log").exists()
    assert not (served.log_dir / "redis.url").exists()
    assert not (served.log_dir / "cluster.token").exists()


def test_sigterm_while_starting_stops_everything(llama_dir: Path, tmp_path: Path) -> None:
    up = Up(llama_dir, tmp_path)
    try:
        up.wait_for("starting prefill-0")
        wait_until(lambda: up.pids_running("--worker-id decode-0"), 30.0, "decode-0 to run")
        up.proc.send_signal(signal.SIGTERM)  # the workers are loading
        assert up.exit_code() == 0, up.output
        assert READY_LINE not in up.output
        assert up.pids_running("--worker-id") == []  # they were seen, and are gone
        assert up.survivors() == []
    finally:
        up.close()


def test_sigkill_of_up_leaves_no_descendant(llama_dir: Path, tmp_path: Path) -> None:
    up = Up(llama_dir, tmp_path, "--decode-tp", "2")
    try:
        up.wait_for(READY_LINE)
        time.sleep(0.2)  # one more /proc walk
        decode = up.pids_running("--worker-id decode-0")
        assert decode and up.pids_running("redis-server")
        ranks = [pid for pid, (start, _) in up.seen.items()
                 if _alive(pid, start) and _proc_table()[pid][0] == decode[0]]
        assert ranks, "the decode worker's second rank"
        assert up.pids_running("pdserve router")
        up.proc.kill()
        up.exit_code()
        wait_until(lambda: not up.survivors(), 10.0, "every child of pdserve up to die")
    finally:
        up.close()


def test_a_child_that_dies_is_named_and_everything_stops(llama_dir: Path, tmp_path: Path
                                                         ) -> None:
    lines: list[str] = []
    config = ClusterSpec(model_dir=llama_dir, port=0, http_port=0, num_kv_blocks=NUM_KV_BLOCKS,
                                log_dir=tmp_path, stop_grace_s=5.0)
    with LocalLauncher(config, progress=lines.append) as cluster:
        pids = cluster.pids()
        assert {"redis", "prefill-0", "decode-0"} <= set(pids)
        assert (tmp_path / "decode-0.log").is_file() and (tmp_path / "redis.log").is_file()
        os.kill(pids["decode-0"], signal.SIGKILL)
        with pytest.raises(ChildExited, match=r"decode-0 exited unexpectedly \(killed by "
                                              r"SIGKILL\)") as info:
            cluster.wait(30.0)
        assert info.value.name == "decode-0"
        assert "decode worker decode-0 ready" in str(info.value)  # the tail of its log
    assert cluster.pids() == {}
    assert not set(pids.values()) & set(_proc_table())  # stopped and reaped
    assert lines[-1] == "all processes stopped"


def test_colocated_cluster_without_prefill_workers(llama_dir: Path, tmp_path: Path) -> None:
    # --prefill 0 --local-prefill always: only Redis, a decode worker and the router; the
    # decode worker prefills every request itself
    from engine import LLM, SamplingParams
    from pdserve.client import Client

    config = ClusterSpec(model_dir=llama_dir, port=0, http_port=0, num_kv_blocks=NUM_KV_BLOCKS,
                                log_dir=tmp_path, num_prefill=0, local_prefill="always")
    with LocalLauncher(config, progress=lambda _: None) as cluster:
        assert set(cluster.pids()) == {"redis", "decode-0", "router"}
        with Client(cluster.router_address) as client:
            result = client.complete("colocated", max_tokens=6, temperature=0,
                                     ignore_eos=True, timeout=60)
    with LLM(llama_dir) as llm:
        expected = llm.generate(["colocated"], SamplingParams(max_tokens=6, temperature=0,
                                                              ignore_eos=True))[0]
    assert list(result.token_ids) == expected.token_ids
    with pytest.raises(ValueError, match="--local-prefill always"):
        ClusterSpec(num_prefill=0)


def _cpus_allowed(pid: int) -> set[int]:
    """Union of the CPU affinity of every thread of ``pid``."""
    allowed: set[int] = set()
    for task in Path(f"/proc/{pid}/task").iterdir():
        allowed |= os.sched_getaffinity(int(task.name))
    return allowed


@pytest.mark.skipif(not hasattr(os, "sched_getaffinity") or len(os.sched_getaffinity(0)) < 2,
                    reason="needs Linux and two CPUs to pin to")
def test_children_run_on_the_cpus_they_are_pinned_to(llama_dir: Path, tmp_path: Path) -> None:
    from deploy.children import spawn

    cpus = sorted(os.sched_getaffinity(0))
    first, last = cpus[0], cpus[-1]
    # 1. spawn itself: the child is pinned before it runs a line of its own
    probe = spawn([sys.executable, "-c", "import os; print(sorted(os.sched_getaffinity(0)))"],
                  cpus=[last], stdout=subprocess.PIPE)
    out, _ = probe.communicate(timeout=30)
    assert out.decode().strip() == f"[{last}]"
    # 2. a cluster: prefill-0 on the first CPU, decode-0 on the last, router and Redis free
    config = ClusterSpec(model_dir=llama_dir, port=0, http_port=None,
                                num_kv_blocks=NUM_KV_BLOCKS, log_dir=tmp_path,
                                cpu_affinity={"prefill-0": (first,), "decode-0": (last,)})
    with LocalLauncher(config, progress=lambda _: None) as cluster:
        pids = cluster.pids()
        assert _cpus_allowed(pids["prefill-0"]) == {first}  # every thread, torch's included
        assert _cpus_allowed(pids["decode-0"]) == {last}
        assert _cpus_allowed(pids["router"]) == set(cpus)
        from pdserve.client import Client

        with Client(cluster.router_address) as client:
            assert client.complete("pinned", max_tokens=3, timeout=60).finish_reason
    # 3. what cannot be pinned is refused before anything starts
    with pytest.raises(ValueError, match="not a process of this cluster"):
        ClusterSpec(cpu_affinity={"decode-1": (0,)})
    with pytest.raises(ValueError, match="CPU numbers"):
        ClusterSpec(cpu_affinity={"router": ()})
    with pytest.raises(ClusterError, match="may use only"):
        LocalLauncher(ClusterSpec(model_dir=llama_dir, port=0, http_port=None,
                                        log_dir=tmp_path, cpu_affinity={"router": (4096,)})
                     ).start()


def test_up_with_the_planner_runs_it_beside_the_cluster(llama_dir: Path, tmp_path: Path) -> None:
    # pdserve up --planner PROFILE: the planner leads, keeps the one prefill worker the
    # routers need (no --local-prefill), and stops first
    from sim.profile import SCHEMA
    from tests.e2e.cluster import scrape_metrics

    profile = tmp_path / "profile.json"
    step = {"base_s": 0.001, "per_prefill_token_s": 1e-5, "per_prefill_attention_s": 0.0,
            "per_decode_seq_s": 1e-4, "per_decode_context_s": 0.0, "num_kv_blocks": 64}
    profile.write_text(json.dumps({
        "schema": SCHEMA, "source": "derived", "model": {
            "name": "tiny", "num_layers": 2, "kv_bytes_per_token": 1024, "block_size": 16,
            "max_model_len": 2048}, "steps": {"1": step},
        "transfer": {"latency_s": 0.001, "bytes_per_s": 1e9}, "router": {"overhead_s": 0.0},
        "handoff": {"overhead_s": 0.0}}))
    config = ClusterSpec(model_dir=llama_dir, port=0, http_port=None, num_kv_blocks=NUM_KV_BLOCKS,
                         log_dir=tmp_path, planner_args=("--profile", str(profile),
                                                         "--ttft-slo-ms", "500",
                                                         "--tpot-slo-ms", "50",
                                                         "--interval", "0.2"))
    lines: list[str] = []
    with LocalLauncher(config, progress=lines.append) as cluster:
        assert set(cluster.pids()) == {"redis", "prefill-0", "decode-0", "router", "planner"}
        [planner] = cluster.planners
        assert "--min-prefill" in planner.argv and planner.argv[-1] == "1"
        address = (planner.ready or {})["metrics_address"]
        wait_until(lambda: scrape_metrics(address)["pdserve:planner_leader{}"] == 1, 10,
                   "the planner to lead")
        pids = list(cluster.pids().values())
    assert any(line.startswith("planner ready") for line in lines), lines
    assert not any(alive(pid) for pid in pids)  # every child, the planner included, stopped


def test_a_restarted_planner_is_tracked_and_a_stop_forgets_only_what_it_stopped(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The launcher's bookkeeping alone (processes stood in for): ``restart`` puts the new
    planner where the old one was (it raised ValueError once the new one was spawned), and
    a stop interrupted midway keeps the groups it did not stop."""
    import deploy.local as local

    def child(name: str) -> local.Child:
        return local.Child(name, None, tmp_path / f"{name}.log",  # type: ignore[arg-type]
                           tmp_path / f"{name}.ready.json")

    launcher = LocalLauncher(ClusterSpec())
    old, worker = child("planner"), child("decode-0")
    launcher.planners, launcher.workers = [old], [worker]
    spawned = child("planner")
    monkeypatch.setattr(local, "terminate_all", lambda procs, grace: None)
    monkeypatch.setattr(launcher, "_spawn", lambda name, argv: spawned)
    monkeypatch.setattr(launcher, "_wait_ready", lambda children, describe: None)
    assert launcher.restart("planner") is spawned and launcher.planners == [spawned]

    def interrupted(procs: list[object], grace: float) -> None:
        if len(procs) == 1 and launcher.workers and procs[0] is worker.proc \
                and not launcher.planners:
            raise KeyboardInterrupt  # a second Ctrl-C while the workers stop

    monkeypatch.setattr(local, "terminate_all", interrupted)
    worker.proc = object()  # type: ignore[assignment]
    with pytest.raises(KeyboardInterrupt):
        launcher._stop_processes()
    assert launcher.planners == [] and launcher.workers == [worker]  # still tracked
