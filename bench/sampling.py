"""What the sampling parameters cost the engine: decode throughput of ``engine.LLM`` at
batch ``--batch`` with penalties on against the same requests without.

    python -m bench.sampling [--quick] [--batch 32] [--prompt-len 128] [--max-tokens 128]
                             [--repeats 3] [--json out.json]

On ``bench55m`` (``--quick``: the built-in tiny model), one torch thread per core. Each
arm runs ``--batch`` requests of fresh random prompts, greedy, ``ignore_eos``, for
``--max-tokens`` tokens; the arms alternate for ``--repeats`` rounds after a warm-up and
the medians are compared: ``penalties`` (presence 0.5, frequency 0.5, repetition 1.2),
``logit_bias`` (16 biased ids), ``min_tokens`` (all of them), ``logprobs`` (5
alternatives per token) and structured outputs (``json_schema``, an array of at least
32 objects, and ``regex``: both run to ``--max-tokens``) against ``plain``. The
issue's goals at batch 32: penalties cost at most 5 % of decode throughput, logprobs with
5 alternatives at most 10 %, JSON-Schema-constrained decoding at most 15 %.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import time
from collections.abc import Sequence
from typing import Any

from bench.clusters import bench_model
from bench.common import format_table, machine_info, write_json
from engine import LLM, SamplingParams
from engine.sampling_params import StructuredOutput

ARMS: dict[str, dict[str, Any]] = {
    "plain": {},
    "penalties": {"presence_penalty": 0.5, "frequency_penalty": 0.5, "repetition_penalty": 1.2},
    "logit_bias": {"logit_bias": {i * 7: 1.5 for i in range(1, 17)}},
    "min_tokens": {"min_tokens": -1},  # -1: max_tokens
    "logprobs": {"logprobs": 5},
    # structured outputs that cannot end before max_tokens (an arm that ended early would
    # run a smaller batch): an array of at least 32 objects (each several tokens), a long regex
    "json_schema": {"structured": StructuredOutput("json", json.dumps({
        "type": "array", "minItems": 32, "items": {"type": "object", "properties": {
            "id": {"type": "integer"}, "tag": {"enum": ["a", "b"]},
            "text": {"type": "string", "maxLength": 12}},
            "required": ["id", "tag"]}}))},
    "regex": {"structured": StructuredOutput("regex", "([a-z]+[ ,.]){1000}")},
}


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m bench.sampling", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true", help="the built-in tiny model")
    p.add_argument("--batch", type=int, default=32)
    p.add_argument("--prompt-len", type=int, default=128)
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--json", default=None, help="also write the results here")
    return p.parse_args(argv)


def tok_s(llm: LLM, rng: random.Random, args: argparse.Namespace, arm: str) -> float:
    """Output tokens per second of one batch of this arm (fresh prompts: no cache hits)."""
    vocab = llm.config.model.vocab_size
    extra = {k: (args.max_tokens if v == -1 else v) for k, v in ARMS[arm].items()}
    params = SamplingParams(max_tokens=args.max_tokens, temperature=0.0, ignore_eos=True,
                            **extra)
    prompts = [[rng.randrange(3, vocab) for _ in range(args.prompt_len)]
               for _ in range(args.batch)]
    start = time.perf_counter()
    results = llm.generate(prompts, params)
    seconds = time.perf_counter() - start
    return sum(len(r.token_ids) for r in results) / seconds


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    model = bench_model(args.quick)
    rng = random.Random(0)
    print(f"sampling cost on {model.name}: batch {args.batch}, {args.prompt_len}-token "
          f"prompts, {args.max_tokens} tokens ...", flush=True)
    with LLM(model, max_num_seqs=args.batch,
             max_num_batched_tokens=max(512, args.prompt_len * 4)) as llm:
        for arm in ARMS:  # warm-up
            tok_s(llm, rng, argparse.Namespace(**{**vars(args), "max_tokens": 4}), arm)
        runs: dict[str, list[float]] = {arm: [] for arm in ARMS}
        for _ in range(args.repeats):
            for arm in ARMS:
                runs[arm].append(tok_s(llm, rng, args, arm))
    medians = {arm: statistics.median(v) for arm, v in runs.items()}
    plain = medians["plain"]
    rows = [[arm, f"{m:.0f}", f"{(1 - m / plain) * 100:+.1f} %"] for arm, m in medians.items()]
    print(format_table(rows, ["arm", "tok/s (median)", "cost vs plain"]))
    facts = machine_info()
    print(f"machine: {facts.get('cpu_model', '?')}, {facts.get('cpu_count', '?')} CPUs, load "
          f"{facts.get('load_avg_1m_5m_15m', '?')}")
    if args.json:
        write_json(args.json, {"model": model.name, "batch": args.batch,
                               "tok_s": medians, "runs": runs,
                               "cost_vs_plain": {a: 1 - m / plain for a, m in medians.items()},
                               "machine": facts})
    return 0


if __name__ == "__main__":
    sys.exit(main())
