"""Authenticated KV channels between real processes (``kvtransfer.wire.auth``): with the
cluster token's keys on both ends KV moves byte for byte, also while a token rotates;
a peer without the key, or with another, is refused before any KV moves; a part that
does not carry the channel's MAC (injected KV, with a valid checksum) fails its transfer
and is never written; the next transfer succeeds."""

from __future__ import annotations

import dataclasses
import hashlib

import pytest

from kvtransfer.config import TransferConfig
from tests.kvtransfer.agent import RemoteError
from tests.kvtransfer.conftest import AgentsFactory
from tests.kvtransfer.topology import (
    CONFIG,
    assert_received,
    expect,
    make_decode,
    make_prefill,
    make_request,
    send,
    transfer,
)

pytestmark = pytest.mark.timeout(120)

OLD, NEW, OTHER = (hashlib.sha256(name).digest() for name in (b"old", b"new", b"other"))


def keyed(*keys: bytes) -> TransferConfig:
    return dataclasses.replace(CONFIG, auth_keys=keys)


def test_keyed_ends_move_kv_byte_for_byte_also_while_a_token_rotates(
        agents: AgentsFactory) -> None:
    sender, receiver = agents(2)
    decode = make_decode([receiver], config=keyed(OLD, NEW))
    for transfer_id, keys in ((81, (OLD, NEW)), (82, (NEW, OLD)), (83, (NEW,))):
        prefill = make_prefill([sender], config=keyed(*keys))
        req = make_request(transfer_id, 120)
        transfer(prefill, decode, req)
        assert_received(decode, req)
        sender.call("reset")


@pytest.mark.parametrize(("sender_keys", "receiver_keys", "why"), [
    ((), (OLD,), "requires the cluster token"),
    ((OLD,), (), "did not prove the cluster token"),
    ((OTHER,), (OLD, NEW), "did not prove the cluster token"),
], ids=["sender-without", "receiver-without", "other-token"])
def test_ends_that_do_not_share_a_key_move_no_kv(
        agents: AgentsFactory, sender_keys: tuple[bytes, ...],
        receiver_keys: tuple[bytes, ...], why: str) -> None:
    sender, receiver = agents(2)
    decode = make_decode([receiver], config=keyed(*receiver_keys))
    prefill = make_prefill([sender], config=keyed(*sender_keys))
    req = make_request(84, 120)
    expect(decode, req, timeout_s=2.0)
    send(prefill, decode, req)
    with pytest.raises(RemoteError) as info:
        sender.call("send_wait", req.transfer_id)
    assert why in info.value.message, info.value
    with pytest.raises(RemoteError):
        receiver.call("recv_wait", req.transfer_id)
    assert receiver.call("written_blocks") == []


def test_a_prober_without_the_key_is_refused(agents: AgentsFactory) -> None:
    prober, receiver = agents(2)
    decode = make_decode([receiver], config=keyed(OLD))
    answer = prober.call("raw_open", decode.address, decode.layout)
    assert "requires the cluster token" in answer
    assert prober.call("raw_open", decode.address, decode.layout, "gloo", (OLD,)) == "accepted"


def test_an_injected_part_fails_its_transfer_and_is_never_written(
        agents: AgentsFactory) -> None:
    sender, receiver = agents(2)
    decode = make_decode([receiver], config=keyed(OLD))
    prefill = make_prefill([sender], config=keyed(OLD), fault=("forge", 85, 0))
    req = make_request(85, 120)
    expect(decode, req)
    send(prefill, decode, req)
    with pytest.raises(RemoteError) as info:
        receiver.call("recv_wait", req.transfer_id)
    assert "failed its MAC" in info.value.message
    with pytest.raises(RemoteError):
        sender.call("send_wait", req.transfer_id)
    assert receiver.call("written_blocks") == []
    # the channel is closed; the next transfer (on a new one) arrives whole
    req2 = make_request(86, 120)
    transfer(prefill, decode, req2)
    assert_received(decode, req2)
