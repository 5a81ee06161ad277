"""Where a disaggregated cluster's draft-model KV should come from: recomputed on the
decode worker (what pdserve does: ``engine.core.drafter`` catches a request's draft KV up
over its first steps) or computed on the prefill worker and shipped with the target's.

    python -m bench.draft_kv [--lengths 256,1024,1536] [--output-len 128] [--json out.json]

The target is ``trained55m`` and the draft its distilled trained preset, int8 (as
``bench.speculative --method draft_model``; ``--model`` and ``--draft`` take others), at
batch 1, greedy, no prefix caching, torch's default threads. For each prompt length, the
same request of ``--output-len`` tokens on three engines with pdserve's own code:

- **plain**: no speculation (the baseline);
- **recompute**: the draft model as a decode worker runs it: the request's draft KV is
  caught up ``CATCH_UP_TOKENS`` a step, and it guesses nothing until it has caught up
  (the engine prefills the prompt itself, but its drafter leaves the prompt chunks
  alone, ``DraftModel.with_prompt_chunks``, as if their KV had come from a prefill
  worker);
- **ship**: the same engine, with each request's draft KV of its prompt written into its
  blocks before its first step guesses — the draft's forward over the prompt in a prefill
  worker's chunks, timed, then ``DraftModel.written`` — so it guesses from its first
  step, as it would with the KV shipped. The draft's forward is the prefill worker's
  share and delays the first token; so do the draft KV's bytes on the wire (pdserve's KV
  plane between two processes, ``bench.handoff.kv_transfer_ms``, all the draft's layers).

The table gives each way's time to the first token and to the last, from the request's
arrival (both omit the target's own handoff, the same either way). Every time is a median
of ``--repeats`` after a warm-up; the three engines' outputs are checked equal. ``--json``
writes every figure.
"""

from __future__ import annotations

import argparse
import math
import statistics
import time
import weakref
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from bench.common import format_table, machine_info, model_facts, write_json
from bench.handoff import kv_transfer_ms
from bench.quality import held_out_windows, trained_model
from bench.speculative import DRAFT_TOKENS
from engine import LLM, SamplingParams
from engine.config import SchedulerConfig
from engine.core.drafter import CATCH_UP_TOKENS
from engine.core.request import Request
from engine.core.runner import ModelRunner
from engine.core.scheduler import ScheduledChunk, SchedulerOutput
from engine.testing.distill import ensure_distilled_draft

PREFILL_CHUNK = SchedulerConfig().max_num_batched_tokens  # a prefill worker's chunks


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m bench.draft_kv", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--lengths", default="256,1024,1536", help="prompt lengths, comma-separated")
    p.add_argument("--model", type=Path, help="the target's checkpoint dir (default: trained55m)")
    p.add_argument("--draft", type=Path, help="the draft's checkpoint dir (default: the "
                   "trained preset distilled from trained55m)")
    p.add_argument("--output-len", type=int, default=128)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--json", type=Path)
    return p.parse_args(argv)


def prefill_draft_kv(runner: ModelRunner, request_id: str, prompt: Sequence[int],
                     blocks: Sequence[int]) -> None:
    """The draft's forward over ``prompt`` into ``blocks``, in a prefill worker's chunks."""
    for first in range(0, len(prompt), PREFILL_CHUNK):
        piece = tuple(prompt[first:first + PREFILL_CHUNK])
        runner.execute([ScheduledChunk(request_id, piece, first, tuple(blocks),
                                       sample=False)])


def forward_ms(runner: ModelRunner, tokens: Sequence[int], block_size: int,
               repeats: int) -> float:
    """Median milliseconds of ``prefill_draft_kv`` over ``tokens`` (blocks from 0:
    nothing else runs)."""
    blocks = range(math.ceil(len(tokens) / block_size))
    times = []
    for repeat in range(repeats + 1):  # the first warms up
        start = time.perf_counter()
        prefill_draft_kv(runner, "draft-kv", tokens, blocks)
        if repeat:
            times.append(time.perf_counter() - start)
    return 1000 * statistics.median(times)


def generate_s(llm: LLM, prompt: list[int], max_tokens: int) -> tuple[float, list[int]]:
    """Seconds for one greedy request of ``max_tokens``, and its tokens."""
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    start = time.perf_counter()
    (result,) = llm.generate([prompt], params)
    return time.perf_counter() - start, list(result.token_ids)


class ShippedDraftKV:
    """Makes a draft-model engine start each request with its prompt's draft KV in place,
    as if it had come with the target's (see the module docstring): before the drafter
    first fills a request's guesses, the draft's forward over its prompt runs in a prefill
    worker's chunks into its blocks, and ``DraftModel.written`` says so."""

    def __init__(self, llm: LLM) -> None:
        drafter = llm.core.drafter
        assert drafter is not None
        self.drafter, self._fill = drafter, drafter.fill
        self._done: weakref.WeakSet[Request] = weakref.WeakSet()
        self.num_requests = 0  # requests whose draft KV it wrote
        drafter.fill = self.fill  # type: ignore[method-assign]

    def fill(self, out: SchedulerOutput, requests: Mapping[str, Request]) -> None:
        for chunk in out.decodes:
            request = requests[chunk.request_id]
            if chunk.num_draft_tokens and request not in self._done:
                self._done.add(request)
                self.num_requests += 1
                prompt = request.prompt_token_ids
                prefill_draft_kv(self.drafter.runner, chunk.request_id, prompt,
                                 chunk.block_ids)
                self.drafter.written(request, len(prompt), chunk.block_ids)
        self._fill(out, requests)


def measure_engines(target: Path, draft: Path, prompts: dict[int, list[int]], output_len: int,
                    repeats: int) -> dict[int, dict[str, float]]:
    """Per prompt length, milliseconds: each engine's request of 1 and ``output_len``
    tokens (``plain_1``, ``spec_N``, ...; ``ship_N`` includes the draft's forward over the
    prompt), the draft's forward over the prompt in a prefill worker's chunks, and how many
    requests the ship engine wrote the draft KV of (``ship_requests``)."""
    config = {"method": "draft_model", "model": str(draft),
              "num_speculative_tokens": DRAFT_TOKENS, "quantization": "int8"}
    found: dict[int, dict[str, float]] = {}
    # no prefix caching: every repeat prefills its prompt again
    with LLM(target, num_kv_blocks=512, enable_prefix_caching=False) as plain, \
            LLM(target, num_kv_blocks=512, enable_prefix_caching=False,
                speculative_config=config) as spec, \
            LLM(target, num_kv_blocks=512, enable_prefix_caching=False,
                speculative_config=config) as ship:
        for llm in (spec, ship):  # prompts prefilled elsewhere: no draft KV beside them
            assert llm.core.drafter is not None
            llm.core.drafter.with_prompt_chunks = False
        shipped = ShippedDraftKV(ship)
        engines = (("plain", plain, (1, output_len)), ("spec", spec, (1, output_len)),
                   ("ship", ship, (output_len,)))
        assert spec.core.drafter is not None
        block_size = spec.config.cache.block_size
        for length, prompt in prompts.items():
            times: dict[str, list[float]] = {}
            for repeat in range(repeats + 1):  # the first warms up
                outputs = {}
                for label, llm, counts in engines if repeat % 2 else engines[::-1]:
                    for n in counts:
                        seconds, tokens = generate_s(llm, prompt, n)
                        outputs[label, n] = tokens
                        if repeat:
                            times.setdefault(f"{label}_{n}", []).append(seconds)
                if len({tuple(t) for (_, n), t in outputs.items() if n == output_len}) != 1:
                    raise SystemExit(f"bench.draft_kv: {length}-token prompt: the engines' "
                                     "outputs differ")
            row = {key: 1000 * statistics.median(v) for key, v in times.items()}
            row["ship_requests"], shipped.num_requests = shipped.num_requests, 0
            row["draft_prefill_ms"] = forward_ms(spec.core.drafter.runner, prompt,
                                                 block_size, repeats)
            spec.core.drafter.blocks.forget(range(math.ceil(len(prompt) / block_size)))
            found[length] = row
            n = output_len
            print(f"  {length}-token prompt: {n} tokens plain {row[f'plain_{n}']:.0f} ms, "
                  f"recompute {row[f'spec_{n}']:.0f} ms, ship {row[f'ship_{n}']:.0f} ms "
                  "(before the wire)", flush=True)
    return found


def compare(length: int, row: dict[str, float], draft_wire_ms: float, output_len: int
            ) -> dict[str, float]:
    """Each way's time to the first token and to the last (ms from the request's arrival),
    beside plain decoding's."""
    n = output_len
    return {
        "prompt_len": length,
        "plain_ttft_ms": row["plain_1"], "plain_last_ms": row[f"plain_{n}"],
        "recompute_ttft_ms": row["spec_1"], "recompute_last_ms": row[f"spec_{n}"],
        "ship_ttft_ms": row["spec_1"] + row["draft_prefill_ms"] + draft_wire_ms,
        "ship_last_ms": row[f"ship_{n}"] + draft_wire_ms,
        "catch_up_steps": catch_up_steps(length),
        "draft_prefill_ms": row["draft_prefill_ms"], "draft_wire_ms": draft_wire_ms,
        "ship_requests": row.get("ship_requests", 0),
    }


def catch_up_steps(prompt_len: int) -> int:
    """Decode steps a lone request of ``prompt_len`` tokens guesses nothing in, its draft KV
    recomputed: each catches up ``CATCH_UP_TOKENS`` while the sequence grows by one, and
    guessing starts in the step whose catch-up reaches its end."""
    return max(0, math.ceil(prompt_len / (CATCH_UP_TOKENS - 1)) - 1)


def main(argv: Sequence[str] | None = None) -> dict[str, Any]:
    args = parse_args(argv)
    lengths = [int(x) for x in args.lengths.split(",")]
    target = args.model or trained_model(preset="trained55m")
    draft = args.draft or ensure_distilled_draft(
        trained_model(), target,
        progress=lambda line: print(f"  distilling the draft: {line}", flush=True))
    limit = model_facts(target)["max_position_embeddings"]
    if max(lengths) + 2 * args.output_len > limit:
        raise SystemExit(f"bench.draft_kv: a {max(lengths)}-token prompt and "
                         f"{2 * args.output_len} tokens exceed the model's {limit} positions")
    print("the engines: plain, the draft's KV recomputed, shipped ...", flush=True)
    (text,) = held_out_windows(target, 1, max(lengths))
    rows = measure_engines(target, draft, {n: text[:n] for n in lengths}, args.output_len,
                           args.repeats)
    print("the draft's KV over the KV plane ...", flush=True)
    facts = model_facts(draft)
    wire = kv_transfer_ms(facts, lengths, repeats=args.repeats,
                          num_layers=facts["num_hidden_layers"])
    table = [compare(n, rows[n], wire[n], args.output_len) for n in lengths]
    print(format_table([[r["prompt_len"], *(f"{r[f'{way}_{at}_ms']:.0f}" for at in ("ttft", "last")
                                            for way in ("plain", "recompute", "ship")),
                         r["catch_up_steps"], f"{r['draft_prefill_ms']:.1f}",
                         f"{r['draft_wire_ms']:.1f}"] for r in table],
                       ["prompt", "TTFT plain", "TTFT recompute", "TTFT ship", "last plain",
                        "last recompute", "last ship", "catch-up steps", "draft prefill",
                        "draft wire"]))
    report = {"target": str(target), "draft": str(draft), "output_len": args.output_len,
              "rows": table, "raw": {str(n): r for n, r in rows.items()},
              "machine": machine_info()}
    print(f"milliseconds from the request's arrival; batch 1, {args.output_len} tokens, "
          f"greedy; machine: {report['machine']}")
    if args.json:
        write_json(args.json, report)
    return report


if __name__ == "__main__":
    main()
