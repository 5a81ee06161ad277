"""What ``n`` > 1 choices cost against one: time to first token, prompt tokens computed on
the prefill worker, and KV bytes it sent.

    python -m bench.parallel [--quick] [--n 4] [--prompt-len 512] [--max-tokens 16]
                             [--trials 5] [--json out.json]

Starts ``pdserve up`` as a library (one prefill and one decode worker, metrics on), on
``bench55m`` (``--quick``: the built-in tiny model). Each trial sends a fresh random
prompt twice, one request at a time: once with ``n=1`` and once (another fresh prompt)
with ``--n``, greedy; TTFT is the time to the first chunk of any choice. The prefill
worker's prompt tokens computed (``vllm:prompt_tokens`` less ``vllm:prefix_cache_hits``,
counted as each prefill ends) and KV bytes sent (``pdserve:kv_transfer_bytes_total``) are
read before and after each request.
The issue's goals: ``n=4`` on a 512-token prompt computes the prompt and moves its KV once
(here each choice is a request of its own: the later ones prefill on choice 0's decode
worker, whose prefix cache holds all of their prompt but the last token's block) and TTFT
at most 1.2x ``n=1``'s.
"""

from __future__ import annotations

import argparse
import random
import statistics
import sys
import time
from collections.abc import Sequence

from bench.clusters import bench_model, cluster, prefill_counters, settled_prefill_counters
from bench.common import format_table, machine_info, write_json
from deploy.local import LocalLauncher
from pdserve import Client


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m bench.parallel", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true", help="the built-in tiny model")
    p.add_argument("--n", type=int, default=4)
    p.add_argument("--prompt-len", type=int, default=512)
    p.add_argument("--max-tokens", type=int, default=16)
    p.add_argument("--trials", type=int, default=5)
    p.add_argument("--json", default=None, help="also write the results here")
    return p.parse_args(argv)


def _one(client: Client, running: LocalLauncher, prompt: list[int], n: int,
         max_tokens: int) -> tuple[float, float, float]:
    """(TTFT s, prompt tokens computed, KV bytes sent) of one request of ``n`` choices."""
    before, sent_before = prefill_counters(running)
    start = time.perf_counter()
    ttft = None
    for _ in client.generate(prompt_token_ids=prompt, n=n, max_tokens=max_tokens,
                             temperature=0.0, ignore_eos=True, timeout=300.0):
        ttft = ttft if ttft is not None else time.perf_counter() - start
    assert ttft is not None
    after, sent_after = settled_prefill_counters(running)
    return ttft, sum(after.values()) - sum(before.values()), sent_after - sent_before


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    model = bench_model(args.quick)
    rng = random.Random(0)
    print(f"n={args.n} against n=1 on {model.name}: {args.prompt_len}-token prompts, "
          f"{args.trials} trials ...", flush=True)
    runs: dict[int, list[tuple[float, float, float]]] = {1: [], args.n: []}
    with cluster(model, num_prefill=1, num_decode=1,
                 worker_args=("--metrics-port", "0")) as running:
        vocab = 500
        with Client(running.router_address) as client:
            client.complete(prompt_token_ids=[5, 6, 7], max_tokens=2)  # warm-up
            for trial in range(args.trials):
                for n in (1, args.n):
                    prompt = [rng.randrange(3, vocab) for _ in range(args.prompt_len)]
                    runs[n].append(_one(client, running, prompt, n, args.max_tokens))
                print(f"  trial {trial + 1}/{args.trials} done", flush=True)
    medians = {n: tuple(statistics.median(r[i] for r in rs) for i in range(3))
               for n, rs in runs.items()}
    base = medians[1]
    rows = [[f"n={n}", f"{m[0] * 1e3:.1f}", f"{m[0] / base[0]:.2f}x", f"{m[1]:.0f}",
             f"{m[1] / base[1]:.2f}x", f"{m[2] / 2**20:.2f}", f"{m[2] / base[2]:.2f}x"]
            for n, m in medians.items()]
    print(format_table(rows, ["arm", "TTFT p50 ms", "vs n=1", "prompt tokens computed",
                              "vs n=1", "KV MiB sent", "vs n=1"]))
    facts = machine_info()
    print(f"machine: {facts.get('cpu_model', '?')}, {facts.get('cpu_count', '?')} CPUs")
    if args.json:
        write_json(args.json, {"model": model.name, "n": args.n, "prompt_len": args.prompt_len,
                               "medians": {str(n): dict(zip(("ttft_s", "prompt_tokens_computed",
                                                             "kv_bytes_sent"),
                                                            m, strict=True))
                                           for n, m in medians.items()},
                               "runs": {str(n): r for n, r in runs.items()}, "machine": facts})
    return 0


if __name__ == "__main__":
    sys.exit(main())
