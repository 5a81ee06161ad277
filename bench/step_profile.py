"""Where a decode step spends its time: ``python -m bench.step_profile``.

For each batch size [1, 32], that many requests of [64] random prompt tokens are
prefilled, then [32] decode steps (``EngineCore.step()``, all requests decoding) are
timed twice: once plain (the step's median), once with a stopwatch around each part
(per-step means, and their share of the mean stopwatched step):

- every linear layer by role (``qkv_proj``, ``o_proj``, ``gate_up_proj``,
  ``down_proj``, ``lm_head``), with what it reached: GB/s of weight read (the figure that
  matters at batch 1) and GFLOP/s (at larger batches);
- attention core: the attention module less its two linears (RoPE, the KV write, the
  paged-KV gather and SDPA; Qwen3's per-head q/k norms too);
- RMSNorm (the layers' and the final one); the MLP activation (the MLP less its two
  linears);
- the compiled decoder stack, where a step runs all layers in one compiled call
  (``engine.models.decoder_stack``: batch 1 to 3 on the CPU, up to 256 on the
  ``packed`` kernel; the embedding, RoPE lookup and final norm too), with the GB/s and
  GFLOP/s of all its layers' linears; the parts inside it (the layers' linears,
  attention, norms, activation, and the rest of the forward) then read about 0 for that
  batch;
- the rest of the model forward (embedding, residual adds, RoPE table lookup);
- outside the forward: input tensors, sampling, scheduler and outputs.

Parts are wall times on the leader rank, per step; the stopwatches add a few
microseconds per call, which lands in the parts measured as differences (attention core,
activation, rest of the forward); both step times are printed. Runs on the
``bench55m`` model by default, the thread count of ``bench.engine`` [2]; the CPU model,
the kernels chosen and the machine's read bandwidth are printed next to the table, and
``--json PATH`` writes every figure.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from collections import defaultdict
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import engine
from bench.common import (
    GB,
    MIB,
    BandwidthProbe,
    format_table,
    machine_info,
    publish,
    torch_threads,
)
from bench.engine import (
    PromptSource,
    compiled_summary,
    ensure_bench_model,
    kernel_facts,
    model_runner,
)
from engine.config import LINEAR_KERNELS
from engine.kernels.cpu import native
from engine.models.layers import linear_layers

LINEAR_ROLES = ("qkv_proj", "o_proj", "gate_up_proj", "down_proj", "lm_head")
STACK = "decoder stack (compiled)"
PARTS = (*LINEAR_ROLES, STACK, "attention core", "rms_norm", "mlp activation",
         "rest of forward", "outside the forward")


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m bench.step_profile", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", type=Path, default=None,
                   help="model directory (default: the bench55m model, built on first use)")
    p.add_argument("--batch-sizes", default="1,32",
                   help="comma-separated decode batch sizes (default 1,32)")
    p.add_argument("--prompt-len", type=int, default=64)
    p.add_argument("--steps", type=int, default=32, help="decode steps timed per pass")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--linear-kernel", default="auto", choices=list(LINEAR_KERNELS))
    p.add_argument("--bandwidth-mib", type=int, default=1024)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", type=Path, default=None)
    args = p.parse_args(argv)
    try:
        args.batch_sizes = [int(b) for b in args.batch_sizes.split(",") if b.strip()]
    except ValueError:
        p.error(f"--batch-sizes must be comma-separated integers, got {args.batch_sizes!r}")
    if not args.batch_sizes or min(args.batch_sizes) < 1:
        p.error("--batch-sizes must name at least one batch size >= 1")
    if args.steps < 2 or args.prompt_len < 1:
        p.error("--steps must be >= 2 and --prompt-len >= 1")
    return args


class Stopwatches:
    """Wall time per named part, summed over calls: ``wrap`` puts a timing wrapper on one
    object's method (an instance attribute over the class's), ``restore`` takes them off."""

    def __init__(self) -> None:
        self.seconds: defaultdict[str, float] = defaultdict(float)
        self._wrapped: list[tuple[Any, str]] = []

    def wrap(self, obj: Any, method: str, part: str) -> None:
        inner = getattr(obj, method)
        seconds = self.seconds

        def timed_call(*args: Any, **kwargs: Any) -> Any:
            start = time.perf_counter()
            try:
                return inner(*args, **kwargs)
            finally:
                seconds[part] += time.perf_counter() - start

        setattr(obj, method, timed_call)
        self._wrapped.append((obj, method))

    def restore(self) -> None:
        for obj, method in reversed(self._wrapped):
            delattr(obj, method)
        self._wrapped.clear()


@contextmanager
def stopwatches_on(llm: engine.LLM) -> Iterator[Stopwatches]:
    """Stopwatches on the leader rank's model parts and on the whole forward."""
    watches = Stopwatches()
    model = model_runner(llm).model
    try:
        for layer in model.decoder_layers:
            attn, mlp = layer.self_attn, layer.mlp
            watches.wrap(attn, "forward", "attention module")
            watches.wrap(attn.qkv_proj, "project", "qkv_proj")
            watches.wrap(attn.o_proj, "forward", "o_proj")
            watches.wrap(mlp, "forward", "mlp module")
            watches.wrap(mlp.gate_up_proj, "forward", "gate_up_proj")
            watches.wrap(mlp.down_proj, "forward", "down_proj")
            for norm in (layer.input_layernorm, layer.post_attention_layernorm):
                watches.wrap(norm, "forward", "rms_norm")
        watches.wrap(model.norm, "forward", "rms_norm")
        kernels = native()
        if kernels is not None:
            watches.wrap(kernels, "decoder_step", STACK)
        watches.wrap(model, "forward", "model forward")
        watches.wrap(model, "compute_logits", "lm_head")
        yield watches
    finally:
        watches.restore()


def split_parts(seconds: dict[str, float], step_s: float) -> dict[str, float]:
    """The measured sums as the disjoint ``PARTS`` (module totals less their linears)."""
    s = defaultdict(float, seconds)
    parts = {role: s[role] for role in LINEAR_ROLES}
    parts["attention core"] = s["attention module"] - s["qkv_proj"] - s["o_proj"]
    parts["rms_norm"] = s["rms_norm"]
    parts["mlp activation"] = s["mlp module"] - s["gate_up_proj"] - s["down_proj"]
    parts[STACK] = s[STACK]
    parts["rest of forward"] = (s["model forward"] - s["attention module"] - s["mlp module"]
                                - s["rms_norm"] - s[STACK])
    parts["outside the forward"] = step_s - s["model forward"] - s["lm_head"]
    return parts


def linear_figures(llm: engine.LLM, batch: int) -> dict[str, dict[str, float]]:
    """Per role, per step: weight bytes read and FLOPs at ``batch`` rows."""
    model = model_runner(llm).model
    linears = {id(layer) for layer in linear_layers(model)}
    figures: dict[str, dict[str, float]] = {}
    for name, layer in model.named_modules():
        if id(layer) not in linears:
            continue
        out_features, in_features = layer.weight_shape
        f = figures.setdefault(name.rsplit(".", 1)[-1], {"bytes": 0.0, "flops": 0.0})
        f["bytes"] += layer.weight_read_bytes
        f["flops"] += 2.0 * batch * out_features * in_features
    layers = [f for role, f in figures.items() if role != "lm_head"]
    figures[STACK] = {key: sum(f[key] for f in layers) for key in ("bytes", "flops")}
    return figures


def decode_steps(llm: engine.LLM, prompts: list[list[int]], num_steps: int,
                 on_step: Callable[[float], None],
                 on_start: Callable[[], None] | None = None) -> None:
    """Prefill ``prompts`` (untimed), call ``on_start``, then report the wall time of
    ``num_steps`` steps in each of which every request decodes one token (checked;
    ``RuntimeError`` otherwise, e.g. when the engine cannot hold them all). The requests
    are aborted afterwards."""
    core = llm.core
    ids = [core.new_request_id() for _ in prompts]
    # enough tokens that none finishes: the first prefilled decode while the rest prefill
    prefill_steps = len(prompts) + -(-sum(map(len, prompts))
                                     // core.config.scheduler.max_num_batched_tokens)
    params = engine.SamplingParams(max_tokens=num_steps + prefill_steps + 1, temperature=0.0,
                                   ignore_eos=True)
    try:
        for rid, prompt in zip(ids, prompts):
            core.add_request(rid, prompt, params)
        while core.scheduler.waiting or _prefilling(core):
            core.step()
        if on_start is not None:
            on_start()
        for _ in range(num_steps):
            before = _output_tokens(core)
            start = time.perf_counter()
            core.step()
            on_step(time.perf_counter() - start)
            if _output_tokens(core) - before != len(prompts):
                raise RuntimeError(f"a timed step did not decode all {len(prompts)} requests")
    finally:
        for rid in ids:
            core.abort_request(rid)


def _output_tokens(core: Any) -> int:
    return sum(len(r.output_token_ids) for r in core.scheduler.running)


def _prefilling(core: Any) -> bool:
    """Whether a running request has not had its first token yet (its prompt is not
    fully prefilled)."""
    return any(not r.output_token_ids for r in core.scheduler.running)


def profile_batch(llm: engine.LLM, prompts: PromptSource, batch: int, steps: int
                  ) -> dict[str, Any]:
    plain: list[float] = []
    decode_steps(llm, prompts.draw(batch), steps, plain.append)
    timed: list[float] = []
    with stopwatches_on(llm) as watches:
        decode_steps(llm, prompts.draw(batch), steps, timed.append, watches.seconds.clear)
    parts = {k: v / steps for k, v in split_parts(watches.seconds, sum(timed)).items()}
    figures = linear_figures(llm, batch)
    return {
        "batch_size": batch,
        "step_ms": statistics.median(plain) * 1e3,
        "timed_step_ms": statistics.fmean(timed) * 1e3,
        "parts_ms": {k: v * 1e3 for k, v in parts.items()},
        "linear_gbps": {r: figures[r]["bytes"] / parts[r] / GB for r in (*LINEAR_ROLES, STACK)
                        if parts[r] > 0},
        "linear_gflops": {r: figures[r]["flops"] / parts[r] / GB
                          for r in (*LINEAR_ROLES, STACK) if parts[r] > 0},
    }


def render(out: dict[str, Any]) -> str:
    lines = [f"model     {out['model_dir']}",
             f"machine   {out['machine']['cpu_model']}, torch threads {out['threads']}",
             f"kernels   {out['linear_kernel']} ({out['linear_kernel_source']}); "
             f"{compiled_summary(out)}",
             f"bandwidth {out['bandwidth_gbps']:.1f} GB/s (torch.sum read)", ""]
    batches = out["batches"]
    headers = ["part"]
    for b in batches:
        n = b["batch_size"]
        headers += [f"B={n} ms", f"B={n} %", f"B={n} GB/s", f"B={n} GFLOP/s"]
    rows: list[list[Any]] = []
    for part in PARTS:
        row: list[Any] = [part]
        for b in batches:
            row += [round(b["parts_ms"][part], 3), round(100 * b["parts_ms"][part] / b["timed_step_ms"], 1),
                    _rate(b["linear_gbps"], part), _rate(b["linear_gflops"], part)]
        rows.append(row)
    for label, key in (("step with stopwatches (mean)", "timed_step_ms"),
                       ("step without (median)", "step_ms")):
        rows.append([label, *[cell for b in batches for cell in (round(b[key], 3), "", "", "")]])
    lines.append(format_table(rows, headers))
    return "\n".join(lines)


def _rate(rates: dict[str, float], part: str) -> Any:
    return round(rates[part]) if part in rates else ""


def main(argv: Sequence[str] | None = None) -> dict[str, Any]:
    """Run the profile, print the table, write ``--json``; returns the results dict."""
    args = parse_args(argv)
    model_dir = args.model if args.model is not None else ensure_bench_model()
    out: dict[str, Any] = {"model_dir": str(model_dir), "threads": args.threads,
                           "machine": machine_info(), "steps": args.steps,
                           "prompt_len": args.prompt_len}
    with torch_threads(args.threads):
        probe = BandwidthProbe(args.bandwidth_mib * MIB, args.threads)
        llm = engine.LLM(model_dir, dtype="float32", linear_kernel=args.linear_kernel,
                         max_num_seqs=max(64, max(args.batch_sizes)))
        try:
            out.update(kernel_facts(llm))
            prompts = PromptSource(args.seed, llm.tokenizer.vocab_size, args.prompt_len)
            out["batches"] = [profile_batch(llm, prompts, b, args.steps)
                              for b in args.batch_sizes]
            out["bandwidth_gbps"] = probe.measure(3)
        finally:
            llm.shutdown()
            probe.release()
    publish(render(out), args.json, out)
    return out


if __name__ == "__main__":
    main(sys.argv[1:])
