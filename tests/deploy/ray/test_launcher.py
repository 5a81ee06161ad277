"""``pdserve up --ray`` on a real single-node Ray cluster that this module starts once,
bound to loopback only, with ``pdserve_gpu`` standing in for GPUs (so every worker's TP
group is reserved through a placement group): greedy output through the router equals
``engine.LLM``; each TP group is one STRICT_PACK placement group; workers advertise their
node and get the Redis URL from their environment; a dead worker (its process, or its
actor's) is restarted by Ray and registers again while traffic goes on; stopping leaves no
actor, placement group or process; the command line serves and stops on SIGTERM; a layout
that does not fit fails and leaves nothing. The test that stops the shared cluster runs
after the tests that use it.
"""

from __future__ import annotations

import itertools
import json
import os
import re
import signal
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import grpc
import pytest

from deploy.ray.plan import RaySpec
from deploy.spec import ClusterError, ClusterSpec
from tests.deploy.ray.raytools import (
    GPU,
    NEEDS_RAY,
    TIMEOUT_S,
    Load,
    assert_nothing_left,
    cmdline,
    complete_all,
    descendants,
    greedy,
    our_processes,
    processes_left,
)
from tests.factories import PROMPTS
from tests.processes import alive, wait_until

pytestmark = [pytest.mark.timeout(180), NEEDS_RAY]

NUM_GPUS = 4
NUM_CPUS = 4
NUM_KV_BLOCKS = 32
LOOPBACK_ENV = {"RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0"}  # Ray keeps 127.0.0.1 as is


# ------------------------------------------------------------------------ Ray and /proc

@pytest.fixture(scope="module")
def ray_head() -> Iterator[Any]:
    """A single-node Ray on 127.0.0.1 (dashboard off), shut down at module end; then no
    process it started is left."""
    from tests.processes import children

    before = set(children(os.getpid()))
    with pytest.MonkeyPatch.context() as patch:
        for key, value in LOOPBACK_ENV.items():
            patch.setenv(key, value)
        import ray

        ray.init(num_cpus=NUM_CPUS, resources={GPU: NUM_GPUS}, include_dashboard=False,
                 _node_ip_address="127.0.0.1", log_to_driver=False, logging_level="WARNING")
    try:
        assert ray.util.get_node_ip_address() == "127.0.0.1"
        assert ray.get_runtime_context().gcs_address.startswith("127.0.0.1:")
        yield ray
    finally:
        ray.shutdown()
        wait_until(lambda: not set(children(os.getpid())) - before, 30.0,
                   "Ray's processes to exit")


# ------------------------------------------------------------------------ the cluster

@pytest.fixture(scope="module")
def served(ray_head: Any, llama_dir: Path, tmp_path_factory: pytest.TempPathFactory
           ) -> Iterator[Any]:
    """2 prefill workers (TP 1) and 1 decode worker (TP 2): all 4 pdserve_gpu."""
    from deploy.ray.launcher import launch

    spec = ClusterSpec(model_dir=llama_dir, num_prefill=2, num_decode=1, decode_tp=2,
                                port=0, http_port=0, num_kv_blocks=NUM_KV_BLOCKS,
                                stop_grace_s=5.0,
                                log_dir=tmp_path_factory.mktemp("ray-up"), start_timeout_s=120)
    lines: list[str] = []
    cluster = launch(RaySpec(cluster=spec, gpu_resource=GPU, cpus_per_rank=0.5,
                                      max_restarts=2), progress=lines.append)
    cluster.lines = lines  # type: ignore[attr-defined]
    try:
        yield cluster
    finally:
        cluster.stop()


@pytest.fixture(scope="module")
def llm(llama_dir: Path) -> Iterator[Any]:
    from engine import LLM

    with LLM(llama_dir) as engine:
        yield engine


def _stub(address: str, role: str = "prefill", token: str | None = None) -> Any:
    """A channel to a worker and its stub, the calls carrying the cluster's ``token``."""
    from cluster.internal.v1 import worker_pb2_grpc as wpb_grpc
    from tests.auth import with_token

    channel = grpc.insecure_channel(address)
    kind = wpb_grpc.PrefillWorkerStub if role == "prefill" else wpb_grpc.DecodeWorkerStub
    return channel, kind(with_token(channel, token))


def _info(address: str, token: str | None) -> Any:
    from cluster.internal.v1 import worker_pb2 as wpb

    channel, stub = _stub(address, token=token)
    with channel:
        return stub.Info(wpb.InfoRequest(), timeout=TIMEOUT_S)


def test_greedy_output_through_the_router_matches_llm(served: Any, llm: Any) -> None:
    from tests.worker.procs import assert_idle

    prompts = [PROMPTS[i % len(PROMPTS)] + " #" * (i // len(PROMPTS)) for i in range(12)]
    assert complete_all(served.router_address, prompts) == greedy(prompts, llm)
    body = json.dumps({"prompt": prompts[0], "max_tokens": 8, "temperature": 0}).encode()
    request = urllib.request.Request(f"{served.http_url}/v1/completions", data=body,
                                     headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=60) as reply:  # the OpenAI HTTP API too
        assert json.load(reply)["usage"]["completion_tokens"] == 8
    for status in served.statuses().values():
        if status.name not in ("redis", "router"):
            channel, stub = _stub(status.ready["grpc_address"], status.ready["role"],
                                  served.cluster_token)
            with channel:
                assert_idle(stub)
    lines = served.lines
    assert lines[0].startswith("logs in ") and "ray: using this process's Ray connection" in lines
    assert any(re.fullmatch(r"placed prefill-0 on 127\.0\.0\.1, .*decode-0 on 127\.0\.0\.1", line)
               for line in lines), lines
    assert any(line.startswith("decode-0 ready at 127.0.0.1:") for line in lines), lines
    assert any(line.startswith("router ready at 127.0.0.1:") for line in lines), lines


def test_each_tp_group_is_one_strict_pack_placement_group(served: Any, ray_head: Any) -> None:
    table = [ray_head.util.placement_group_table(pg) for pg in served.placement_groups]
    assert [t["name"] for t in table] == ["pdserve-default-prefill-0", "pdserve-default-prefill-1",
                                          "pdserve-default-decode-0"]
    assert {t["strategy"] for t in table} == {"STRICT_PACK"}
    assert {t["state"] for t in table} == {"CREATED"}
    assert [t["bundles"] for t in table] == [{0: {"CPU": 0.5, GPU: 1.0}}] * 2 + [
        {0: {"CPU": 1.0, GPU: 2.0}}]
    assert all(len(set(t["bundles_to_node_id"].values())) == 1 for t in table)
    assert ray_head.available_resources().get(GPU, 0.0) == 0.0  # all 4 reserved
    # each worker's ranks run under its actor: the worker process leads, followers below it
    statuses = served.statuses()
    assert [len(_followers(statuses[n].child_pid)) for n in ("prefill-0", "decode-0")] == [0, 1]


def _followers(worker_pid: int) -> list[int]:
    """The rank processes a worker started (``python -m engine.tp.rank_main``)."""
    return [p for p in descendants(worker_pid) if b"engine.tp.rank_main" in cmdline(p)]


def _environ(pid: int) -> dict[str, str]:
    raw = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
    return dict(item.decode(errors="replace").partition("=")[::2] for item in raw if item)


def test_workers_advertise_their_node_and_get_secrets_from_the_environment(served: Any) -> None:
    from cluster.registry import Registry

    assert served.redis_url.startswith("redis://:") and "@127.0.0.1:" in served.redis_url
    with Registry(served.redis_url) as registry:
        records = {r.worker_id: r for r in registry.list_workers()}
    statuses = served.statuses()
    assert set(records) == {"prefill-0", "prefill-1", "decode-0"}
    for name, record in records.items():
        assert record.grpc_address == statuses[name].ready["grpc_address"]
        assert record.grpc_address.startswith("127.0.0.1:")  # the node's IP (loopback here)
        argv = cmdline(statuses[name].child_pid).split(b"\0")
        assert argv[argv.index(b"--advertise-host") + 1] == b"127.0.0.1"
        assert b"redis" not in b" ".join(argv)  # no URL (nor its password) on a command line
        env = _environ(statuses[name].child_pid)
        assert env["PDSERVE_REDIS_URL"] == served.redis_url
        assert env["OMP_NUM_THREADS"] == "1" and env["GLOO_SOCKET_IFNAME"] == "lo"
    router = statuses["router"]
    assert b"redis" not in cmdline(router.child_pid)
    assert _environ(router.child_pid)["PDSERVE_REDIS_URL"] == served.redis_url


def _follow_until(cluster: Any, name: str, old_actor_pid: int, timeout_s: float = 120.0
                  ) -> Any:
    """Follow the cluster (as ``pdserve up`` does) until ``name`` is ready in a new actor."""
    def back() -> bool:
        cluster.check()
        status = cluster.statuses()[name]
        return status.actor_pid != old_actor_pid and status.ready is not None \
            and status.exit is None and not cluster.workers[_index(cluster, name)].down

    wait_until(back, timeout_s, f"{name} to be restarted and ready", period_s=0.25)
    return cluster.statuses()[name]


def _index(cluster: Any, name: str) -> int:
    return [m.name for m in cluster.workers].index(name)


def test_a_dead_worker_is_restarted_and_reregisters(served: Any, llm: Any) -> None:
    from cluster.registry import Registry

    prompts = [f"topic {i * 7919} " + PROMPTS[i % len(PROMPTS)] * 2 for i in range(8)]
    expected = greedy(prompts, llm, max_tokens=4)
    # 1. prefill-1's worker process dies: traffic goes on through prefill-0 meanwhile
    old = served.statuses()["prefill-1"]
    os.kill(old.child_pid, signal.SIGKILL)
    assert complete_all(served.router_address, prompts, max_tokens=4) == expected
    new = _follow_until(served, "prefill-1", old.actor_pid)
    assert new.child_pid != old.child_pid and not alive(old.child_pid)
    assert any(line.startswith("prefill-1 is down (") and line.endswith("Ray restarts it")
               for line in served.lines), served.lines
    assert any(line.startswith("prefill-1 ready at ") and line.endswith("(restart 1)")
               for line in served.lines), served.lines
    # 2. it registered again, under its id, with its new address, and serves again
    with Registry(served.redis_url) as registry:
        record = {r.worker_id: r for r in registry.list_workers("prefill")}["prefill-1"]
    assert record.grpc_address == new.ready["grpc_address"]
    wait_until(lambda: _prefill_gets_traffic(served, new.ready["grpc_address"], prompts),
               60.0, "the router to send prefill-1 requests again", period_s=1.0)
    # 3. decode-0's actor process is killed: Ray restarts it (and its two ranks)
    old = served.statuses()["decode-0"]
    os.kill(old.actor_pid, signal.SIGKILL)
    new = _follow_until(served, "decode-0", old.actor_pid)
    wait_until(lambda: not alive(old.child_pid), 10.0, "the old decode worker to die with it")
    assert any(line.startswith("decode-0 ready at ") and line.endswith("(restart 1)")
               for line in served.lines), served.lines
    assert [m.restarts for m in served.workers] == [0, 1, 1]
    # the router sees the new decode worker within a refresh of its view
    from pdserve.client import PdserveError

    wait_until(lambda: complete_all(served.router_address, prompts[:4], max_tokens=4)
               == expected[:4], 30.0, "requests to succeed again", period_s=0.5,
               ignore=(PdserveError,))


_ROUNDS = itertools.count()


def _prefill_gets_traffic(cluster: Any, address: str, prompts: list[str]) -> bool:
    """Whether new prompts reach the prefill worker at ``address``: fresh ones each call,
    so none is held by the decode worker, which computes a prompt it holds all but a
    short tail of itself (conditional disaggregation)."""
    before = _info(address, cluster.cluster_token).kv.cached_blocks
    round_ = next(_ROUNDS)
    complete_all(cluster.router_address, [f"again {round_} {p}" for p in prompts],
                 max_tokens=1)
    return bool(_info(address, cluster.cluster_token).kv.cached_blocks > before)


def test_stop_removes_every_actor_placement_group_and_process(served: Any, ray_head: Any
                                                              ) -> None:
    pids = our_processes(served.statuses())
    assert len(pids) >= 2 * 5  # 5 actors, each with its child (and the ranks below)
    served.stop()
    assert served.lines[-1] == "all processes stopped"
    assert served.statuses() == {} and served.placement_groups == []
    assert_nothing_left(ray_head, pids, served.log_dir)
    served.stop()  # idempotent


# ------------------------------------------------------------------------ the command line

def _up_on(ray_head: Any, llama_dir: Path, log_dir: Path, *args: str) -> Any:
    """``pdserve up --ray`` connected to this module's Ray (a ``test_local_cluster.Up``)."""
    from tests.deploy.test_local import Up

    address = ray_head.get_runtime_context().gcs_address
    os.environ.update(LOOPBACK_ENV)  # the CLI's Ray driver must join the node at 127.0.0.1
    try:
        return Up(llama_dir, log_dir, "--ray", "--ray-address", address, "--ray-gpu-resource",
                  GPU, "--ray-cpus-per-rank", "0.5", *args)
    finally:
        for key in LOOPBACK_ENV:
            os.environ.pop(key, None)


def test_pdserve_up_ray_serves_and_stops_on_sigterm(ray_head: Any, llama_dir: Path,
                                                    tmp_path: Path) -> None:
    from tests.deploy.test_local import READY_LINE

    address = ray_head.get_runtime_context().gcs_address
    up = _up_on(ray_head, llama_dir, tmp_path, "--decode-tp", "2", "--demo")
    try:
        up.wait_for(READY_LINE, timeout_s=150.0)
        out = up.output
        assert f"ray: connected to {address} (1 node)" in out
        assert "placed prefill-0 on 127.0.0.1, decode-0 on 127.0.0.1" in out
        assert "completion_tokens=48" in out  # the demo streamed through the router
        assert re.search(r"redis ready at redis://:\*\*\*@127\.0\.0\.1:\d+/0", out), out
        names = {a["name"] for a in ray_head.util.list_named_actors(all_namespaces=True)}
        assert {"pdserve-default-prefill-0", "pdserve-default-decode-0",
                "pdserve-default-router", "pdserve-default-redis"} <= names
        up.proc.send_signal(signal.SIGTERM)
        assert up.exit_code(60.0) == 0, up.output
        assert "all processes stopped" in up.output
        assert_nothing_left(ray_head, [], tmp_path)
        assert (tmp_path / "decode-0.log").is_file() and (tmp_path / "router.log").is_file()
    finally:
        up.close()


def test_sigkill_of_pdserve_up_ray_leaves_nothing(ray_head: Any, llama_dir: Path,
                                                  tmp_path: Path) -> None:
    # the actors and placement groups are the driver's: Ray removes them when it dies, and
    # every child dies with its actor
    from tests.deploy.test_local import READY_LINE

    up = _up_on(ray_head, llama_dir, tmp_path)
    try:
        up.wait_for(READY_LINE, timeout_s=150.0)
        assert processes_left([], tmp_path), "the workers and the router name the log dir"
        up.proc.kill()
        up.exit_code()
        assert_nothing_left(ray_head, [], tmp_path)
    finally:
        up.close()


def test_a_layout_that_does_not_fit_fails_and_leaves_nothing(ray_head: Any, llama_dir: Path,
                                                              tmp_path: Path) -> None:
    from deploy.ray.launcher import RayLauncher

    spec = ClusterSpec(model_dir=llama_dir, num_prefill=1, num_decode=1,
                                decode_tp=NUM_GPUS + 1, port=0, http_port=0, log_dir=tmp_path)
    config = RaySpec(cluster=spec, gpu_resource=GPU, cpus_per_rank=0.5,
                              placement_timeout_s=2.0)
    lines: list[str] = []
    with pytest.raises(ClusterError, match=r"no room for decode-0 within 2s: decode-0 needs "
                                           r"one node with CPU=2.5, pdserve_gpu=5"):
        RayLauncher(config, progress=lines.append).start()
    assert "redis ready at" in " ".join(lines) and lines[-1] == "all processes stopped"
    assert_nothing_left(ray_head, [], tmp_path)


def test_a_router_without_room_fails_before_any_worker_starts(ray_head: Any, llama_dir: Path,
                                                               tmp_path: Path) -> None:
    """The router's CPUs are placed with the workers' groups, on this node: a plan that
    leaves it none fails at once naming it and the flags (it used to wait in silence)."""
    from deploy.ray.launcher import RayLauncher

    spec = ClusterSpec(model_dir=llama_dir, num_prefill=1, num_decode=1, port=0, http_port=0,
                       log_dir=tmp_path)
    config = RaySpec(cluster=spec, gpu_resource=GPU, cpus_per_rank=0.5,
                     router_cpus=NUM_CPUS, placement_timeout_s=2.0)
    lines: list[str] = []
    with pytest.raises(ClusterError, match=r"no room for router within 2s: router needs this "
                                           r"node \(127\.0\.0\.1\) with CPU=4; .*"
                                           r"--ray-router-cpus"):
        RayLauncher(config, progress=lines.append).start()
    assert not any("starting prefill-0" in line for line in lines), lines
    assert lines[-1] == "all processes stopped"
    assert_nothing_left(ray_head, [], tmp_path)


def test_two_routers_serve_and_a_rolling_restart_fails_no_request(
        ray_head: Any, llama_dir: Path, tmp_path: Path, llm: Any) -> None:
    """``--routers 2`` on Ray (and two of each worker kind, all 4 GPUs): both replicas serve
    the same greedy output; a rolling
    restart (SIGHUP's) replaces every process in its placement group — routers on their
    ports — while a client given both routers keeps streaming: none fails, every one
    right; then stopping leaves nothing."""
    import threading

    from deploy.ray.launcher import launch
    from pdserve.client import Client

    spec = ClusterSpec(model_dir=llama_dir, num_prefill=2, num_decode=2, num_routers=2,
                       port=0, http_port=None, num_kv_blocks=NUM_KV_BLOCKS * 4,
                       stop_grace_s=5.0, log_dir=tmp_path, start_timeout_s=120)
    lines: list[str] = []
    cluster = launch(RaySpec(cluster=spec, gpu_resource=GPU, cpus_per_rank=0.5,
                             router_cpus=0.5), progress=lines.append)
    try:
        addresses = cluster.router_addresses
        assert len(set(addresses)) == 2 and [m.name for m in cluster.routers] == \
            ["router", "router-1"]
        prompts = [f"rolling {i} " + PROMPTS[i % len(PROMPTS)] for i in range(6)]
        expected = greedy(prompts, llm, max_tokens=12)
        for address in addresses:
            assert complete_all(address, prompts, max_tokens=12) == expected
        before = cluster.statuses()
        done, results, failures = threading.Event(), [], []

        def load() -> None:
            with Client(addresses) as client:
                n = 0
                while not done.is_set():
                    i, n = n % len(prompts), n + 1
                    try:
                        tokens = list(client.complete(prompts[i], max_tokens=12, temperature=0,
                                                      ignore_eos=True, timeout=TIMEOUT_S).token_ids)
                    except Exception as exc:  # noqa: BLE001 - reported below
                        failures.append(repr(exc))
                        continue
                    results.append(tokens == expected[i])

        thread = threading.Thread(target=load, daemon=True)
        thread.start()
        try:  # the restart begins once requests flow (the client has connected)
            wait_until(lambda: bool(results or failures), TIMEOUT_S, "the load's first request")
            cluster.rolling_restart(settle_s=1.0)
        finally:
            done.set()
            thread.join(TIMEOUT_S)
        assert not failures, failures[:3]
        assert len(results) >= 10 and all(results)
        after = cluster.statuses()
        names = ["router", "router-1", "prefill-0", "prefill-1", "decode-0", "decode-1"]
        assert all(after[n].actor_pid != before[n].actor_pid for n in names), (before, after)
        assert [f"restarting {n} ..." for n in names] == \
            [line for line in lines if line.startswith("restarting ")]
        assert cluster.router_addresses == addresses  # the routers kept their ports
        pids = our_processes(after)
    finally:
        cluster.stop()
    assert lines[-1] == "all processes stopped"
    assert_nothing_left(ray_head, pids, tmp_path)


# ------------------------------------------------------------------------ the planner scales

def test_the_planner_on_ray_adds_a_worker_under_load_and_drains_one_when_idle(
        ray_head: Any, llama_dir: Path, tmp_path: Path, llm: Any) -> None:
    """``pdserve up --ray --planner PROFILE --min-workers 2 --max-workers 3``: the planner
    runs as an actor on this node. Under a load its profile says one prefill worker cannot
    serve (and the bounds leave nothing to switch), it asks for a worker; the launcher
    places and starts ``prefill-1``, which registers and serves. When the load stops the
    planner asks for one fewer: the launcher drains it and removes its actor and placement
    group. No request fails, outputs equal ``engine.LLM``'s, and stopping leaves nothing.
    The wait loop goes on (its health checks of the others) while a step runs."""
    from cluster.registry import Registry
    from deploy.ray.launcher import launch
    from tests.sim.profiles import write_slow_prefill_profile

    profile = write_slow_prefill_profile(tmp_path / "profile.json")
    planner = ("--profile", str(profile), "--ttft-slo-ms", "450", "--tpot-slo-ms", "1000",
               "--interval", "0.5", "--window", "3", "--dwell", "4", "--min-workers", "2",
               "--max-workers", "3")
    spec = ClusterSpec(model_dir=llama_dir, port=0, http_port=None, stop_grace_s=5.0,
                       num_kv_blocks=NUM_KV_BLOCKS, log_dir=tmp_path / "logs",
                       start_timeout_s=120, planner_args=planner)
    lines: list[str] = []
    cluster = launch(RaySpec(cluster=spec, gpu_resource=GPU, cpus_per_rank=0.5,
                             min_workers=2, max_workers=3), progress=lines.append)
    def names() -> list[str]:
        return [m.name for m in cluster.workers]

    busy: list[list[str]] = []  # the workers checked, seen while a step ran

    def wait_for(condition: Any, what: str, timeout_s: float = 90.0) -> None:
        deadline = time.monotonic() + timeout_s
        while not condition():  # the launcher's wait loop applies the planner's steps
            assert time.monotonic() < deadline, f"{what}: {lines[-5:]}"
            cluster.wait(0.5)
            if cluster.scaler is not None and cluster.scaler.busy:
                busy.append(names())

    try:
        assert cluster.planner is not None and names() == ["prefill-0", "decode-0"]
        with Load(cluster.router_address) as load:
            wait_for(lambda: names() == ["prefill-0", "decode-0", "prefill-1"],
                     "the planner to add a prefill worker")
            with Registry(cluster.redis_url, cluster=spec.name) as registry:
                roles = {w.worker_id: w.role for w in registry.list_workers()}
            assert roles == {"prefill-0": "prefill", "decode-0": "decode",
                             "prefill-1": "prefill"}
            served_before = len(load.done)
            wait_for(lambda: len(load.done) >= served_before + 6, "requests after the add")
        added = cluster.statuses()["prefill-1"]
        wait_for(lambda: len(names()) == 2, "the planner to drain a worker when idle")
        assert not load.failures, load.failures[:3]
        [removed] = {"prefill-0", "prefill-1"} - set(names())
        assert any(line.startswith(f"scale: draining {removed} for the planner: ")
                   for line in lines), lines
        assert any(line.startswith("scale: adding prefill-1 (TP 1) for the planner: ")
                   for line in lines), lines
        with Registry(cluster.redis_url, cluster=spec.name) as registry:
            wait_until(lambda: removed not in {w.worker_id for w in registry.list_workers()},
                       10, f"{removed} to deregister")
        assert len(cluster.placement_groups) == 2
        # wait() returned while prefill-1 started, and while a worker drained (out of the
        # checked workers from its first moment)
        assert ["prefill-0", "decode-0"] in busy, busy
        assert any(len(seen) == 2 and removed not in seen for seen in busy[1:]), busy
        planner_log = (tmp_path / "logs" / "planner.log").read_text()
        assert "scale: add a prefill worker" in planner_log, planner_log[-2000:]
        sample = sorted(load.done)[::max(1, len(load.done) // 8)]
        assert [load.done[p] for p in sample] == greedy(sample, llm, max_tokens=6)
        pids = our_processes(cluster.statuses()) + [added.actor_pid]
    finally:
        cluster.stop()
    assert lines[-1] == "all processes stopped"
    assert_nothing_left(ray_head, pids, tmp_path / "logs")


def test_stopping_while_a_scale_step_adds_a_worker_leaves_nothing(
        ray_head: Any, llama_dir: Path, tmp_path: Path) -> None:
    """A scale step runs on a thread of its own: a stop that comes while it places and
    starts a worker stops that worker too, and removes its placement group."""
    from cluster.registry import Registry
    from cluster.scale import ScaleTarget
    from deploy.ray.launcher import launch
    from deploy.ray.plan import NAMESPACE

    spec = ClusterSpec(model_dir=llama_dir, port=0, http_port=None, stop_grace_s=5.0,
                       num_kv_blocks=NUM_KV_BLOCKS, log_dir=tmp_path / "logs",
                       start_timeout_s=120, start_router=False)
    lines: list[str] = []
    cluster = launch(RaySpec(cluster=spec, gpu_resource=GPU, cpus_per_rank=0.5,
                             max_workers=3), progress=lines.append)
    try:
        pids = our_processes(cluster.statuses())
        with Registry(cluster.redis_url, cluster=spec.name) as registry:
            registry.set_scale_target(ScaleTarget("add", "decode", "", 1, 2, reason="test",
                                                  written_at=time.time()).to_json())

        def adding() -> bool:
            cluster.wait(0.2)
            return any(a["name"].endswith("-decode-1") for a in
                       ray_head.util.list_named_actors(all_namespaces=True)
                       if a["namespace"] == NAMESPACE)

        wait_until(adding, 30.0, "the step to start decode-1's actor")
        assert cluster.scaler is not None and cluster.scaler.busy
        assert [m.name for m in cluster.workers] == ["prefill-0", "decode-0"]
    finally:
        cluster.stop()
    assert lines[-1] == "all processes stopped", lines
    assert any(line.startswith("scale: adding decode-1") for line in lines), lines
    # the stop stopped it while it started (not the step, once it was ready)
    assert any(line.startswith("scale: decode-1 not added") for line in lines), lines
    assert not any(line.startswith("decode-1 ready") for line in lines), lines
    assert_nothing_left(ray_head, pids, tmp_path / "logs")
