"""What the handoff costs and what prefix affinity buys, from the timestamps the router and
the workers report (``router.trace``: the ``pdserve-trace`` trailer).

    python -m bench.handoff [--prompt-lens 512,2048] [--json out.json] [--quick]

1. TTFT breakdown (``bench55m``, fp32; one prefill worker pinned to the first core, one
   decode worker to the last, one torch thread each; router and client unpinned): requests
   of each prompt length sent one at a time (random prompts, no cache hits, 8 output
   tokens). Each request's client-side TTFT is split, exactly, into: ``router_queue``
   (received → first call to a worker: validation, admission, the queue), ``reserve``
   (first call → the Prefill sent: the decode worker's Reserve when the Prefill waits for
   its reply, next to nothing when it goes out with it), ``prefill_queue``, ``prefill_compute`` and
   ``exposed_transfer`` (the prefill worker's own clock: queued → first chunk scheduled →
   last layer computed → every decode rank acknowledged the KV, i.e. the transfer left
   after the last layer), ``decode_admission`` (the rest until the Generate stream's first
   chunk reaches the router: the Prefill request's trip to its worker, and on the decode
   side the KV's arrival noticed, the request admitted, the chunk sent; the Generate
   stream is opened together with the Prefill, so its set-up and the Prefill's reply are
   off this path), ``router_relay`` (that chunk through the router to the client's stream) and
   ``delivery`` (the request's trip in and the token's trip out, client side).
   ``orchestration`` is TTFT minus compute, exposed transfer and delivery: everything but
   compute and the wire. ``one_layer_transfer_ms``: one pdserve KV transfer (gather,
   checksum, scatter) of one layer's bytes of the prompt between two processes pinned to
   the same two cores (``bench.kvtransfer``'s), median of a few.
2. Router overhead: the tiny model (one layer, context 4096), so the workers keep up, at
   ``--overhead-rate`` (100) requests/s, Poisson, for ``--overhead-seconds``: prompts of
   each length sharing all but their last 16 tokens (the prefill worker's cache makes the
   prefill cheap; every request still carries its whole prompt through the router and its
   whole KV to the decode worker; 4 output tokens). ``to_first_worker_call``: received →
   first call to a worker (a backlog shows here: the router has no queued-token limit in
   this run), ``to_first_worker_call_unqueued`` the same less the time it waited in the
   router's queue for capacity (the router's own work); ``token_to_client``: each chunk from the decode worker's stream to the
   client's (every chunk of every request). p50 and p99, with the rate achieved and the
   share of a core each process (router, workers, this client) was busy.
3. Prefix affinity: the prefix-repetition workload (``--prefixes`` prefixes of
   ``--prefix-len`` tokens, suffixes of 64, 8 output tokens) on two prefill workers (one per
   core) and one decode worker (unpinned), at ``--affinity-rate`` requests/s (``--quick``:
   one at a time, so the load bound never moves a prefix and affinity must equal the
   oracle): the cached
   fraction of the prompt tokens against the oracle (each prefix cached after its first
   use), and TTFT, for prefix affinity and for ``--prefill-routing round-robin``, each on a
   fresh cluster with the same requests.

``--json PATH``: ``ttft_breakdown_ms`` (p50 of each part), ``orchestration_p50_ms``,
``exposed_transfer_p50_ms``, ``one_layer_transfer_ms``, ``router_overhead_p50_ms`` and
``router_overhead_p99_ms`` (each ``{to_first_worker_call, token_to_client}``) for the
longest prompt at the top level, the same keys per length under ``by_prompt_len``,
``prefix_affinity``, the machine facts. Defaults take a few minutes on 2 cores.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import statistics
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import grpc

from bench.clusters import bench_model, cluster, two_cpus
from bench.common import (
    BandwidthProbe,
    format_table,
    machine_info,
    model_facts,
    percentile,
    write_json,
)
from engine.config import KV_CACHE_DTYPES
from loadtest.workloads import Request, Workload, WorkloadSpec, oracle_cached_tokens
from pdserve.v1 import generate_pb2, generate_pb2_grpc
from sim.metrics import arrival_times

PARTS = ("router_queue", "reserve", "prefill_queue", "prefill_compute", "exposed_transfer",
         "decode_admission", "router_relay", "delivery")
OUTPUT_LEN = 8
OVERHEAD_OUTPUT_LEN = 4
SUFFIX_LEN = 16  # router overhead: the tokens of each prompt not shared with the others


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m bench.handoff", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", help="checkpoint of the breakdown and affinity runs "
                                   "(default: bench55m; --quick: the tiny model)")
    p.add_argument("--prompt-lens", default="512,2048")
    p.add_argument("--requests", type=int, default=12, help="per prompt length, one at a time")
    p.add_argument("--overhead-rate", type=float, default=100.0)
    p.add_argument("--overhead-seconds", type=float, default=5.0)
    p.add_argument("--prefix-len", type=int, default=512)
    p.add_argument("--prefixes", type=int, default=6)
    p.add_argument("--affinity-requests", type=int, default=36)
    p.add_argument("--affinity-rate", type=float, default=1.0,
                   help="requests/s, Poisson (0: one at a time)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", type=Path)
    p.add_argument("--quick", action="store_true", help="the tiny model, a few requests")
    p.add_argument("--kv-cache-dtype", choices=KV_CACHE_DTYPES, default="auto",
                   help="the breakdown's workers' KV cache (int8: its blocks travel as int8 "
                        "values and scales; fp8, fp8_e5m2: as their fp8 bytes)")
    p.add_argument("--kv-transfer-dtype", choices=("auto", "int8"), default="auto",
                   help="the breakdown's workers' KV transfer (int8: fp32 KV quantised for "
                        "the wire only, dequantised on arrival)")
    p.add_argument("--breakdown-only", action="store_true",
                   help="the TTFT breakdown alone (no router-overhead or affinity run)")
    if "--quick" in (sys.argv[1:] if argv is None else argv):
        p.set_defaults(prompt_lens="64,256", requests=4, overhead_seconds=0.5, prefix_len=64,
                       prefixes=3, affinity_requests=9, affinity_rate=0.0)
    args = p.parse_args(argv)
    args.lengths = sorted(int(n) for n in args.prompt_lens.split(","))
    return args


# ---------------------------------------------------------------- traced requests


async def traced(stub: generate_pb2_grpc.GenerationStub, request: Request) -> dict[str, Any]:
    """One request with the router's trace: client TTFT and E2E (ms), usage, the trace."""
    message = generate_pb2.GenerateRequest(
        token_ids=generate_pb2.TokenIds(ids=request.prompt_token_ids),
        sampling=generate_pb2.SamplingParams(max_tokens=request.max_tokens, temperature=0,
                                             ignore_eos=True))
    start = time.perf_counter()
    call = stub.Generate(message, metadata=(("pdserve-trace", "1"),), timeout=600)
    first = None
    usage = None
    try:
        async for response in call:
            if first is None and response.token_ids:
                first = time.perf_counter()
            if response.HasField("usage"):
                usage = response.usage
    except grpc.aio.AioRpcError as exc:
        return {"error": f"{exc.code().name}: {exc.details()}"}
    end = time.perf_counter()
    trailer = dict(await call.trailing_metadata())
    assert first is not None and usage is not None
    return {"ttft_ms": (first - start) * 1000, "e2e_ms": (end - start) * 1000,
            "prompt_tokens": usage.prompt_tokens, "cached_tokens": usage.cached_tokens,
            "trace": json.loads(trailer["pdserve-trace"])}


async def send_traced(address: str, requests: Sequence[Request], rate: float | None,
                      seed: int = 0) -> tuple[list[dict[str, Any]], float]:
    """``requests`` one at a time (``rate`` None) or at Poisson times; results, seconds.
    Failed requests are left out of the results at Poisson times (counted by the caller),
    and stop the benchmark one at a time (nothing else is running then)."""
    async with grpc.aio.insecure_channel(address) as channel:
        stub = generate_pb2_grpc.GenerationStub(channel)
        start = time.perf_counter()
        if rate is None:
            results = [await traced(stub, r) for r in requests]
        else:
            async def at(request: Request, when: float) -> dict[str, Any]:
                await asyncio.sleep(max(0.0, start + when - time.perf_counter()))
                return await traced(stub, request)

            times = arrival_times(len(requests), rate, seed)
            results = list(await asyncio.gather(*(at(r, t) for r, t in zip(
                requests, times, strict=True))))
        failed = [r["error"] for r in results if "error" in r]
        if rate is None and failed:
            raise SystemExit(f"bench.handoff: a request failed: {failed[0]}")
        return [r for r in results if "error" not in r], time.perf_counter() - start


def breakdown(result: dict[str, Any]) -> dict[str, float]:
    """The parts of one request's TTFT (ms); they add up to it exactly."""
    m, p = result["trace"]["marks_ms"], result["trace"]["prefill_ms"]
    to_first_chunk = m["first_chunk"] - m["prefill_started"]
    return {
        "router_queue": m["first_call"], "reserve": m["prefill_started"] - m["first_call"],
        "prefill_queue": p["queue"], "prefill_compute": p["compute"],
        "exposed_transfer": p["transfer"],
        "decode_admission": to_first_chunk - p["queue"] - p["compute"] - p["transfer"],
        "router_relay": m["first_sent"] - m["first_chunk"],
        "delivery": result["ttft_ms"] - m["first_sent"]}


def p50(values: Sequence[float]) -> float:
    return float(statistics.median(values))


# ---------------------------------------------------------------- the three runs


def measure_breakdowns(args: argparse.Namespace, model_dir: Path, vocab: int
                       ) -> dict[int, dict[str, Any]]:
    first, last = two_cpus()
    pins = {"prefill-0": (first,), "decode-0": (last,)}
    found = {}
    kv: tuple[str, ...] = () if args.kv_cache_dtype == "auto" else (
        "--kv-cache-dtype", args.kv_cache_dtype)
    if args.kv_transfer_dtype != "auto":
        kv += ("--kv-transfer-dtype", args.kv_transfer_dtype)
    with cluster(model_dir, num_prefill=1, num_decode=1, cpu_affinity=pins,
                 worker_args=kv) as running:
        for length in args.lengths:
            spec = WorkloadSpec("random", input_len=length, output_len=OUTPUT_LEN)
            warm = Workload(spec, vocab, seed=args.seed + 7).take(2)
            asyncio.run(send_traced(running.router_address, warm, None))
            requests = Workload(spec, vocab, seed=args.seed + length).take(args.requests)
            results, _ = asyncio.run(send_traced(running.router_address, requests, None))
            # a Prefill reply later than the stream's end (the router waits 1 s) has no
            # timings in the trace: such a request cannot be split
            results = [r for r in results if r["trace"]["prefill_ms"]]
            if not results:
                raise SystemExit("bench.handoff: no request's trace had the prefill timings")
            parts = [breakdown(r) for r in results]
            orchestration = [r["ttft_ms"] - b["prefill_compute"] - b["exposed_transfer"]
                             - b["delivery"] for r, b in zip(results, parts, strict=True)]
            found[length] = {
                "ttft_p50_ms": p50([r["ttft_ms"] for r in results]),
                "ttft_breakdown_ms": {k: p50([b[k] for b in parts]) for k in PARTS},
                "decode_admission_worker_p50_ms": p50(
                    [r["trace"]["decode_first_chunk_ms"] for r in results]),
                "orchestration_p50_ms": p50(orchestration),
                "exposed_transfer_p50_ms": p50([b["exposed_transfer"] for b in parts]),
                "requests": len(results)}
            print(f"  breakdown, {length}-token prompts: TTFT p50 "
                  f"{found[length]['ttft_p50_ms']:.1f} ms", flush=True)
    return found


def kv_transfer_ms(model: dict[str, Any], lengths: Sequence[int], repeats: int = 5,
                   kv_cache_dtype: str = "auto", kv_transfer_dtype: str = "auto",
                   num_layers: int = 1) -> dict[int, float]:
    """Median time of one pdserve KV transfer of ``num_layers`` layers' bytes of ``model``'s
    shape, per prompt length (an int8 cache's: ``head_dim + 4`` bytes per token, head and
    K/V, an fp8 cache's ``head_dim``; with ``kv_transfer_dtype`` int8, fp32 bytes quantised
    for the wire, the quantising and dequantising included)."""
    from bench import kvtransfer as kv

    head_dim = model.get("head_dim") or model["hidden_size"] // model["num_attention_heads"]
    slot = (head_dim + 4 if kv_cache_dtype == "int8" else head_dim
            if kv_cache_dtype.startswith("fp8") else head_dim * 4)
    layer_bytes = {n: num_layers * 2 * n * model["num_key_value_heads"] * slot for n in lengths}
    tokens = {n: -(-b // kv.TOKEN_BYTES) for n, b in layer_bytes.items()}
    num_blocks = 2 * max(tokens.values()) // kv.LAYOUT.block_size + 16
    shared = {"pin": True, "timeout_s": 60.0, "part_mib": 4.0, "num_blocks": num_blocks,
              "sizes_mib": [1], "auth": False, "kv_transfer_dtype": kv_transfer_dtype}
    rx, tx = kv.Remote("receiver", shared), kv.Remote("sender", shared)
    times: dict[int, list[float]] = {n: [] for n in lengths}
    try:
        address = rx.ready()
        tx.ready()
        rx.submit("join_raw", address, 60.0)
        tx.call("join_raw", address, 60.0)
        rx._reply()
        rng, transfer_id = random.Random(0), 0
        for repeat in range(repeats + 1):  # the first warms up
            for n in lengths:
                transfer_id += 1
                seconds = kv.run_pdserve(tx, rx, address, transfer_id, tokens[n], num_blocks, rng)
                if repeat:
                    times[n].append(seconds)
    finally:
        tx.stop()
        rx.stop()
    return {n: 1000 * statistics.median(t) for n, t in times.items()}


def overhead_model() -> Path:
    """The tiny model with one layer and a 4096-token context (built once into the model
    cache): the least work per request the workers can do, so they keep up with the rate."""
    from engine.testing.tiny_model import (
        _generator_fingerprint,
        default_model_cache_dir,
        make_tiny_model,
    )

    final = default_model_cache_dir() / f"tiny1l4k-llama-seed0-{_generator_fingerprint()}"
    if not final.is_dir():
        tmp = final.with_name(final.name + f".tmp{time.monotonic_ns()}")
        make_tiny_model(tmp, preset="tiny", overrides={"max_position_embeddings": 4096,
                                                       "num_hidden_layers": 1})
        tmp.rename(final)
    return final


def cpu_seconds(pid: int) -> float:
    """User + system CPU seconds of process ``pid`` so far (/proc)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def measure_overhead(args: argparse.Namespace) -> dict[int, dict[str, Any]]:
    model_dir = overhead_model()
    vocab = model_facts(model_dir)["vocab_size"]
    found = {}
    # no queued-token limit: a backlog shows in to_first_worker_call instead of refusals;
    # every prompt through the prefill worker, as before conditional disaggregation's
    # default took tails this short to the decode worker that holds the rest
    with cluster(model_dir, num_prefill=1, num_decode=1, num_kv_blocks=32768,
                 router_args=("--max-queued-tokens", "0", "--local-prefill-max-tokens", "0")
                 ) as running:
        pids = {k: v for k, v in running.pids().items() if k != "redis"}
        for length in args.lengths:
            spec = WorkloadSpec("prefix-repetition", prefix_len=length - SUFFIX_LEN,
                                suffix_len=SUFFIX_LEN, num_prefixes=1,
                                output_len=OVERHEAD_OUTPUT_LEN)
            workload = Workload(spec, vocab, seed=args.seed + length)
            asyncio.run(send_traced(running.router_address, workload.take(3), None))  # cached
            n = max(10, round(args.overhead_rate * args.overhead_seconds))
            cpu = {name: cpu_seconds(pid) for name, pid in pids.items()}
            client_cpu = time.process_time()
            results, seconds = asyncio.run(send_traced(
                running.router_address, workload.take(n), args.overhead_rate, args.seed))
            busy = {name: (cpu_seconds(pid) - cpu[name]) / seconds for name, pid in pids.items()}
            busy["client"] = (time.process_time() - client_cpu) / seconds
            marks = [r["trace"]["marks_ms"] for r in results]
            series = {
                "to_first_worker_call": [m["first_call"] for m in marks],
                # the same less the wait in the router's queue for capacity: its own work
                "to_first_worker_call_unqueued": [m["first_call"] - (m["turn"] - m["admitted"])
                                                  for m in marks],
                "token_to_client": [g for r in results for g in r["trace"]["relay_ms"]]}
            found[length] = {
                "router_overhead_p50_ms": {k: percentile(v, 50) for k, v in series.items()},
                "router_overhead_p99_ms": {k: percentile(v, 99) for k, v in series.items()},
                "overhead_offered_rate": args.overhead_rate,
                "overhead_achieved_rate": len(results) / seconds,
                "overhead_requests": len(results), "overhead_failed": n - len(results),
                "overhead_cores_busy": busy}
            print(f"  router overhead, {length}-token prompts: {len(results)} of {n} requests "
                  f"completed, {len(results) / seconds:.0f} req/s achieved; cores busy: "
                  + ", ".join(f"{k} {v:.2f}" for k, v in busy.items()), flush=True)
    return found


def measure_affinity(args: argparse.Namespace, model_dir: Path, vocab: int
                     ) -> dict[str, Any]:
    first, last = two_cpus()
    spec = WorkloadSpec("prefix-repetition", prefix_len=args.prefix_len, suffix_len=64,
                        num_prefixes=args.prefixes, output_len=OUTPUT_LEN)
    requests = Workload(spec, vocab, seed=args.seed + 5).take(args.affinity_requests)
    block_size = 16
    oracle = sum(oracle_cached_tokens(requests, block_size))
    prompt_tokens = sum(r.prompt_len for r in requests)
    out: dict[str, Any] = {"oracle_cached_fraction": oracle / prompt_tokens,
                           "requests": len(requests), "request_rate": args.affinity_rate,
                           "prefix_len": args.prefix_len, "num_prefixes": args.prefixes}
    for routing in ("affinity", "round-robin"):
        with cluster(model_dir, num_prefill=2, num_decode=1,
                     cpu_affinity={"prefill-0": (first,), "prefill-1": (last,)},
                     router_args=("--prefill-routing", routing)) as running:
            warm = Workload(WorkloadSpec("random", input_len=32, output_len=2), vocab,
                            seed=args.seed + 11).take(2)
            asyncio.run(send_traced(running.router_address, warm, None))
            results, _ = asyncio.run(send_traced(running.router_address, requests,
                                                 args.affinity_rate or None, args.seed))
        ttfts = [r["ttft_ms"] for r in results]
        out[routing.replace("-", "_")] = {
            "cached_fraction": sum(r["cached_tokens"] for r in results) / prompt_tokens,
            "mean_ttft_ms": statistics.fmean(ttfts), "median_ttft_ms": p50(ttfts),
            "p90_ttft_ms": percentile(ttfts, 90), "p99_ttft_ms": percentile(ttfts, 99)}
        print(f"  prefix affinity, {routing}: cached fraction "
              f"{out[routing.replace('-', '_')]['cached_fraction']:.2f} (oracle "
              f"{out['oracle_cached_fraction']:.2f})", flush=True)
    return out


# ---------------------------------------------------------------- report


def render(report: dict[str, Any]) -> str:
    lengths = sorted(report["by_prompt_len"], key=int)
    rows = [[part, *(report["by_prompt_len"][n]["ttft_breakdown_ms"][part] for n in lengths)]
            for part in PARTS]
    for key in ("ttft_p50_ms", "orchestration_p50_ms", "exposed_transfer_p50_ms",
                "one_layer_transfer_ms", "decode_admission_worker_p50_ms"):
        rows.append([key, *(report["by_prompt_len"][n][key] for n in lengths)])
    for key in ("router_overhead_p50_ms", "router_overhead_p99_ms"):
        for sub in ("to_first_worker_call", "to_first_worker_call_unqueued", "token_to_client"):
            if key in report["by_prompt_len"][lengths[0]]:  # not with --breakdown-only
                rows.append([f"{key} {sub}", *(report["by_prompt_len"][n][key][sub]
                                              for n in lengths)])
    lines = [
        "TTFT breakdown (p50 of each part, ms; parts of one request add up to its TTFT, "
        f"the p50s need not) and router overhead; KV cache {report['kv_cache_dtype']}, "
        f"transfer {report.get('kv_transfer_dtype', 'auto')}",
        format_table(rows, ["", *(f"{n} tokens" for n in lengths)]),
        f"goals: orchestration <= 5 ms at p50; exposed transfer <= one layer's transfer; "
        f"router overhead <= 1 ms (p50) / 5 ms (p99) at {report['overhead_rate']:g} req/s"]
    a = report.get("prefix_affinity")
    if a:
        lines += ["prefix affinity (two prefill workers)", format_table(
            [[name, a[name]["cached_fraction"], a["oracle_cached_fraction"],
              a[name]["median_ttft_ms"], a[name]["p90_ttft_ms"]]
             for name in ("affinity", "round_robin")],
            ["prefill routing", "cached fraction", "oracle", "TTFT p50 ms", "TTFT p90 ms"])]
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> dict[str, Any]:
    args = parse_args(argv)
    model_dir = Path(args.model) if args.model else bench_model(args.quick)
    facts = model_facts(model_dir)
    probe = BandwidthProbe(256 << 20 if args.quick else 1 << 30, threads=1)
    bandwidth = probe.measure()
    probe.release()
    print(f"TTFT breakdown on {model_dir.name} ...", flush=True)
    by_len = measure_breakdowns(args, model_dir, facts["vocab_size"])
    for length, layer_ms in kv_transfer_ms(
            facts, args.lengths, kv_cache_dtype=args.kv_cache_dtype,
            kv_transfer_dtype=args.kv_transfer_dtype).items():
        by_len[length]["one_layer_transfer_ms"] = layer_ms
    affinity: dict[str, Any] = {}
    if not args.breakdown_only:
        print(f"router overhead at {args.overhead_rate:g} req/s (tiny model) ...", flush=True)
        for length, found in measure_overhead(args).items():
            by_len[length].update(found)
        print("prefix affinity vs round-robin ...", flush=True)
        affinity = measure_affinity(args, model_dir, facts["vocab_size"])
    top = by_len[max(args.lengths)]
    report: dict[str, Any] = {
        "prompt_len": max(args.lengths), **top,
        "by_prompt_len": {str(n): v for n, v in by_len.items()},
        "prefix_affinity": affinity, "overhead_rate": args.overhead_rate,
        "kv_cache_dtype": args.kv_cache_dtype, "kv_transfer_dtype": args.kv_transfer_dtype,
        "machine": {**machine_info(), "bandwidth_gbps_1_thread": bandwidth},
        "model": {**facts, "dtype": "float32", "torch_threads_per_worker": 1},
        "settings": {k: v for k, v in vars(args).items() if k != "json"}}
    print(render(report))
    print(f"machine: {report['machine']}")
    print(f"model: {facts['parameters'] / 1e6:.1f}M parameters, fp32, one torch thread per "
          "worker; breakdown and affinity workers pinned one per core; router overhead on "
          "the tiny model (one layer, context 4096), workers unpinned")
    if args.json:
        write_json(args.json, report)
    return report


if __name__ == "__main__":
    main()
