"""EXPERIMENT (issue 13): does streaming the first token when Prefill returns (the router's
``--first-token-from-prefill``) lower TTFT?

    python -m bench.first_token [--prompt-len 2048] [--requests 12] [--quick]

One prefill worker (first core) and one decode worker (last core) on ``bench55m``, two
routers on them (unpinned): one plain, one with the flag. Requests alternate between the
two routers, one at a time, same random prompts (no cache hits), 8 output tokens; client
TTFT p50 of each and the paired differences.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import subprocess
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from bench.clusters import bench_model, two_cpus
from bench.common import machine_info, model_facts, write_json
from bench.handoff import send_traced
from loadtest.workloads import Workload, WorkloadSpec
from pdserve import Client
from pdserve.child_process import spawn, terminate_all
from pdserve.local_cluster import LocalCluster, LocalClusterConfig


def start_router(cluster: LocalCluster, name: str, *extra: str) -> tuple[subprocess.Popen[bytes],
                                                                         str]:
    assert cluster.log_dir is not None
    ready = cluster.log_dir / f"{name}.ready.json"
    log = open(cluster.log_dir / f"{name}.log", "wb")  # noqa: SIM115 - closed with the process
    proc = spawn([sys.executable, "-m", "pdserve", "router", "--model", str(cluster.model_dir),
                  "--redis-url", str(cluster.redis_url), "--port", "0", "--no-http",
                  "--ready-file", str(ready), *extra], stdout=log, stderr=subprocess.STDOUT)
    deadline = time.monotonic() + 60
    while not ready.exists():
        if proc.poll() is not None or time.monotonic() > deadline:
            raise SystemExit(f"{name} did not start: see {cluster.log_dir / (name + '.log')}")
        time.sleep(0.1)
    time.sleep(1.5)  # a refresh or two: it sees both workers
    return proc, json.loads(ready.read_text())["grpc_address"]


def main(argv: Sequence[str] | None = None) -> dict[str, Any]:
    p = argparse.ArgumentParser(prog="python -m bench.first_token", description=__doc__)
    p.add_argument("--prompt-len", type=int, default=2048)
    p.add_argument("--requests", type=int, default=12)
    p.add_argument("--quick", action="store_true")
    p.add_argument("--json", type=Path)
    args = p.parse_args(argv)
    model_dir = bench_model(args.quick)
    vocab = model_facts(model_dir)["vocab_size"]
    first, last = two_cpus()
    config = LocalClusterConfig(model_dir=model_dir, port=0, http_port=None,
                                start_router=False,
                                cpu_affinity={"prefill-0": (first,), "decode-0": (last,)})
    spec = WorkloadSpec("random", input_len=args.prompt_len, output_len=8)
    ttft: dict[str, list[float]] = {"off": [], "on": []}
    ahead: list[float] = []  # with the flag: the first token's lead on the decode's chunk
    with LocalCluster(config, progress=lambda line: None) as cluster:
        routers = {"off": start_router(cluster, "router-off"),
                   "on": start_router(cluster, "router-on", "--first-token-from-prefill")}
        try:
            for mode in ("off", "on"):
                asyncio.run(send_traced(routers[mode][1], Workload(spec, vocab, 9).take(2), None))
            check = Workload(spec, vocab, 5).next()
            outputs = {}
            for mode, (_, address) in routers.items():
                with Client(address) as client:
                    outputs[mode] = client.complete(
                        prompt_token_ids=check.prompt_token_ids, max_tokens=8, temperature=0,
                        ignore_eos=True, timeout=120)
            assert outputs["on"].token_ids == outputs["off"].token_ids, outputs
            assert outputs["on"].text == outputs["off"].text
            assert len(outputs["on"].token_ids) == 8 == outputs["on"].usage.completion_tokens
            for i, request in enumerate(Workload(spec, vocab, 1).take(2 * args.requests)):
                mode = ("off", "on")[i % 2]
                results, _ = asyncio.run(send_traced(routers[mode][1], [request], None))
                ttft[mode].append(results[0]["ttft_ms"])
                marks = results[0]["trace"]["marks_ms"]
                if mode == "on":
                    ahead.append(marks["first_chunk"] - marks["first_sent"])
        finally:
            terminate_all([proc for proc, _ in routers.values()], 10.0)
    pairs = [on - off for off, on in zip(ttft["off"], ttft["on"], strict=True)]
    report = {"prompt_len": args.prompt_len, "requests_each": args.requests,
              "ttft_p50_ms_off": statistics.median(ttft["off"]),
              "ttft_p50_ms_on": statistics.median(ttft["on"]),
              "paired_difference_p50_ms": statistics.median(pairs),
              "first_token_ahead_of_decode_p50_ms": statistics.median(ahead),
              "ttft_ms": ttft, "machine": machine_info()}
    print(f"TTFT p50: {report['ttft_p50_ms_off']:.1f} ms plain, {report['ttft_p50_ms_on']:.1f} "
          f"ms with --first-token-from-prefill; paired difference p50 "
          f"{report['paired_difference_p50_ms']:+.1f} ms ({args.prompt_len}-token prompts); "
          f"with it the first token left the router {report['first_token_ahead_of_decode_p50_ms']:.2f}"
          " ms (p50) before the decode worker's first chunk arrived")
    print(f"machine: {report['machine']}")
    if args.json:
        write_json(args.json, report)
    return report


if __name__ == "__main__":
    main()
