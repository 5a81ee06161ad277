"""The ``pdserve`` command line."""

from __future__ import annotations

import argparse
import sys
import time
from collections.abc import Iterator, Sequence

DEMO_PROMPT = "Once upon a time, in a city of caf\u00e9s and \u65e5\u672c\u8a9e signs,"


def main(argv: Sequence[str] | None = None) -> int:
    parser = _parser()
    args = parser.parse_args(argv)
    if not hasattr(args, "func"):
        parser.print_help()
        return 2
    return int(args.func(args) or 0)


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="pdserve", description=__doc__)
    sub = parser.add_subparsers(metavar="COMMAND")

    tiny = sub.add_parser("make-tiny-model", help="write a random-weight checkpoint (HF layout)")
    tiny.add_argument("dir", help="output directory")
    tiny.add_argument("--arch", default="llama", choices=("llama", "mistral", "qwen2", "qwen3"))
    tiny.add_argument("--preset", default="tiny", choices=("tiny", "bench55m"))
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
    return parser


def _add_worker_parsers(sub: argparse._SubParsersAction) -> None:
    from pdserve.worker_common import add_worker_args

    prefill = sub.add_parser("prefill", help="run a prefill worker (gRPC, pushes KV)")
    add_worker_args(prefill)
    prefill.set_defaults(func=_prefill)
    decode = sub.add_parser("decode", help="run a decode worker (gRPC, receives KV, streams)")
    add_worker_args(decode)
    decode.add_argument("--kv-port", type=int, default=0,
                        help="KV rendezvous store port (0: a free port)")
    decode.set_defaults(func=_decode)
    from router.server import add_router_args

    router = sub.add_parser("router", help="run the router (public gRPC API, torch-free)")
    add_router_args(router)
    router.set_defaults(func=_router)


def _router(args: argparse.Namespace) -> int:
    from router.server import main as router_main

    return router_main(args)


def _prefill(args: argparse.Namespace) -> int:
    from pdserve.worker_common import configure_worker_logging
    from prefill_worker.server import main as prefill_main

    configure_worker_logging("prefill")
    return prefill_main(args)


def _decode(args: argparse.Namespace) -> int:
    from decode_worker.server import main as decode_main
    from pdserve.worker_common import configure_worker_logging

    configure_worker_logging("decode")
    return decode_main(args)


def _make_tiny_model(args: argparse.Namespace) -> int:
    from engine.tiny_model import make_tiny_model

    start = time.monotonic()
    print(f"building a random {args.arch} checkpoint ({args.preset}, seed {args.seed}) ...",
          flush=True)
    path = make_tiny_model(args.dir, arch=args.arch, preset=args.preset, seed=args.seed)
    print(f"wrote {path} in {time.monotonic() - start:.1f}s")
    return 0


def _demo(args: argparse.Namespace) -> int:
    from engine import LLM, SamplingParams
    from engine.tiny_model import ensure_demo_model

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
