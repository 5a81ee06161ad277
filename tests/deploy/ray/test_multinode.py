"""``pdserve up --ray`` on a Ray cluster of several nodes on this one machine (Ray's own
``cluster_utils``: one raylet per node, each on its own loopback address, 127.0.0.x, with
resources of its own): the head (127.0.0.1) has the CPUs for the router and no
``pdserve_gpu``, three worker nodes have two ``pdserve_gpu`` each and no CPU.

One test walks a cluster's life: each worker's placement group holds its whole TP group
on one node and the worker advertises that node; killing the raylet of a worker's node
brings the worker back on another node (Ray reschedules its placement group and restarts
its actor) while a steady load is served with no failure; a node that joins is where a
scale step's new TP-2 worker goes, the only node with room for it; stopping leaves no
actor, placement group or process.
"""

from __future__ import annotations

import os
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from deploy.spec import ClusterSpec
from tests.deploy.ray.raytools import (
    GPU,
    NEEDS_RAY,
    Load,
    assert_nothing_left,
    complete_all,
    greedy,
    our_processes,
)
from tests.factories import PROMPTS
from tests.processes import wait_until

pytestmark = [pytest.mark.timeout(300), NEEDS_RAY]

LOOPBACK_ENV = {"RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0"}  # Ray keeps 127.0.0.x as given
WORKER_NODES = ("127.0.0.2", "127.0.0.3", "127.0.0.4")
JOINING_NODE = "127.0.0.5"


@pytest.fixture(scope="module")
def nodes() -> Iterator[Any]:
    """The head and three worker nodes (see the module doc); this process drives them."""
    from tests.processes import children

    before = set(children(os.getpid()))
    with pytest.MonkeyPatch.context() as patch:
        for key, value in LOOPBACK_ENV.items():
            patch.setenv(key, value)
        import ray
        from ray.cluster_utils import Cluster

        cluster = Cluster(initialize_head=True, head_node_args={
            "num_cpus": 3, "resources": {GPU: 0}, "node_ip_address": "127.0.0.1",
            "include_dashboard": False})
        try:
            for ip in WORKER_NODES:
                cluster.add_node(num_cpus=0, resources={GPU: 2}, node_ip_address=ip)
            ray.init(address=cluster.address, log_to_driver=False, logging_level="WARNING")
            assert ray.get_runtime_context().get_node_id() == cluster.head_node.node_id
            yield cluster
        finally:
            ray.shutdown()
            cluster.shutdown()
    wait_until(lambda: not set(children(os.getpid())) - before, 30.0,
               "the nodes' processes to exit")


@pytest.fixture(scope="module")
def llm(llama_dir: Path) -> Iterator[Any]:
    from engine import LLM

    with LLM(llama_dir) as engine:
        yield engine


def _node_ips() -> dict[str, str]:
    import ray

    return {n["NodeID"]: n["NodeManagerAddress"] for n in ray.nodes() if n["Alive"]}


def _placed_on(cluster: Any, name: str) -> str:
    """The IP of the node worker ``name``'s placement group is placed on (its one bundle:
    the whole TP group)."""
    from ray.util.placement_group import placement_group_table

    group = cluster.placement_groups[[m.name for m in cluster.workers].index(name)]
    table = placement_group_table(group)
    assert table["strategy"] == "STRICT_PACK" and len(table["bundles"]) == 1
    return _node_ips()[table["bundles_to_node_id"][0]]


def _registered(cluster: Any) -> dict[str, str]:
    """Worker id → the host it registered (its node's address)."""
    from cluster.registry import Registry

    with Registry(cluster.redis_url, cluster=cluster.spec.name) as registry:
        return {r.worker_id: r.grpc_address.rpartition(":")[0]
                for r in registry.list_workers()}


def _generated(cluster: Any, worker_id: str) -> float:
    """Tokens ``worker_id`` generated, from its ``/metrics``."""
    from cluster.registry import Registry
    from tests.e2e.cluster import scrape_metrics

    with Registry(cluster.redis_url, cluster=cluster.spec.name) as registry:
        [record] = [r for r in registry.list_workers() if r.worker_id == worker_id]
    return sum(v for k, v in scrape_metrics(record.metrics_address).items()
               if k.startswith("vllm:generation_tokens_total"))


def _wait_for(cluster: Any, lines: list[str], condition: Any, what: str,
              timeout_s: float = 90.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():  # the launcher's wait loop follows restarts, applies steps
        assert time.monotonic() < deadline, f"{what}: {lines[-6:]}"
        cluster.wait(0.5)


def test_workers_keep_their_tp_group_on_one_node_outlive_a_node_and_scale_onto_one_that_joins(
        nodes: Any, llama_dir: Path, tmp_path: Path, llm: Any) -> None:
    from cluster.registry import Registry
    from cluster.scale import ScaleTarget
    from deploy.ray.launcher import launch
    from deploy.ray.plan import RaySpec

    spec = ClusterSpec(model_dir=llama_dir, num_prefill=1, num_decode=1, decode_tp=2, port=0,
                       http_port=None, stop_grace_s=5.0, num_kv_blocks=32, log_dir=tmp_path,
                       start_timeout_s=120, local_prefill="fallback")
    lines: list[str] = []
    cluster = launch(RaySpec(cluster=spec, gpu_resource=GPU, cpus_per_rank=0, max_restarts=2,
                             max_workers=3), progress=lines.append)
    joined = None
    try:
        # each TP group on one node, and each worker registered that node's address
        placed = {name: _placed_on(cluster, name) for name in ("prefill-0", "decode-0")}
        assert set(placed.values()) <= set(WORKER_NODES) and len(set(placed.values())) == 2
        assert _registered(cluster) == placed
        assert {n: s.node_ip for n, s in cluster.statuses().items() if n in placed} == placed
        prompts = [f"node {i} " + PROMPTS[i % len(PROMPTS)] for i in range(4)]
        expected = greedy(prompts, llm)
        with Load(cluster.router_address) as load:
            wait_until(lambda: len(load.done) >= 4, 60, "the load to be served")
            victim = next(n for n in nodes.worker_nodes if n.node_ip_address ==
                          placed["prefill-0"])
            nodes.remove_node(victim)  # its raylet and every process on it die
            _wait_for(cluster, lines, lambda: any(
                line.startswith("prefill-0 ready at") and line.endswith("(restart 1)")
                for line in lines), "prefill-0 to come back on another node")
            served = len(load.done)
            wait_until(lambda: len(load.done) >= served + 6, 60, "requests after the restart")
        assert not load.failures, load.failures[:3]
        moved_to = _placed_on(cluster, "prefill-0")
        assert moved_to not in (placed["prefill-0"], placed["decode-0"])
        wait_until(lambda: _registered(cluster).get("prefill-0") == moved_to, 20,
                   "prefill-0 to register its new node")
        sample = sorted(load.done)[::max(1, len(load.done) // 6)]
        assert [load.done[p] for p in sample] == greedy(sample, llm)
        # a node joins; the next TP-2 worker can only go there (the others have 0 and 1 free)
        joined = nodes.add_node(num_cpus=0, resources={GPU: 2}, node_ip_address=JOINING_NODE)
        with Registry(cluster.redis_url, cluster=spec.name) as registry:
            registry.set_scale_target(ScaleTarget(
                "add", "decode", "", 1, 2, "a node joined", written_at=time.time()).to_json())
        _wait_for(cluster, lines, lambda: len(cluster.workers) == 3, "decode-1 to be added")
        assert _placed_on(cluster, "decode-1") == JOINING_NODE
        assert _registered(cluster)["decode-1"] == JOINING_NODE
        assert complete_all(cluster.router_address, prompts) == expected
        more = [f"joined {i} " + PROMPTS[i % len(PROMPTS)] for i in range(8)]
        assert complete_all(cluster.router_address, more) == greedy(more, llm)

        def decoded_on_the_new_worker() -> bool:
            """Whether decode-1 decoded some: its counters are refreshed as its loop goes
            idle, and the router may not have seen it serving when the requests went out
            (then they all went to decode-0: send them again)."""
            if _generated(cluster, "decode-1") > 0:
                return True
            time.sleep(0.2)
            if _generated(cluster, "decode-1") == 0:
                complete_all(cluster.router_address, more)
            return False

        wait_until(decoded_on_the_new_worker, 60, "the new worker to decode some requests")
        pids = our_processes(cluster.statuses())
    finally:
        cluster.stop()
        if joined is not None:  # its raylet is this test's child: it goes with the test
            nodes.remove_node(joined)
    assert lines[-1] == "all processes stopped"
    import ray

    assert_nothing_left(ray, pids, tmp_path)
