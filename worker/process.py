"""The engine side of a worker process, the same for both kinds: ``run_worker``.

Start-up order (gRPC and fork do not mix): with ``--redis-url``, check the cluster
fingerprint first (a worker that could never join exits 3 before it loads anything), build
the engine — it spawns the follower ranks, each with the KV rank plugin
(``worker.kv.rank``) — run one warm-up step through every rank, build and start the engine
loop (a receiving worker's starts its KV endpoint), and only then create the gRPC server
(``worker.server.serve_until_signal``). A ``WorkerKind`` names what differs.
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import grpc

from cluster.fingerprint import fingerprint_model_dir
from cluster.internal_tls import internal_tls
from cluster.records import WorkerLoad
from cluster.registry import ClusterTokenRequired, FingerprintMismatch, Registry, RegistryError
from cluster.token import ClusterToken, load_cluster_token
from engine.config import (
    CacheConfig,
    EngineConfig,
    ParallelConfig,
    SchedulerConfig,
    load_model_config,
    speculative_fields,
)
from engine.core.drafter import draft_model_config
from engine.core.engine_core import EngineCore
from engine.kvcache.events import KVEventLog
from engine.kvcache.layout import KVLayout
from engine.sampling_params import SamplingParams
from engine.text.tokenizer import load_tokenizer
from worker import options
from worker.commands import Info, WorkerError
from worker.kv.config import KVPlaneConfig
from worker.kv.rank import PLUGIN
from worker.kv_events import KVEventPublisher
from worker.loop import EngineLoop
from worker.metrics import WorkerMetrics
from worker.server import Endpoint, Identity, serve_until_signal

log = logging.getLogger(__name__)

LOAD_TIMEOUT_S = 1.0
"""How long a heartbeat waits for the engine loop's figures before it sends the last ones."""


FAULT_HOOK_ENV = "PDSERVE_TEST_KV_FAULT_HOOK"
"""Tests only: ``module:factory`` of a ``kvtransfer`` sender fault hook for every rank."""


@dataclass(frozen=True)
class WorkerKind:
    """What a worker kind adds to the shared process.

    - ``role``: "prefill" or "decode";
    - ``make_loop(core, args, metrics)``: its engine loop over the built engine (not
      started), recording into ``metrics``;
    - ``add_servicer(loop, identity, server)``: registers its gRPC service.
    """

    role: str
    make_loop: Callable[[EngineCore, argparse.Namespace, WorkerMetrics], EngineLoop]
    add_servicer: Callable[[EngineLoop, Identity, grpc.Server], None]


def kv_plane_config(args: argparse.Namespace, fingerprint: str,
                    token: ClusterToken | None = None) -> KVPlaneConfig:
    """Every rank's KV plane settings: rank 0's store (when it receives) binds ``--host``
    on ``--kv-port`` (0: any), the data plane advertises and binds ``--advertise-host``;
    with a cluster token, channels are authenticated with keys derived from it."""
    fault_hook = os.environ.get(FAULT_HOOK_ENV) or None
    if fault_hook is not None:
        log.warning("test-only KV fault hook %s is active (%s)", fault_hook, FAULT_HOOK_ENV)
    return KVPlaneConfig(fingerprint, timeout_s=args.transfer_timeout, bind_host=args.host,
                         store_port=getattr(args, "kv_port", 0),
                         advertise_host=options.advertise_host(args), fault_hook=fault_hook,
                         auth_keys=tuple(k.hex() for k in token.kv_keys()) if token else ())


def kv_address(loop: EngineLoop) -> str:
    """Where the worker receives KV (``host:port`` of rank 0's store), "" when it does not."""
    try:
        address = loop.kv.receiving.address
    except RuntimeError:
        return ""
    return f"{address.host}:{address.port}"


def engine_config(args: argparse.Namespace, rank_plugin: str = "",
                  plugin_config: str = "") -> EngineConfig:
    """The worker's engine configuration (reads the model's ``config.json`` only)."""
    return EngineConfig(
        model=load_model_config(args.model, dtype=options.dtype(args)), device=args.device,
        cache=CacheConfig(block_size=args.block_size, num_kv_blocks=args.num_kv_blocks,
                          enable_prefix_caching=args.enable_prefix_caching,
                          kv_cache_dtype=args.kv_cache_dtype,
                          kv_transfer_dtype=args.kv_transfer_dtype),
        parallel=ParallelConfig(tensor_parallel_size=args.tensor_parallel_size),
        scheduler=SchedulerConfig(max_num_seqs=args.max_num_seqs,
                                  max_num_batched_tokens=args.max_num_batched_tokens,
                                  **speculative_fields(args.speculative_config)),
        quantization=args.quantization, rank_plugin=rank_plugin,
        rank_plugin_config=plugin_config)


def build_engine(args: argparse.Namespace, fingerprint: str,
                 token: ClusterToken | None = None) -> EngineCore:
    """The worker's engine with the KV rank plugin on every rank; spawns the follower ranks
    (call before any gRPC object exists)."""
    plugin_config = kv_plane_config(args, fingerprint, token).to_json()
    return EngineCore(engine_config(args, PLUGIN, plugin_config), load_tokenizer(args.model))


def refusal(args: argparse.Namespace, layout: KVLayout, token: ClusterToken | None = None
            ) -> str | None:
    """Why this worker could never join its cluster, asked before anything is loaded:
    the cluster fingerprint differs from ``layout`` (the message names the field), or the
    cluster requires a token this worker lacks. ``None`` when neither, or when Redis does
    not answer now (registration, after readiness, checks the fingerprint again and waits
    for Redis)."""
    if not args.redis_url:
        return None
    try:
        with Registry(args.redis_url, cluster=args.cluster) as registry:
            registry.check_token(token is not None)
            cluster = registry.cluster_layout()
    except ClusterTokenRequired as exc:
        return str(exc)
    except RegistryError as exc:
        log.info("could not check the cluster before loading: %s", exc)
        return None
    diff = None if cluster is None else layout.diff(cluster)
    if diff is None:
        return None
    mismatch = FingerprintMismatch(args.cluster, diff)
    return f"{mismatch} (differing field: {mismatch.field})"


def warm_up(core: EngineCore) -> None:
    """One local request through every rank; its blocks end free or cached."""
    core.add_request("warm-up", [0], SamplingParams(max_tokens=1, temperature=0))
    while core.has_unfinished():
        core.step()


def run_worker(args: argparse.Namespace, kind: WorkerKind) -> int:
    """Run one worker of ``kind`` until SIGTERM/SIGINT (see ``serve_until_signal``);
    returns the exit code (2 for unusable options, before anything starts)."""
    try:
        options.advertise_host(args)
        token = load_cluster_token(args.cluster_token_file)
        tls = internal_tls(args)
        config = engine_config(args)  # e.g. a --speculative-config it cannot run
        if config.scheduler.speculative_method == "draft_model":
            draft_model_config(config)  # a draft it could never use: refused before loading
    except ValueError as exc:
        print(f"pdserve {kind.role}: {exc}", file=sys.stderr)
        return 2
    fingerprint = fingerprint_model_dir(args.model)
    layout = KVLayout.from_engine_config(config, fingerprint)
    if (refused := refusal(args, layout, token)) is not None:
        print(f"pdserve {kind.role}: not joining the cluster: {refused}", file=sys.stderr)
        return 3
    identity = Identity(args.worker_id or f"{kind.role}-{uuid.uuid4().hex[:12]}", kind.role,
                        args.tensor_parallel_size, fingerprint)
    metrics = WorkerMetrics(Path(args.model).resolve().name, kind.role, identity.worker_id)
    core = build_engine(args, fingerprint, token)
    try:
        warm_up(core)
        loop = kind.make_loop(core, args, metrics)
    except BaseException:
        core.shutdown()
        raise
    loop.role_listeners.append(metrics.set_role)
    loop.kv_events = kv_event_publisher(args, identity.worker_id, core)
    loop.start()

    last: list[WorkerLoad] = []

    def load() -> WorkerLoad:
        """The heartbeat's figures. While the loop is inside a long step, the last ones:
        a busy worker must not miss beats and drop out of the registry."""
        try:
            info = loop.call(Info(), LOAD_TIMEOUT_S)
        except WorkerError:
            if not loop.alive or not last:
                raise
            return last[0]
        last[:] = [WorkerLoad(info.kv.free + info.kv.cached, info.kv.total, info.running,
                              info.waiting)]
        return last[0]

    endpoint = Endpoint(identity, layout,
                        kv_address(loop),
                        lambda server: kind.add_servicer(loop, identity, server), load, metrics,
                        token, tls)
    try:
        return serve_until_signal(args, loop, endpoint)
    finally:
        if loop.kv_events is not None:
            loop.kv_events.stop()


def kv_event_publisher(args: argparse.Namespace, worker_id: str, core: EngineCore
                       ) -> KVEventPublisher | None:
    """With ``--redis-url``: the started publisher of what the engine's prefix cache
    gains and loses (``worker.kv_events``); call before the engine loop starts."""
    if not args.redis_url:
        return None
    events = KVEventLog()
    core.block_manager.publish_events(events)
    registry = Registry(args.redis_url, cluster=args.cluster)
    return KVEventPublisher(registry, worker_id, events).start()
