"""Command-line options of the worker commands (``pdserve prefill``, ``pdserve decode``).

Standard library only: the ``pdserve`` command line builds its parser from this module
even where the server extra is not installed (it then says which extra to install).
"""

from __future__ import annotations

import argparse
import os

from cluster.internal_tls import add_internal_tls_args  # standard library only too
from cluster.token import CLUSTER_TOKEN_ENV, add_token_arg
from engine.config import KV_CACHE_DTYPES, KV_TRANSFER_DTYPES, QUANTIZATIONS, RANK_GPUS_ENV

__all__ = ["CLUSTER_TOKEN_ENV", "KV_CACHE_DTYPES", "KV_TRANSFER_DTYPES", "QUANTIZATIONS",
           "RANK_GPUS_ENV", "REDIS_URL_ENV", "WILDCARDS", "add_engine_choice_args",
           "engine_choice_args", "add_decode_args", "add_worker_args", "advertise_host", "dtype"]

REDIS_URL_ENV = "PDSERVE_REDIS_URL"
"""Where ``--redis-url`` defaults from (so a password never has to be on a command line)."""
WILDCARDS = ("0.0.0.0", "::", "")


def add_worker_args(parser: argparse.ArgumentParser) -> None:
    """Options both worker commands take."""
    parser.add_argument("--model", required=True, help="checkpoint directory (HF layout)")
    parser.add_argument("--host", default="127.0.0.1", help="address every endpoint binds to")
    parser.add_argument("--advertise-host",
                        help="address other processes reach this worker at: registered in "
                             "Redis, advertised by the KV endpoint, bound by the KV data "
                             "plane's groups (default: --host, which must then not be a "
                             "wildcard such as 0.0.0.0)")
    parser.add_argument("--port", type=int, default=0, help="gRPC port (0: the OS picks)")
    parser.add_argument("--tensor-parallel-size", type=int, default=1)
    parser.add_argument("--device", default="cpu", choices=("cpu", "cuda"),
                        help="where the model and its KV cache live (cuda: one GPU per rank)")
    parser.add_argument("--dtype", choices=("float32", "float16", "bfloat16"),
                        help="weights and KV cache (default: float32 on cpu, bfloat16 on cuda)")
    parser.add_argument("--quantization", choices=QUANTIZATIONS,
                        help="int8: the linear weights quantised at load to int8 with a scale "
                             "per output feature (weight-only; a quarter of the bytes a decode "
                             "step reads); default: as loaded. Each worker's own: workers of "
                             "one cluster may differ")
    parser.add_argument("--kv-cache-dtype", choices=KV_CACHE_DTYPES, default="auto",
                        help="int8: each token's K/V per head stored as int8 values and their "
                             "fp32 scale (about a quarter of fp32's bytes); fp8 (= fp8_e4m3) "
                             "or fp8_e5m2: one fp8 byte per value, no scale (a quarter "
                             "exactly); blocks travel so between workers; auto: --dtype. Part "
                             "of the cluster's KV layout: every worker of a cluster must use "
                             "the same")
    parser.add_argument("--speculative-config", metavar="JSON",
                        help="vLLM's speculative_config: n-gram lookup, "
                             "'{\"method\": \"ngram\", \"num_speculative_tokens\": 4, "
                             "\"prompt_lookup_max\": 4}' (a decode worker's decoding "
                             "requests guess their next tokens from their own history), or a "
                             "draft model, '{\"method\": \"draft_model\", \"model\": DIR, "
                             "\"num_speculative_tokens\": 4}' (a small checkpoint with the "
                             "model's vocabulary guesses them; its KV is computed on the decode "
                             "worker). Greedy and seeded output unchanged. Each worker's own")
    parser.add_argument("--kv-transfer-dtype", choices=KV_TRANSFER_DTYPES, default="auto",
                        help="int8: blocks cross the wire as int8 values and a scale per "
                             "token and head (about a quarter of fp32's bytes), dequantised "
                             "into the receiver's cache; lossy, so the prefix cache keys such "
                             "blocks apart. auto: as the cache holds them. Part of the "
                             "cluster's KV layout: every worker of a cluster must use the same")
    parser.add_argument("--ready-file", help="write the addresses here as JSON once ready")
    parser.add_argument("--metrics-port", type=int, default=0,
                        help="serve Prometheus metrics on this port's /metrics (0: any free "
                             "port; registered and in the ready file as metrics_address)")
    parser.add_argument("--redis-url", default=os.environ.get(REDIS_URL_ENV),
                        help=f"register in this Redis (default: ${REDIS_URL_ENV}; neither: run "
                             "unregistered)")
    parser.add_argument("--cluster", default="default", help="Redis key namespace")
    parser.add_argument("--heartbeat-interval", type=float,
                        help="seconds between registration heartbeats (default: 3; at most "
                             "5, so routers keep a worker past a Redis restart)")
    parser.add_argument("--registration-ttl", type=float,
                        help="seconds the record outlives the last heartbeat (default: 10)")
    parser.add_argument("--worker-id", help="default: ROLE-<random>")
    parser.add_argument("--num-kv-blocks", type=int, help="default: fit to memory")
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--enable-prefix-caching", action=argparse.BooleanOptionalAction,
                        default=True,
                        help="reuse cached prompt blocks by hash (a decode worker: skip "
                             "receiving the blocks it holds); --no-enable-prefix-caching: off")
    parser.add_argument("--max-num-batched-tokens", type=int, default=512)
    parser.add_argument("--max-num-seqs", type=int, default=64)
    parser.add_argument("--transfer-timeout", type=float, default=30.0,
                        help="seconds a KV transfer may take")
    parser.add_argument("--grace", type=float, default=5.0,
                        help="seconds in-flight RPCs get on SIGTERM before they are aborted")
    parser.add_argument("--drain-moves", action=argparse.BooleanOptionalAction, default=True,
                        help="on SIGTERM, with another decode worker registered, park the "
                             "decoding requests and let the routers move them there with "
                             "their KV (at most --grace seconds for the offer); "
                             "--no-drain-moves: they finish here within --grace, then are "
                             "replayed elsewhere")
    parser.add_argument("--max-requests", type=int, default=1024,
                        help="requests held at once (queued, prefilling, reserved or "
                             "streaming); more are refused as busy (RESOURCE_EXHAUSTED, or a "
                             "Reserve not accepted), which the router waits on")
    parser.add_argument("--stall-timeout", type=float, default=60.0,
                        help="seconds the engine loop may complete no step while it has work "
                             "before health says NOT_SERVING")
    add_token_arg(parser)
    add_internal_tls_args(parser)


def add_decode_args(parser: argparse.ArgumentParser) -> None:
    """The KV store's port (every worker receives KV: any may serve decode), besides
    ``add_worker_args``."""
    parser.add_argument("--kv-port", type=int, default=0,
                        help="KV rendezvous store port (0: the OS picks when the store "
                        "binds; the ready file and registration tell the port it got)")


def advertise_host(args: argparse.Namespace) -> str:
    """The address this worker is reached at (``--advertise-host``, else ``--host``);
    ``ValueError`` when that would be a wildcard."""
    host = args.advertise_host or args.host
    if host in WILDCARDS:
        raise ValueError(f"--host {args.host} binds every interface: give --advertise-host, "
                         "the address other processes reach this worker at")
    return str(host)


def dtype(args: argparse.Namespace) -> str:
    return str(args.dtype or ("bfloat16" if args.device == "cuda" else "float32"))


def add_engine_choice_args(parser: argparse.ArgumentParser) -> None:
    """The engine choices ``pdserve up`` passes on to every worker it starts."""
    parser.add_argument("--quantization", choices=QUANTIZATIONS,
                        help="every worker's --quantization (int8: weight-only int8)")
    parser.add_argument("--kv-cache-dtype", choices=KV_CACHE_DTYPES, default="auto",
                        help="every worker's --kv-cache-dtype (int8: values and a scale per "
                             "token and head; fp8, fp8_e5m2: one byte per value)")
    parser.add_argument("--speculative-config", metavar="JSON",
                        help="every worker's --speculative-config (n-gram lookup or a "
                             "draft model)")
    parser.add_argument("--kv-transfer-dtype", choices=KV_TRANSFER_DTYPES, default="auto",
                        help="every worker's --kv-transfer-dtype (int8: KV quantised for the "
                             "wire only)")


def engine_choice_args(args: argparse.Namespace) -> tuple[str, ...]:
    """The worker arguments ``add_engine_choice_args``' flags stand for."""
    out: tuple[str, ...] = ()
    if args.quantization is not None:
        out += ("--quantization", args.quantization)
    if args.kv_cache_dtype != "auto":
        out += ("--kv-cache-dtype", args.kv_cache_dtype)
    if args.kv_transfer_dtype != "auto":
        out += ("--kv-transfer-dtype", args.kv_transfer_dtype)
    if args.speculative_config is not None:
        out += ("--speculative-config", args.speculative_config)
    return out
