"""Factories for kvtransfer scenarios: a prefill worker of p sender agents and a decode
worker of r receiver agents, transfers between them, and byte-exact checks."""

from __future__ import annotations

import random
from dataclasses import dataclass, field

import torch

from engine.kvcache.layout import KVLayout
from engine.models.layers import kv_head_range
from engine.tp.distributed import LOOPBACK, StoreAddress
from kvtransfer.config import TransferConfig
from tests.kvtransfer.agent import Agent, global_kv, unpack

NUM_BLOCKS = 48
LAYOUT = KVLayout(model_fingerprint="tiny-test-model", dtype="float32", block_size=16,
                  hash_algorithm="xxh3_128", hash_seed=0, num_layers=3, num_kv_heads=2,
                  head_dim=32)
# small parts, so that messages have several parts; short timeouts for fault tests
CONFIG = TransferConfig(timeout_s=4.0, part_bytes=16 << 10, max_channels=4)


def make_layout(**changes: object) -> KVLayout:
    fields = {**LAYOUT.__dict__, **changes}
    return KVLayout(**fields)  # type: ignore[arg-type]


@dataclass
class Decode:
    """A decode worker: receiver agents, rank 0 hosting the rendezvous store."""

    ranks: list[Agent]
    address: StoreAddress
    layout: KVLayout


@dataclass
class Prefill:
    ranks: list[Agent]
    layout: KVLayout


def make_decode(ranks: list[Agent], layout: KVLayout = LAYOUT,
                config: TransferConfig = CONFIG, devices: list[str] | None = None) -> Decode:
    r = len(ranks)
    devices = devices or ["cpu"] * r
    address = ranks[0].call("make_receiver", layout, StoreAddress(LOOPBACK, 0), 0, r, config,
                            NUM_BLOCKS, devices[0])
    for j, agent in enumerate(ranks[1:], start=1):
        agent.call("make_receiver", layout, address, j, r, config, NUM_BLOCKS, devices[j])
    return Decode(ranks, address, layout)


def make_prefill(ranks: list[Agent], layout: KVLayout = LAYOUT, config: TransferConfig = CONFIG,
                 fault: tuple[str, int, int] | None = None, devices: list[str] | None = None
                 ) -> Prefill:
    devices = devices or ["cpu"] * len(ranks)
    for i, agent in enumerate(ranks):
        agent.call("make_sender", layout, i, len(ranks), config, NUM_BLOCKS, fault, devices[i])
    return Prefill(ranks, layout)


@dataclass
class Request:
    """One request's KV: ``num_tokens`` tokens in scattered blocks on both sides."""

    transfer_id: int
    num_tokens: int
    seed: int
    src_blocks: list[int] = field(default_factory=list)
    dst_blocks: list[int] = field(default_factory=list)


def make_request(transfer_id: int, num_tokens: int, *, seed: int | None = None,
                 block_size: int = 16) -> Request:
    """Blocks drawn at random from the pool, so they are neither contiguous nor ordered."""
    rng = random.Random(transfer_id)
    n = -(-num_tokens // block_size)
    return Request(transfer_id, num_tokens, transfer_id if seed is None else seed,
                   rng.sample(range(NUM_BLOCKS), n), rng.sample(range(NUM_BLOCKS), n))


def expect(decode: Decode, req: Request, timeout_s: float | None = None) -> None:
    for agent in decode.ranks:
        agent.call("expect", req.transfer_id, req.dst_blocks, req.num_tokens, timeout_s)


def send(prefill: Prefill, decode: Decode, req: Request, layers: range | None = None) -> None:
    for agent in prefill.ranks:
        if layers is None or layers.start == 0:
            agent.call("fill", req.seed, req.src_blocks, req.num_tokens)
        agent.call("send", req.transfer_id, req.src_blocks, req.num_tokens, decode.address, layers)


def wait_all(prefill: Prefill, decode: Decode, req: Request) -> None:
    for agent in prefill.ranks:
        agent.call("send_wait", req.transfer_id)
    for agent in decode.ranks:
        agent.call("recv_wait", req.transfer_id)


def transfer(prefill: Prefill, decode: Decode, req: Request) -> None:
    expect(decode, req)
    send(prefill, decode, req)
    wait_all(prefill, decode, req)


def assert_received(decode: Decode, req: Request) -> None:
    """Each decode rank holds exactly its KV heads of the request, in its blocks."""
    expected = global_kv(decode.layout, req.num_tokens, req.seed)
    r = len(decode.ranks)
    for j, agent in enumerate(decode.ranks):
        start, end = kv_head_range(decode.layout.num_kv_heads, j, r)
        got = unpack(agent.call("read", req.dst_blocks, req.num_tokens),
                     "uint8" if decode.layout.kv_cache_dtype != "auto" else decode.layout.cache_dtype)
        assert got.shape == expected[:, :, :, start:end].shape, (j, got.shape)
        assert torch.equal(got, expected[:, :, :, start:end]), f"decode rank {j} differs"


def reports(agents: list[Agent]) -> list[dict[str, object]]:
    return [agent.call("report") for agent in agents]
