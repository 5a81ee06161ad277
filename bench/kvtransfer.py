"""KV-transfer benchmark: a pdserve transfer against raw gloo of the same bytes, between
two processes on loopback, in one invocation.

What is measured (``python -m bench.kvtransfer``, defaults in brackets):

- A, pdserve: ``KVSender.send`` + ``KVReceiver.wait`` of a request's KV that lives in
  randomly chosen (non-contiguous) paged blocks on the sender and lands in other
  randomly chosen blocks on the receiver, all layers at once: part headers sent, every
  payload XXH3-verified and scattered. Time: from the sender's ``send()`` call to the
  receiver's ``wait()`` returning (``time.monotonic`` is one clock for both processes),
  on an already open channel.
- B, raw gloo: the same number of bytes as one contiguous tensor over a plain gloo
  group between the same two processes, both as one blocking send and as chunks of
  the part size sent with ``isend`` (all posted, then waited); the better median is B.
- Sizes [1, 16, 128] MiB of KV; A and B alternate, [5] timed repeats each after one
  warm-up; medians reported; ``ratio = pdserve_gbps / raw_gloo_gbps``.

The KV geometry is [8] layers, [2] KV heads of [64] dims, fp32, blocks of [16] tokens
(8 KiB per token); parts of [4] MiB. ``--auth`` runs A on authenticated channels (a
cluster token's keys on both ends: every part MACed, ``kvtransfer.wire.auth``), to compare
with a run without. Each process runs one torch thread; with
``--pin`` (default on when the machine has >= 2 cores) the sender runs on core 0 and the
receiver on core 1. The table is printed; ``--json PATH`` also writes every figure.
Target: ratio >= 0.8 at 16 MiB and above.
"""

from __future__ import annotations

import argparse
import dataclasses
import hashlib
import multiprocessing as mp
import os
import random
import statistics
import sys
import time
from collections.abc import Sequence
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any

import torch
import xxhash

from bench.common import GB, MIB, BandwidthProbe, format_table, machine_info, write_json
from engine.kvcache.layout import KVLayout
from engine.tp.distributed import LOOPBACK, StoreAddress, connect_store, make_group
from kvtransfer.config import TransferConfig
from kvtransfer.receive.receiver import KVReceiver
from kvtransfer.send.sender import KVSender
from kvtransfer.wire.auth import ChannelMac
from kvtransfer.wire.checksum import checksum
from kvtransfer.wire.packing import gather, rows_view, scatter, split_rows
from kvtransfer.wire.protocol import ChecksumAlgo

TARGET_RATIO = 0.8
LAYOUT = KVLayout(model_fingerprint="bench-kvtransfer", dtype="float32", block_size=16,
                  hash_algorithm="xxh3_128", hash_seed=0, num_layers=8, num_kv_heads=2,
                  head_dim=64)
TOKEN_BYTES = 2 * LAYOUT.num_layers * LAYOUT.num_kv_heads * LAYOUT.head_dim * 4


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m bench.kvtransfer", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--sizes-mib", type=int, nargs="+", default=[1, 16, 128])
    p.add_argument("--repeats", type=int, default=5, help="timed runs per size and side")
    p.add_argument("--part-mib", type=float, default=4, help="pdserve part / raw chunk size")
    p.add_argument("--pin", action=argparse.BooleanOptionalAction,
                   default=(os.cpu_count() or 1) >= 2, help="sender on core 0, receiver on 1")
    p.add_argument("--bandwidth-mib", type=int, default=256, help="bandwidth probe buffer")
    p.add_argument("--timeout-s", type=float, default=120.0)
    p.add_argument("--auth", action="store_true",
                   help="authenticated channels (every part MACed), as with a cluster token")
    p.add_argument("--json", type=Path, default=None, help="also write the results here")
    return p.parse_args(argv)


# ---------------------------------------------------------------- the two processes


class Side:
    """One end: a kvtransfer role, a raw gloo group and a paged KV cache."""

    def __init__(self, role: str, args: dict[str, Any]) -> None:
        torch.set_num_threads(1)
        if args["pin"]:
            os.sched_setaffinity(0, {0 if role == "sender" else 1})
        self.role = role
        keys = (hashlib.sha256(b"bench cluster token").digest(),) if args["auth"] else ()
        config = TransferConfig(timeout_s=args["timeout_s"], part_bytes=int(args["part_mib"] * MIB),
                                auth_keys=keys)
        num_blocks = args["num_blocks"]
        shape = (LAYOUT.num_layers, 2, num_blocks, LAYOUT.block_size, LAYOUT.num_kv_heads,
                 LAYOUT.head_dim)
        gen = torch.Generator().manual_seed(1 if role == "sender" else 2)
        self.cache = torch.randn(shape, generator=gen)
        self.raw = torch.ones(max(args["sizes_mib"]) * MIB, dtype=torch.uint8)
        self.part_bytes = config.part_bytes
        self.sender: KVSender | None = None
        self.receiver: KVReceiver | None = None
        # "int8": fp32 caches, the KV quantised for the wire (bench.handoff's one layer)
        layout = dataclasses.replace(LAYOUT, kv_transfer_dtype=args.get("kv_transfer_dtype",
                                                                        "auto"))
        if role == "receiver":
            self.receiver = KVReceiver(layout, StoreAddress(LOOPBACK, 0), config=config)
            self.address = self.receiver.address
        else:
            self.sender = KVSender(layout, name="bench", config=config)
        self._tag = 0

    def join_raw(self, address: StoreAddress, timeout_s: float) -> None:
        store = connect_store(address, timeout_s=timeout_s)
        rank = 0 if self.role == "sender" else 1
        self.group = make_group(store, "bench/raw", rank, 2, timeout_s=timeout_s, threads=1)

    def pdserve(self, transfer_id: int, block_ids: list[int], num_tokens: int, address: Any
                ) -> float:
        """Sender: the start time. Receiver (after ``expect``): the completion time."""
        if self.sender is not None:
            start = time.monotonic()
            self.sender.send(transfer_id, self.cache, block_ids, num_tokens, address)
            self.sender.wait(transfer_id)
            return start
        assert self.receiver is not None
        self.receiver.wait(transfer_id)
        return time.monotonic()

    def expect(self, transfer_id: int, block_ids: list[int], num_tokens: int) -> None:
        assert self.receiver is not None
        self.receiver.expect(transfer_id, self.cache, block_ids, num_tokens)

    def raw_send(self, nbytes: int, chunked: bool) -> float:
        """Sender: start time; receiver: completion time of ``nbytes`` over plain gloo."""
        self._tag += 1
        tag, peer = self._tag * 1024, 1 - self.group.rank
        step = self.part_bytes if chunked else nbytes
        chunks = [self.raw[i : min(i + step, nbytes)] for i in range(0, nbytes, step)]
        start = time.monotonic()
        post = self.group.isend if self.group.rank == 0 else self.group.irecv
        works = [post(chunk, peer, tag + i) for i, chunk in enumerate(chunks)]
        for work in works:
            work.wait()
        return start if self.group.rank == 0 else time.monotonic()

    def digest(self, block_ids: list[int]) -> int:
        return xxhash.xxh3_64_intdigest(self.cache[:, :, block_ids].contiguous().numpy().data)

    def close(self) -> None:
        for role in (self.sender, self.receiver):
            if role is not None:
                role.close()
        self.group.abort()


def side_main(role: str, args: dict[str, Any], conn: Connection) -> None:
    side = Side(role, args)
    conn.send(getattr(side, "address", None))
    while True:
        method, call_args = conn.recv()
        if method == "quit":
            side.close()
            conn.send(None)
            return
        conn.send(getattr(side, method)(*call_args))


class Remote:
    def __init__(self, role: str, args: dict[str, Any]) -> None:
        ctx = mp.get_context("spawn")
        self.conn, child = ctx.Pipe()
        self.proc = ctx.Process(target=side_main, args=(role, args, child), daemon=True,
                                name=f"bench-{role}")
        self.proc.start()
        child.close()
        self.timeout_s = args["timeout_s"] * 2

    def ready(self) -> Any:
        return self._reply()

    def submit(self, method: str, *args: Any) -> None:
        self.conn.send((method, args))

    def call(self, method: str, *args: Any) -> Any:
        self.submit(method, *args)
        return self._reply()

    def _reply(self) -> Any:
        if not self.conn.poll(self.timeout_s):
            raise TimeoutError(f"{self.proc.name} did not answer")
        return self.conn.recv()

    def stop(self) -> None:
        if self.proc.is_alive():
            try:
                self.call("quit")
            except (OSError, EOFError, TimeoutError):
                pass
            self.proc.kill()
        self.proc.join(timeout=10)


# ---------------------------------------------------------------- measurement


def run_pdserve(tx: Remote, rx: Remote, address: StoreAddress, transfer_id: int, num_tokens: int,
                num_blocks: int, rng: random.Random) -> float:
    """Seconds for one pdserve transfer between fresh random block sets."""
    n = -(-num_tokens // LAYOUT.block_size)
    src, dst = rng.sample(range(num_blocks), n), rng.sample(range(num_blocks), n)
    rx.call("expect", transfer_id, dst, num_tokens)
    rx.submit("pdserve", transfer_id, dst, num_tokens, address)
    start = tx.call("pdserve", transfer_id, src, num_tokens, address)
    return float(rx._reply() - start)


def run_raw(tx: Remote, rx: Remote, nbytes: int, chunked: bool) -> float:
    rx.submit("raw_send", nbytes, chunked)
    start = tx.call("raw_send", nbytes, chunked)
    return float(rx._reply() - start)


def check_bytes(tx: Remote, rx: Remote, address: StoreAddress, num_blocks: int) -> None:
    """One transfer whose blocks are compared end to end (the figures mean nothing else)."""
    rng = random.Random(7)
    n = 8
    src, dst = rng.sample(range(num_blocks), n), rng.sample(range(num_blocks), n)
    rx.call("expect", 10**9, dst, n * LAYOUT.block_size)
    rx.submit("pdserve", 10**9, dst, n * LAYOUT.block_size, address)
    tx.call("pdserve", 10**9, src, n * LAYOUT.block_size, address)
    rx._reply()
    if tx.call("digest", src) != rx.call("digest", dst):
        raise RuntimeError("received KV differs from the sent KV")


def measure(args: argparse.Namespace, tx: Remote, rx: Remote, address: StoreAddress,
            num_blocks: int) -> dict[str, dict[int, list[float]]]:
    samples: dict[str, dict[int, list[float]]] = {k: {s: [] for s in args.sizes_mib}
                                                  for k in ("pdserve", "blocking", "chunked")}
    rng = random.Random(0)
    transfer_id = 0
    for repeat in range(args.repeats + 1):  # repeat 0 warms up
        for size in args.sizes_mib:
            num_tokens = size * MIB // TOKEN_BYTES
            transfer_id += 1
            timings = {
                "pdserve": run_pdserve(tx, rx, address, transfer_id, num_tokens, num_blocks, rng),
                "blocking": run_raw(tx, rx, size * MIB, chunked=False),
                "chunked": run_raw(tx, rx, size * MIB, chunked=True),
            }
            if repeat:
                for kind, seconds in timings.items():
                    samples[kind][size].append(seconds)
    return samples


def summarize(args: argparse.Namespace, samples: dict[str, dict[int, list[float]]]
              ) -> dict[str, Any]:
    def gbps(kind: str, size: int) -> float:
        return size * MIB / statistics.median(samples[kind][size]) / GB

    sizes = list(args.sizes_mib)
    pd = [gbps("pdserve", s) for s in sizes]
    blocking = [gbps("blocking", s) for s in sizes]
    chunked = [gbps("chunked", s) for s in sizes]
    raw = [max(b, c) for b, c in zip(blocking, chunked, strict=True)]
    return {
        "sizes_mib": sizes,
        "pdserve_gbps": pd,
        "raw_gloo_gbps": raw,
        "ratio": [a / b for a, b in zip(pd, raw, strict=True)],
        "raw_gloo_blocking_gbps": blocking,
        "raw_gloo_chunked_gbps": chunked,
        "samples_s": {k: {str(s): v for s, v in d.items()} for k, d in samples.items()},
    }


def print_report(result: dict[str, Any], context: dict[str, Any]) -> None:
    rows = [[f"{s} MiB", a, b, blocking, chunked, r]
            for s, a, b, blocking, chunked, r in zip(
                result["sizes_mib"], result["pdserve_gbps"], result["raw_gloo_gbps"],
                result["raw_gloo_blocking_gbps"], result["raw_gloo_chunked_gbps"],
                result["ratio"], strict=True)]
    print(format_table(rows, ["KV size", "pdserve GB/s", "raw gloo GB/s", "(blocking)",
                              "(chunked)", "ratio"]))
    for key, value in context.items():
        print(f"{key}: {value}")
    big = [r for s, r in zip(result["sizes_mib"], result["ratio"], strict=True) if s >= 16]
    verdict = "met" if big and min(big) >= TARGET_RATIO else "NOT met"
    print(f"target ratio >= {TARGET_RATIO} at 16 MiB and above: {verdict}")


def pass_speeds(num_blocks: int, size_mib: int = 16) -> dict[str, float]:
    """GB/s of the extra passes pdserve makes over the bytes, on one thread, in this
    process: gather (paged -> part), XXH3 over the part, its MAC on an authenticated
    channel (Poly1305), scatter (part -> paged)."""
    torch.set_num_threads(1)
    shape = (LAYOUT.num_layers, 2, num_blocks, LAYOUT.block_size, LAYOUT.num_kv_heads,
             LAYOUT.head_dim)
    cache = torch.randn(shape)
    n = min(size_mib * MIB // TOKEN_BYTES // LAYOUT.block_size, num_blocks)
    ids = torch.tensor(random.Random(3).sample(range(num_blocks), n))
    row_bytes = TOKEN_BYTES * LAYOUT.block_size // (2 * LAYOUT.num_layers)
    rows_per_part = 4 * MIB // row_bytes
    part = torch.zeros(rows_per_part * row_bytes, dtype=torch.uint8)  # pages touched
    view = rows_view(part, torch.float32, rows_per_part, LAYOUT.block_size, LAYOUT.num_kv_heads,
                     LAYOUT.head_dim)
    spent = {"gather": 0.0, "xxh3": 0.0, "mac": 0.0, "scatter": 0.0}
    mac = ChannelMac(hashlib.sha256(b"bench").digest())
    parts = split_rows(2 * LAYOUT.num_layers * n, row_bytes, 4 * MIB)
    for counted, rows in [(False, parts[0])] + [(True, r) for r in parts]:  # one warm-up
        out = view[: rows[1] - rows[0]]
        marks = [time.perf_counter()]
        gather(cache, ids, (0, LAYOUT.num_kv_heads), 0, n, rows, out)
        marks.append(time.perf_counter())
        checksum(part[: (rows[1] - rows[0]) * row_bytes], ChecksumAlgo.XXH3_64)
        marks.append(time.perf_counter())
        mac.words_mac(b"part", 0, [0] * 27, part[: (rows[1] - rows[0]) * row_bytes].numpy().data)
        marks.append(time.perf_counter())
        scatter(cache, ids.flip(0), (0, LAYOUT.num_kv_heads), 0, n, rows, out)
        marks.append(time.perf_counter())
        for key, a, b in zip(spent, marks, marks[1:], strict=False):
            spent[key] += (b - a) if counted else 0.0
    total_bytes = n * LAYOUT.block_size * TOKEN_BYTES
    return {key: total_bytes / seconds / GB for key, seconds in spent.items()}


def main(argv: Sequence[str] | None = None) -> dict[str, Any]:
    args = parse_args(argv)
    num_blocks = 2 * max(args.sizes_mib) * MIB // (TOKEN_BYTES * LAYOUT.block_size) + 16
    shared = {"pin": args.pin, "timeout_s": args.timeout_s, "part_mib": args.part_mib,
              "num_blocks": num_blocks, "sizes_mib": args.sizes_mib, "auth": args.auth}
    probe = BandwidthProbe(args.bandwidth_mib * MIB, threads=1)
    read_gbps = probe.measure()
    probe.release()
    rx, tx = Remote("receiver", shared), Remote("sender", shared)
    try:
        address = rx.ready()
        tx.ready()
        rx.submit("join_raw", address, args.timeout_s)
        tx.call("join_raw", address, args.timeout_s)
        rx._reply()
        check_bytes(tx, rx, address, num_blocks)
        samples = measure(args, tx, rx, address, num_blocks)
    finally:
        tx.stop()
        rx.stop()
    result = summarize(args, samples)
    passes = pass_speeds(num_blocks, min(16, max(args.sizes_mib)))
    context = {
        "KV geometry": f"{LAYOUT.num_layers} layers x {LAYOUT.num_kv_heads} KV heads x "
                       f"{LAYOUT.head_dim} dims, fp32, blocks of {LAYOUT.block_size} tokens "
                       f"({TOKEN_BYTES // 1024} KiB/token), parts of {args.part_mib:g} MiB",
        "processes": "2 (sender, receiver), 1 torch thread each, "
                     + ("pinned to cores 0 and 1" if args.pin else "not pinned"),
        "channels": "authenticated (every part MACed)" if args.auth else "unauthenticated",
        "median of": f"{args.repeats} runs per size and side, interleaved",
        "memory read bandwidth (1 thread)": f"{read_gbps:.1f} GB/s",
        "extra passes (1 thread, GB/s)": ", ".join(f"{k} {v:.1f}" for k, v in passes.items()),
        "machine": machine_info(),
    }
    print_report(result, context)
    result.update(context=context, target_ratio=TARGET_RATIO, read_bandwidth_gbps=read_gbps,
                  pass_gbps=passes)
    if args.json is not None:
        write_json(args.json, result)
    return result


if __name__ == "__main__":
    main(sys.argv[1:])
