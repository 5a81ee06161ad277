"""Faults between real processes: a peer killed or hung mid-transfer, a corrupted
payload, a mismatched layout, more peers than the channel bound, unknown and late
parts. Each failure must surface within the timeout, and the next transfer succeed."""

from __future__ import annotations

import dataclasses
import datetime
import signal
import time

import pytest
import torch
import torch.distributed as dist

from engine.tp.distributed import StoreAddress, connect_store
from kvtransfer.errors import ChannelError
from kvtransfer.transport.channel import abandoned_key, open_channel
from kvtransfer.wire.protocol import OpenRequest
from tests.kvtransfer.agent import Agent, RemoteError
from tests.kvtransfer.conftest import AgentsFactory
from tests.kvtransfer.topology import (
    CONFIG,
    LAYOUT,
    NUM_BLOCKS,
    Decode,
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
SLACK_S = 2.0  # scheduling noise on a shared 2-core machine


CHANNEL_ERRORS = ("ChannelError", "PeerUnresponsive", "ChannelClosed")


def _raises(agent: Agent, method: str, transfer_id: int, *kinds: str) -> tuple[str, float]:
    """Call ``method`` expecting an error of one of ``kinds``; its message and how long
    it took."""
    start = time.monotonic()
    with pytest.raises(RemoteError) as info:
        agent.call(method, transfer_id)
    assert info.value.kind in kinds, info.value
    return info.value.message, time.monotonic() - start


def _stopped_at(agent: Agent, timeout_s: float = 30.0) -> float:
    """When ``agent``'s process was seen stopped (SIGSTOP), polling ``/proc``."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            with open(f"/proc/{agent.proc.pid}/stat") as f:
                state = f.read().rpartition(")")[2].split()[0]
        except FileNotFoundError:
            raise AssertionError("the sender died instead of stopping") from None
        if state in "Tt":  # stopped (t: and traced)
            return time.monotonic()
        time.sleep(0.005)
    raise AssertionError(f"the sender did not stop within {timeout_s}s")


def _wait_dead(agent: Agent) -> None:
    agent.proc.join(timeout=10)
    assert not agent.alive


def test_sender_killed_mid_transfer(agents: AgentsFactory) -> None:
    # 1. the prefill rank kills itself before sending the 4th part (120 tokens: 12 parts)
    sender, receiver = agents(2)
    decode = make_decode([receiver])
    prefill = make_prefill([sender], fault=("kill", 51, 3))
    req = make_request(51, 120)
    expect(decode, req, timeout_s=60)  # far off: the error must come from the channel
    send(prefill, decode, req)
    # 2. the decode rank reports the failure within the channel timeout
    _, elapsed = _raises(receiver, "recv_wait", 51, *CHANNEL_ERRORS)
    assert elapsed < CONFIG.timeout_s + SLACK_S
    _wait_dead(sender)
    # 3. a restarted prefill rank opens a new channel to the same receiver; it works
    sender2 = agents(2)[0]
    prefill2 = make_prefill([sender2])
    req2 = make_request(52, 120)
    transfer(prefill2, decode, req2)
    assert_received(decode, req2)
    assert receiver.call("report")["stats"]["channels_accepted"] == 2


def test_sender_hung_mid_transfer(agents: AgentsFactory) -> None:
    # 1. the prefill rank stops (SIGSTOP) before sending the 4th part
    sender, receiver = agents(2)
    decode = make_decode([receiver])
    prefill = make_prefill([sender], fault=("stop", 61, 3))
    req = make_request(61, 120)
    expect(decode, req, timeout_s=60)
    send(prefill, decode, req)
    # 2. the decode rank gives up within the timeout of the sender's stop (its start-up
    # before that, three store connections and a gloo group, is not the channel's to time)
    # and cuts the channel
    stopped = _stopped_at(sender)
    _raises(receiver, "recv_wait", 61, *CHANNEL_ERRORS)
    assert time.monotonic() - stopped < CONFIG.timeout_s + SLACK_S
    # 3. the prefill rank resumes: its transfer fails, its next one rebuilds the channel
    sender.signal(signal.SIGCONT)
    _raises(sender, "send_wait", 61, *CHANNEL_ERRORS)
    req2 = make_request(62, 120)
    transfer(prefill, decode, req2)
    assert_received(decode, req2)
    assert sender.call("report")["stats"]["channels_opened"] == 2


def test_transfers_queued_to_a_hung_receiver_fail_within_one_timeout(
        agents: AgentsFactory) -> None:
    # three transfers queued behind one another on the route to a stopped decode rank:
    # the first waits out the timeout, the two behind it fail with it (before, each
    # waited a timeout of its own: the third failed three timeouts late)
    sender, receiver = agents(2)
    decode, prefill = make_decode([receiver]), make_prefill([sender])
    transfer(prefill, decode, make_request(80, 64))  # the route's channel is open
    receiver.signal(signal.SIGSTOP)
    try:
        start = time.monotonic()
        for transfer_id in (81, 82, 83):
            send(prefill, decode, make_request(transfer_id, 64))
        for transfer_id in (81, 82, 83):
            _raises(sender, "send_wait", transfer_id, *CHANNEL_ERRORS)
        assert time.monotonic() - start < CONFIG.timeout_s + SLACK_S
    finally:
        receiver.signal(signal.SIGCONT)
    req = make_request(84, 64)  # the receiver is back: the route is tried again
    transfer(prefill, decode, req)
    assert_received(decode, req)


def test_a_transfer_queued_late_behind_a_silent_message_gets_its_own_try(
        agents: AgentsFactory) -> None:
    # a stopped decode rank leaves a message unacknowledged for the whole timeout; a
    # transfer queued behind it late in that timeout is not failed with it but tries the
    # receiver again, which is back by then (CI once saw the case: the next request to a
    # decode worker resumed from SIGSTOP failed with the one its stop had timed out)
    sender, receiver = agents(2)
    decode, prefill = make_decode([receiver]), make_prefill([sender])
    transfer(prefill, decode, make_request(85, 64))  # the route's channel is open
    first, late = make_request(86, 64), make_request(87, 64)
    expect(decode, first, timeout_s=60)
    expect(decode, late, timeout_s=60)
    receiver.signal(signal.SIGSTOP)
    try:
        start = time.monotonic()
        send(prefill, decode, first)
        time.sleep(0.7 * CONFIG.timeout_s)
        send(prefill, decode, late)
        _raises(sender, "send_wait", 86, *CHANNEL_ERRORS)
        assert time.monotonic() - start < CONFIG.timeout_s + SLACK_S
    finally:
        receiver.signal(signal.SIGCONT)
    wait_all(prefill, decode, late)
    assert_received(decode, late)
    assert sender.call("report")["stats"]["channels_opened"] == 2
    _raises(receiver, "recv_wait", 86, *CHANNEL_ERRORS)  # the broken channel's message


def test_a_decode_worker_restarted_at_the_same_address_gets_the_next_transfer(
        agents: AgentsFactory) -> None:
    # the sender keeps its connection to the decode rank's store across transfers; after
    # a restart at the same address that connection is broken, and the first transfer
    # there must not fail for it
    sender, receiver = agents(2)
    decode, prefill = make_decode([receiver]), make_prefill([sender])
    transfer(prefill, decode, make_request(90, 64))
    receiver.signal(signal.SIGKILL)
    _wait_dead(receiver)
    again = agents(2)[1]  # a new process in the dead one's place
    address = again.call("make_receiver", LAYOUT, decode.address, 0, 1, CONFIG, NUM_BLOCKS)
    assert address == decode.address
    req = make_request(91, 64)
    transfer(prefill, Decode([again], address, LAYOUT), req)
    assert_received(Decode([again], address, LAYOUT), req)


def test_receiver_killed_while_sender_waits(agents: AgentsFactory) -> None:
    sender, receiver = agents(2)
    decode, prefill = make_decode([receiver]), make_prefill([sender])
    req = make_request(65, 64)
    send(prefill, decode, req)  # never expected: the receiver holds the first part
    time.sleep(0.3)
    receiver.signal(signal.SIGKILL)
    _, elapsed = _raises(sender, "send_wait", 65, *CHANNEL_ERRORS)
    assert elapsed < CONFIG.timeout_s + SLACK_S
    _wait_dead(receiver)
    # a restarted decode worker (new address): the same sender reaches it
    decode2 = make_decode([agents(2)[1]])
    req2 = make_request(66, 64)
    transfer(prefill, decode2, req2)
    assert_received(decode2, req2)


def test_a_decode_worker_gone_leaves_nothing_open_on_the_sender(agents: AgentsFactory) -> None:
    """A route idle for ``idle_timeout_s`` is forgotten, with its connection to the
    receiver's store, when the next transfer starts: a prefill rank that served decode
    workers which went away (a scale-down, a restart on a new port) holds no socket to
    them."""
    config = dataclasses.replace(CONFIG, idle_timeout_s=0.5)
    sender, r1, r2 = agents(3)
    prefill = make_prefill([sender], config=config)
    transfer(prefill, make_decode([r1], config=config), make_request(67, 40))
    first = sender.call("report")
    assert first["lanes"] == 1
    r1.signal(signal.SIGKILL)
    _wait_dead(r1)
    time.sleep(config.idle_timeout_s + 0.3)
    req = make_request(68, 40)
    decode2 = make_decode([r2], config=config)
    transfer(prefill, decode2, req)
    assert_received(decode2, req)
    after = sender.call("report")
    assert after["lanes"] == 1  # the second decode worker's only
    assert after["open_channels"] == 1
    assert after["fds"] <= first["fds"], (first["fds"], after["fds"])


def test_an_advertisement_the_sender_cannot_read_fails_its_transfers_at_once(
        agents: AgentsFactory) -> None:
    """A decode worker of another protocol version (or anything that is not a receiver's
    advertisement) fails each transfer to it at once with LayoutMismatch, every time:
    the thread reading it died on the parse error before, and every transfer to that
    address waited for it for good."""
    sender, host = agents(2)
    prefill = make_prefill([sender])
    dest = Decode([], host.call("host_advertisement", b"junk"), LAYOUT)
    for transfer_id in (69, 70):
        req = make_request(transfer_id, 40)
        send(prefill, dest, req)
        message, elapsed = _raises(sender, "send_wait", transfer_id, "LayoutMismatch")
        assert "cannot read" in message and elapsed < CONFIG.timeout_s


def test_corrupted_payload_is_detected_and_not_used(agents: AgentsFactory) -> None:
    sender, receiver = agents(2)
    decode = make_decode([receiver])
    prefill = make_prefill([sender], fault=("corrupt", 71, 0))  # one bit of part 0
    req = make_request(71, 120)
    expect(decode, req)
    send(prefill, decode, req)
    _raises(receiver, "recv_wait", 71, "ChecksumMismatch")
    _raises(sender, "send_wait", 71, "ChecksumMismatch")
    assert receiver.call("written_blocks") == []  # nothing of it reached a block
    assert receiver.call("report")["stats"]["checksum_failures"] == 1
    # the channel itself is fine: the next transfer uses it
    req2 = make_request(72, 120)
    transfer(prefill, decode, req2)
    assert_received(decode, req2)
    assert sender.call("report")["stats"]["channels_opened"] == 1


def test_a_corrupted_scale_of_an_int8_cache_is_detected(agents: AgentsFactory) -> None:
    """The checksum covers an int8 cache's scales: one flipped bit of the first slot's
    scale (the bytes after its head_dim values) fails the transfer."""
    layout = make_layout(kv_cache_dtype="int8")
    sender, receiver = agents(2)
    decode = make_decode([receiver], layout)
    prefill = make_prefill([sender], layout, fault=(f"corrupt-at:{layout.head_dim + 3}", 73, 0))
    req = make_request(73, 40)
    expect(decode, req)
    send(prefill, decode, req)
    _raises(receiver, "recv_wait", 73, "ChecksumMismatch")
    _raises(sender, "send_wait", 73, "ChecksumMismatch")
    assert receiver.call("written_blocks") == []


def test_sender_abort_mid_transfer_fails_the_receiver(agents: AgentsFactory) -> None:
    """After abort() the sender reads no block: later parts go out marked cancelled."""
    sender, receiver = agents(2)
    decode = make_decode([receiver])
    prefill = make_prefill([sender], fault=("abort", 77, 2))  # abort while sending part 2
    req = make_request(77, 120)
    expect(decode, req)
    send(prefill, decode, req)
    message, _ = _raises(receiver, "recv_wait", 77, "TransferRejected")
    assert "aborted" in message.splitlines()[0]
    req2 = make_request(78, 120)  # the channel is intact
    transfer(prefill, decode, req2)
    assert_received(decode, req2)
    assert sender.call("report")["stats"]["channels_opened"] == 1


@pytest.mark.parametrize(("field", "value"), [
    ("block_size", 32), ("model_fingerprint", "another-model"), ("hash_seed", 7),
    ("num_kv_heads", 4), ("dtype", "float16"), ("kv_cache_dtype", "int8"),
])
def test_mismatched_layout_is_refused(agents: AgentsFactory, field: str, value: object) -> None:
    sender, receiver = agents(2)
    decode = make_decode([receiver])
    prefill = make_prefill([sender], layout=make_layout(**{field: value}))
    req = make_request(75, 40, block_size=prefill.layout.block_size)
    send(prefill, decode, req)
    message, _ = _raises(sender, "send_wait", 75, "LayoutMismatch")
    assert field in message.splitlines()[0]
    assert receiver.call("report")["open_channels"] == 0


def test_receiver_refuses_a_mismatched_open_request(agents: AgentsFactory) -> None:
    """The receiver checks too (a sender may skip or race its own check)."""
    prober, receiver = agents(2)
    decode = make_decode([receiver])
    answer = prober.call("raw_open", decode.address, make_layout(head_dim=64))
    assert answer.startswith("LayoutMismatch") and "head_dim: 32 != 64" in answer
    answer = prober.call("raw_open", decode.address, decode.layout, "nccl")
    assert answer.startswith("LayoutMismatch") and "backend: gloo != nccl" in answer
    assert prober.call("raw_open", decode.address, decode.layout) == "accepted"
    assert receiver.call("report")["stats"]["channels_refused"] == 2


def test_more_peers_than_the_channel_bound(agents: AgentsFactory) -> None:
    """Two prefill and two decode workers, every process allowed one open channel:
    each round pairs them differently, so idle channels are closed and reopened."""
    config = dataclasses.replace(CONFIG, max_channels=1)
    s1, s2, r1, r2 = everyone = agents(4)
    d1, d2 = make_decode([r1], config=config), make_decode([r2], config=config)
    p1, p2 = make_prefill([s1], config=config), make_prefill([s2], config=config)
    for round_ in range(4):
        pairs = [(p1, d1), (p2, d2)] if round_ % 2 == 0 else [(p1, d2), (p2, d1)]
        reqs = [make_request(300 + 2 * round_ + i, 50) for i in range(2)]
        for (prefill, decode), req in zip(pairs, reqs):
            expect(decode, req)
            send(prefill, decode, req)
        for (prefill, decode), req in zip(pairs, reqs):
            wait_all(prefill, decode, req)
            assert_received(decode, req)
        assert all(r["open_channels"] <= 1 for r in reports(everyone))
    stats = [r["stats"] for r in reports(everyone)]
    assert [s["channels_opened"] for s in stats[:2]] == [4, 4]  # type: ignore[index]
    assert [s["channels_accepted"] for s in stats[2:]] == [4, 4]  # type: ignore[index]


def test_a_channel_just_accepted_is_not_closed_to_make_room_before_its_first_message(
        agents: AgentsFactory) -> None:
    """A receiver with one channel slot: the channel it accepted for one sender stays that
    sender's until its first message is through (it was idle, so another sender's open
    request closed it to make room, and the first transfer failed); the other sender is
    told BUSY meanwhile and gets the slot after."""
    config = dataclasses.replace(CONFIG, max_channels=1)
    s1, s2, r = agents(3)
    decode = make_decode([r], config=config)
    slow = make_prefill([s1], fault=("sleep:1.0", 73, 0))  # its first part goes out late
    other = make_prefill([s2])
    first, second = make_request(73, 40), make_request(74, 40)
    expect(decode, first)
    expect(decode, second)
    send(slow, decode, first)
    time.sleep(0.5)  # its channel is open and waiting for the part
    send(other, decode, second)
    wait_all(slow, decode, first)
    wait_all(other, decode, second)
    assert_received(decode, first)
    assert_received(decode, second)
    assert r.call("report")["stats"]["busy_replies"] >= 1


def test_unknown_and_late_parts_are_ignored_and_counted(agents: AgentsFactory) -> None:
    sender, receiver = agents(2)
    decode, prefill = make_decode([receiver]), make_prefill([sender])
    # 1. never expected: held for the park timeout, then ignored
    send(prefill, decode, make_request(81, 40))
    _raises(sender, "send_wait", 81, "TransferRejected")
    # 2. expected, but its deadline passes before anything is sent
    late = make_request(82, 40)
    expect(decode, late, timeout_s=0.3)
    _, elapsed = _raises(receiver, "recv_wait", 82, "TransferTimeout")
    assert elapsed < 0.3 + SLACK_S
    send(prefill, decode, late)  # arrives after the deadline: ignored, counted
    _raises(sender, "send_wait", 82, "TransferRejected")
    # 3. ids are never reused; the channel still works
    with pytest.raises(RemoteError, match="used before"):
        expect(decode, late)
    req = make_request(83, 40)
    transfer(prefill, decode, req)
    assert_received(decode, req)
    stats = receiver.call("report")["stats"]
    assert stats["unknown_parts"] >= 1 and stats["late_parts"] >= 1
    assert sender.call("report")["stats"]["channels_opened"] == 1


def test_a_transfer_refused_before_it_was_expected_is_dropped_at_once(
        agents: AgentsFactory) -> None:
    # a decode worker refused the Reserve whose Prefill went out ahead of its reply: the
    # parts already parked for it are ignored at once, not held for the park timeout (they
    # hold up their channel meanwhile), the id can never be expected, the channel works on
    config = dataclasses.replace(CONFIG, park_timeout_s=60.0)
    sender, receiver = agents(2)
    decode, prefill = make_decode([receiver], config=config), make_prefill([sender], config=config)
    refused = make_request(86, 40)
    send(prefill, decode, refused)
    time.sleep(0.3)  # its first part waits on the receiver for expect()
    assert receiver.call("recv_abort", 86) is False  # it was never expected
    _, elapsed = _raises(sender, "send_wait", 86, "TransferRejected")
    assert elapsed < SLACK_S  # against the 60 s it would have been parked
    with pytest.raises(RemoteError, match="used before"):
        expect(decode, refused)
    req = make_request(87, 40)
    transfer(prefill, decode, req)
    assert_received(decode, req)
    assert receiver.call("report")["stats"]["late_parts"] >= 1


def test_unexpected_acknowledgements_are_ignored_and_counted(agents: AgentsFactory) -> None:
    # Row 7, sender side: an acknowledgement naming another transfer and a malformed one
    # arrive before the real one; the sender counts and ignores them and keeps waiting:
    # the transfer succeeds on the same channel, and so does the next one
    sender, receiver = agents(2)
    decode, prefill = make_decode([receiver]), make_prefill([sender])
    receiver.call("send_stray_acks", 91)
    req = make_request(91, 40)
    transfer(prefill, decode, req)
    assert_received(decode, req)
    after = make_request(92, 40)
    transfer(prefill, decode, after)
    assert_received(decode, after)
    stats = sender.call("report")["stats"]
    assert stats["unexpected_acks"] == 2, stats
    assert stats["channels_opened"] == 1 and stats["retries"] == 0, stats


def test_a_sender_dead_mid_open_does_not_hold_up_other_opens(agents: AgentsFactory) -> None:
    # 1. a "sender" asks the decode rank for a channel and never joins it (died mid-open);
    #    the receiver waits for it up to the timeout, on a thread of that channel's own
    sender, receiver, ghost = agents(3)
    decode = make_decode([receiver])
    ghost.call("ghost_open", decode.address, decode.layout)
    time.sleep(0.2)  # the receiver has taken the ghost's request
    # 2. a live sender opens its channel and transfers meanwhile, well within the timeout
    prefill = make_prefill([sender])
    req = make_request(71, 40)
    start = time.monotonic()
    transfer(prefill, decode, req)
    assert time.monotonic() - start < CONFIG.timeout_s / 2
    assert_received(decode, req)
    # 3. the ghost's channel is given up at the timeout: nothing stays reserved for it
    time.sleep(CONFIG.timeout_s + SLACK_S - (time.monotonic() - start))
    report = receiver.call("report")
    assert report["open_channels"] == 1, report


def test_an_open_request_its_sender_gave_up_on_is_dropped_unanswered(
        agents: AgentsFactory) -> None:
    # a sender that gave up waiting for the answer marked its request abandoned: the
    # receiver answers nothing and reserves no slot for it (before: a slot held for the
    # timeout, waiting on a sender that had left, and a reply nobody reads)
    receiver, ghost = agents(2)
    decode = make_decode([receiver])
    ghost.call("ghost_open", decode.address, decode.layout, True)
    deadline = time.monotonic() + 5.0
    while (report := receiver.call("report"))["stats"]["opens_abandoned"] < 1:
        assert time.monotonic() < deadline, report
        time.sleep(0.02)
    assert report["open_channels"] == 0 and report["stats"]["channels_accepted"] == 0, report


def test_a_sender_that_gives_up_marks_its_open_request_abandoned() -> None:
    # nobody answers the open request (no receiver accepts on this store): after the
    # timeout the sender fails and marks the request, so a receiver that takes it later
    # drops it (the test above)
    server = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False,
                           timeout=datetime.timedelta(seconds=10))
    address = StoreAddress("127.0.0.1", server.port)
    store = connect_store(address, timeout_s=10.0)
    request = OpenRequest(0, "sender", 0, 1, 0, "gloo", LAYOUT)
    with pytest.raises(ChannelError):
        open_channel(store, address, request, torch.device("cpu"),
                     dataclasses.replace(CONFIG, timeout_s=0.3))
    assert store.check([abandoned_key(1)])  # the first channel id the store gave out
