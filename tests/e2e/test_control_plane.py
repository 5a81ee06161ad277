"""The control plane through real processes: Redis, one prefill worker, two decode workers
and the router on loopback (RELIABILITY rows 8, 18, 20, 21, 23, 36; issue 11 defects 2, 6, 7, 8).

- every listening socket of every process (ranks included) is on 127.0.0.1 (row 36);
- a deadline is observed on the prefill worker itself, not only by the client (row 18);
- a worker whose engine loop is held stays registered (its heartbeat does not wait on it);
- after Redis loses its data, a worker of another model that claims the fingerprint
  first cannot hijack the cluster: the router re-asserts the one it pinned (row 8);
- Redis down for many TTLs: routing goes on; a worker started meanwhile waits and joins
  once Redis is back (row 20);
- a decode worker hung (SIGSTOP) during Reserve: the request is retried on the other one;
  the hung worker leaves routing and comes back after SIGCONT (row 21, defect 2);
- the router and a prefill worker drain on SIGTERM: what they hold finishes, new calls
  are refused (the router's) or go elsewhere (the worker's), both exit 0 (row 23).

Every test ends with the leak check on every live worker (``Cluster.assert_no_leaks``).
"""

from __future__ import annotations

import dataclasses
import re
import signal
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import grpc
import pytest
import redis

from cluster.pause_points import PauseDir
from cluster.records import WorkerRecord, layout_to_json
from cluster.registry import Registry, RegistryError
from pdserve.client import Client, PdserveError
from tests.e2e.cluster import Cluster
from tests.processes import Proc, children, listening, wait_until

pytestmark = pytest.mark.timeout(300)

TIMEOUT_S = 60.0
TTL_S = 3.0  # tests.e2e.cluster.WORKER_FLAGS' --registration-ttl


CLUSTER = {"num_prefill": 1, "num_decode": 2, "decode_tp": 1}


def _router_log(cluster: Cluster) -> str:
    """The router's whole log (offsets into it stay valid as it grows)."""
    assert cluster.router is not None
    return cluster.router.log_path.read_text(errors="replace")


# ------------------------------------------------------------------------ row 36

def test_every_listening_socket_is_on_loopback(cluster: Cluster, client: Client) -> None:
    # a request first, so the KV channels (gloo pairs) between the workers exist
    assert client.complete("bind where told " * 4, max_tokens=3, timeout=TIMEOUT_S).usage
    assert cluster.router is not None
    procs: list[Proc] = [cluster.router, *cluster.workers()]
    seen: dict[str, list[str]] = {}
    for proc in procs:
        for pid in [proc.proc.pid, *children(proc.proc.pid)]:
            seen[f"{proc.name}/{pid}"] = listening(pid)
    assert all(seen[f"{p.name}/{p.proc.pid}"] for p in procs), seen  # each one listens
    bound = [a for addresses in seen.values() for a in addresses]
    assert all(a.startswith("127.0.0.1:") for a in bound), seen
    for proc in procs:  # the addresses they advertise are among them
        assert proc.address in seen[f"{proc.name}/{proc.proc.pid}"], (proc.name, seen)
    for proc in cluster.decode:
        assert proc.ready["kv_address"] in bound, seen


# ------------------------------------------------------------------------ row 18

def test_a_deadline_is_observed_on_the_prefill_worker(cluster: Cluster, client: Client) -> None:
    # A request queued on the prefill worker behind another, past its deadline there, is
    # dropped by the worker itself at its next step (its expired counter moves), not
    # only failed by the client's timer and cancelled by the router afterwards.
    pause = PauseDir(cluster.pause_dir(0))
    prefill = cluster.prefill[0]
    expired_before = cluster.info(prefill).num_expired_requests
    long_prompt = [5 + (11 * i) % 600 for i in range(600)]  # 19 chunks of prefill
    # 1. the prefill loop is held before a step while it holds the long request
    pause.arm("prefill.before_step", held=1)
    with ThreadPoolExecutor(2) as pool:
        first = pool.submit(client.complete, prompt_token_ids=long_prompt, max_tokens=2,
                            ignore_eos=True, timeout=TIMEOUT_S)
        pause.wait_paused("prefill.before_step", TIMEOUT_S)
        # 2. a short-deadline request arrives behind it; the loop pauses again once it
        #    holds both (before any of the second's prompt is computed)
        short = pool.submit(client.complete, "too late " * 6, max_tokens=2, timeout=3.0,
                            request_id="too-late")
        wait_until(lambda: any("request_id=too-late" in line and "blocks reserved" in line
                               for line in _router_log(cluster).splitlines()), TIMEOUT_S,
                   "the router to reserve for it (its Prefill call follows at once)")
        time.sleep(0.2)  # the Prefill call reaches the paused worker's command queue
        pause.arm("prefill.before_step", held=2)
        pause.release("prefill.before_step")
        wait_until(lambda: (pause.wait_paused("prefill.before_step", TIMEOUT_S)
                            .get("held") == 2), TIMEOUT_S, "the loop to hold both",
                   ignore=(TimeoutError,))
        # 3. the client's deadline passes; only then does the worker step again
        with pytest.raises(PdserveError) as excinfo:
            short.result(TIMEOUT_S)
        assert excinfo.value.code == grpc.StatusCode.DEADLINE_EXCEEDED
        time.sleep(0.5)  # the worker's copy of the deadline may trail the client's a little
        pause.release("prefill.before_step")
        assert first.result(TIMEOUT_S).finish_reason == "length"
    # 4. the worker dropped it at its deadline by itself
    wait_until(lambda: cluster.info(prefill).num_expired_requests == expired_before + 1,
               30.0, "the prefill worker to count the expired request")


def test_a_worker_whose_engine_loop_is_held_stays_registered(
        cluster: Cluster, client: Client) -> None:
    # Its heartbeat no longer waits on a busy engine loop for its figures (it sends the
    # last ones), so a long step does not make its registration lapse (defect 8's cause)
    pause = PauseDir(cluster.pause_dir(0))
    pause.arm("prefill.before_step", held=1)
    with ThreadPoolExecutor(1) as pool, Registry(cluster.redis.url) as registry:
        future = pool.submit(client.complete, "held for a while " * 3, max_tokens=2,
                             ignore_eos=True, timeout=TIMEOUT_S)
        pause.wait_paused("prefill.before_step", TIMEOUT_S)
        try:
            deadline = time.monotonic() + 2 * TTL_S
            while time.monotonic() < deadline:
                assert "prefill-0" in {r.worker_id for r in registry.list_workers()}
                time.sleep(0.2)
        finally:
            pause.release("prefill.before_step")
        assert future.result(TIMEOUT_S).finish_reason == "length"


# ------------------------------------------------------------------------ row 8 (defect 6)

def test_another_model_cannot_hijack_the_fingerprint_after_redis_lost_its_data(
        cluster: Cluster, client: Client) -> None:
    with Registry(cluster.redis.url) as registry, \
            redis.Redis.from_url(cluster.redis.url) as raw:
        ours = registry.cluster_layout()
        assert ours is not None
        foreign = dataclasses.replace(ours, model_fingerprint="another-model")
        impostor = WorkerRecord(
            worker_id="decode-impostor", role="decode", grpc_address="127.0.0.1:9",
            kv_address="127.0.0.1:9", tensor_parallel_size=1, layout=foreign,
            free_kv_blocks=64, total_kv_blocks=64, num_running=0, num_waiting=0,
            started_at=time.time())
        # 1. Redis loses everything and, before any good worker beats again, a worker of
        #    another model registers: it claims the cluster fingerprint (one transaction)
        with raw.pipeline(transaction=True) as tx:
            tx.flushall()
            tx.set(registry.keys.fingerprint, layout_to_json(foreign))
            tx.set(registry.keys.worker(impostor.worker_id), impostor.to_json(), px=60_000)
            tx.execute()
        # 2. the router re-asserts the fingerprint it pinned; the good workers register
        #    again and stay (a transient mismatch is not a reason to leave)
        wait_until(lambda: registry.cluster_layout() == ours, 10.0,
                   "the router to re-assert the fingerprint", ignore=(RegistryError,))
        good = {w.name for w in cluster.workers()}
        wait_until(lambda: {r.worker_id for r in registry.list_workers()} == good, 10.0,
                   "every good worker listed again", ignore=(RegistryError,))
        deadline = time.monotonic() + 2 * TTL_S  # past the workers' mismatch grace
        while time.monotonic() < deadline:
            assert client.complete("after the hijack", max_tokens=2, timeout=TIMEOUT_S).usage
        assert all(w.proc.poll() is None for w in cluster.workers())
        assert registry.cluster_layout() == ours
        assert {r.worker_id for r in registry.list_workers()} == good  # impostor ignored
        assert "re-asserted the cluster fingerprint" in _router_log(cluster)
        assert "model_fingerprint" in _router_log(cluster).rpartition("re-asserted")[2]
        raw.delete(registry.keys.worker(impostor.worker_id))


# ------------------------------------------------------------------------ row 20 (defect 7)

def test_redis_down_for_many_ttls_routing_continues_and_a_new_worker_joins_after(
        cluster: Cluster, client: Client) -> None:
    errors: list[BaseException] = []
    done = threading.Event()
    completed = [0]

    def traffic() -> None:
        while not done.is_set():
            try:
                client.complete("while redis is down", max_tokens=2, timeout=TIMEOUT_S)
                completed[0] += 1
            except BaseException as exc:  # collected and asserted below
                errors.append(exc)

    # 1. Redis goes down; a new prefill worker is started while it is down
    cluster.redis.stop()
    down_at = time.monotonic()
    late = cluster.start_worker("prefill", 1)
    thread = threading.Thread(target=traffic, daemon=True)
    thread.start()
    try:
        # 2. it waits to join, saying so, instead of exiting with a traceback
        wait_until(lambda: "waiting for Redis" in late.log_tail(), 120.0,
                   "the new worker to wait for Redis")
        assert late.proc.poll() is None, late.log_tail()
        assert "Traceback" not in late.log_tail()
        # 3. routing goes on for many TTLs (the router's last-known-good view)
        wait_until(lambda: time.monotonic() - down_at > 4 * TTL_S, 60.0, "four TTLs")
        before = completed[0]
        wait_until(lambda: completed[0] > before, TIMEOUT_S, "a request after four TTLs")
    finally:
        cluster.redis.restart()
        done.set()
        thread.join(TIMEOUT_S)
    assert not errors, errors
    # 4. Redis is back: the new worker joins and the router routes to it
    late.wait_ready()
    wait_until(lambda: "worker prefill-1 is serving" in _router_log(cluster), 30.0,
               "the router to route to the new worker")
    assert "joined the cluster after waiting" in late.log_tail()
    assert client.complete("after redis came back", max_tokens=2, timeout=TIMEOUT_S).usage


# ------------------------------------------------------------------------ row 21 (defect 2)

def test_a_decode_worker_hung_during_reserve_is_retried_elsewhere_and_rejoins(
        cluster: Cluster, client: Client) -> None:
    victim = cluster.decode[1]
    log_before = len(_router_log(cluster))

    def ask(i: int) -> tuple[int, float]:
        start = time.monotonic()
        result = client.complete(f"hung decode {i} " * 3, max_tokens=3, temperature=0,
                                 ignore_eos=True, timeout=TIMEOUT_S)
        return len(result.token_ids), time.monotonic() - start

    # 1. SIGSTOP, and requests at once: the router still thinks it healthy, so some
    #    Reserve calls go there and hang; each is retried on the other decode worker
    victim.proc.send_signal(signal.SIGSTOP)
    try:
        with ThreadPoolExecutor(6) as pool:
            results = list(pool.map(ask, range(6)))
        assert [n for n, _ in results] == [3] * 6, results
        assert max(s for _, s in results) < TIMEOUT_S / 2, results  # never held to the deadline
        # a Reserve waiting there was taken back once decode-1 missed its health checks
        # (before its own cap, reserve_timeout_s) and retried on decode-0
        log = _router_log(cluster)[log_before:]
        taken_back = re.search(r"worker decode-1 missed \d+ health checks: taking back its "
                               r"([1-9]\d*) calls", log)
        assert taken_back, log[-3000:]
        # 2. it is out of routing: health checks time out (its record expires after the TTL)
        wait_until(lambda: "worker decode-1 is not serving" in _router_log(cluster)[log_before:],
                   30.0, "the router to take decode-1 out")
        for i in range(3):
            assert client.complete(f"meanwhile {i}", max_tokens=2, timeout=TIMEOUT_S).usage
    finally:
        victim.proc.send_signal(signal.SIGCONT)
    # 3. SIGCONT: it serves again and the router routes to it again
    wait_until(lambda: "worker decode-1 is serving" in
               _router_log(cluster)[log_before:].rpartition("is not serving")[2], 30.0,
               "the router to route to decode-1 again")


# ------------------------------------------------------------------------ row 23 (last)

def _prompt_to(worker_id: str, workers: tuple[str, ...], num_tokens: int) -> list[int]:
    """A prompt whose prefill affinity (all ``workers`` idle) is ``worker_id``."""
    from engine.kvcache.block_hash import compute_block_hashes
    from router.routing import affinity_key, rendezvous_order

    for salt in range(300):
        prompt = [5 + (17 * i + salt) % 600 for i in range(num_tokens)]
        key = affinity_key(compute_block_hashes(prompt, 16), prompt)
        if rendezvous_order(key, list(workers))[0] == worker_id:
            return prompt
    raise AssertionError("no prompt routes there")


def test_router_and_prefill_worker_drain_on_sigterm(cluster: Cluster, client: Client,
                                                    tmp_path: Path) -> None:
    from cluster.pause_points import ENV as PAUSE_ENV
    from tests.processes import spawn

    # 1. the router: a stream in flight finishes; new calls are refused; it exits 0. The
    # stream is held in the router's queue until the refusal is seen (else, on a fast
    # machine, it may end, and the router exit, before the second call is sent).
    router_pause = PauseDir(tmp_path / "pause-router")
    router_pause.arm("router.queued", request_id="held-by-drain")
    router = spawn("router-drain", ["router", "--model", str(cluster.model_dir), "--port", "0",
                                    "--redis-url", cluster.redis.url, "--grace", "20"],
                   tmp_path, env=router_pause.env()).wait_ready()
    try:
        with Client(router.address) as draining, ThreadPoolExecutor(1) as pool:
            held = pool.submit(draining.complete, "drain the router " * 3, max_tokens=120,
                               ignore_eos=True, timeout=TIMEOUT_S, request_id="held-by-drain")
            router_pause.wait_paused("router.queued", TIMEOUT_S)
            router.proc.send_signal(signal.SIGTERM)
            wait_until(lambda: "stopping:" in router.log_tail(), 30.0, "the router to drain")
            with pytest.raises(PdserveError) as excinfo:
                draining.complete("too late for this router", max_tokens=2, timeout=10.0)
            assert excinfo.value.code == grpc.StatusCode.UNAVAILABLE, excinfo.value
            assert "shutting down" in excinfo.value.details, excinfo.value
            router_pause.release("router.queued")
            result = held.result(TIMEOUT_S)
            assert (len(result.token_ids), result.finish_reason) == (120, "length")
        assert router.proc.wait(30) == 0, router.log_tail()
    finally:
        router.stop()
    # 2. a prefill worker: the Prefill it holds finishes; new calls go elsewhere; exit 0
    pause_dir = tmp_path / "pause-drain"
    pause = PauseDir(pause_dir)
    worker = cluster.start_worker("prefill", 2, "--grace", "20",
                                  env={PAUSE_ENV: str(pause_dir)}).wait_ready()
    router_log = _router_log(cluster)
    wait_until(lambda: "worker prefill-2 is serving" in _router_log(cluster), 30.0,
               "the router to route to prefill-2")
    names = tuple(sorted(p.name for p in cluster.prefill if p.proc.poll() is None))
    pause.arm("prefill.before_step", held=1)
    with ThreadPoolExecutor(2) as pool:
        held = pool.submit(client.complete, prompt_token_ids=_prompt_to("prefill-2", names, 40),
                           max_tokens=3, ignore_eos=True, timeout=TIMEOUT_S)
        pause.wait_paused("prefill.before_step", TIMEOUT_S)
        worker.proc.send_signal(signal.SIGTERM)
        wait_until(lambda: "worker prefill-2 is not serving" in
                   _router_log(cluster)[len(router_log):], 30.0, "the router to see it drain")
        with pytest.raises(grpc.RpcError) as refused:  # its server takes no new call
            cluster.info(worker)
        assert refused.value.code() == grpc.StatusCode.UNAVAILABLE  # type: ignore[attr-defined]
        for i in range(3):  # new requests, even those whose affinity is prefill-2
            assert client.complete(prompt_token_ids=_prompt_to("prefill-2", names, 40 + i),
                                   max_tokens=2, timeout=TIMEOUT_S).usage
        pause.release("prefill.before_step")
        result = held.result(TIMEOUT_S)
    assert (len(result.token_ids), result.finish_reason) == (3, "length")
    assert worker.proc.wait(30) == 0, worker.log_tail()
    cluster.prefill.remove(worker)
