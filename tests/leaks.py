"""The one leak check of a whole cluster (``assert_cluster_idle``): every process and Redis
back to baseline after a scenario.

- every live worker is idle (``tests.worker.procs.assert_idle``: blocks free or cached,
  nothing pinned, pending, running or waiting) and holds no attempt, watches no lease and
  has no engine-loop command queued;
- every live router holds nothing (its ``RouterDebug.Holdings``: no request in flight, no
  live attempt, no pending abort, no lease kept or left to write, no prompt in flight
  that requests could wait for);
- Redis holds exactly the cluster's fingerprint, its KV event stream and one record per
  live worker (and the marks that last: the token rule, the resume key, the planner's
  note): no lease, no record of a worker that is gone.

Each part is retried until ``timeout_s`` (freeing travels asynchronously: aborts, lease
expiry, a dead worker's record expiring); the failure names what is still held.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import grpc
import redis

from cluster.internal.v1 import worker_pb2 as pb
from cluster.internal.v1 import worker_pb2_grpc as pb_grpc
from tests.processes import wait_until
from tests.worker.procs import assert_idle

RPC_TIMEOUT_S = 30.0
IDLE_TIMEOUT_S = 15.0


def router_problem(holdings: pb.RouterHoldings) -> str | None:
    """What a router still holds (None: nothing)."""
    held = (holdings.inflight_requests, len(holdings.attempt_ids), holdings.pending_aborts,
            len(holdings.lease_keys), holdings.unwritten_leases, holdings.prompts_in_flight)
    return None if held == (0, 0, 0, 0, 0, 0) else (
        f"router {holdings.router_id} still holds (requests, attempts, pending aborts, "
        f"leases, unwritten leases, prompts in flight) = {held}: {holdings}")


def worker_problem(info: pb.WorkerInfo) -> str | None:
    """What an idle-looking worker still holds beyond blocks (None: nothing)."""
    held = (len(info.attempt_ids), info.watched_leases, info.queued_commands)
    return None if held == (0, 0, 0) else (
        f"worker {info.worker_id} still holds (attempts, watched leases, queued commands) = "
        f"{held}: {list(info.attempt_ids)}")


def redis_problem(client: redis.Redis, cluster: str, live_worker_ids: Sequence[str]) -> str | None:
    prefix = f"pdserve:{cluster}:"
    # the cluster's lasting marks (its fingerprint, that it requires a token, the routers'
    # resume key, the bounded KV event stream of every cluster in this Redis and the
    # planner's note of its last change, kept a day) may stay
    keys = {k.decode() for k in client.scan_iter(match="*", count=1000)
            if not k.endswith((b":resume_key", b":kv_events"))} - {
        f"{prefix}token_required", f"{prefix}lock:planner:note"}
    expected = {f"{prefix}fingerprint", *(f"{prefix}worker:{w}" for w in live_worker_ids)}
    if keys == expected:
        return None
    return f"Redis keys differ: extra {sorted(keys - expected)}, missing {sorted(expected - keys)}"


def assert_cluster_idle(workers: Sequence[Any], routers: Sequence[str], redis_url: str,
                        live_worker_ids: Sequence[str], *, cluster: str = "default",
                        timeout_s: float = IDLE_TIMEOUT_S) -> None:
    """The whole cluster is back to baseline within ``timeout_s`` (see module doc).
    ``workers``: stubs with ``Info`` of the live workers; ``routers``: the live routers'
    ``--debug-port`` addresses; ``live_worker_ids``: whose records Redis must hold."""
    assert_idle(*workers, timeout_s=timeout_s)
    for stub in workers:
        _retry(lambda stub=stub: worker_problem(stub.Info(pb.InfoRequest(),
                                                          timeout=RPC_TIMEOUT_S)), timeout_s)
    for address in routers:
        with grpc.insecure_channel(address) as channel:
            debug = pb_grpc.RouterDebugStub(channel)
            _retry(lambda debug=debug: router_problem(debug.Holdings(
                pb.InfoRequest(), timeout=RPC_TIMEOUT_S)), timeout_s)
    client = redis.Redis.from_url(redis_url, socket_timeout=5.0)
    try:
        _retry(lambda: redis_problem(client, cluster, live_worker_ids), timeout_s)
    finally:
        client.close()


def router_holdings(address: str) -> pb.RouterHoldings:
    """One router's ``Holdings`` (its ``--debug-port`` address)."""
    with grpc.insecure_channel(address) as channel:
        reply: pb.RouterHoldings = pb_grpc.RouterDebugStub(channel).Holdings(
            pb.InfoRequest(), timeout=RPC_TIMEOUT_S)
        return reply


def _retry(problem: Any, timeout_s: float) -> None:
    last: list[str | None] = [None]

    def clean() -> bool:
        last[0] = problem()
        return last[0] is None

    try:
        wait_until(clean, timeout_s, "the cluster to hold nothing", period_s=0.05)
    except AssertionError:
        raise AssertionError(last[0]) from None
