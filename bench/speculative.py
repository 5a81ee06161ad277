"""Speculative decoding: ``python -m bench.speculative`` measures, per workload, how many
guessed tokens the target keeps and what that does to decode speed, with n-gram lookup
(``--method ngram``, the default) or a draft model (``--method draft_model``).

The target is a trained preset (random weights never repeat their prompt, and a draft
cannot predict them): ``--target trained55m`` (the default: bench55m's layers, about 27M
parameters, so a decode step is bound by reading the weights rather than by overhead;
built and cached on first use, about 30 minutes here) or ``trained`` (5M parameters,
whose step costs its overhead). The draft model (``--draft`` another checkpoint with the
same vocabulary) is the ``trained`` preset, a fifth of the target's size, distilled from
``trained55m`` on the same text (``engine.testing.distill``: two small models trained
apart agree on too few tokens; built and cached on first use, about 20 minutes here).
Greedy, ``--output-len`` [128] tokens per request, at batch 1 and ``--batch`` [8]:

- ``input-grounded``: each prompt is a passage of the held-out standard-library text
  followed by its first ``--repeat-len`` [96] tokens again, so the model's continuation
  can copy the passage (as a summary quoting its source, or an edit, repeats its prompt);
- ``free-text``: the passage alone, continued.

Per workload and batch: tokens/s without and with speculation (``engine.LLM.generate``,
prefill included; median of [3] repeats in alternating order), the speedup, the
acceptance rate (guesses kept ÷ guessed) and the tokens a speculated step emits on
average. The outputs are checked equal (greedy). ``--speculative-config`` (vLLM's JSON)
overrides the method's default: n-gram, 4 tokens, suffixes of 1..3; draft model, 4
tokens, its weights in int8 (a draft pass then reads a quarter of the bytes).
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from bench.common import format_table, machine_info, write_json
from bench.quality import trained_model
from engine import LLM, SamplingParams
from engine.testing.distill import ensure_distilled_draft
from engine.testing.training import held_out_text
from engine.text.tokenizer import load_tokenizer

DEFAULT_CONFIG = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 3}
DRAFT_TOKENS = 4  # the draft model's default guesses a step


def workloads(model_dir: Path, batch: int, passage_len: int, repeat_len: int
              ) -> dict[str, list[list[int]]]:
    """Each workload's ``batch`` prompts (see the module docstring)."""
    tokenizer = load_tokenizer(model_dir)
    ids = list(tokenizer.tokenizer.encode(held_out_text(), add_special_tokens=False).ids)
    passages = [ids[i * passage_len:(i + 1) * passage_len] for i in range(batch)]
    return {"input-grounded": [p + p[:repeat_len] for p in passages], "free-text": passages}


def run(llm: LLM, prompts: list[list[int]], output_len: int) -> tuple[float, list[list[int]]]:
    """Seconds for ``prompts`` at once, and their tokens."""
    params = SamplingParams(max_tokens=output_len, temperature=0.0, ignore_eos=True)
    start = time.perf_counter()
    results = llm.generate(prompts, params)
    return time.perf_counter() - start, [r.token_ids for r in results]


def measure(model_dir: Path, config: dict[str, Any], args: argparse.Namespace
            ) -> list[dict[str, Any]]:
    rows = []
    with LLM(model_dir, num_kv_blocks=1024) as plain, \
            LLM(model_dir, num_kv_blocks=1024, speculative_config=config) as spec:
        for batch in (1, args.batch):
            for name, prompts in workloads(model_dir, batch, args.passage_len,
                                           args.repeat_len).items():
                times: dict[str, list[float]] = {"plain": [], "spec": []}
                outputs = {}
                for repeat in range(args.repeats + 1):  # the first warms up
                    order = (("plain", plain), ("spec", spec))
                    for label, llm in order if repeat % 2 else order[::-1]:
                        before = (llm.stats.num_draft_tokens, llm.stats.num_accepted_tokens,
                                  llm.stats.num_steps)
                        seconds, outputs[label] = run(llm, prompts, args.output_len)
                        if repeat:
                            times[label].append(seconds)
                        if label == "spec":
                            drafted = llm.stats.num_draft_tokens - before[0]
                            kept = llm.stats.num_accepted_tokens - before[1]
                if outputs["plain"] != outputs["spec"]:
                    raise SystemExit(f"bench.speculative: {name} at batch {batch}: the "
                                     "speculative output differs from the plain one")
                tokens = batch * args.output_len
                plain_s, spec_s = (statistics.median(times[k]) for k in ("plain", "spec"))
                rows.append({"workload": name, "batch": batch,
                             "plain_tok_s": tokens / plain_s, "spec_tok_s": tokens / spec_s,
                             "speedup": plain_s / spec_s,
                             "acceptance_rate": kept / drafted if drafted else 0.0,
                             "drafted": drafted, "kept": kept})
                print(f"  {name}, batch {batch}: speedup {plain_s / spec_s:.2f}x, "
                      f"acceptance {rows[-1]['acceptance_rate']:.2f}", flush=True)
    return rows


def default_draft(args: argparse.Namespace) -> Path:
    """The draft of ``--target trained55m``: the trained preset distilled from it
    (``engine.testing.distill``; built and cached on first use, minutes)."""
    if args.model is not None or args.target != "trained55m":
        raise SystemExit("bench.speculative: --method draft_model needs --draft DIR for a "
                         "target other than trained55m")
    return ensure_distilled_draft(
        trained_model(), trained_model(preset="trained55m"),
        progress=lambda line: print(f"  distilling the draft: {line}", flush=True))


def main(argv: Sequence[str] | None = None) -> dict[str, Any]:
    p = argparse.ArgumentParser(prog="python -m bench.speculative", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", type=Path, help="the target's checkpoint dir (default: "
                   "--target's preset)")
    p.add_argument("--target", choices=("trained55m", "trained"), default="trained55m")
    p.add_argument("--method", choices=("ngram", "draft_model"), default="ngram")
    p.add_argument("--draft", type=Path, help="draft_model's checkpoint dir (default: the "
                   "trained preset distilled from trained55m)")
    p.add_argument("--speculative-config", help="vLLM's speculative_config as JSON "
                   "(default: --method's)")
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--passage-len", type=int, default=192)
    p.add_argument("--repeat-len", type=int, default=96)
    p.add_argument("--output-len", type=int, default=128)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--json", type=Path)
    args = p.parse_args(argv)
    model_dir = args.model or trained_model(preset=args.target)
    if args.speculative_config is not None:
        config = json.loads(args.speculative_config)
    elif args.method == "draft_model":
        config = {"method": "draft_model", "model": str(args.draft or default_draft(args)),
                  "num_speculative_tokens": DRAFT_TOKENS, "quantization": "int8"}
    else:
        config = DEFAULT_CONFIG
    rows = measure(model_dir, config, args)
    print(format_table([[r["workload"], r["batch"], f"{r['plain_tok_s']:.0f}",
                         f"{r['spec_tok_s']:.0f}", f"{r['speedup']:.2f}",
                         f"{r['acceptance_rate']:.2f}", r["kept"], r["drafted"]] for r in rows],
                       ["workload", "batch", "plain tok/s", "speculative tok/s", "speedup",
                        "acceptance", "kept", "guessed"]))
    report = {"model_dir": str(model_dir), "speculative_config": config, "rows": rows,
              "machine": machine_info(), "settings": {k: str(v) for k, v in vars(args).items()}}
    print(f"machine: {report['machine']}")
    if args.json:
        write_json(args.json, report)
    return report


if __name__ == "__main__":
    main()
