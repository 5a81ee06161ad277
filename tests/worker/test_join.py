"""Joining the cluster through real worker processes (RELIABILITY row 8): a worker whose
layout differs from the cluster fingerprint in any one field — the protocol version
included — exits 3 naming that field, before it loads its model; a worker that finds a
lasting mismatch at a later heartbeat drains and exits 3 naming it too."""

from __future__ import annotations

import dataclasses
import time
from pathlib import Path

import pytest
import redis

from cluster.fingerprint import fingerprint_model_dir
from cluster.records import layout_to_json
from cluster.registry import Keys, Registry
from deploy.redis_server import RedisServer
from engine.config import CacheConfig, EngineConfig, load_model_config
from engine.kvcache.layout import PROTOCOL_VERSION, KVLayout
from tests.processes import START_TIMEOUT_S, STOP_TIMEOUT_S, Proc, wait_until
from tests.worker.procs import spawn_worker

pytestmark = pytest.mark.timeout(300)


def our_layout(model_dir: Path) -> KVLayout:
    """The layout a worker started with the tests' options has (float32, blocks of 16)."""
    config = EngineConfig(model=load_model_config(model_dir, dtype="float32"),
                          cache=CacheConfig(block_size=16))
    return KVLayout.from_engine_config(config, fingerprint_model_dir(model_dir))


def changes(layout: KVLayout) -> dict[str, object]:
    """One different value for every field of the fingerprint."""
    return {"protocol_version": PROTOCOL_VERSION + 1, "model_fingerprint": "another-model",
            "dtype": "bfloat16", "block_size": 32, "hash_algorithm": "sha256",
            "hash_seed": layout.hash_seed + 1, "num_layers": layout.num_layers + 1,
            "num_kv_heads": layout.num_kv_heads * 2, "head_dim": layout.head_dim * 2,
            "kv_cache_dtype": "int8", "kv_transfer_dtype": "int8"}


# the protocol version, the model, one only a flag could change, the KV cache's dtype
# (workers holding int8 and fp32 KV are refused, never converted) and the transfer's
QUICK_FIELDS = ("protocol_version", "model_fingerprint", "hash_seed", "kv_cache_dtype",
                "kv_transfer_dtype")


def test_a_differing_field_keeps_a_worker_out(llama_dir: Path, tmp_path: Path) -> None:
    # five fields here (QUICK_FIELDS); every field in the slow test below
    _assert_each_refused(llama_dir, tmp_path, QUICK_FIELDS)


@pytest.mark.slow
def test_each_differing_field_keeps_a_worker_out(llama_dir: Path, tmp_path: Path) -> None:
    names = {f.name for f in dataclasses.fields(KVLayout)}
    assert set(changes(our_layout(llama_dir))) == names  # none forgotten
    _assert_each_refused(llama_dir, tmp_path, tuple(sorted(names)))


def _assert_each_refused(llama_dir: Path, tmp_path: Path, names: tuple[str, ...]) -> None:
    ours = our_layout(llama_dir)
    fields = {name: changes(ours)[name] for name in names}
    workers: dict[str, Proc] = {}
    with RedisServer(start_timeout_s=10.0) as redis_server, \
            redis.Redis.from_url(redis_server.url) as raw:
        try:
            # 1. one cluster (Redis namespace) per field, whose fingerprint differs from
            #    the worker's in that field only; one worker started into each, all at once
            for name, value in fields.items():
                cluster = f"c-{name.replace('_', '-')}"
                theirs = dataclasses.replace(ours, **{name: value})
                assert ours.diff(theirs) is not None
                raw.set(Keys(cluster).fingerprint, layout_to_json(theirs))
                workers[name] = spawn_worker(
                    "prefill", llama_dir, tmp_path, "--redis-url", redis_server.url,
                    "--cluster", cluster, "--worker-id", f"p-{cluster}", name=cluster)
            # 2. each exits 3 naming its field, never became ready, never registered
            for name, worker in workers.items():
                assert worker.proc.wait(START_TIMEOUT_S) == 3, worker.log_tail()
                assert f"(differing field: {name})" in worker.log_tail(), worker.log_tail()
                assert not worker.ready_path.exists()
                with Registry(redis_server.url, cluster=worker.name) as registry:
                    assert registry.list_workers() == []
        finally:
            for worker in workers.values():
                worker.stop()


HEARTBEAT_S, TTL_S = 0.2, 1.0


def test_a_lasting_mismatch_at_a_later_heartbeat_makes_the_worker_exit(
        llama_dir: Path, tmp_path: Path) -> None:
    # Defect: the heartbeat failed forever (the worker stayed up, unregistered). Now,
    # when the mismatch lasts a TTL (no router re-asserts the fingerprint here), the
    # worker drains and exits 3 naming the field, and its record is gone.
    ours = our_layout(llama_dir)
    with RedisServer(start_timeout_s=10.0) as redis_server, \
            Registry(redis_server.url) as registry, \
            redis.Redis.from_url(redis_server.url) as raw:
        worker = spawn_worker("decode", llama_dir, tmp_path, "--redis-url", redis_server.url,
                              "--worker-id", "decode-m", "--heartbeat-interval",
                              str(HEARTBEAT_S), "--registration-ttl", str(TTL_S))
        try:
            worker.wait_ready()
            assert [r.worker_id for r in registry.list_workers()] == ["decode-m"]
            raw.set(registry.keys.fingerprint,
                    layout_to_json(dataclasses.replace(ours, hash_seed=ours.hash_seed + 1)))
            start = time.monotonic()
            assert worker.proc.wait(STOP_TIMEOUT_S) == 3, worker.log_tail()
            took = time.monotonic() - start
            assert "left the cluster" in worker.log_tail()
            assert "(differing field: hash_seed)" in worker.log_tail()
            assert took > TTL_S * 0.9, took  # it waited out the grace first
            assert raw.get(registry.keys.worker("decode-m")) is None
        finally:
            worker.stop()
        wait_until(lambda: not worker.child_pids or
                   all(not Path(f"/proc/{p}").exists() for p in worker.child_pids), 30.0,
                   "its rank processes to exit")
