"""Route on where the KV is: a chat fleet's traffic under each prefill routing, at 1 and 4
routers, against an oracle; and the routing decision's own cost.

    python -m bench.routing [--quick] [--chats 24] [--turns 4] [--system-tokens 256]
                            [--user-tokens 32] [--reply-tokens 16] [--prefill 4]
                            [--routers 1,4] [--arms kv-aware,affinity,round-robin]
                            [--json PATH] [--plot PATH]

The workload: ``--chats`` concurrent multi-turn chats that all start with one shared
system prompt; each turn's prompt is the chat so far (its earlier turns and the replies
the cluster gave, greedy) plus a new user turn. Token ids, random in the vocabulary,
fixed by the seed, so every arm sends the same turns.

Each arm is a fresh ``pdserve up`` (``--prefill`` prefill workers, one decode worker,
``--routers`` router replicas; chat ``i`` talks to router ``i mod routers``) on the
built-in tiny model (``--quick``) or ``bench55m``, with ``--prefill-routing`` set to the
arm; ``affinity-no-reuse`` is ``affinity`` with the decode worker's prefix cache off
(``--no-enable-prefix-caching``): the cluster before decode-side reuse, whose decode
worker receives every turn's whole prompt, the baseline of the KV bytes. Per arm:

- cached ÷ oracle: the prompt tokens the cluster did not compute (``usage.cached_tokens``,
  summed) over the oracle's: for each prompt, the longest full-block prefix it shares
  with any prompt sent before it, capped at its length − 1. The oracle counts prompts
  only, so a decode worker's cached reply KV could push the ratio past 1;
- prefill imbalance: max ÷ mean of the prompt tokens each prefill worker computed
  (``vllm:prompt_tokens`` less ``vllm:prefix_cache_hits``);
- TTFT p50/p90 (client side), KV bytes the prefill workers sent per request
  (``pdserve:kv_transfer_bytes_total``);
- the prompts the decode worker prefilled itself, by conditional disaggregation's reason
  (short tail, queue wait as the router saw it, refused by the prefill worker for its
  queue: the routers' ``pdserve:router_decisions_total``).

The decision's cost is measured on the policy objects alone (``router.kv_index`` and
``router.routing``): ``--prefill`` workers with 10,000 indexed blocks each, 2,000 prompts
of 512 tokens whose prefixes they hold in part; p50/p99 of one decision (match + cost
ranking), in-process.
"""

from __future__ import annotations

import argparse
import asyncio
import random
import statistics
import sys
import time
import urllib.request
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from bench.clusters import bench_model, cluster, settled_prefill_counters
from bench.common import format_table, machine_info, write_json
from cluster.kv_events import EventBatch
from deploy.local import LocalLauncher
from engine.kvcache.block_hash import compute_block_hashes
from engine.kvcache.events import STORED
from pdserve.aio_client import AsyncClient
from router.kv_index import KVIndex
from router.routing import rank_by_cost, uncached_tokens

BLOCK = 16
VOCAB = 500  # token ids drawn below this (both models' vocabularies are larger)
# arm -> (the routers' --prefill-routing, the decode worker's own flags)
# conditional disaggregation's reasons (``pdserve:router_decisions_total``), in the table
LOCAL_REASONS = ("local_short_tail", "local_queue_wait", "local_queue_refused")
ARMS = {"kv-aware": ("kv-aware", ()), "affinity": ("affinity", ()),
        "round-robin": ("round-robin", ()),
        "affinity-no-reuse": ("affinity", ("--no-enable-prefix-caching",))}


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m bench.routing", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true", help="the built-in tiny model")
    p.add_argument("--chats", type=int, default=24)
    p.add_argument("--turns", type=int, default=4)
    p.add_argument("--system-tokens", type=int, default=256)
    p.add_argument("--user-tokens", type=int, default=32)
    p.add_argument("--reply-tokens", type=int, default=16)
    p.add_argument("--prefill", type=int, default=4, help="prefill workers")
    p.add_argument("--routers", default="1,4", help="router replica counts, comma-separated")
    p.add_argument("--arms", default=",".join(ARMS), help=f"any of {', '.join(ARMS)}")
    p.add_argument("--local-prefill-max-tokens", type=int, default=None,
                   help="the kv-aware arm's routers' --local-prefill-max-tokens (default: "
                        "the router's)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", default=None, help="also write the results here")
    p.add_argument("--plot", default=None, help="also draw the arms side by side here (PNG)")
    return p.parse_args(argv)


@dataclass
class Turn:
    prompt: list[int]
    sent_at: float
    ttft_s: float = 0.0
    tpot_s: float = 0.0  # the mean time between its tokens after the first
    cached_tokens: int = 0


@dataclass
class ArmResult:
    arm: str
    routers: int
    turns: list[Turn] = field(default_factory=list)
    computed: dict[str, float] = field(default_factory=dict)  # per prefill worker
    kv_bytes: float = 0.0
    wall_s: float = 0.0
    # prompts the decode worker prefilled itself, by conditional disaggregation's reason
    local: dict[str, float] = field(default_factory=dict)

    def figures(self) -> dict[str, float]:
        oracle = oracle_cached_tokens([t.prompt for t in sorted(self.turns,
                                                                key=lambda t: t.sent_at)])
        cached = sum(t.cached_tokens for t in self.turns)
        ttfts = sorted(t.ttft_s for t in self.turns)
        tpots = sorted(t.tpot_s for t in self.turns if t.tpot_s)
        loads = list(self.computed.values())
        mean = statistics.fmean(loads) if loads else 0.0
        return {"requests": len(self.turns), "cached_tokens": cached,
                "oracle_tokens": oracle, "cached_over_oracle": cached / oracle if oracle else 0.0,
                "prefill_imbalance": max(loads) / mean if mean else 0.0,
                "ttft_p50_ms": _quantile(ttfts, 0.5) * 1e3,
                "ttft_p90_ms": _quantile(ttfts, 0.9) * 1e3,
                "tpot_p50_ms": _quantile(tpots, 0.5) * 1e3,
                "tpot_p90_ms": _quantile(tpots, 0.9) * 1e3,
                "kv_bytes_per_request": self.kv_bytes / max(1, len(self.turns)),
                "wall_s": self.wall_s}


def oracle_cached_tokens(prompts: Sequence[Sequence[int]]) -> int:
    """Σ over ``prompts`` (in the order sent) of the longest full-block prefix each shares
    with any prompt before it, capped at its length − 1: what a perfect cluster-wide prefix
    cache could have served."""
    seen: set[bytes] = set()
    total = 0
    for prompt in prompts:
        hashes = compute_block_hashes(list(prompt), BLOCK)
        shared = 0
        for block_hash in hashes:
            if block_hash not in seen:
                break
            shared += 1
        total += min(shared * BLOCK, len(prompt) - 1)
        seen.update(hashes)
    return total


def _quantile(values: Sequence[float], q: float) -> float:
    if not values:
        return 0.0
    return values[min(len(values) - 1, int(q * len(values)))]


def chat_script(args: argparse.Namespace) -> tuple[list[int], list[list[list[int]]]]:
    """(the shared system prompt, each chat's user turns)."""
    rng = random.Random(args.seed)
    system = [rng.randrange(3, VOCAB) for _ in range(args.system_tokens)]
    users = [[[rng.randrange(3, VOCAB) for _ in range(args.user_tokens)]
              for _ in range(args.turns)] for _ in range(args.chats)]
    return system, users


async def _chats(addresses: list[str], system: list[int], users: list[list[list[int]]],
                 reply_tokens: int) -> list[Turn]:
    clients = [AsyncClient(a) for a in addresses]
    turns: list[Turn] = []

    async def chat(index: int) -> None:
        client = clients[index % len(clients)]
        history = list(system)
        for user in users[index]:
            prompt = history + user
            turn = Turn(prompt, time.perf_counter())
            turns.append(turn)
            reply: list[int] = []
            last = 0.0
            async for chunk in client.generate(prompt_token_ids=prompt, max_tokens=reply_tokens,
                                               temperature=0.0, ignore_eos=True, timeout=600.0):
                if chunk.token_ids:
                    last = time.perf_counter() - turn.sent_at
                    if not reply:
                        turn.ttft_s = last
                reply.extend(chunk.token_ids)
                if chunk.usage is not None:
                    turn.cached_tokens = chunk.usage.cached_tokens
            if len(reply) > 1:
                turn.tpot_s = (last - turn.ttft_s) / (len(reply) - 1)
            history = prompt + reply

    try:
        await asyncio.gather(*(chat(i) for i in range(len(users))))
    finally:
        for client in clients:
            await client.close()
    return turns


def run_arm(args: argparse.Namespace, arm: str, routers: int) -> ArmResult:
    system, users = chat_script(args)
    result = ArmResult(arm, routers)
    routing, decode_args = ARMS[arm]
    router_args: tuple[str, ...] = ("--prefill-routing", routing, "--metrics-port", "0")
    if routing == "kv-aware" and args.local_prefill_max_tokens is not None:
        router_args += ("--local-prefill-max-tokens", str(args.local_prefill_max_tokens))
    with cluster(bench_model(args.quick), num_prefill=args.prefill, num_decode=1,
                 num_routers=routers, router_args=router_args,
                 worker_args=("--metrics-port", "0"), decode_args=decode_args) as running:
        time.sleep(1.5)  # the routers' KV feeds take their first snapshots
        before, sent0 = settled_prefill_counters(running, tries=40, pause_s=0.1)
        start = time.perf_counter()
        result.turns = asyncio.run(_chats(running.router_addresses, system, users,
                                          args.reply_tokens))
        result.wall_s = time.perf_counter() - start
        after, sent1 = settled_prefill_counters(running, tries=40, pause_s=0.1)
        result.local = local_prefills(running)
    result.computed = {w: after[w] - before.get(w, 0.0) for w in after}
    result.kv_bytes = sent1 - sent0
    return result


def local_prefills(running: LocalLauncher) -> dict[str, float]:
    """The routers' prefill decisions that kept a prompt on its decode worker
    (``pdserve:router_decisions_total{kind="prefill"}``, summed), by reason."""
    totals = dict.fromkeys(LOCAL_REASONS, 0.0)
    for router in running.routers:
        assert router.ready is not None
        url = f"http://{router.ready['metrics_address']}/metrics"
        with urllib.request.urlopen(url, timeout=10) as reply:
            text = reply.read().decode()
        for line in text.splitlines():
            if line.startswith("pdserve:router_decisions_total") and 'kind="prefill"' in line:
                for reason in LOCAL_REASONS:
                    if f'reason="{reason}"' in line:
                        totals[reason] += float(line.rsplit(" ", 1)[-1])
    return totals


def decision_cost(num_workers: int, blocks_per_worker: int = 10_000,
                  prompts: int = 2000, prompt_tokens: int = 512) -> dict[str, float]:
    """p50/p99 seconds of one kv-aware prefill decision on a full index (in-process)."""
    rng = random.Random(1)
    index = KVIndex(max_blocks=num_workers * blocks_per_worker + 1)
    workers = [f"prefill-{i}" for i in range(num_workers)]
    index.watch(workers)
    chains = [compute_block_hashes([rng.randrange(3, VOCAB) for _ in range(prompt_tokens)],
                                   BLOCK) for _ in range(blocks_per_worker * num_workers
                                                         // (prompt_tokens // BLOCK))]
    for i, chain in enumerate(chains):
        worker = workers[i % num_workers]
        index.apply(EventBatch(worker, 1, index.seq_of(worker) + 1,
                               tuple((STORED, h) for h in chain)))
    index.heard()
    times = []
    for i in range(prompts):
        chain = chains[rng.randrange(len(chains))]
        cut = rng.randrange(1, len(chain) + 1)  # the known part, then a new tail
        hashes = chain[:cut] + compute_block_hashes([rng.randrange(3, VOCAB)] * 64, BLOCK)
        start = time.perf_counter()
        cached = index.match(hashes, workers)
        costs = {w: i % 7 * 100 + uncached_tokens(len(hashes) * BLOCK, BLOCK, cached[w])
                 for w in workers}
        rank_by_cost(hashes[0], costs)
        times.append(time.perf_counter() - start)
    times.sort()
    return {"blocks_per_worker": min(index.num_blocks_of(w) for w in workers),
            "p50_ms": _quantile(times, 0.5) * 1e3, "p99_ms": _quantile(times, 0.99) * 1e3}


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    arms = [a for a in args.arms.split(",") if a]
    if unknown := [a for a in arms if a not in ARMS]:
        raise SystemExit(f"bench.routing: unknown arm(s) {', '.join(unknown)}; "
                         f"the arms are {', '.join(ARMS)}")
    router_counts = [int(n) for n in args.routers.split(",") if n]
    model = bench_model(args.quick)
    print(f"{args.chats} chats x {args.turns} turns (system {args.system_tokens}, user "
          f"{args.user_tokens}, reply {args.reply_tokens} tokens) on {model.name}, "
          f"{args.prefill} prefill + 1 decode worker", flush=True)
    results: list[ArmResult] = []
    for routers in router_counts:
        for arm in arms:
            print(f"  {arm}, {routers} router(s) ...", flush=True)
            results.append(run_arm(args, arm, routers))
    rows, out = [], []
    for r in results:
        f = r.figures()
        out.append({"arm": r.arm, "routers": r.routers, **f, "computed_per_worker": r.computed,
                    "local_prefills": r.local})
        rows.append([r.arm, str(r.routers), f"{f['cached_over_oracle']:.3f}",
                     f"{f['prefill_imbalance']:.2f}", f"{f['ttft_p50_ms']:.1f}",
                     f"{f['ttft_p90_ms']:.1f}", f"{f['tpot_p50_ms']:.1f}",
                     f"{f['tpot_p90_ms']:.1f}", f"{f['kv_bytes_per_request'] / 1024:.1f}",
                     "/".join(f"{r.local.get(k, 0):.0f}" for k in LOCAL_REASONS),
                     f"{f['wall_s']:.1f}"])
    print(format_table(rows, ["arm", "routers", "cached/oracle", "prefill imbalance",
                              "TTFT p50 ms", "TTFT p90 ms", "TPOT p50 ms", "TPOT p90 ms",
                              "KV KiB/request", "local tail/wait/refused", "wall s"]))
    fewer = kv_bytes_fewer(out)
    for routers, by_arm in fewer.items():
        print(f"KV bytes per request at {routers} router(s), against affinity-no-reuse (no "
              "decode-side reuse): " + ", ".join(f"{arm} {times:.2f}x fewer"
                                                 for arm, times in by_arm.items()))
    cost = decision_cost(args.prefill)
    print(f"routing decision (kv-aware, {args.prefill} workers x "
          f"{cost['blocks_per_worker']:.0f} indexed blocks): p50 {cost['p50_ms']:.3f} ms, "
          f"p99 {cost['p99_ms']:.3f} ms")
    facts = machine_info()
    print(f"machine: {facts.get('cpu_model', '?')}, {facts.get('cpu_count', '?')} CPUs")
    if args.plot:
        _plot(args.plot, out)
    if args.json:
        write_json(args.json, {"model": model.name, "args": vars(args), "arms": out,
                               "kv_bytes_fewer_than_no_reuse": fewer, "decision": cost,
                               "machine": facts})
    return 0


def kv_bytes_fewer(arms: Sequence[dict[str, Any]]) -> dict[int, dict[str, float]]:
    """Per router count: the ``affinity-no-reuse`` arm's KV bytes per request over each
    other arm's run at that count (``affinity``: decode-side reuse alone; ``kv-aware``:
    with its routing)."""
    per = {(a["arm"], a["routers"]): a["kv_bytes_per_request"] for a in arms}
    return {routers: {arm: per[("affinity-no-reuse", routers)] / sent
                      for (arm, count), sent in per.items()
                      if count == routers and arm != "affinity-no-reuse" and sent > 0}
            for (name, routers) in per if name == "affinity-no-reuse"}


def _plot(path: str, arms: list[dict[str, Any]]) -> None:
    from bench.plots import _pyplot

    plt = _pyplot()
    names = [f"{a['arm']} {a['routers']}R" for a in arms]
    fig, axes = plt.subplots(1, 3, figsize=(13, 4))
    for ax, key, title in zip(axes, ("cached_over_oracle", "prefill_imbalance", "ttft_p90_ms"),
                              ("cached ÷ oracle", "prefill imbalance (max ÷ mean)",
                               "TTFT p90 (ms)"), strict=True):
        ax.bar(names, [a[key] for a in arms])
        ax.set_title(title)
        ax.tick_params(axis="x", labelsize=8, labelrotation=30)
    fig.tight_layout()
    fig.savefig(path)
    print(f"plot: {path}")


if __name__ == "__main__":
    sys.exit(main())
