"""A router-owned lease per attempt, through real processes: Redis, a prefill and a
decode worker and routers whose leases live ``LEASE_TTL_S``. Each test ends with the
whole cluster's leak check (workers, live routers' holdings, Redis: no lease left).

- RELIABILITY row 24: a router SIGKILLed between Reserve and Prefill, or hung (SIGSTOP)
  mid-stream, leaves attempts only its lease speaks for: the workers free them within the
  lease TTL (their reservation could have waited a minute, the transfer timeout is 10 s);
  a router SIGKILLed mid-stream: the client gets UNAVAILABLE, the workers free.
- Redis restarted (data lost) or hung for several TTLs while attempts live: nothing is
  freed, every stream finishes in full (the router re-writes its leases; workers act on
  a missing lease only while Redis answers, after a full TTL).
- Two routers on one cluster never touch each other's attempts, even under one client
  request id: a cancel, or a router's death, on one leaves the other's stream whole.
"""

from __future__ import annotations

import os
import signal
import time
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

import grpc
import pytest
import redis

from cluster.internal.v1 import worker_pb2 as wpb
from cluster.pause_points import PauseDir
from pdserve.client import Client, PdserveError
from tests.e2e.cluster import Cluster
from tests.leaks import router_holdings
from tests.processes import wait_until

pytestmark = pytest.mark.timeout(400)

LEASE_TTL_S = 1.5
TIMEOUT_S = 60.0  # each request's deadline: what a reservation could wait without a lease
FREED_WITHIN_S = 3 * LEASE_TTL_S + 3.0  # the TTL, a renewal, a check period, and a 2-core margin


CLUSTER = {
    "num_prefill": 1,
    "num_decode": 1,
    "decode_tp": 1,
    "lease_ttl_s": LEASE_TTL_S,
    "decode_kv_blocks": 256,
}  # room for two long streams


IDLE_TIMEOUT_S = 20.0  # the leak check's (tests.e2e.conftest): leases take a TTL to lapse


@pytest.fixture
def idle(cluster: Cluster) -> Cluster:
    """The cluster, with its router running (a test before may have killed it)."""
    return cluster.with_router()


def _decode_info(c: Cluster) -> wpb.WorkerInfo:
    return c.info(c.decode[0])


def _prefill_info(c: Cluster) -> wpb.WorkerInfo:
    return c.info(c.prefill[0])


def _holds(info: wpb.WorkerInfo) -> bool:
    return bool(info.attempt_ids) or info.kv.in_use_blocks > 0 or info.kv.pinned_blocks > 0


def _stream_async(pool: ThreadPoolExecutor, address: str, text: str, max_tokens: int,
                  request_id: str, **kw: Any) -> Future[list[int]]:
    """A whole stream read in a thread: its tokens (or the PdserveError it raised; the
    client does not resume a broken stream, so the router's own failure shows)."""
    def run() -> list[int]:
        with Client(address, max_resumes=0) as client:
            tokens: list[int] = []
            for chunk in client.generate(text, max_tokens=max_tokens, ignore_eos=True,
                                         request_id=request_id, timeout=TIMEOUT_S, **kw):
                tokens += chunk.token_ids
            return tokens

    return pool.submit(run)


def _until_streaming(c: Cluster) -> None:
    wait_until(lambda: _decode_info(c).running_requests >= 1, 30.0, "a stream to run")


# ------------------------------------------------------------------------ row 24

def test_router_killed_between_reserve_and_prefill_frees_decode_within_the_ttl(
        idle: Cluster) -> None:
    c = idle
    # a router of its own whose Prefills wait for the Reserve's reply (kv-aware routing
    # may send the Prefill with the Reserve: then the prefill worker, its call cut by the
    # router's death, fails the transfer and the decode worker frees the blocks for that)
    router = c.start_router("--prefill-routing", "affinity", name="router-classic")
    with Client(router.address) as client:  # it sees the workers
        client.complete("warm", max_tokens=2, timeout=TIMEOUT_S)
    pause = PauseDir(c.pause_dir("router-classic"))
    aborted = _decode_info(c).num_lease_aborts
    # 1. the router holds a reservation (lease written), before its Prefill call
    pause.arm("router.before_prefill", request_id="orphan")
    with ThreadPoolExecutor(1) as pool:
        result = _stream_async(pool, router.address, "orphaned " * 5, 8, "orphan")
        pause.wait_paused("router.before_prefill", 30.0)
        assert _holds(_decode_info(c)) and not _prefill_info(c).attempt_ids
        # 2. the router dies: only the lease's absence speaks for the reservation
        os.kill(router.proc.pid, signal.SIGKILL)
        killed_at = time.monotonic()
        took = wait_until(lambda: not _holds(_decode_info(c)), 30.0,
                          "the decode worker to free the orphaned reservation")
        with pytest.raises(PdserveError) as excinfo:
            result.result(timeout=TIMEOUT_S)
    assert excinfo.value.code == grpc.StatusCode.UNAVAILABLE
    assert took < FREED_WITHIN_S, f"freed {time.monotonic() - killed_at:.1f}s after the kill"
    assert _decode_info(c).num_lease_aborts == aborted + 1  # the lease, not a timeout
    router.proc.wait(10)
    pause.disarm("router.before_prefill")


def test_router_hung_mid_stream_frees_its_attempt_within_the_ttl(idle: Cluster) -> None:
    # SIGSTOP: the router's connections stay open, so only its lease (no longer renewed)
    # tells the workers it is gone. The decode loop is held at the stream's 20th token
    # meanwhile: unheld, the tiny model could finish all 1500 tokens within the TTL, and the
    # stream would end normally before the lease had lapsed
    c = idle
    assert c.router is not None
    decode = c.decode[0]
    pause = PauseDir(c.pause_dir(decode.name))
    aborted = _decode_info(c).num_lease_aborts
    gone = "is gone (its router died or lost it)"
    seen = decode.log_path.read_text(errors="replace").count(gone)
    pause.arm("decode.token", n=20)
    with ThreadPoolExecutor(1) as pool:
        result = _stream_async(pool, c.address, "hung router " * 3, 1500, "hung")
        try:
            pause.wait_paused("decode.token", 30.0)
            c.router.proc.send_signal(signal.SIGSTOP)
            took = wait_until(lambda: decode.log_path.read_text(errors="replace").count(gone)
                              > seen, 30.0, "the decode worker to see the hung router's lease gone")
        finally:
            pause.disarm("decode.token")
            pause.release("decode.token")
        try:  # the abort the watcher queued runs before the next step
            wait_until(lambda: not _holds(_decode_info(c)), 30.0,
                       "the decode worker to free the hung router's stream")
        finally:
            c.router.proc.send_signal(signal.SIGCONT)
        with pytest.raises(PdserveError) as excinfo:
            result.result(timeout=TIMEOUT_S)
    assert took < FREED_WITHIN_S
    assert _decode_info(c).num_lease_aborts == aborted + 1
    assert excinfo.value.code == grpc.StatusCode.UNAVAILABLE  # after some tokens, never silent


def test_router_killed_mid_stream_workers_notice_and_free(idle: Cluster) -> None:
    c = idle
    assert c.router is not None
    with ThreadPoolExecutor(1) as pool:
        result = _stream_async(pool, c.address, "killed router " * 3, 1500, "killed")
        _until_streaming(c)
        os.kill(c.router.proc.pid, signal.SIGKILL)
        took = wait_until(lambda: not _holds(_decode_info(c)), 30.0,
                          "the decode worker to free the dead router's stream")
        with pytest.raises(PdserveError) as excinfo:
            result.result(timeout=TIMEOUT_S)
    assert excinfo.value.code == grpc.StatusCode.UNAVAILABLE
    assert took < FREED_WITHIN_S
    c.router.proc.wait(10)


# ------------------------------------------------------------------------ Redis

def test_redis_restart_and_outage_never_free_live_attempts(idle: Cluster) -> None:
    c = idle
    aborted = _decode_info(c).num_lease_aborts, _prefill_info(c).num_lease_aborts
    with ThreadPoolExecutor(2) as pool:
        results = [_stream_async(pool, c.address, f"through a Redis restart {k} " * 2, 900,
                                 f"redis-{k}") for k in range(2)]
        _until_streaming(c)
        # 1. Redis restarts empty: every lease is gone at once, written again by the router
        c.redis.restart()
        wait_until(lambda: len(_lease_keys(c)) == 2, 10.0, "the router to re-write its leases")
        time.sleep(2 * LEASE_TTL_S)
        # 2. Redis hangs for several TTLs (its keys expire meanwhile); then answers again
        assert c.redis.pid is not None
        os.kill(c.redis.pid, signal.SIGSTOP)
        try:
            time.sleep(3 * LEASE_TTL_S)
        finally:
            os.kill(c.redis.pid, signal.SIGCONT)
        time.sleep(2 * LEASE_TTL_S)
        for result in results:
            assert len(result.result(timeout=TIMEOUT_S)) == 900  # whole
    assert (_decode_info(c).num_lease_aborts, _prefill_info(c).num_lease_aborts) == aborted


def _lease_keys(c: Cluster) -> list[str]:
    with redis.Redis.from_url(c.redis.url, socket_timeout=2) as client:
        return [k.decode() for k in client.scan_iter(match="pdserve:default:lease:*")]


# ------------------------------------------------------------------------ two routers

def test_two_routers_never_touch_each_others_attempts(idle: Cluster) -> None:
    c = idle
    assert c.router is not None
    other = c.start_router(name="router-b")
    try:
        a_id = router_holdings(c.router.ready["debug_address"]).router_id
        b_id = router_holdings(other.ready["debug_address"]).router_id
        assert a_id != b_id
        with ThreadPoolExecutor(3) as pool:
            # 1. one client request id on both routers; B's attempts are B's alone
            on_b = _stream_async(pool, other.address, "router b " * 4, 1200, "shared")
            _until_streaming(c)
            held_b = router_holdings(other.ready["debug_address"])
            assert held_b.attempt_ids and all(a.startswith(f"{b_id}-")
                                              for a in held_b.attempt_ids)
            # 2. A's request under the same id is cancelled: B's stream goes on
            with Client(c.address) as client:
                stream = client.generate("router a " * 4, max_tokens=600, ignore_eos=True,
                                         request_id="shared", timeout=TIMEOUT_S)
                assert next(stream).token_ids
                stream.close()
            # 3. router A dies with a stream under the same id: freed; B's stream goes on
            on_a = _stream_async(pool, c.address, "router a again " * 2, 1500, "shared")
            wait_until(lambda: _decode_info(c).running_requests >= 2, 30.0, "both streams")
            os.kill(c.router.proc.pid, signal.SIGKILL)
            killed_at = time.monotonic()
            with pytest.raises(PdserveError):
                on_a.result(timeout=TIMEOUT_S)
            assert len(on_b.result(timeout=TIMEOUT_S)) == 1200  # whole
        c.router.proc.wait(10)
        # A's attempts go with its lease (B's stream may end first, inside A's TTL)
        wait_until(lambda: {a.split("-")[0] for a in _decode_info(c).attempt_ids} <= {b_id},
                   max(0.5, FREED_WITHIN_S - (time.monotonic() - killed_at)),
                   "the dead router's attempts to be freed within the lease bound")
    finally:
        c.routers.remove(other)
        wait_until(lambda: not router_holdings(other.ready["debug_address"]).attempt_ids,
                   20.0, "router b to hold nothing")
        assert other.stop() == 0, other.log_tail()
