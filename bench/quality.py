"""Quantisation quality: ``python -m bench.quality`` compares a quantised engine's
next-token distributions with fp32's, teacher-forced, on the ``trained`` preset (a small
Llama trained on the standard library's sources; random weights have near-tied logits
that any rounding flips, so they say nothing here).

What is measured (defaults in brackets): [8] windows of [256] tokens of the held-out
standard-library text (never trained on), each run as one prefill with every position's
logits (with ``--kv-cache-dtype int8``: a token at a time, every earlier position read
from the int8 cache; with ``--kv-transfer-dtype int8``: the window's first half prefilled in
fp32, its KV quantised and dequantised as the wire does, the second half decoded a token at
a time in fp32, against the same without the wire, on the second half only); per position, whether the quantised engine's most likely next token is fp32's
(``top1_agreement``) and the KL divergence of its distribution from fp32's
(``mean_kl``, nats; ``max_kl``). ``bench.engine --quantization int8`` reports the same
beside its speed figures. Building the trained model takes a few minutes once (cached).
"""

from __future__ import annotations

import argparse
import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

from engine.attention.kv_quant import dequantize, quantize
from engine.config import (
    KV_CACHE_DTYPES,
    KV_TRANSFER_DTYPES,
    QUANTIZATIONS,
    CacheConfig,
    EngineConfig,
    SchedulerConfig,
    load_model_config,
)
from engine.core.runner import ModelRunner
from engine.core.scheduler import ScheduledChunk
from engine.kernels.choice import choose_kernel_plan
from engine.testing.tiny_model import ensure_cached_model
from engine.testing.training import held_out_text
from engine.text.tokenizer import load_tokenizer
from engine.tp.distributed import Group

TARGET_TOP1_AGREEMENT = 0.97
BLOCK = 16


def trained_model(progress: bool = True, preset: str = "trained") -> Path:
    """A trained preset (``trained``, or ``trained55m``) in the model cache (trained on
    first use, with progress)."""
    return ensure_cached_model(preset=preset,
                               progress=(lambda line: print(f"  training {preset}: {line}",
                                                            flush=True))
                               if progress else None)


def held_out_windows(model_dir: Path, count: int, length: int) -> list[list[int]]:
    """``count`` consecutive windows of ``length`` tokens of the held-out text."""
    tokenizer = load_tokenizer(model_dir)
    ids = list(tokenizer.tokenizer.encode(held_out_text(), add_special_tokens=False).ids)
    if len(ids) < count * length:
        raise ValueError(f"the held-out text has {len(ids)} tokens, fewer than "
                         f"{count} x {length}")
    return [ids[i * length:(i + 1) * length] for i in range(count)]


def teacher_forced_logits(model_dir: Path, windows: Sequence[Sequence[int]],
                          quantization: str | None = None, kv_cache_dtype: str = "auto",
                          step: int | None = None, wire: tuple[int, bool] | None = None
                          ) -> torch.Tensor:
    """``[windows, length, vocab]``: the engine's logits at every position of each
    window (the measured kernel plan of this configuration): one prefill per window, or
    (``step``) chunks of ``step`` tokens, each attending to the earlier ones through the
    KV cache — ``step`` 1 reads every earlier position from the cache, as decoding does.
    ``wire`` (prompt tokens, lossy): a handoff — the first ``prompt`` tokens prefilled at
    once, their KV quantised and dequantised as ``kv_transfer_dtype="int8"`` moves it when
    ``lossy``, the rest a token at a time."""
    length = max(len(w) for w in windows)
    config = EngineConfig(model=load_model_config(model_dir), quantization=quantization,
                          cache=CacheConfig(block_size=BLOCK, kv_cache_dtype=kv_cache_dtype),
                          scheduler=SchedulerConfig(max_num_batched_tokens=length))
    blocks = -(-length // BLOCK)
    runner = ModelRunner(config, Group.single(), blocks,
                         choose_kernel_plan(config, torch.get_num_threads()))
    out = []
    step = step or length

    def run(name: str, window: Sequence[int], start: int, end: int) -> torch.Tensor:
        return runner.execute([ScheduledChunk(name, tuple(window[start:end]), start,
                                              tuple(range(blocks)), True, all_logits=True)])

    with torch.inference_mode():
        for i, window in enumerate(windows):
            if wire is None:
                out.append(torch.cat([run(f"w{i}", window, s, s + step)
                                      for s in range(0, len(window), step)]))
                continue
            prompt, lossy = wire
            parts = [run(f"w{i}", window, 0, prompt)]
            if lossy:
                runner.kv_cache.copy_(dequantize(quantize(runner.kv_cache)))
            parts += [run(f"w{i}", window, s, s + 1) for s in range(prompt, len(window))]
            out.append(torch.cat(parts))
    return torch.stack(out)


def compare(reference: torch.Tensor, other: torch.Tensor) -> dict[str, float]:
    """Top-1 agreement and KL(reference || other) per position, over every position."""
    ref_logp = torch.log_softmax(reference.double(), dim=-1)
    other_logp = torch.log_softmax(other.double(), dim=-1)
    kl = (ref_logp.exp() * (ref_logp - other_logp)).sum(-1)
    agree = (reference.argmax(-1) == other.argmax(-1)).double().mean()
    return {"top1_agreement": float(agree), "mean_kl": float(kl.mean()),
            "max_kl": float(kl.max()), "positions": int(kl.numel())}


def measure(quantization: str | None, windows: int = 8, length: int = 256,
            model_dir: Path | None = None, kv_cache_dtype: str = "auto",
            kv_transfer_dtype: str = "auto") -> dict[str, Any]:
    """``compare`` of ``quantization`` (weights) and ``kv_cache_dtype`` against fp32 on
    ``model_dir`` (default: the trained preset), plus what was measured on. With an int8
    KV cache both sides run a token at a time (every earlier position read from the
    cache, as decoding reads it); otherwise one prefill per window. With
    ``kv_transfer_dtype`` int8 both sides hand off after the window's first half (see
    ``teacher_forced_logits``), only the lossy one through the wire's quantiser, and the
    second half's positions are compared."""
    model_dir = model_dir or trained_model()
    tokens = held_out_windows(model_dir, windows, length)
    step = 1 if kv_cache_dtype != "auto" else None
    prompt = length // 2 if kv_transfer_dtype != "auto" else None
    fp32 = teacher_forced_logits(model_dir, tokens, step=step,
                                 wire=None if prompt is None else (prompt, False))
    quantised = teacher_forced_logits(model_dir, tokens, quantization, kv_cache_dtype, step,
                                      wire=None if prompt is None else (prompt, True))
    if prompt is not None:  # the prompt's own logits come from the prefill: unchanged
        fp32, quantised = fp32[:, prompt:], quantised[:, prompt:]
    what = " + ".join([*([f"{quantization} weights"] if quantization else []),
                       *([f"{kv_cache_dtype} KV cache"] if kv_cache_dtype != "auto" else []),
                       *([f"{kv_transfer_dtype} KV transfer"]
                         if kv_transfer_dtype != "auto" else [])])
    return {**compare(fp32, quantised), "quantization": quantization,
            "kv_cache_dtype": kv_cache_dtype, "kv_transfer_dtype": kv_transfer_dtype,
            "what": what, "model_dir": str(model_dir), "windows": windows,
            "window_tokens": length, "target_top1_agreement": TARGET_TOP1_AGREEMENT}


def render(result: dict[str, Any]) -> str:
    met = "met" if result["top1_agreement"] >= TARGET_TOP1_AGREEMENT else "NOT met"
    what = result.get("what") or result["quantization"]
    return (f"{what} vs fp32, teacher-forced on {result['positions']} held-out "
            f"tokens of the trained model: top-1 agreement {result['top1_agreement']:.4f} "
            f"(target >= {TARGET_TOP1_AGREEMENT}: {met}), mean KL {result['mean_kl']:.2g} "
            f"nats, max {result['max_kl']:.2g}")


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.quality", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quantization", choices=QUANTIZATIONS,
                   help="the weights (default: int8 unless a KV dtype is given)")
    p.add_argument("--kv-cache-dtype", choices=KV_CACHE_DTYPES, default="auto")
    p.add_argument("--kv-transfer-dtype", choices=KV_TRANSFER_DTYPES, default="auto",
                   help="int8: the KV of each window's first half through the wire's "
                        "quantiser, the second half decoded from it")
    p.add_argument("--model", type=Path, help="checkpoint dir (default: the trained preset)")
    p.add_argument("--windows", type=int, default=8)
    p.add_argument("--window-tokens", type=int, default=256)
    p.add_argument("--json", type=Path, help="also write the result here")
    args = p.parse_args(argv)
    if args.windows < 1 or args.window_tokens < 2:
        p.error("--windows must be >= 1 and --window-tokens >= 2")
    kv_dtypes = (args.kv_cache_dtype, args.kv_transfer_dtype)
    quantization = args.quantization or (None if kv_dtypes != ("auto", "auto") else "int8")
    result = measure(quantization, args.windows, args.window_tokens, args.model,
                     args.kv_cache_dtype, args.kv_transfer_dtype)
    print(render(result))
    if args.json:
        args.json.write_text(json.dumps(result, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
