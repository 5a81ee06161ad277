"""Byte-exact KV delivery between real processes on loopback (gloo), with heterogeneous
tensor parallelism, layer-by-layer sending, concurrent transfers and trailers."""

from __future__ import annotations

import time

import pytest
import torch

from engine.attention.kv_quant import dequantize, quantize
from engine.tp.sharding import kv_head_range
from kvtransfer.wire.protocol import Trailer
from tests.kvtransfer.agent import RemoteError, global_kv, unpack
from tests.kvtransfer.conftest import AgentsFactory
from tests.kvtransfer.topology import (
    assert_received,
    expect,
    make_decode,
    make_layout,
    make_prefill,
    make_request,
    reports,
    send,
    transfer,
    wait_all,
)

pytestmark = pytest.mark.timeout(120)


@pytest.mark.parametrize(
    ("p", "r", "kv_heads"),
    [(1, 1, 2), (1, 2, 2), (2, 1, 2), (2, 2, 2), (1, 2, 1), (2, 1, 1), (2, 2, 1)],
    ids=["1-1", "1-2", "2-1", "2-2", "1-2-replicated", "2-1-replicated", "2-2-replicated"],
)
def test_byte_exact_across_tp_sizes(agents: AgentsFactory, p: int, r: int, kv_heads: int) -> None:
    layout = make_layout(num_kv_heads=kv_heads)
    ranks = agents(p + r)
    prefill, decode = make_prefill(ranks[:p], layout), make_decode(ranks[p:], layout)
    # 77 tokens: 5 blocks, the last one partial; blocks scattered on both sides
    req = make_request(11, 77)
    transfer(prefill, decode, req)
    assert_received(decode, req)
    for agent in decode.ranks:  # nothing written outside the request's blocks
        assert set(agent.call("written_blocks")) <= set(req.dst_blocks)


@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_half_precision(agents: AgentsFactory, dtype: str) -> None:
    layout = make_layout(dtype=dtype)
    a, b = agents(2)
    prefill, decode = make_prefill([a], layout), make_decode([b], layout)
    req = make_request(21, 40)
    transfer(prefill, decode, req)
    assert_received(decode, req)


@pytest.mark.parametrize(("kv_cache_dtype", "extra"), [("int8", 4), ("fp8_e4m3", 0),
                                                    ("fp8_e5m2", 0)])
def test_a_quantised_cache_moves_as_it_lies_and_reshards(
        agents: AgentsFactory, kv_cache_dtype: str, extra: int) -> None:
    """A quantised cache's blocks travel as their bytes, re-sharded by heads (1 sender, 2
    receivers): an int8 cache's slots (head_dim values, then their 4-byte scale), a quarter
    of fp32's bytes and then some; an fp8 cache's values, a quarter exactly."""
    layout = make_layout(kv_cache_dtype=kv_cache_dtype)
    assert layout.wire_dtype == "uint8" and not layout.wire_quantized
    assert layout.row_bytes(2) == (layout.head_dim + extra) * 2 * layout.block_size
    a, b, c = agents(3)
    prefill, decode = make_prefill([a], layout), make_decode([b, c], layout)
    req = make_request(23, 70)
    transfer(prefill, decode, req)
    assert_received(decode, req)
    sent = reports([a])[0]["stats"]["bytes_sent"]  # type: ignore[index]
    fp32 = make_layout().row_bytes(2) * 2 * layout.num_layers * 5  # 5 blocks, K and V
    assert sent == layout.row_bytes(2) * 2 * layout.num_layers * 5
    assert sent * 4 * layout.head_dim == fp32 * (layout.head_dim + extra)


def test_kv_quantised_for_the_wire_only_arrives_dequantised_and_reshards(
        agents: AgentsFactory) -> None:
    """``kv_transfer_dtype="int8"`` over fp32 caches: the sender quantises (int8 slots, as
    an int8 cache holds them: a quarter of fp32's bytes and then some), each receiver
    dequantises into its fp32 cache exactly what ``kv_quant`` gives, re-sharded by heads."""
    layout = make_layout(kv_transfer_dtype="int8")
    assert layout.wire_quantized and layout.cache_dtype == "float32"
    a, b, c = agents(3)
    prefill, decode = make_prefill([a], layout), make_decode([b, c], layout)
    req = make_request(27, 70)
    transfer(prefill, decode, req)
    expected = dequantize(quantize(global_kv(layout, req.num_tokens, req.seed)))
    for j, agent in enumerate(decode.ranks):
        start, end = kv_head_range(layout.num_kv_heads, j, 2)
        got = unpack(agent.call("read", req.dst_blocks, req.num_tokens), "float32")
        assert torch.equal(got, expected[:, :, :, start:end]), f"decode rank {j} differs"
        plain = global_kv(layout, req.num_tokens, req.seed)[:, :, :, start:end]
        assert not torch.equal(got, plain)  # lossy, and within int8's rounding of it
        assert torch.allclose(got, plain, atol=float(plain.abs().max()) / 127)
    sent = reports([a])[0]["stats"]["bytes_sent"]  # type: ignore[index]
    fp32 = make_layout().row_bytes(2) * 2 * layout.num_layers * 5  # 5 blocks, K and V
    assert sent == make_layout(kv_cache_dtype="int8").row_bytes(2) * 2 * layout.num_layers * 5
    assert sent < 0.3 * fp32


def test_layer_by_layer(agents: AgentsFactory) -> None:
    a, b, c = agents(3)
    prefill, decode = make_prefill([a]), make_decode([b, c])
    req = make_request(31, 100)
    expect(decode, req)
    for layer in range(decode.layout.num_layers):  # as a layer hook would
        send(prefill, decode, req, layers=range(layer, layer + 1))
    wait_all(prefill, decode, req)
    assert_received(decode, req)


def test_sent_before_expected(agents: AgentsFactory) -> None:
    """Parts that arrive before expect() wait for it (up to the park timeout)."""
    a, b = agents(2)
    prefill, decode = make_prefill([a]), make_decode([b])
    req = make_request(41, 33)
    send(prefill, decode, req)
    expect(decode, req)
    wait_all(prefill, decode, req)
    assert_received(decode, req)


def test_many_transfers_over_one_channel(agents: AgentsFactory) -> None:
    a, b = agents(2)
    prefill, decode = make_prefill([a]), make_decode([b])
    requests = [make_request(100 + i, 20 + 9 * i) for i in range(8)]
    for req in requests:
        expect(decode, req)
    for req in requests:  # all queued before any is waited for
        send(prefill, decode, req)
    for req in requests:
        wait_all(prefill, decode, req)
    # blocks overlap between requests: check each request right after a fresh send
    assert_received(decode, requests[-1])
    assert reports([a])[0]["stats"]["channels_opened"] == 1  # type: ignore[index]


def test_concurrent_transfers_over_several_channels(agents: AgentsFactory) -> None:
    """Two prefill workers push to both ranks of one decode worker at the same time."""
    s1, s2, d0, d1 = agents(4)
    p1, p2, decode = make_prefill([s1]), make_prefill([s2]), make_decode([d0, d1])
    reqs = [make_request(200 + i, 30 + 7 * i) for i in range(6)]
    for req in reqs:
        expect(decode, req)
    for i, req in enumerate(reqs):
        send(p1 if i % 2 else p2, decode, req)
    for i, req in enumerate(reqs):
        wait_all(p1 if i % 2 else p2, decode, req)
    for agent in (d0, d1):
        assert agent.call("report")["stats"]["channels_accepted"] == 2
    final = make_request(299, 64)
    transfer(p1, decode, final)
    assert_received(decode, final)


@pytest.mark.parametrize(("p", "r"), [(1, 2), (2, 2)], ids=["1-2", "2-2"])
def test_trailer_travels_last_to_receiver_rank_0(agents: AgentsFactory, p: int, r: int) -> None:
    ranks = agents(p + r)
    prefill, decode = make_prefill(ranks[:p]), make_decode(ranks[p:])
    req = make_request(71 + p, 77)
    # 1. rank 0 wants the trailer, the other ranks do not
    for j, agent in enumerate(decode.ranks):
        agent.call("expect", req.transfer_id, req.dst_blocks, req.num_tokens, None, j == 0)
    send(prefill, decode, req)
    for agent in prefill.ranks[1:]:
        agent.call("send_wait", req.transfer_id)
    # 2. every layer arrived, but rank 0 is not done without the trailer
    for agent in decode.ranks[1:]:
        assert agent.call("recv_wait", req.transfer_id) is None
    time.sleep(0.2)
    assert not decode.ranks[0].call("recv_done", req.transfer_id)
    # 3. prefill rank 0 sends it behind its layers; rank 0 returns it, KV intact
    prefill.ranks[0].call("send_finish", req.transfer_id, Trailer(613, 48))
    prefill.ranks[0].call("send_wait", req.transfer_id)
    assert decode.ranks[0].call("recv_wait", req.transfer_id) == Trailer(613, 48)
    assert_received(decode, req)


def test_sender_done_is_nonblocking_and_counts_the_trailer(agents: AgentsFactory) -> None:
    a, b = agents(2)
    prefill, decode = make_prefill([a]), make_decode([b])
    req = make_request(81, 40)
    b.call("expect", req.transfer_id, req.dst_blocks, req.num_tokens, None, True)
    send(prefill, decode, req)
    a.call("send_finish", req.transfer_id, Trailer(0, 0))
    deadline = time.monotonic() + 10
    while not a.call("send_done", req.transfer_id):  # acknowledged soon after
        assert time.monotonic() < deadline
        time.sleep(0.01)
    a.call("send_wait", req.transfer_id, 0)
    assert b.call("recv_wait", req.transfer_id) == Trailer(0, 0)


def test_a_missing_trailer_fails_at_the_deadline(agents: AgentsFactory) -> None:
    a, b = agents(2)
    prefill, decode = make_prefill([a]), make_decode([b])
    req = make_request(91, 40)
    b.call("expect", req.transfer_id, req.dst_blocks, req.num_tokens, 1.0, True)
    send(prefill, decode, req)
    a.call("send_wait", req.transfer_id)  # the layers were acknowledged
    with pytest.raises(RemoteError) as err:
        b.call("recv_wait", req.transfer_id)
    assert err.value.kind == "TransferTimeout"
