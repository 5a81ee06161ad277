"""Measure a simulator profile (``sim.profile``) of one model on this machine.

    python -m bench.profile [--model DIR] [--threads 1] --json profile.json [--quick]

Two parts, both on this machine:

1. Step times, in this process: an ``engine.LLM`` on ``--model`` (default ``bench55m``;
   ``--quick``: the built-in tiny model) with ``--threads`` torch threads (1: a worker of
   ``bench.disagg``'s, pinned to one core). Prefill steps of each length in
   ``--prefill-lens`` after a cached prefix of each of ``--contexts`` tokens; decode steps
   of each batch in ``--batches`` at each context, once every prompt of the batch is in
   and ``DECODE_WARMUP_STEPS`` steps after (a batch whose KV would take more than 90% of
   the pool is skipped, and says so). Each
   step is timed around ``EngineCore.step()`` with the scheduler's own output recorded,
   and ``sim.profile.StepModel`` (its two fixed costs of a step's kind among its terms) is
   fitted to them by least squares (coefficients kept >= 0); the fit's error per point is
   printed and kept under ``points``.
2. The handoff, through a real cluster (``pdserve up``: one prefill, one decode worker,
   with ``--threads 1`` each pinned to a core of its own, as ``bench.disagg`` and the
   validation start them, so a prefill worker's KV sends take from its own core's
   compute as they do there): requests of each prompt length in ``--handoff-lens`` at
   ``--handoff-rate`` per second (Poisson) with the router's trace (``bench.handoff``'s
   breakdown). The exposed KV transfer against its
   bytes gives ``transfer`` (latency + bytes / bandwidth); ``router_queue`` is
   ``router.overhead_s``; reserve, decode admission, relay and delivery together are
   ``handoff.overhead_s`` (medians). Then a few requests sent alone and a few at once:
   what each stream at once adds to their time per output token beyond the fitted step's
   terms is the loop's cost per stream (``per_decode_seq_s`` includes it), and the time
   per output token alone, less the fitted decode step, what it adds to each step
   (``base_s`` includes it).
   The prefill worker's own prefill time against the fitted steps of its chunks gives a
   scale of the per-token prefill terms and a cost added to a prefill step
   (``prefill_in_cluster``).

The JSON is the profile (``source: measured``), loadable with ``sim.profile.load``.

``--derive GPU --shape MODEL [--tps 1,2,4,8]`` measures nothing: it writes the profile
``sim.roofline`` derives from datasheet figures (``source: derived``), e.g. ``--derive
h100 --shape llama-3-8b``.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any, NamedTuple

import numpy as np

from bench.clusters import bench_model, cluster
from bench.common import machine_info, write_json
from bench.handoff import breakdown, send_traced
from engine.core.scheduler import SchedulerOutput
from loadtest.workloads import Workload, WorkloadSpec
from sim.profile import (
    FIXED_TERMS,
    SCHEMA,
    STEP_TERMS,
    chunk_quantities,
    from_json,
    step_quantities,
)
from sim.roofline import GPUS, MODELS, derive

HANDOFF_OUTPUT_LEN = 8
LOOP_REQUESTS, LOOP_PROMPT_LEN, LOOP_OUTPUT_LEN = 4, 64, 32  # sent alone: the loop's cost
LOOP_STREAMS = 4  # sent at once: the loop's cost per stream
# decode steps right after a batch's prefill run slow while the caches refill (bench55m,
# batch 1: 11.2, 8.8, 7.2, 6.7, then 6.5 ms): this many are left out of each batch's points
DECODE_WARMUP_STEPS = 4
WORKER_MAX_BATCHED_TOKENS = 512  # the workers' default --max-num-batched-tokens: their chunks
FEATURES = STEP_TERMS  # the fitted coefficients, in ``features`` order


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m bench.profile", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", type=Path, help="checkpoint (default: bench55m; --quick: tiny)")
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--prefill-lens", default="16,64,128,256,512")
    p.add_argument("--contexts", default="0,256,1024")
    p.add_argument("--batches", default="1,4,16,32,64")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--handoff-lens", default="64,256,512,1024")
    p.add_argument("--handoff-requests", type=int, default=12)
    p.add_argument("--handoff-rate", type=float,
                   help="requests per second (Poisson) of the handoff part (default: a light "
                        "steady load, a quarter of what the fitted steps say one prefill "
                        "worker takes at the mean length, at most 4/s)")
    p.add_argument("--no-handoff", action="store_true",
                   help="skip the cluster part (transfer and overheads from --quick's "
                        "defaults, labelled in the description)")
    p.add_argument("--json", type=Path, required=True)
    p.add_argument("--derive", choices=sorted(GPUS), help="derive, for this GPU, instead")
    p.add_argument("--shape", choices=sorted(MODELS), default="llama-3-8b",
                   help="--derive: the model")
    p.add_argument("--tps", default="1,2,4,8", help="--derive: tensor-parallel sizes")
    p.add_argument("--quick", action="store_true",
                   help="the tiny model and a few points (for tests)")
    args = p.parse_args(argv)
    if args.quick:
        args.prefill_lens, args.contexts, args.batches = "16,64,256", "0,256", "1,8,32"
        args.repeats, args.handoff_lens, args.handoff_requests = 2, "64,512", 8
    for name in ("prefill_lens", "contexts", "batches", "handoff_lens"):
        setattr(args, name, [int(v) for v in getattr(args, name).split(",") if v])
    return args


# ---------------------------------------------------------------- step times


class StepRecorder:
    """Times ``EngineCore.step()`` calls and keeps each one's scheduler output."""

    def __init__(self, core: Any) -> None:
        self.core = core
        self.last: SchedulerOutput | None = None
        self.timed: list[tuple[SchedulerOutput, float]] = []
        schedule = core.scheduler.schedule

        def recorded() -> SchedulerOutput:
            self.last = schedule()
            return self.last

        core.scheduler.schedule = recorded

    def took(self, seconds: float) -> None:
        """A step timed elsewhere took ``seconds``: kept, with its output, in ``timed``."""
        assert self.last is not None
        self.timed.append((self.last, seconds))

    def step(self) -> tuple[SchedulerOutput, float]:
        start = time.perf_counter()
        self.core.step()
        elapsed = time.perf_counter() - start
        assert self.last is not None
        return self.last, elapsed


def features(out: SchedulerOutput) -> list[float]:
    """The step model's quantities of one step, in ``FEATURES`` order."""
    return list(step_quantities(out))


def measure_steps(args: argparse.Namespace, model_dir: Path) -> dict[str, Any]:
    import torch

    from bench.step_profile import decode_steps
    from engine import LLM, SamplingParams

    torch.set_num_threads(args.threads)
    max_len = max(args.contexts) + max(args.prefill_lens) + 64
    max_batched = max(max(args.prefill_lens), max(args.batches))
    llm = LLM(model_dir, max_num_batched_tokens=max_batched,
              max_num_seqs=max(args.batches))
    core, rec = llm.core, StepRecorder(llm.core)
    num_blocks, block_size = int(core.executor.num_kv_blocks), llm.config.cache.block_size
    vocab = llm.config.model.vocab_size
    workload = Workload(WorkloadSpec("random", input_len=max_len, output_len=1), vocab, seed=1)
    points: list[dict[str, Any]] = []
    ids = iter(range(10**9))

    def drain() -> None:
        while core.has_unfinished():
            core.step()

    for context in args.contexts:  # prefill of n tokens after a cached prefix of `context`
        for n in args.prefill_lens:
            for rep in range(args.repeats + 1):  # the first of each shape warms up
                prompt = list(workload.take(1)[0].prompt_token_ids)
                if context:
                    core.add_request(f"p{next(ids)}", prompt[:context],
                                     SamplingParams(max_tokens=1, temperature=0.0))
                    drain()
                core.add_request(f"p{next(ids)}", prompt[:context + n],
                                 SamplingParams(max_tokens=1, temperature=0.0))
                out, seconds = rec.step()
                drain()
                if rep:
                    points.append({"kind": "prefill", "context": context, "tokens": n,
                                   "features": features(out), "seconds": seconds})
    for context in args.contexts:  # decode steps of `batch` sequences at `context`
        for batch in args.batches:
            # step_profile.decode_steps gives each enough tokens to outlast the batch's
            # prefill (its first ones decode while the later prompts are prefilled)
            max_tokens = (DECODE_WARMUP_STEPS + args.repeats + 1 + batch
                          + -(-batch * max(context, 1) // max_batched))
            if batch * -(-(max(context, 1) + max_tokens) // block_size) > 0.9 * num_blocks:
                print(f"  decode at batch {batch}, context {context}: skipped (more KV "
                      f"than 90% of the pool's {num_blocks} blocks)", flush=True)
                continue
            prompts = [list(r.prompt_token_ids)[:max(context, 1)]
                       for r in workload.take(batch)]
            rec.timed.clear()
            try:
                decode_steps(llm, prompts, DECODE_WARMUP_STEPS + args.repeats, rec.took)
            except RuntimeError as exc:  # a step that did not decode the whole batch
                print(f"  decode at batch {batch}, context {context}: skipped ({exc})",
                      flush=True)
                continue
            points += [{"kind": "decode", "context": context, "batch": batch,
                        "features": features(out), "seconds": seconds}
                       for out, seconds in rec.timed[DECODE_WARMUP_STEPS:]]
    model = llm.config.model
    layers, kv_heads, head_dim = model.kv_layout
    facts = {"name": model_dir.name, "num_layers": layers,
             "kv_bytes_per_token": 2 * layers * kv_heads * head_dim
             * {"float32": 4, "bfloat16": 2, "float16": 2}[model.dtype],
             "block_size": llm.config.cache.block_size, "max_model_len": model.max_model_len}
    return {"points": points, "model": facts,
            "num_kv_blocks": int(core.executor.num_kv_blocks)}


def _telling(x: np.ndarray) -> list[int]:
    """The features the points can tell apart: each kept only if it is not a combination
    of those kept before it, in the order base, the per-token terms, then the fixed costs
    of a step's kind (the prefill's before the batched one's). E.g. without a batch of 1
    every step computes more than one token, so ``multi_token_s`` is the base's and left
    at 0; with only batches of 1 it is the prefill step's."""
    order = [0, *range(3, x.shape[1]), 2, 1]
    scaled = x / np.maximum(np.abs(x).max(axis=0), 1e-300)  # ranks alike at any unit
    kept: list[int] = []
    for i in order:
        if np.linalg.matrix_rank(scaled[:, [*kept, i]]) > len(kept):
            kept.append(i)
    return sorted(kept)


def fit(points: Sequence[dict[str, Any]]) -> tuple[dict[str, float], list[float]]:
    """Least squares of step seconds on the features, coefficients >= 0 (a negative one
    is dropped and the rest refitted); the coefficients and each point's relative error."""
    x = np.array([p["features"] for p in points], dtype=float)
    y = np.array([p["seconds"] for p in points], dtype=float)
    # weighted by 1/y: the fit minimises relative error, so fast steps count as much
    w = 1.0 / y
    active = _telling(x)
    coef = np.zeros(x.shape[1])
    while active:
        sol, *_ = np.linalg.lstsq(x[:, active] * w[:, None], y * w, rcond=None)
        if (sol >= 0).all():
            coef[active] = sol
            break
        active.pop(int(np.argmin(sol)))
    errors = ((x @ coef) - y) / y
    return dict(zip(FEATURES, (float(c) for c in coef), strict=True)), [float(e) for e in errors]


# ---------------------------------------------------------------- the handoff


def light_rate(coef: dict[str, float], lengths: Sequence[int]) -> float:
    """A quarter of one prefill worker's capacity at the mean length, at most 4/s."""
    n = round(statistics.fmean(lengths))
    return min(4.0, 0.25 / _weigh(coef, chunk_quantities(n)))


def _weigh(coef: dict[str, float], quantities: Sequence[float],
           terms: Sequence[str] = FEATURES) -> float:
    """The seconds ``coef``'s ``terms`` give ``quantities`` (``step_quantities`` order; a
    term whose quantity is 0 need not be in ``coef``)."""
    return sum(coef[t] * q for t, q in zip(FEATURES, quantities, strict=True)
               if q and t in terms)


def measure_handoff(args: argparse.Namespace, model_dir: Path, vocab: int,
                    kv_bytes_per_token: int, rate: float) -> dict[str, Any]:
    print(f"handoff at {rate:.2f} requests/s ...", flush=True)
    samples: list[dict[str, Any]] = []
    cpus = sorted(os.sched_getaffinity(0))
    pinned = {"prefill-0": (cpus[0],), "decode-0": (cpus[-1],)} \
        if args.threads == 1 and len(cpus) >= 2 else None
    with cluster(model_dir, num_prefill=1, num_decode=1, cpu_affinity=pinned) as running:
        for length in args.handoff_lens:
            spec = WorkloadSpec("random", input_len=length, output_len=HANDOFF_OUTPUT_LEN)
            asyncio.run(send_traced(running.router_address,
                                    Workload(spec, vocab, seed=7 + length).take(1), None))
            requests = Workload(spec, vocab, seed=length).take(args.handoff_requests)
            results, _ = asyncio.run(send_traced(running.router_address, requests,
                                                 rate, seed=length))
            for r in results:
                if r["trace"]["prefill_ms"]:
                    tpot = (r["e2e_ms"] - r["ttft_ms"]) / (HANDOFF_OUTPUT_LEN - 1)
                    samples.append({"prompt_len": length, "tpot": tpot, **breakdown(r)})
            print(f"  handoff, {length}-token prompts: {len(results)} traced", flush=True)
        # the loop's cost from requests alone: at the handoff's rate a stream's steps
        # share the decode worker's core with the next requests' KV arriving
        spec = WorkloadSpec("random", input_len=LOOP_PROMPT_LEN, output_len=LOOP_OUTPUT_LEN)
        alone, _ = asyncio.run(send_traced(running.router_address,
                                           Workload(spec, vocab, seed=3).take(LOOP_REQUESTS),
                                           None))
        loop_tpots = [(LOOP_PROMPT_LEN + LOOP_OUTPUT_LEN / 2,
                       (r["e2e_ms"] - r["ttft_ms"]) / (LOOP_OUTPUT_LEN - 1) / 1000)
                      for r in alone]
        # ... and what each stream adds: LOOP_STREAMS sent at once
        together, _ = asyncio.run(send_traced(
            running.router_address, Workload(spec, vocab, seed=4).take(LOOP_STREAMS),
            float("inf")))
        stream_tpots = [(r["e2e_ms"] - r["ttft_ms"]) / (LOOP_OUTPUT_LEN - 1) / 1000
                        for r in together]
        print(f"  {len(alone)} requests alone and {len(together)} at once, for the loop's "
              "cost", flush=True)
    if not samples:
        raise SystemExit("bench.profile: no traced request had the prefill timings")
    transfer = fit_transfer(samples, kv_bytes_per_token)
    # each part >= 0: under a queue the two processes' clocks can split a wait oddly
    overhead = [sum(max(0.0, s[k]) for k in ("reserve", "decode_admission", "router_relay",
                                              "delivery")) / 1000 for s in samples]
    return {"transfer": transfer, "pinned": pinned is not None,
            "tpot_s": loop_tpots, "streams_tpot_s": stream_tpots,
            "router": {"overhead_s": statistics.median(max(0.0, s["router_queue"]) / 1000
                                                       for s in samples)},
            "handoff": {"overhead_s": statistics.median(overhead)},
            "samples": samples}


def fit_transfer(samples: Sequence[dict[str, Any]], kv_bytes_per_token: int
                 ) -> dict[str, float]:
    """The KV transfer's visible time against its bytes: ``latency_s`` + bytes ÷
    ``bytes_per_s``, from the handoff's samples (``prompt_len``, ``exposed_transfer`` and
    ``decode_admission`` in ms). A negative decode admission is the decode worker starting
    the stream before the prefill worker heard every rank acknowledge the KV: the
    transfer's visible part is the two together. Fitted on each length's median (a few
    late acknowledgements at one length would steer a fit of the samples themselves)."""
    visible: dict[int, list[float]] = {}
    for s in samples:
        visible.setdefault(s["prompt_len"], []).append(
            max(0.0, s["exposed_transfer"] + min(0.0, s["decode_admission"])) / 1000)
    lengths = sorted(visible)
    medians = [statistics.median(visible[n]) for n in lengths]
    if len(lengths) < 2:
        return {"latency_s": medians[0], "bytes_per_s": 1e12}
    slope, intercept = np.polyfit([n * kv_bytes_per_token for n in lengths], medians, 1)
    return {"latency_s": max(0.0, float(intercept)),
            "bytes_per_s": 1.0 / slope if slope > 0 else 1e12}  # 1e12: it did not grow


def prefill_in_cluster(coef: dict[str, float], samples: Sequence[dict[str, Any]],
                       chunk: int = WORKER_MAX_BATCHED_TOKENS) -> tuple[float, float]:
    """How a prefill worker in the cluster computes a prompt against the fitted steps of its
    chunks: ``(scale, extra_s)``, its own clock's ``prefill_compute`` taken as ``fixed +
    scale × per-token costs + extra_s × chunks`` (the worker's loop, its KV sends layer by
    layer and its events beside the engine's steps: some grow with the tokens, some come
    once a chunk). Fitted to each prompt length's median (relative least squares); one
    length, a negative ``extra_s`` or a ``scale`` under 0.5 gives the median ratio alone
    (``extra_s`` 0, ``scale`` >= 0.5). ``scale`` multiplies the per-token terms, ``extra_s`` is added to a prefill
    step's."""
    by_len: dict[int, list[float]] = {}
    for s in samples:
        if s["prefill_compute"] > 0:
            by_len.setdefault(s["prompt_len"], []).append(s["prefill_compute"] / 1000)
    per_token = [t for t in FEATURES if t not in FIXED_TERMS]
    rows = []
    for length, seconds in sorted(by_len.items()):
        fixed = variable = 0.0
        chunks = range(0, length, chunk)
        for start in chunks:
            quantities = chunk_quantities(min(chunk, length - start), start)
            fixed += _weigh(coef, quantities, FIXED_TERMS)
            variable += _weigh(coef, quantities, per_token)
        if variable > 0:
            measured = statistics.median(seconds)
            rows.append(_LengthRow(variable, len(chunks), measured - fixed, measured))
    if not rows:
        return 1.0, 0.0
    if len(rows) >= 2:
        w = np.array([1 / r.measured_s for r in rows])
        x = np.array([[r.per_token_s, r.chunks] for r in rows]) * w[:, None]
        y = np.array([r.beyond_fixed_s for r in rows]) * w
        (scale, extra), *_ = np.linalg.lstsq(x, y, rcond=None)
        if extra >= 0 and scale >= 0.5:
            return float(scale), float(extra)
    return max(0.5, statistics.median(r.beyond_fixed_s / r.per_token_s for r in rows)), 0.0


class _LengthRow(NamedTuple):
    """One prompt length in ``prefill_in_cluster``: its chunks' fitted per-token seconds,
    how many chunks, the measured median less the chunks' fixed costs, the median."""

    per_token_s: float
    chunks: int
    beyond_fixed_s: float
    measured_s: float


def loop_per_stream(coef: dict[str, float], alone: Sequence[tuple[float, float]],
                    together: Sequence[float]) -> float:
    """What a real worker's loop costs a step for each stream in it beyond the engine's own
    ``per_decode_seq_s`` (each token streamed out, through the router, to the client, on
    the cores the workers share): ``LOOP_STREAMS`` requests decoding at once against one
    alone (``alone``: ``(mean context, seconds per token)`` each; ``together``: seconds per
    token of each at once), less what the fitted step adds for the other streams (their
    sequences and context, the fixed cost of several tokens), over those streams (>= 0;
    0 without both)."""
    if not alone or not together:
        return 0.0
    one, many = statistics.median(t for _, t in alone), statistics.median(together)
    context = statistics.median(c for c, _ in alone)
    others = LOOP_STREAMS - 1
    engine = (coef["multi_token_s"] + coef["per_decode_seq_s"] * others
              + coef["per_decode_context_s"] * context * others)
    return max(0.0, (many - one - engine) / others)


def loop_overhead(coef: dict[str, float], tpots: Sequence[tuple[float, float]]) -> float:
    """What a real worker's step costs beyond ``EngineCore.step()`` (its engine loop: the
    outputs streamed, the KV events, the commands): the cluster's time per output token of
    requests sent alone (``(mean context, seconds)`` each), less the fitted batch-1 decode
    step at that context (median, >= 0). It is added to ``base_s``."""
    gaps = [tpot - (coef["base_s"] + coef["per_decode_seq_s"]
                    + coef["per_decode_context_s"] * context)
            for context, tpot in tpots]
    return max(0.0, statistics.median(gaps))


def main(argv: Sequence[str] | None = None) -> dict[str, Any]:
    args = parse_args(argv)
    if args.derive:
        derived = derive(MODELS[args.shape], GPUS[args.derive],
                         [int(t) for t in args.tps.split(",") if t]).to_json()
        write_json(args.json, derived)
        print(f"{derived['description']}; TP {', '.join(derived['steps'])}: wrote {args.json}")
        return derived
    model_dir = args.model or bench_model(args.quick)
    print(f"profiling {model_dir} on {args.threads} thread(s) ...", flush=True)
    steps = measure_steps(args, model_dir)
    coef, errors = fit(steps["points"])
    for point, error in zip(steps["points"], errors, strict=True):
        point["fit_error"] = error
    print("step model: " + ", ".join(f"{k} {v:.3g}" for k, v in coef.items()))
    print(f"fit: mean |error| {statistics.fmean(abs(e) for e in errors):.1%}, "
          f"max {max(abs(e) for e in errors):.1%} over {len(errors)} steps")
    if args.no_handoff:
        handoff: dict[str, Any] = {"transfer": {"latency_s": 0.0, "bytes_per_s": 1e9},
                                   "router": {"overhead_s": 0.0},
                                   "handoff": {"overhead_s": 0.0}, "samples": [],
                                   "tpot_s": [], "streams_tpot_s": []}
        where = "handoff not measured (--no-handoff: zero overheads, 1 GB/s transfer)"
    else:
        import json

        vocab = int(json.loads((Path(model_dir) / "config.json").read_text())["vocab_size"])
        rate = args.handoff_rate or light_rate(coef, args.handoff_lens)
        handoff = measure_handoff(args, Path(model_dir), vocab,
                                  steps["model"]["kv_bytes_per_token"], rate)
        cores = ", one core each" if handoff["pinned"] else ""
        where = f"handoff measured through pdserve up (1 prefill + 1 decode{cores})"
        # the loop's cost first: a prefill worker's every step has it too, and what its
        # prefill takes beyond that is the prefill's own
        per_stream = loop_per_stream(coef, handoff["tpot_s"], handoff["streams_tpot_s"])
        coef["per_decode_seq_s"] += per_stream
        coef["base_s"] += loop_overhead(coef, handoff["tpot_s"])
        print(f"worker loop: {coef['base_s'] * 1000:.3f} ms per step, "
              f"{coef['per_decode_seq_s'] * 1000:.3f} ms per stream in it "
              f"({per_stream * 1000:.3f} of it the loop's) with the loop's own cost")
        scale, extra = prefill_in_cluster(coef, handoff["samples"])
        coef["per_prefill_token_s"] *= scale
        coef["per_prefill_attention_s"] *= scale
        coef["prefill_step_s"] += extra
        print(f"prefill in the cluster: {scale:.2f}x the fitted step's per-token costs, "
              f"{extra * 1000:.1f} ms more a chunk")
        print(f"transfer: {handoff['transfer']['latency_s'] * 1000:.2f} ms + bytes at "
              f"{handoff['transfer']['bytes_per_s'] / 1e9:.2f} GB/s; router "
              f"{handoff['router']['overhead_s'] * 1000:.2f} ms, handoff "
              f"{handoff['handoff']['overhead_s'] * 1000:.2f} ms per request")
    machine = machine_info()
    profile = {
        "schema": SCHEMA, "source": "measured",
        "description": f"{model_dir.name}, {args.threads} torch thread(s) per worker, "
                       f"{machine['cpu_model']}; {where}",
        "model": steps["model"],
        "steps": {"1": {**coef, "num_kv_blocks": steps["num_kv_blocks"]}},
        "transfer": handoff["transfer"], "router": handoff["router"],
        "handoff": handoff["handoff"],
        "points": {"steps": steps["points"], "handoff": handoff["samples"],
                   "alone_tpot_s": handoff["tpot_s"],
                   "streams_tpot_s": handoff["streams_tpot_s"], "machine": machine,
                   "threads": args.threads}}
    from_json(profile)  # what the simulator will read
    write_json(args.json, profile)
    print(f"wrote {args.json}")
    return profile


if __name__ == "__main__":
    main()
