"""Command-line options of ``pdserve router`` (standard library only, like ``router.config``:
the ``pdserve`` parser is built from them even without the server extra)."""

from __future__ import annotations

import argparse
import os

from cluster.internal_tls import add_internal_tls_args
from cluster.token import add_token_arg
from router.config import (
    DEFAULT_HTTP_PORT,
    DEFAULT_LEASE_TTL_S,
    DEFAULT_LOCAL_PREFILL_MAX_TOKENS,
    DEFAULT_MIGRATION_LIMIT,
    DEFAULT_PORT,
    LOCAL_PREFILL_MODES,
    PREFILL_ROUTING,
    AdmissionConfig,
)

__all__ = ["API_KEY_ENV", "DEFAULT_HTTP_PORT", "DEFAULT_PORT", "LOCAL_PREFILL_MODES",
           "REDIS_URL_ENV", "add_router_args"]

REDIS_URL_ENV = "PDSERVE_REDIS_URL"
API_KEY_ENV = "PDSERVE_API_KEY"
"""Where the router's API key comes from when no ``--api-key-file`` is given."""


def add_router_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model",
                        help="checkpoint directory (the router reads config.json and "
                             "tokenizer.json only, never the weights; default: the "
                             "built-in tiny model, built on first use)")
    parser.add_argument("--redis-url", default=os.environ.get(REDIS_URL_ENV),
                        help=f"the cluster's Redis (default: ${REDIS_URL_ENV}; one of the two "
                             "is required)")
    parser.add_argument("--host", default="127.0.0.1", help="address the API binds to")
    parser.add_argument("--port", type=int, default=DEFAULT_PORT,
                        help="API port (0: the OS picks)")
    parser.add_argument("--http-port", type=int, default=DEFAULT_HTTP_PORT,
                        help="OpenAI-compatible HTTP API port (0: the OS picks; default "
                             f"{DEFAULT_HTTP_PORT})")
    parser.add_argument("--no-http", dest="http", action="store_false",
                        help="serve gRPC only (no HTTP API)")
    parser.add_argument("--chat-template",
                        help="Jinja chat template file for /v1/chat/completions (default: the "
                             "model's, from chat_template.jinja or tokenizer_config.json)")
    parser.add_argument("--health-port", type=int,
                        help="also serve grpc.health.v1 alone, in plaintext, on this port (for "
                             "probes when the API port serves TLS; 0: any free port)")
    parser.add_argument("--metrics-port", type=int,
                        help="serve the router's Prometheus metrics on this port's /metrics "
                             "(0: any free port; they are on the HTTP API's /metrics too)")
    parser.add_argument("--cluster", default="default", help="Redis key namespace")
    parser.add_argument("--ready-file",
                        help='write {"grpc_address", "role", "model"} (and "http_address", '
                             '"health_address", "metrics_address" when served) as JSON once '
                             "serving")
    parser.add_argument("--model-name", help="name clients may give (default: the directory name)")
    parser.add_argument("--max-inflight", type=int, default=AdmissionConfig.max_inflight,
                        help="requests queued or running at once (a busy cluster queues them "
                             "first come, first served); more get RESOURCE_EXHAUSTED at once")
    parser.add_argument("--max-queued-tokens", type=int,
                        default=AdmissionConfig.max_queued_tokens,
                        help="prompt tokens waiting for their first token at once; more get "
                             "RESOURCE_EXHAUSTED (0: no limit)")
    parser.add_argument("--max-buffered-chunks", type=int,
                        default=AdmissionConfig.max_buffered_chunks,
                        help="chunks of one stream the router holds for a client that reads "
                             "slower than tokens come; past it the request is cancelled with "
                             "RESOURCE_EXHAUSTED (client too slow)")
    parser.add_argument("--max-n", type=int, default=AdmissionConfig.max_n,
                        help="choices one request may ask for (n); more is INVALID_ARGUMENT "
                             "/ a 400 (each choice is admitted as a request of its own)")
    parser.add_argument("--grace", type=float, default=5.0,
                        help="seconds in-flight requests get to finish on SIGTERM")
    parser.add_argument("--local-prefill", choices=LOCAL_PREFILL_MODES, default="never",
                        help="never: no prefill worker left is UNAVAILABLE; fallback: then a "
                             "decode worker prefills locally; always: colocated mode, every "
                             "request prefilled on its decode worker (default: never). In "
                             "every mode the later choices of n > 1 prefill on choice 0's "
                             "decode worker, whose prefix cache holds their prompt but its "
                             "last block, and a prompt a decode worker holds all but a short "
                             "tail of is prefilled there (--local-prefill-max-tokens)")
    parser.add_argument("--prefill-routing", choices=PREFILL_ROUTING, default="kv-aware",
                        help="kv-aware: the prefill worker with the least predicted work "
                             "(prompt tokens queued there plus this prompt's tokens it does "
                             "not hold, from the workers' KV events, over its measured "
                             "prefill speed), and the decode worker "
                             "holding the longest prefix within the load bound; affinity "
                             "while the events do not flow (default). affinity: by prefix "
                             "affinity (rendezvous hashing of the prompt's leading blocks, "
                             "bounded load); round-robin: the next one in turn, whatever "
                             "the prompt (a baseline for benchmarks)")
    parser.add_argument("--local-prefill-max-tokens", type=int,
                        default=DEFAULT_LOCAL_PREFILL_MAX_TOKENS,
                        help="kv-aware: a prompt that a decode worker holds all of but at most "
                             "this many tokens is prefilled there, not on a prefill worker "
                             "(conditional disaggregation), and so is one whose missing "
                             "tokens, twice, and the local backlog come to less than every "
                             "prefill worker's queue plus what that worker lacks of it (as "
                             "this router sees the queues, or as the prefill worker asked "
                             "counts its own, refusing the Prefill); a prompt that one on its "
                             "way to a decode worker covers but this many tokens waits for it "
                             "to land (at most 1 s), then is prefilled there; 0: never (default "
                             f"{DEFAULT_LOCAL_PREFILL_MAX_TOKENS})")
    parser.add_argument("--migration-limit", type=int, default=DEFAULT_MIGRATION_LIMIT,
                        help="how often one stream may move to another decode worker when "
                             "its own fails after tokens were streamed (the prompt and the "
                             "tokens sent are prefilled there; the client sees one stream); "
                             f"0: never, the client gets UNAVAILABLE (default "
                             f"{DEFAULT_MIGRATION_LIMIT})")
    parser.add_argument("--lease-ttl", type=float, default=DEFAULT_LEASE_TTL_S,
                        help="seconds of each attempt's lease in Redis (renewed every third of "
                             "it): a worker frees what it holds for an attempt whose lease has "
                             f"been gone this long, e.g. after this router died (default "
                             f"{DEFAULT_LEASE_TTL_S:g})")
    parser.add_argument("--debug-port", type=int,
                        help="serve the internal introspection service (RouterDebug: requests, "
                             "attempts, leases, pending aborts, channels) in plaintext on this "
                             "port of --debug-host (0: any free port; default: off); it "
                             "requires the API key when one is set")
    parser.add_argument("--debug-host", default="127.0.0.1",
                        help="the address --debug-port binds (default 127.0.0.1: loopback "
                             "only, whatever --host is)")
    add_token_arg(parser)
    add_internal_tls_args(parser)
    parser.add_argument("--tls-cert", help="serve TLS with this PEM certificate (chain)")
    parser.add_argument("--tls-key", help="... and this PEM private key")
    parser.add_argument("--api-key-file",
                        help="require 'authorization: Bearer KEY' on every call but health "
                             "and reflection (gRPC) and /health, /metrics, /version (HTTP), "
                             "KEY being this file's first line (default: $PDSERVE_API_KEY if "
                             "set, else no key)")
