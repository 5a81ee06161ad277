"""What losing its decode worker costs a stream: the stall of a migration against an
unloaded time to first token of the same prompt length (the goal: stall p50 <= 2x TTFT
p50), for a death and for a drain — the KV moved, against replayed.

    python -m bench.migration [--quick] [--lengths 128 512] [--trials 5]
                              [--faults kill move replay] [--json out.json]

Starts ``pdserve up`` as a library (``deploy.local.LocalLauncher``): one prefill and two
decode workers, the router with its defaults (``--migration-limit 3``), on ``bench55m``
(``--quick``: the built-in tiny model). For each prompt length: ``--trials`` unloaded
requests of fresh random prompts (one token each) give the TTFT; then ``--trials``
streams, one at a time, each of ``--max-tokens`` greedy tokens: once it has
``--kill-after`` tokens, the decode worker holding it loses it, and the stream's stall
is the longest gap, as its client saw it, between chunks from the fault on. Faults
(``--faults``, one cluster each):

- ``kill``: the worker is SIGKILLed; the router replays the stream elsewhere (the prompt,
  cached on the prefill worker, and the tokens so far prefilled, then decoding on the
  other decode worker);
- ``move``: the worker is drained (SIGTERM): it parks the stream and its KV moves to the
  other decode worker (``cluster.moves``), nothing recomputed;
- ``replay``: the same drain with ``--no-drain-moves --grace 0``: the stream is cut at
  once and replayed as after a death.

The worker is restarted before the next trial. Every stream must come out whole (``--max-tokens`` tokens, the greedy
output of the same prompt unfaulted). Prints a table and the machine facts; ``--json``
writes them.
"""

from __future__ import annotations

import argparse
import random
import statistics
import sys
import time
from collections.abc import Sequence

import grpc

from bench.clusters import bench_model, launched
from bench.common import format_table, machine_info, percentile, write_json
from cluster.internal.v1 import worker_pb2 as wpb
from cluster.internal.v1 import worker_pb2_grpc as wpb_grpc
from cluster.token import TOKEN_METADATA
from deploy.local import Child, LocalLauncher
from deploy.spec import ClusterSpec
from pdserve import Client

SETTLE_S = 6.0  # after a restart: past the router's 5 s of not routing to a failed worker
FAULTS = ("kill", "move", "replay")
WORKER_ARGS = {"kill": (), "move": (), "replay": ("--no-drain-moves", "--grace", "0")}


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m bench.migration", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true", help="the built-in tiny model")
    p.add_argument("--lengths", type=int, nargs="+", default=[128, 512])
    p.add_argument("--trials", type=int, default=5)
    p.add_argument("--max-tokens", type=int, default=192)
    p.add_argument("--kill-after", type=int, default=32)
    p.add_argument("--faults", nargs="+", choices=FAULTS, default=list(FAULTS),
                   help="how the decode worker loses the stream (one cluster each)")
    p.add_argument("--settle-s", type=float, default=SETTLE_S,
                   help="wait after restarting the dead worker (the router does not route "
                        "to a failed worker for 5 s)")
    p.add_argument("--json", default=None, help="also write the results here")
    return p.parse_args(argv)


def _holder(launcher: LocalLauncher) -> Child:
    """The decode worker that holds an attempt now."""
    metadata = ((TOKEN_METADATA, launcher.cluster_token),) if launcher.cluster_token else None
    for child in launcher.workers:
        if child.name.startswith("decode"):
            with grpc.insecure_channel(child.address) as channel:
                info = wpb_grpc.DecodeWorkerStub(channel).Info(wpb.InfoRequest(), timeout=10,
                                                               metadata=metadata)
            if info.attempt_ids:
                return child
    raise RuntimeError("no decode worker holds the stream")


def _prompt(rng: random.Random, length: int, vocab_size: int) -> list[int]:
    return [rng.randrange(3, vocab_size) for _ in range(length)]


def ttft_s(client: Client, prompt: list[int]) -> float:
    start = time.monotonic()
    for _chunk in client.generate(prompt_token_ids=prompt, max_tokens=1, temperature=0.0,
                                  timeout=120):
        return time.monotonic() - start
    raise RuntimeError("no token")


def migrated_stall_s(launcher: LocalLauncher, client: Client, prompt: list[int],
                     max_tokens: int, kill_after: int, settle_s: float, fault: str = "kill"
                     ) -> tuple[float, list[int]]:
    """One stream whose decode worker loses it (``fault``) after ``kill_after`` tokens:
    the gap around the fault and every token; the worker is restarted afterwards."""
    tokens: list[int] = []
    victim: Child | None = None
    stall = 0.0
    last = time.monotonic()
    for chunk in client.generate(prompt_token_ids=prompt, max_tokens=max_tokens,
                                 temperature=0.0, ignore_eos=True, timeout=300):
        now = time.monotonic()
        if victim is not None and chunk.token_ids:  # chunks sent before the death may
            stall = max(stall, now - last)  # still arrive first: the longest gap is its
        tokens += chunk.token_ids
        last = now
        if victim is None and len(tokens) >= kill_after:
            victim = _holder(launcher)
            if fault == "kill":
                victim.proc.kill()
            else:
                victim.proc.terminate()
            last = time.monotonic()  # the gap counts from the death
    if victim is None:
        raise RuntimeError("the stream ended before the kill")
    launcher.restart(victim.name)
    time.sleep(settle_s)
    return stall, tokens


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    model = bench_model(args.quick)
    rng = random.Random(0)
    rows: list[list[object]] = []
    results: dict[str, dict[str, dict[str, object]]] = {}
    print(f"migration stall on {model.name}: 1 prefill + 2 decode workers, "
          f"{args.trials} trials per prompt length and fault ...", flush=True)
    for fault in args.faults:
        spec = ClusterSpec(model_dir=model, num_prefill=1, num_decode=2, port=0,
                           http_port=None, num_kv_blocks=512, worker_args=WORKER_ARGS[fault])
        by_length: dict[str, dict[str, object]] = {}
        results[fault] = by_length
        with launched(spec) as launcher, \
                Client(launcher.router_address, max_resumes=0) as client:
            vocab = client.model_info(timeout=30).vocab_size
            ttft_s(client, _prompt(rng, 8, vocab))  # warm-up
            for length in args.lengths:
                ttfts = [ttft_s(client, _prompt(rng, length, vocab))
                         for _ in range(args.trials)]
                stalls = []
                for _ in range(args.trials):
                    prompt = _prompt(rng, length, vocab)
                    stall, tokens = migrated_stall_s(launcher, client, prompt,
                                                     args.max_tokens, args.kill_after,
                                                     args.settle_s, fault)
                    whole = list(client.complete(prompt_token_ids=prompt,
                                                 max_tokens=args.max_tokens, temperature=0.0,
                                                 ignore_eos=True, timeout=300).token_ids)
                    if tokens != whole:
                        print(f"{fault}: stream of {length}-token prompt came out wrong",
                              file=sys.stderr)
                        return 1
                    stalls.append(stall)
                ttft, stall = statistics.median(ttfts), statistics.median(stalls)
                by_length[str(length)] = {"ttft_p50_ms": ttft * 1e3, "stall_p50_ms": stall * 1e3,
                                          "stall_p90_ms": percentile(stalls, 90) * 1e3,
                                          "stall_over_ttft": stall / ttft,
                                          "goal_met": stall <= 2 * ttft}
                rows.append([fault, length, f"{ttft * 1e3:.1f}", f"{stall * 1e3:.1f}",
                             f"{percentile(stalls, 90) * 1e3:.1f}", f"{stall / ttft:.2f}",
                             "yes" if stall <= 2 * ttft else "NO"])
                print(f"  {fault}, {length}-token prompts: TTFT p50 {ttft * 1e3:.1f} ms, "
                      f"stall p50 {stall * 1e3:.1f} ms", flush=True)
    print(format_table(rows, ["fault", "prompt", "TTFT p50 ms", "stall p50 ms",
                              "stall p90 ms", "stall/TTFT", "<= 2x"]))
    facts = machine_info()
    print(f"machine: {facts.get('cpu_model', '?')}, {facts.get('cpu_count', '?')} CPUs, load "
          f"{facts.get('load_avg_1m_5m_15m', '?')}")
    if args.json:
        write_json(args.json, {"model": model.name, "trials": args.trials,
                               "max_tokens": args.max_tokens, "kill_after": args.kill_after,
                               "by_fault": results, "machine": facts})
    return 0


if __name__ == "__main__":
    sys.exit(main())
