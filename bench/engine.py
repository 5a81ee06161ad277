"""Engine benchmark: pdserve's ``engine.LLM`` against Hugging Face ``generate()``, and its
batch-1 decode step against the memory-bandwidth roofline, in one invocation on the same
random-weight 55M-parameter fp32 Llama (``engine.testing.tiny_model`` preset ``bench55m``).

What is measured (``python -m bench.engine``, defaults in brackets):

- Throughput, both sides: output tokens ÷ wall time from submitting the requests to the
  last token, prefill included, for [32] requests of [64] random prompt token ids and
  [64] output tokens each. Hugging Face runs one ``generate(do_sample=False,
  min_new_tokens=L, max_new_tokens=L)`` over the batch of equal-length prompts (no
  padding); pdserve runs ``LLM.generate`` with greedy, ``ignore_eos`` sampling, prefix
  caching on as users run it. Every round draws fresh prompts (the same for both sides),
  so pdserve gets no prefix cache hits (``num_cached_tokens == 0`` is checked). Each side
  gets a warm-up run (not timed), then both run back to back for [3] repeats, in
  alternating order; the medians are reported and
  ``ratio_vs_hf = pdserve_tok_s / hf_generate_tok_s`` (per-repeat ratios in the JSON).
- Batch-1 decode step: the wall time of ``EngineCore.step()`` while a single request
  (same prompt length) decodes; median over all timed steps.
- Roofline: bytes a decode step must read (every weight except the input embedding, which
  is only gathered, plus the K/V of the context) ÷ the machine's read bandwidth, measured
  in the same run as the best of several ``torch.sum`` passes over a ≥ 1 GiB fp32 buffer
  with the same thread count, interleaved with the step timing and the throughput runs.
  ``roofline_fraction = roofline_step_ms / batch1_step_ms`` (1.0 = at the roofline).
  The host's bandwidth can change within a run (one seen here flips between about 33 and
  55 GB/s): so the fraction of each of the 3 step blocks against the bandwidth sampled
  just before or after it is printed too (``roofline_fraction_by_block``); the headline
  figure stays the strict one, the median step against the run's best bandwidth.

Both sides use the same torch thread count [2] (``--threads``). pdserve's linear kernels
are chosen by measurement at load [auto] (``--linear-kernel`` forces one; see
``engine.kernels.choice``); the CPU model and the kernels chosen are printed next to the
figures. The table is printed; ``--json PATH`` also writes every figure as JSON.
Targets: ``ratio_vs_hf >= 2.0`` and ``roofline_fraction >= 0.6``.
"""

from __future__ import annotations

import argparse
import math
import random
import statistics
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

import engine
from bench import quality, speculative
from bench.common import (
    MIB,
    BandwidthProbe,
    cpu_model,
    format_table,
    load_average,
    machine_info,
    publish,
    timed,
    torch_threads,
)
from engine.config import KV_CACHE_DTYPES, LINEAR_KERNELS, QUANTIZATIONS
from engine.core.runner import ModelRunner
from engine.kernels.cpu import native
from engine.models.decoder_stack import CompiledDecoderStack
from engine.models.layers import linear_layers
from engine.testing.cache import built_once
from engine.testing.tiny_model import (
    _generator_fingerprint,
    default_model_cache_dir,
    make_tiny_model,
)
from engine.tp.executor import LocalExecutor, TPExecutor

BENCH_PRESET = "bench55m"
FIRST_SAFE_TOKEN_ID = 3  # 0..2 are <pad>, <s>, </s>
TARGET_RATIO_VS_HF = 2.0
TARGET_ROOFLINE_FRACTION = 0.6
NOISY_SPREAD = 1.5  # max/min of one side's runs above this: warn
NOISY_START_LOAD = 1.5  # 1-minute load average at start above this: warn


@dataclass
class Results:
    """Raw measurements of one invocation."""

    pdserve_runs_tok_s: list[float] = field(default_factory=list)
    hf_runs_tok_s: list[float] = field(default_factory=list)
    batch1_steps_s: list[float] = field(default_factory=list)
    batch1_context_lens: list[int] = field(default_factory=list)
    # per batch-1 block: (its median step in s, the best bandwidth just before or after it)
    batch1_blocks: list[tuple[float, float]] = field(default_factory=list)
    load_1m_runs: list[float] = field(default_factory=list)  # 1-minute load after each repeat


# ---------------------------------------------------------------- setup


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m bench.engine", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--speculative", metavar="CONFIG", nargs="?", const="",
                   help="measure speculative decoding instead (bench.speculative: acceptance "
                        "and speedup per workload) with CONFIG, vLLM's speculative_config as "
                        "JSON (default: n-gram, 4 tokens); bench.speculative's flags follow")
    p.add_argument("--model", type=Path, default=None,
                   help="checkpoint dir (default: the bench55m Llama, built once into the cache)")
    p.add_argument("--num-requests", type=int, default=32)
    p.add_argument("--prompt-len", type=int, default=64)
    p.add_argument("--output-len", type=int, default=64)
    p.add_argument("--repeats", type=int, default=3, help="timed runs per side (median taken)")
    p.add_argument("--threads", type=int, default=2, help="torch threads, both sides")
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    p.add_argument("--skip-hf", action="store_true", help="do not run Hugging Face generate()")
    p.add_argument("--linear-kernel", default="auto", choices=list(LINEAR_KERNELS),
                   help="pdserve's linear kernel (auto: chosen by measurement, cached)")
    p.add_argument("--quantization", choices=QUANTIZATIONS,
                   help="pdserve's weights: int8 (weight-only, quantised at load; its kernels "
                        "are int8_*); default: as loaded")
    p.add_argument("--kv-cache-dtype", choices=KV_CACHE_DTYPES, default="auto",
                   help="pdserve's KV cache: int8 (values and a scale per token and head); "
                        "auto: the model's dtype")
    p.add_argument("--skip-quality", action="store_true",
                   help="with --quantization: skip its quality against fp32 on the trained "
                        "model (bench.quality; the model trains for a few minutes once)")
    p.add_argument("--batch1-steps", type=int, default=48,
                   help="timed batch-1 decode steps (split into 3 blocks between bandwidth passes)")
    p.add_argument("--bandwidth-mib", type=int, default=1024, help="bandwidth buffer size (MiB)")
    p.add_argument("--bandwidth-passes", type=int, default=3, help="passes per bandwidth sample")
    p.add_argument("--seed", type=int, default=0, help="seed of the random prompts")
    p.add_argument("--json", type=Path, default=None, help="also write the results here")
    args = p.parse_args(argv)
    for name in ("num_requests", "prompt_len", "output_len", "repeats", "threads",
                 "batch1_steps", "bandwidth_mib", "bandwidth_passes"):
        if getattr(args, name) < 1:
            p.error(f"--{name.replace('_', '-')} must be at least 1")
    return args


def ensure_bench_model() -> Path:
    """The bench55m Llama (seed 0) in the model cache, built on first use: written to a
    temporary sibling and renamed into place, so a present directory is complete."""
    def build(tmp: Path) -> None:
        print(f"building {BENCH_PRESET} into the model cache (once) ...", flush=True)
        make_tiny_model(tmp, arch="llama", preset=BENCH_PRESET, seed=0)

    return built_once(default_model_cache_dir() / f"{BENCH_PRESET}-llama-seed0-"
                      f"{_generator_fingerprint()}", build)


class PromptSource:
    """Distinct random token-id prompts: every call draws new ones (no prefix-cache hits)."""

    def __init__(self, seed: int, vocab_size: int, prompt_len: int) -> None:
        self.rng = random.Random(seed)
        self.high = vocab_size  # exclusive
        self.prompt_len = prompt_len

    def draw(self, num: int) -> list[list[int]]:
        return [[self.rng.randrange(FIRST_SAFE_TOKEN_ID, self.high) for _ in range(self.prompt_len)]
                for _ in range(num)]


# ---------------------------------------------------------------- the two sides


def load_hf(model_dir: Path, dtype: str) -> Any:
    import transformers
    from transformers import AutoModelForCausalLM

    transformers.logging.set_verbosity_error()
    transformers.logging.disable_progress_bar()
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=getattr(torch, dtype))
    return model.eval()


def run_hf(model: Any, prompts: list[list[int]], output_len: int) -> float:
    """One batched greedy ``generate()``; returns output tokens per second."""
    input_ids = torch.tensor(prompts, dtype=torch.long)
    mask = torch.ones_like(input_ids)
    elapsed, out = timed(lambda: model.generate(
        input_ids=input_ids, attention_mask=mask, do_sample=False,
        min_new_tokens=output_len, max_new_tokens=output_len, pad_token_id=0))
    expected = (len(prompts), input_ids.shape[1] + output_len)
    if tuple(out.shape) != expected:
        raise RuntimeError(f"HF generate returned shape {tuple(out.shape)}, expected {expected}")
    return len(prompts) * output_len / elapsed


def run_pdserve(llm: engine.LLM, prompts: list[list[int]], output_len: int) -> float:
    """``LLM.generate`` over all prompts at once; returns output tokens per second."""
    params = engine.SamplingParams(max_tokens=output_len, temperature=0.0, ignore_eos=True)
    elapsed, results = timed(lambda: llm.generate(prompts, params))
    cached = [r.num_cached_tokens for r in results]
    if any(cached):
        raise RuntimeError(f"pdserve prompts hit the prefix cache (num_cached_tokens {cached})")
    lengths = {len(r.token_ids) for r in results}
    if lengths != {output_len}:
        raise RuntimeError(f"pdserve produced {sorted(lengths)} tokens, expected {output_len}")
    return len(prompts) * output_len / elapsed


def time_batch1_block(llm: engine.LLM, prompt: list[int], num_steps: int,
                      results: Results) -> None:
    """Decode one request alone; record each decode step's time (the prefill step and
    the first token are not timed) and the context length it attended over."""
    core = llm.core
    rid = core.new_request_id()
    core.add_request(rid, prompt, engine.SamplingParams(
        max_tokens=num_steps + 1, temperature=0.0, ignore_eos=True))
    core.step()  # prefill + first token
    context = len(prompt) + 1  # the token fed to the next step is at position len(prompt)
    while core.has_unfinished():
        elapsed, _ = timed(core.step)
        results.batch1_steps_s.append(elapsed)
        results.batch1_context_lens.append(context)
        context += 1


# ---------------------------------------------------------------- roofline


def weight_bytes(model: torch.nn.Module) -> tuple[int, int, int]:
    """(parameter count, weight bytes held, bytes a decode step reads): every
    parameter once, the input embedding only where it doubles as the (tied) output head,
    and each linear's weight as its kernel reads it (int8 and scales where quantised)."""
    params = {id(p): p for p in model.parameters()}.values()
    total = sum(p.numel() * p.element_size() for p in params)
    linears = linear_layers(model)
    released = [layer for layer in linears if layer.weight.numel() == 0]  # int8: freed
    count = sum(p.numel() for p in params) + sum(math.prod(layer.weight_shape) for layer in released)
    total += sum(layer.weight_read_bytes for layer in released)
    embedding = model.get_parameter("embed_tokens.weight")
    skip = {id(embedding), *(id(layer.weight) for layer in linears)}
    read = sum(p.numel() * p.element_size() for p in params if id(p) not in skip)
    read += sum(layer.weight_read_bytes for layer in linears)
    return count, total, read


def model_runner(llm: engine.LLM) -> ModelRunner:
    """The (leader rank's) model runner, which holds the torch model and the KV cache."""
    executor = llm.core.executor
    if not isinstance(executor, LocalExecutor | TPExecutor):
        raise TypeError(f"cannot find the model runner of a {type(executor).__name__}")
    return executor.runner


def kernel_facts(llm: engine.LLM) -> dict[str, Any]:
    """The linear kernels pdserve runs, where the choice came from and what it cost at
    load; the attention backend; the compiled CPU kernels' library (``None``: not built)
    and the largest decode batch the compiled decoder stack takes (0: none)."""
    executor = llm.core.executor
    assert isinstance(executor, LocalExecutor | TPExecutor)
    plan = executor.kernel_plan
    runner = model_runner(llm)
    # the compiled kernels take fp32 CPU tensors only: for other models they do not run
    fp32_cpu = runner.dtype == torch.float32 and runner.device.type == "cpu"
    compiled = native() if fp32_cpu else None
    stack = CompiledDecoderStack.build(runner.model) if compiled is not None else None
    return {
        "attention_backend": runner.backend.name,
        "cpu_kernels_library": compiled.path if compiled is not None else None,
        "decoder_stack_max_batch": stack.max_rows if stack is not None else 0,
        "linear_kernel": plan.summary,
        "linear_kernel_source": plan.source,
        "linear_kernel_plan": [{"out_features": o, "in_features": i, "kernel": k}
                               for o, i, k in plan.kernels],
        "kernel_choice_s": executor.kernel_choice_s,
    }


def compiled_summary(out: dict[str, Any]) -> str:
    """One line part: the attention backend, and whether the compiled kernels run."""
    library, stack = out["cpu_kernels_library"], out["decoder_stack_max_batch"]
    if not library:
        return f"attention {out['attention_backend']}, compiled CPU kernels off (torch kernels)"
    return (f"attention {out['attention_backend']}, compiled CPU kernels on, decoder stack "
            + (f"in one call up to batch {stack}" if stack else "per layer"))


def kv_bytes_read(llm: engine.LLM, context_len: int) -> int:
    """K and V bytes one decode step reads at ``context_len`` tokens, all layers."""
    kv = model_runner(llm).kv_cache  # [layers, 2, blocks, block, heads, head_dim]
    layers, two, _, _, heads, head_dim = kv.shape
    return layers * two * heads * head_dim * kv.element_size() * context_len


# ---------------------------------------------------------------- the run


def measure(args: argparse.Namespace, model_dir: Path, probe: BandwidthProbe
            ) -> tuple[Results, engine.LLM]:
    """Throughput runs of both sides, then batch-1 decode blocks; bandwidth passes in
    between. Returns the measurements and the (still running) engine."""
    results = Results()
    llm = engine.LLM(model_dir, dtype=args.dtype, linear_kernel=args.linear_kernel,
                     quantization=args.quantization, kv_cache_dtype=args.kv_cache_dtype)
    prompts = PromptSource(args.seed, llm.tokenizer.vocab_size, args.prompt_len)
    hf = None if args.skip_hf else load_hf(model_dir, args.dtype)
    measure_throughput(args, llm, hf, prompts, probe, results)
    del hf
    measure_batch1(args, llm, prompts, probe, results)
    return results, llm


def measure_throughput(args: argparse.Namespace, llm: engine.LLM, hf: Any, prompts: PromptSource,
                       probe: BandwidthProbe, results: Results) -> None:
    """One untimed warm-up per side, then ``repeats`` rounds of both sides on the same fresh
    prompts (HF first in even rounds, pdserve first in odd ones), with a bandwidth sample
    after each round."""
    warm_len = min(args.output_len, 8)
    probe.measure(args.bandwidth_passes)
    if hf is not None:
        run_hf(hf, prompts.draw(args.num_requests), warm_len)
    run_pdserve(llm, prompts.draw(args.num_requests), warm_len)
    for repeat in range(args.repeats):
        batch = prompts.draw(args.num_requests)
        if repeat % 2:
            results.pdserve_runs_tok_s.append(run_pdserve(llm, batch, args.output_len))
        if hf is not None:
            results.hf_runs_tok_s.append(run_hf(hf, batch, args.output_len))
        if not repeat % 2:
            results.pdserve_runs_tok_s.append(run_pdserve(llm, batch, args.output_len))
        results.load_1m_runs.append(round(load_average()[0], 2))
        print(f"repeat {repeat + 1}/{args.repeats}: pdserve {results.pdserve_runs_tok_s[-1]:.1f} "
              f"tok/s" + (f", HF {results.hf_runs_tok_s[-1]:.1f} tok/s" if hf else "")
              + f" (load {results.load_1m_runs[-1]})", flush=True)
        probe.measure(args.bandwidth_passes)


def measure_batch1(args: argparse.Namespace, llm: engine.LLM, prompts: PromptSource,
                   probe: BandwidthProbe, results: Results) -> None:
    """A short untimed warm-up, then the timed decode steps in 3 blocks (one request each),
    each block preceded and the last one followed by a bandwidth sample; each block is
    also kept with the bandwidth sampled next to it (the host's bandwidth can move
    within one run)."""
    time_batch1_block(llm, prompts.draw(1)[0], 4, Results())
    before = probe.measure(args.bandwidth_passes)
    for block in range(3):
        steps = args.batch1_steps // 3 + (block < args.batch1_steps % 3)
        first = len(results.batch1_steps_s)
        if steps:
            time_batch1_block(llm, prompts.draw(1)[0], steps, results)
        after = probe.measure(args.bandwidth_passes)
        if steps:
            block_steps = results.batch1_steps_s[first:]
            results.batch1_blocks.append((statistics.median(block_steps), max(before, after)))
        before = after


def summarize_run(args: argparse.Namespace, model_dir: Path, results: Results, llm: engine.LLM,
                  probe: BandwidthProbe) -> dict[str, Any]:
    params, total_bytes, read_bytes = weight_bytes(model_runner(llm).model)
    context = statistics.median(results.batch1_context_lens)
    kv_bytes = kv_bytes_read(llm, round(context))
    bandwidth = probe.best_gbps
    step_ms = statistics.median(results.batch1_steps_s) * 1e3
    roofline_ms = (read_bytes + kv_bytes) / (bandwidth * 1e9) * 1e3
    pdserve = statistics.median(results.pdserve_runs_tok_s)
    hf = statistics.median(results.hf_runs_tok_s) if results.hf_runs_tok_s else None
    return {
        "cpu_model": cpu_model(),
        **kernel_facts(llm),
        "pdserve_tok_s": pdserve,
        "hf_generate_tok_s": hf,
        "ratio_vs_hf": pdserve / hf if hf else None,
        "batch1_step_ms": step_ms,
        "roofline_step_ms": roofline_ms,
        "roofline_fraction": roofline_ms / step_ms,
        # each block against the bandwidth sampled next to it, not the run's best
        "roofline_fraction_by_block": [
            (read_bytes + kv_bytes) / (gbps * 1e9) / step_s for step_s, gbps in results.batch1_blocks],
        "bandwidth_by_block_gbps": [gbps for _, gbps in results.batch1_blocks],
        "pdserve_runs_tok_s": results.pdserve_runs_tok_s,
        "hf_runs_tok_s": results.hf_runs_tok_s,
        # each repeat runs both sides back to back: per-repeat ratios resist drifting load
        "ratio_vs_hf_runs": [p / h for p, h in zip(results.pdserve_runs_tok_s, results.hf_runs_tok_s)],
        "load_1m_runs": results.load_1m_runs,
        "batch1_steps_ms": [s * 1e3 for s in results.batch1_steps_s],
        "batch1_median_context_len": context,
        "bandwidth_gbps": bandwidth,
        "bandwidth_samples_gbps": probe.samples_gbps,
        "bandwidth_buffer_bytes": probe.num_bytes,
        "model_dir": str(model_dir),
        "model_params": params,
        "weight_bytes": total_bytes,
        "weight_bytes_per_step": read_bytes,
        "kv_bytes_per_step": kv_bytes,
        "dtype": args.dtype,
        "quantization": args.quantization,
        "kv_cache_dtype": args.kv_cache_dtype,
        "threads": torch.get_num_threads(),
        "num_requests": args.num_requests,
        "prompt_len": args.prompt_len,
        "output_len": args.output_len,
        "repeats": args.repeats,
        "targets": {"ratio_vs_hf": TARGET_RATIO_VS_HF, "roofline_fraction": TARGET_ROOFLINE_FRACTION},
    }


def render(out: dict[str, Any]) -> str:
    n, pl, ol = out["num_requests"], out["prompt_len"], out["output_len"]
    machine = out["machine"]
    head = [
        f"model     {out['model_dir']}",
        f"          {out['model_params'] / 1e6:.1f}M params, {out['weight_bytes'] / 1e6:.1f} MB, "
        f"{out['dtype']}{', int8 weights' if out.get('quantization') else ''}"
        f"{', ' + out['kv_cache_dtype'] + ' KV cache' if out.get('kv_cache_dtype', 'auto') != 'auto' else ''}; "
        f"{out['weight_bytes_per_step'] / 1e6:.1f} MB read per decode step",
        f"machine   {machine['cpu_model']}, {machine['cpu_count']} CPUs, torch threads "
        f"{out['threads']}, load avg at start {machine['load_avg_1m_5m_15m']}, "
        f"at end {out['load_avg_end']}",
        f"kernels   {out['linear_kernel']} ({out['linear_kernel_source']}, "
        f"{out['kernel_choice_s'] * 1e3:.0f} ms to choose at load) on {out['cpu_model']}; "
        f"{compiled_summary(out)}",
        f"bandwidth {out['bandwidth_gbps']:.2f} GB/s (best of "
        f"{[round(x, 1) for x in out['bandwidth_samples_gbps']]}, "
        f"{out['bandwidth_buffer_bytes'] / MIB:.0f} MiB torch.sum passes)",
        f"load      1-min load after each repeat {out['load_1m_runs']}",
    ]
    hf, ratio = out["hf_generate_tok_s"], out["ratio_vs_hf"]
    runs = [round(x, 1) for x in out["pdserve_runs_tok_s"]]
    rows: list[list[Any]] = [
        [f"pdserve engine.LLM, {n} req x {pl} in / {ol} out", "tok/s", out["pdserve_tok_s"],
         "", str(runs)],
        [f"HF generate(), batch {n}", "tok/s", hf if hf is not None else "skipped", "",
         str([round(x, 1) for x in out["hf_runs_tok_s"]])],
        ["ratio_vs_hf (of medians)", "x", ratio if ratio is not None else "-",
         f">= {TARGET_RATIO_VS_HF}", "per repeat " + str([round(x, 2) for x in out["ratio_vs_hf_runs"]])],
        ["batch-1 decode step (median)", "ms", out["batch1_step_ms"], "",
         f"{len(out['batch1_steps_ms'])} steps, ctx ~{out['batch1_median_context_len']:.0f}"],
        ["roofline step (bytes / bandwidth)", "ms", out["roofline_step_ms"], "",
         f"{(out['weight_bytes_per_step'] + out['kv_bytes_per_step']) / 1e6:.1f} MB"],
        ["roofline_fraction", "", out["roofline_fraction"], f">= {TARGET_ROOFLINE_FRACTION}",
         "by block " + str([round(x, 2) for x in out["roofline_fraction_by_block"]]) + " at "
         + str([round(x) for x in out["bandwidth_by_block_gbps"]]) + " GB/s"],
    ]
    if out.get("quality"):
        q = out["quality"]
        rows += [[f"{q.get('what') or q['quantization']} top-1 agreement with fp32", "", round(q["top1_agreement"], 4),
                  f">= {q['target_top1_agreement']}",
                  f"trained model, {q['positions']} held-out tokens, teacher-forced"],
                 [f"{q.get('what') or q['quantization']} mean KL from fp32", "nats", f"{q['mean_kl']:.1e}", "",
                  f"max {q['max_kl']:.4f}"]]
    table = format_table(rows, ["metric", "unit", "value", "target", "runs / notes"])
    warnings = [f"WARNING: {w}" for w in out["noise_warnings"]]
    return "\n".join(head) + "\n\n" + table + "".join("\n" + w for w in warnings)


def noise_warnings(out: dict[str, Any]) -> list[str]:
    """Signs that other work shared the cores (2 OpenMP threads stall badly when a core is
    taken: one HF run has been seen at 1/30 of its quiet speed)."""
    found = []
    for key in ("pdserve_runs_tok_s", "hf_runs_tok_s"):
        runs = out[key]
        if len(runs) > 1 and max(runs) > NOISY_SPREAD * min(runs):
            found.append(f"{key} spread {min(runs):.1f}..{max(runs):.1f} (> {NOISY_SPREAD}x)")
    start_load = out["machine"]["load_avg_1m_5m_15m"][0]
    if start_load > NOISY_START_LOAD:
        found.append(f"1-min load {start_load} at start (> {NOISY_START_LOAD})")
    if found:
        found.append("the machine was busy: rerun when it is quiet before trusting the ratios")
    return found


def main(argv: Sequence[str] | None = None) -> dict[str, Any]:
    """Run the benchmark, print the table, write ``--json``; returns the results dict.
    ``--speculative [CONFIG]`` runs ``bench.speculative`` instead, with the flags after it."""
    argv = list(sys.argv[1:] if argv is None else argv)
    if "--speculative" in argv:
        i = argv.index("--speculative")
        given = i + 1 < len(argv) and not argv[i + 1].startswith("--")
        config = ["--speculative-config", argv[i + 1]] if given else []
        return speculative.main([*config, *argv[:i], *argv[i + (2 if given else 1):]])
    args = parse_args(argv)
    started = time.perf_counter()
    machine = machine_info()
    model_dir = args.model if args.model is not None else ensure_bench_model()
    with torch_threads(args.threads):
        probe = BandwidthProbe(args.bandwidth_mib * MIB, args.threads)
        results, llm = measure(args, model_dir, probe)
        try:
            out = summarize_run(args, model_dir, results, llm, probe)
        finally:
            llm.shutdown()
            probe.release()
        if (args.quantization or args.kv_cache_dtype != "auto") and not args.skip_quality:
            out["quality"] = quality.measure(  # on the trained model (bench.quality)
                args.quantization, kv_cache_dtype=args.kv_cache_dtype)
    out["machine"] = machine
    out["load_avg_end"] = [round(x, 2) for x in load_average()]
    out["elapsed_s"] = time.perf_counter() - started
    out["noise_warnings"] = noise_warnings(out)
    publish(render(out), args.json, out)
    return out


if __name__ == "__main__":
    main(sys.argv[1:])
