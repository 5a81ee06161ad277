"""What the sampling parameters cost the engine: decode throughput of ``engine.LLM`` at
batch ``--batch`` with each parameter on against the same requests without.

    python -m bench.sampling [--quick] [--batch 32] [--prompt-len 128] [--max-tokens 128]
                             [--repeats 9] [--threads N] [--json out.json]

On ``bench55m`` (``--quick``: the built-in tiny model), with the engine's torch threads
(one per core; ``--threads 1`` leaves a core to the structured outputs' mask thread).
Each arm runs ``--batch`` requests of fresh random prompts, greedy, ``ignore_eos``, for
``--max-tokens`` tokens, timed from the step after every request has its first token
(the prefills are the same in every arm) to the last, the garbage collector paused. A
round runs every arm once, back to back, in a new order each round; an arm's cost is
the median over ``--repeats`` rounds of its round's ``1 - tok/s ÷ plain's tok/s``
(paired: the machine's drift between rounds cancels).
The arms: ``penalties`` (presence 0.5, frequency 0.5, repetition 1.2), ``logit_bias`` (16
biased ids), ``min_tokens`` (all of them), ``logprobs`` (5 alternatives per token) and
structured outputs (``json_schema``, an array of at least 32 objects, and ``regex``: both
run to ``--max-tokens``). For the structured arms the engine thread's own time per decode
step on the masks (``Constraints.mask_seconds``: waited for, made, applied) and on
following the sampled tokens (``follow_seconds``) is also reported, each against
plain's decode step. The issue's goals at batch 32: penalties cost at most 5 % of decode
throughput, logprobs with 5 alternatives at most 10 %, JSON-Schema-constrained decoding
at most 15 %; on the tiny model the masks at most 10 % of a decode step.
"""

from __future__ import annotations

import argparse
import gc
import json
import random
import statistics
import sys
import time
from collections.abc import Sequence
from contextlib import nullcontext
from dataclasses import dataclass
from typing import Any

import torch

from bench.clusters import bench_model
from bench.common import format_table, machine_info, torch_threads, write_json
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
STRUCTURED = ("json_schema", "regex")


@dataclass(frozen=True)
class ArmRun:
    """One batch of one arm, its decode part: tokens per second, the steps, and the
    engine thread's seconds in them on structured outputs' masks and on following the
    tokens."""

    tok_s: float
    steps: int
    seconds: float
    mask_seconds: float
    follow_seconds: float


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m bench.sampling", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true", help="the built-in tiny model")
    p.add_argument("--batch", type=int, default=32)
    p.add_argument("--prompt-len", type=int, default=128)
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--repeats", type=int, default=9, help="rounds of every arm")
    p.add_argument("--threads", type=int, default=None,
                   help="torch threads of the engine (default: the engine's, one per core)")
    p.add_argument("--json", default=None, help="also write the results here")
    return p.parse_args(argv)


def run_arm(llm: LLM, rng: random.Random, args: argparse.Namespace, arm: str) -> ArmRun:
    """One batch of this arm: fresh prompts (no cache hits), timed from the step after
    every request has its first token to the last."""
    vocab = llm.config.model.vocab_size
    extra = {k: (args.max_tokens if v == -1 else v) for k, v in ARMS[arm].items()}
    params = SamplingParams(max_tokens=args.max_tokens, temperature=0.0, ignore_eos=True,
                            **extra)
    core = llm.core
    waiting = set()
    for _ in range(args.batch):
        request_id = core.new_request_id()
        core.add_request(request_id, [rng.randrange(3, vocab) for _ in range(args.prompt_len)],
                         params)
        waiting.add(request_id)
    while waiting:  # the prefills (and the first decodes beside them)
        waiting.difference_update(o.request_id for o in core.step() if o.new_token_ids)
    tokens = steps = 0
    constraints = core.constraints
    masks, follows = constraints.mask_seconds, constraints.follow_seconds
    gc.collect()
    gc.disable()  # as timeit does: a collection's pause lands in whichever arm it hits
    try:
        start = time.perf_counter()
        while core.has_unfinished():
            tokens += sum(len(o.new_token_ids) for o in core.step())
            steps += 1
        seconds = time.perf_counter() - start
    finally:
        gc.enable()
    return ArmRun(tokens / seconds, steps, seconds, constraints.mask_seconds - masks,
                  constraints.follow_seconds - follows)


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    model = bench_model(args.quick)
    rng = random.Random(0)
    print(f"sampling cost on {model.name}: batch {args.batch}, {args.prompt_len}-token "
          f"prompts, {args.max_tokens} tokens, {args.repeats} rounds ...", flush=True)
    with LLM(model, max_num_seqs=args.batch,
             max_num_batched_tokens=max(512, args.prompt_len * 4)) as llm, \
            (torch_threads(args.threads) if args.threads else nullcontext()):
        threads = torch.get_num_threads()
        for arm in ARMS:  # warm-up
            run_arm(llm, rng, argparse.Namespace(**{**vars(args), "max_tokens": 4}), arm)
        runs: dict[str, list[ArmRun]] = {arm: [] for arm in ARMS}
        order = list(ARMS)
        for _ in range(args.repeats):
            rng.shuffle(order)  # no arm always runs after the same one
            for arm in order:
                runs[arm].append(run_arm(llm, rng, args, arm))
    report = summarize(runs)
    rows = [[arm, f"{report['tok_s'][arm]:.0f}", f"{report['cost_vs_plain'][arm] * 100:+.1f} %",
             *((f"{report['mask_step_fraction'][arm] * 100:.1f} %",
                f"{report['follow_step_fraction'][arm] * 100:.1f} %")
               if arm in STRUCTURED else ("", ""))] for arm in ARMS]
    print(format_table(rows, ["arm", "decode tok/s (median)", "cost vs plain (median of rounds)",
                              "masks ÷ plain step", "following ÷ plain step"]))
    print(f"plain decode step: {report['plain_step_ms']:.3f} ms; torch threads: {threads}")
    facts = machine_info()
    print(f"machine: {facts.get('cpu_model', '?')}, {facts.get('cpu_count', '?')} CPUs, load "
          f"{facts.get('load_avg_1m_5m_15m', '?')}")
    if args.json:
        write_json(args.json, {"model": model.name, "batch": args.batch, "threads": threads,
                               **report, "machine": facts})
    return 0


def summarize(runs: dict[str, list[ArmRun]]) -> dict[str, Any]:
    """The figures of every arm's rounds: median tok/s, the median of the rounds' paired
    costs, and (structured arms) the engine thread's time on them per decode step as a
    fraction of plain's decode step."""
    plain = runs["plain"]
    plain_step = statistics.median(r.seconds / r.steps for r in plain)
    return {
        "tok_s": {arm: statistics.median(r.tok_s for r in v) for arm, v in runs.items()},
        "runs": {arm: [r.tok_s for r in v] for arm, v in runs.items()},
        "cost_vs_plain": {arm: statistics.median(1 - r.tok_s / p.tok_s
                                                 for r, p in zip(v, plain, strict=True))
                          for arm, v in runs.items()},
        "plain_step_ms": plain_step * 1e3,
        "mask_step_fraction": {
            arm: statistics.median(r.mask_seconds / r.steps for r in runs[arm]) / plain_step
            for arm in STRUCTURED},
        "follow_step_fraction": {
            arm: statistics.median(r.follow_seconds / r.steps for r in runs[arm]) / plain_step
            for arm in STRUCTURED},
    }


if __name__ == "__main__":
    sys.exit(main())
