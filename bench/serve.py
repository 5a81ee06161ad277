"""A serving benchmark in the manner of ``vllm bench serve``, against a running cluster.

    python -m bench.serve --address 127.0.0.1:50051 --dataset-name random \\
        --input-len 512 --output-len 64 --num-prompts 200 --request-rate 4 \\
        --goodput ttft:2000 tpot:100 --json out.json --plot plots/

``--address`` (gRPC) or ``--base-url`` (the OpenAI-compatible HTTP API) names the cluster;
with neither, one is started for the run (``pdserve up`` on ``--model``, default the
built-in tiny model: one prefill and one decode worker). Data sets: ``random``
(``--input-len``, ``--output-len``, ``--range-ratio``), ``prefix-repetition``
(``--prefix-len``, ``--suffix-len``, ``--num-prefixes``, ``--output-len``) and
``sharegpt-like`` (synthetic lengths, ``loadtest.workloads``). ``--num-prompts`` requests
arrive as a Poisson process at ``--request-rate`` per second (``inf``: all at once; a
gamma process with ``--burstiness`` ≠ 1), at most ``--max-concurrency`` in flight.
``--seed`` fixes prompts and arrivals. One warm-up request goes first (not counted).

Prints vLLM's result table, a progress bar, the machine facts (CPU, measured bandwidth,
and the model, its dtype and threads where this process knows them: ``--model`` or a
cluster it started); ``--json PATH`` writes every figure under vLLM's key names and the
per-request lists; ``--plot DIR`` writes CDFs of TTFT and TPOT. ``--quick``: a small run
(a few requests of a few tokens) for tests.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import sys
import time
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

from bench.common import BandwidthProbe, machine_info, model_facts, write_json
from bench.serving import Backend, GrpcBackend, HttpBackend, run
from loadtest.workloads import Request, Workload
from sim.cli import add_workload_args, check_workload_args
from sim.metrics import Outcome, details, metrics, render


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m bench.serve", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    where = p.add_mutually_exclusive_group()
    where.add_argument("--address", help="the router's gRPC address HOST:PORT")
    where.add_argument("--base-url", help="the router's HTTP API, e.g. http://127.0.0.1:8000")
    p.add_argument("--model", help="checkpoint directory: the model of a cluster started here "
                                   "(default: the built-in tiny model), or the facts printed")
    p.add_argument("--vocab-size", type=int,
                   help="prompt token ids are drawn below this (default: the model's)")
    p.add_argument("--api-key", help="the router's API key, if it has one")
    add_workload_args(p)
    p.add_argument("--max-concurrency", type=int)
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--json", type=Path, help="write the results here")
    p.add_argument("--plot", type=Path, help="write ttft_cdf.png and tpot_cdf.png here")
    p.add_argument("--no-progress", action="store_true")
    p.add_argument("--quick", action="store_true",
                   help="small defaults (for tests): 12 prompts of 32 → 8 tokens at 20/s")
    if "--quick" in (sys.argv[1:] if argv is None else argv):  # smaller defaults
        p.set_defaults(num_prompts=12, input_len=32, output_len=8, prefix_len=64,
                       suffix_len=16, num_prefixes=3, request_rate=20.0)
    return check_workload_args(p, p.parse_args(argv))


@contextlib.contextmanager
def target(args: argparse.Namespace) -> Iterator[dict[str, Any]]:
    """Where to send: the given address, or a ``pdserve up`` started for the run."""
    if args.address or args.base_url:
        model = Path(args.model) if args.model else None
        yield {"address": args.address, "base_url": args.base_url, "model_dir": model,
               "cluster": None}
        return
    from bench.clusters import launched
    from deploy.spec import ClusterSpec

    print("starting pdserve up (1 prefill + 1 decode worker) ...", flush=True)
    with launched(ClusterSpec(model_dir=Path(args.model) if args.model else None, port=0,
                              http_port=None)) as cluster:
        yield {"address": cluster.router_address, "base_url": None,
               "model_dir": cluster.model_dir,
               "cluster": {"num_prefill": 1, "num_decode": 1,
                           "threads_per_process": int(cluster.child_env()["OMP_NUM_THREADS"])}}


def make_backend(args: argparse.Namespace, where: dict[str, Any]) -> Backend:
    if where["address"]:
        return GrpcBackend(where["address"], temperature=args.temperature, api_key=args.api_key)
    return HttpBackend(where["base_url"], temperature=args.temperature, api_key=args.api_key)


async def _vocab_size(args: argparse.Namespace, where: dict[str, Any]) -> int:
    if args.vocab_size:
        return int(args.vocab_size)
    if where["model_dir"] is not None:
        config = json.loads((Path(where["model_dir"]) / "config.json").read_text())
        return int(config["vocab_size"])
    if where["address"]:
        from pdserve import AsyncClient

        async with AsyncClient(where["address"], api_key=args.api_key) as client:
            return (await client.model_info(timeout=30)).vocab_size
    raise SystemExit("bench.serve: with --base-url give --vocab-size or --model")


class Progress:
    """A tqdm bar of finished requests (nothing with ``--no-progress``)."""

    def __init__(self, total: int, enabled: bool) -> None:
        self.bar = None
        if enabled:
            from tqdm import tqdm

            self.bar = tqdm(total=total, unit="req", file=sys.stderr)

    def __call__(self, _outcome: Outcome) -> None:
        if self.bar is not None:
            self.bar.update(1)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()


async def benchmark(args: argparse.Namespace, where: dict[str, Any]
                    ) -> tuple[list[Request], list[Outcome], float]:
    vocab = await _vocab_size(args, where)
    requests = Workload(args.spec, vocab, seed=args.seed).take(args.num_prompts)
    backend = make_backend(args, where)
    try:
        warm = Outcome(requests[0].prompt_len, 2)
        await backend.send(Request(requests[0].prompt_token_ids, 2), warm)
        if not warm.success:
            raise SystemExit(f"bench.serve: the warm-up request failed: {warm.error}")
        progress = Progress(len(requests), not args.no_progress)
        try:
            outcomes, duration = await run(backend, requests, request_rate=args.request_rate,
                                           max_concurrency=args.max_concurrency, seed=args.seed,
                                           burstiness=args.burstiness, on_done=progress)
        finally:
            progress.close()
    finally:
        await backend.close()
    return requests, outcomes, duration


def main(argv: Sequence[str] | None = None) -> dict[str, Any]:
    args = parse_args(argv)
    probe = BandwidthProbe(256 << 20 if args.quick else 1 << 30)
    bandwidth = probe.measure()
    probe.release()
    with target(args) as where:
        started = time.time()
        _, outcomes, duration = asyncio.run(benchmark(args, where))
    result: dict[str, Any] = {
        "date": time.strftime("%Y%m%d-%H%M%S", time.localtime(started)),
        "backend": "grpc" if where["address"] else "openai-http",
        "dataset_name": args.dataset_name, "num_prompts": args.num_prompts,
        "request_rate": args.request_rate, "burstiness": args.burstiness,
        "max_concurrency": args.max_concurrency, "seed": args.seed,
        "workload": vars(args.spec), "goodput_slo_ms": args.slo_ms,
        **metrics(outcomes, duration, slo_ms=args.slo_ms or None,
                  percentiles=args.percentiles),
        "machine": {**machine_info(), "bandwidth_gbps": bandwidth},
        "model": model_facts(where["model_dir"]) if where["model_dir"] else None,
        "cluster": where["cluster"], **details(outcomes)}
    print(render(result))
    print(f"machine: {result['machine']}")
    print(f"model: {result['model'] or 'unknown to the client (give --model DIR)'}; "
          f"cluster: {result['cluster'] or 'not started here (threads: the cluster’s)'}")
    errors = sorted({o.error.split(':')[0] for o in outcomes if not o.success})
    if errors:
        print(f"failures: {', '.join(errors)}")
    if args.json:
        write_json(args.json, result)
    if args.plot:
        from bench.plots import cdf_plots

        cdf_plots(args.plot, {result["backend"]: outcomes}, slo_ms=args.slo_ms or None)
    return result


if __name__ == "__main__":
    main()
