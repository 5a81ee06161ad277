"""``pdserve router``: serves ``pdserve.v1.Generation`` (placeholder, being written)."""

from __future__ import annotations

import argparse

DEFAULT_PORT = 50051


def add_router_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", required=True,
                        help="checkpoint directory (the router reads config.json and "
                             "tokenizer.json only, never the weights)")
    parser.add_argument("--redis-url", required=True, help="the cluster's Redis")
    parser.add_argument("--host", default="127.0.0.1", help="address the API binds to")
    parser.add_argument("--port", type=int, default=DEFAULT_PORT, help="API port (0: the OS picks)")
    parser.add_argument("--cluster", default="default", help="Redis key namespace")
    parser.add_argument("--ready-file",
                        help="write {\"grpc_address\", \"role\", \"model\"} as JSON once serving")
    parser.add_argument("--model-name", help="name clients may give (default: the directory name)")
    parser.add_argument("--max-inflight", type=int, default=256,
                        help="requests in flight at once; more get RESOURCE_EXHAUSTED")


def main(args: argparse.Namespace) -> int:
    raise NotImplementedError("the router is being written")
