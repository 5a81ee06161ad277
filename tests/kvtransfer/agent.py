"""Test harness: rank processes ("agents") that play kvtransfer roles on command.

An agent is a spawned process (one torch thread) holding at most one sender or
receiver and its own KV cache. The test process drives it over a pipe with
``agent.call("method", *args)`` (test-only RPC; the product never pickles control
messages). Agents outlive a test so scenarios don't pay a process start each; a test
that kills one gets a fresh one from the pool next time.

KV contents are deterministic: ``global_kv(layout, num_tokens, seed)`` is the whole
request's KV ``[layers, 2, tokens, all KV heads, head_dim]``; a sender rank writes its
heads of it into its blocks, and a test compares what a receiver rank holds against
the same tensor.
"""

from __future__ import annotations

import dataclasses
import gc
import multiprocessing as mp
import os
import signal
import threading
import time
import traceback
from collections.abc import Sequence
from multiprocessing.connection import Connection
from typing import Any

import torch

from engine.attention.kv_quant import as_bytes
from engine.kvcache.layout import KVLayout
from engine.models.layers import kv_head_range
from engine.tp.distributed import (
    LOOPBACK,
    StoreAddress,
    connect_store,
    create_store_server,
    make_group,
)
from kvtransfer.config import TransferConfig
from kvtransfer.errors import TransferError
from kvtransfer.receive.receiver import KVReceiver
from kvtransfer.receive.recv_channel import RecvChannel
from kvtransfer.send.sender import KVSender
from kvtransfer.transport.channel import (
    KEY_NEXT_CHANNEL,
    KEY_RECEIVER_INFO,
    Channel,
    Pending,
    abandoned_key,
    accept_key,
    open_channel,
)
from kvtransfer.wire.auth import ChannelMac
from kvtransfer.wire.checksum import checksum
from kvtransfer.wire.protocol import (
    HEADER_BYTES,
    Ack,
    ChecksumAlgo,
    OpenRequest,
    PartHeader,
    Status,
    Trailer,
    _u64_to_i64,
)


class RemoteError(RuntimeError):
    """An exception raised in an agent: ``kind`` is its class name."""

    def __init__(self, kind: str, message: str) -> None:
        super().__init__(f"{kind}: {message}")
        self.kind = kind
        self.message = message


def global_kv(layout: KVLayout, num_tokens: int, seed: int) -> torch.Tensor:
    """Every token's KV of ``layout`` (a quantised cache's as random bytes: an int8 cache's
    values and scales, an fp8 cache's values)."""
    gen = torch.Generator().manual_seed(seed)
    shape = (layout.num_layers, 2, num_tokens, layout.num_kv_heads, layout.slot_width)
    if layout.kv_cache_dtype != "auto":
        return torch.randint(0, 256, shape, generator=gen, dtype=torch.uint8)
    return torch.randn(shape, generator=gen).to(getattr(torch, layout.dtype))


def unpack(raw: tuple[bytes, tuple[int, ...]], dtype: str) -> torch.Tensor:
    """The tensor ``AgentState.read`` returned."""
    data, shape = raw
    flat = torch.frombuffer(bytearray(data), dtype=torch.uint8)
    return flat.view(getattr(torch, dtype)).view(shape)


def cache_shape(layout: KVLayout, tp_rank: int, tp_size: int, num_blocks: int) -> tuple[int, ...]:
    start, end = kv_head_range(layout.num_kv_heads, tp_rank, tp_size)
    return (layout.num_layers, 2, num_blocks, layout.block_size, end - start, layout.slot_width)


def token_slots(block_ids: Sequence[int], num_tokens: int, block_size: int
                ) -> tuple[torch.Tensor, torch.Tensor]:
    """(block id, offset) of every token position."""
    pos = torch.arange(num_tokens)
    ids = torch.tensor(list(block_ids), dtype=torch.int64)
    return ids[pos // block_size], pos % block_size


class AgentState:
    """What one agent holds; every public method is callable from the test process."""

    def __init__(self) -> None:
        self.layout: KVLayout | None = None
        self.tp: tuple[int, int] = (0, 1)
        self.cache: torch.Tensor | None = None
        self.sender: KVSender | None = None
        self.receiver: KVReceiver | None = None
        self.advertising: Any = None  # host_advertisement's store

    def pid(self) -> int:
        return os.getpid()

    def warm_up(self) -> list[str]:
        """One small transfer within this process, so lazily started torch threads exist
        before the OS thread count is taken as the baseline; returns the thread names."""
        layout = KVLayout("warm-up", "float32", 4, "xxh3_128", 0, 1, 1, 4)
        config = TransferConfig(timeout_s=30.0)
        receiver = KVReceiver(layout, StoreAddress(LOOPBACK, 0), config=config)
        sender = KVSender(layout, config=config)
        try:
            src, dst = torch.ones(1, 2, 2, 4, 1, 4), torch.zeros(1, 2, 2, 4, 1, 4)
            receiver.expect(0, dst, [1], 4)
            sender.send(0, src, [0], 4, receiver.address)
            sender.wait(0)
            receiver.wait(0)
            assert bool((dst[:, :, 1] == 1).all())
        finally:
            sender.close()
            receiver.close()
        gc.collect()
        return _native_threads()

    def make_receiver(self, layout: KVLayout, address: StoreAddress, tp_rank: int, tp_size: int,
                      config: TransferConfig, num_blocks: int, device: str = "cpu"
                      ) -> StoreAddress:
        self._setup(layout, tp_rank, tp_size, num_blocks, device)
        self.receiver = KVReceiver(layout, address, tp_rank=tp_rank, tp_size=tp_size,
                                   device=device, config=config)
        return self.receiver.address

    def make_sender(self, layout: KVLayout, tp_rank: int, tp_size: int, config: TransferConfig,
                    num_blocks: int, fault: tuple[str, int, int] | None = None,
                    device: str = "cpu") -> None:
        self._setup(layout, tp_rank, tp_size, num_blocks, device)
        hook = _fault_hook(*fault, abort=lambda tid: self.sender and self.sender.abort(tid)
                           ) if fault else None
        self.sender = KVSender(layout, tp_rank=tp_rank, tp_size=tp_size,
                               name=f"prefill-{os.getpid()}", config=config, fault_hook=hook)

    def fill(self, seed: int, block_ids: Sequence[int], num_tokens: int) -> None:
        """Write this rank's heads of ``global_kv(seed)`` into ``block_ids``."""
        assert self.layout is not None and self.cache is not None
        start, end = kv_head_range(self.layout.num_kv_heads, *self.tp)
        kv = global_kv(self.layout, num_tokens, seed)[:, :, :, start:end]
        blocks, offsets = token_slots(block_ids, num_tokens, self.layout.block_size)
        as_bytes(self.cache)[:, :, blocks, offsets] = kv.to(self.cache.device)

    def read(self, block_ids: Sequence[int], num_tokens: int) -> tuple[bytes, tuple[int, ...]]:
        """``[layers, 2, tokens, local heads, head_dim]`` as held in ``block_ids``, as raw
        bytes and shape (a pickled tensor would travel through shared memory, whose fd
        passing starts a thread in this process)."""
        assert self.layout is not None and self.cache is not None
        blocks, offsets = token_slots(block_ids, num_tokens, self.layout.block_size)
        held = as_bytes(self.cache)[:, :, blocks, offsets].cpu().contiguous()
        return held.view(torch.uint8).numpy().tobytes(), tuple(held.shape)

    def written_blocks(self) -> list[int]:
        """Ids of the blocks holding any nonzero value."""
        assert self.cache is not None
        return torch.nonzero(as_bytes(self.cache).abs().sum(dim=(0, 1, 3, 4, 5))).flatten().cpu().tolist()

    def send(self, transfer_id: int, block_ids: Sequence[int], num_tokens: int,
             dest: StoreAddress, layers: range | None = None) -> None:
        assert self.sender is not None and self.cache is not None
        self.sender.send(transfer_id, self.cache, block_ids, num_tokens, dest, layers)

    def send_wait(self, transfer_id: int, timeout_s: float | None = None) -> None:
        assert self.sender is not None
        self.sender.wait(transfer_id, timeout_s)

    def send_finish(self, transfer_id: int, trailer: Trailer) -> None:
        assert self.sender is not None
        self.sender.finish(transfer_id, trailer)

    def send_done(self, transfer_id: int) -> bool:
        assert self.sender is not None
        return self.sender.done(transfer_id)

    def expect(self, transfer_id: int, block_ids: Sequence[int], num_tokens: int,
               timeout_s: float | None = None, trailer: bool = False) -> None:
        assert self.receiver is not None and self.cache is not None
        self.receiver.expect(transfer_id, self.cache, block_ids, num_tokens, timeout_s,
                             trailer=trailer)

    def recv_wait(self, transfer_id: int, timeout_s: float | None = None) -> Trailer | None:
        assert self.receiver is not None
        return self.receiver.wait(transfer_id, timeout_s)

    def recv_abort(self, transfer_id: int) -> bool:
        assert self.receiver is not None
        return self.receiver.abort(transfer_id)

    def recv_done(self, transfer_id: int) -> bool:
        assert self.receiver is not None
        return self.receiver.done(transfer_id)

    def report(self) -> dict[str, Any]:
        """Leak-check figures: open channels and bound, pending transfers, threads."""
        role = self.sender or self.receiver
        out: dict[str, Any] = {"threads": _role_threads(), "native_threads": _native_threads()}
        if role is not None:
            out.update(open_channels=role.num_open_channels, max_channels=role.config.max_channels,
                       pending=role.num_pending, stats=vars(role.stats).copy())
        if self.sender is not None:
            out.update(lanes=self.sender.num_lanes, fds=len(os.listdir("/proc/self/fd")))
        return out

    def reset(self) -> dict[str, Any]:
        """Close the roles (checking nothing was pending first) and drop the cache."""
        before = self.report()
        for role in (self.sender, self.receiver):
            if role is not None:
                role.close()
        self.sender = self.receiver = None
        self.cache = self.advertising = None
        gc.collect()
        after = self.report()
        return {"before": before, "after": after}

    def raw_open(self, address: StoreAddress, layout: KVLayout, backend: str = "gloo",
                 auth_keys: tuple[bytes, ...] = ()) -> str:
        """Ask for a channel with ``layout`` directly, skipping the sender's own check of
        the advertised layout: what the receiver answers ("accepted" or the error)."""
        config = TransferConfig(timeout_s=10.0, auth_keys=auth_keys)
        store = connect_store(address, timeout_s=10.0)
        request = OpenRequest(0, "raw", 0, 1, 0, backend, layout)
        try:
            channel, _ = open_channel(store, address, request, torch.device("cpu"), config)
        except TransferError as exc:
            return f"{type(exc).__name__}: {exc}"
        channel.close("done", graceful=True)
        return "accepted"

    def ghost_open(self, address: StoreAddress, layout: KVLayout, abandoned: bool = False
                   ) -> None:
        """Ask receiver rank 0 for a channel and never join it: what a sender that dies
        between its open request and the group rendezvous leaves behind; ``abandoned``:
        one that gave up waiting for the answer before the receiver took the request (it
        marks it abandoned, as ``open_channel`` does)."""
        store = connect_store(address, timeout_s=10.0)
        channel_id = int(store.add(KEY_NEXT_CHANNEL, 1))
        if abandoned:  # first, so that the receiver cannot take the request before
            store.set(abandoned_key(channel_id), b"")
        store.queue_push(accept_key(0),
                         OpenRequest(channel_id, "ghost", 0, 1, 0, "gloo", layout).encode())

    def send_stray_acks(self, transfer_id: int) -> None:
        """Receiver: before the first acknowledgement of ``transfer_id``, send two on the
        same tag that its sender does not expect: one naming another transfer (as a late
        or duplicate acknowledgement would) and one malformed. Fires once."""
        original = RecvChannel._acknowledge

        def acknowledge(rc: RecvChannel, header: PartHeader, status: Status) -> None:
            if header.transfer_id == transfer_id:
                RecvChannel._acknowledge = original  # type: ignore[method-assign]
                ch, timeout_s = rc.channel, rc.receiver.config.timeout_s
                ch.wait(ch.send_ack(Ack(transfer_id + 10_000, header.seq, Status.OK)), timeout_s)
                junk = torch.tensor([7, 7, 7, 7], dtype=torch.int64)  # bad checksum word
                ch.wait(Pending(ch._post(ch._control.isend, junk, header.seq), junk, "junk"),
                        timeout_s)
            original(rc, header, status)

        RecvChannel._acknowledge = acknowledge  # type: ignore[method-assign,assignment]

    def host_advertisement(self, payload: bytes) -> StoreAddress:
        """A rendezvous store advertising ``payload`` where a receiver's description is
        (another protocol version, or junk); no receiver behind it."""
        self.advertising = create_store_server(LOOPBACK, 0, timeout_s=30.0)
        self.advertising.set(KEY_RECEIVER_INFO, payload)
        return StoreAddress(LOOPBACK, int(self.advertising.port))

    # ------------------------------------------------ spike: a raw group, no kvtransfer

    def spike_host(self, timeout_s: float) -> StoreAddress:
        self.spike_store = create_store_server(LOOPBACK, 0, timeout_s=timeout_s)
        return StoreAddress(LOOPBACK, int(self.spike_store.port))

    def spike_join(self, address: StoreAddress, prefix: str, rank: int, timeout_s: float) -> None:
        store = connect_store(address, timeout_s=timeout_s)
        self.spike_group = make_group(store, prefix, rank, 2, timeout_s=timeout_s, threads=1)

    def spike_start(self, op: str, nbytes: int) -> None:
        """Start sending to / receiving from the peer in a loop ("idle": nothing)."""
        group, peer = self.spike_group, 1 - self.spike_group.rank

        def loop() -> None:
            buf = torch.ones(nbytes, dtype=torch.uint8)
            try:
                for tag in range(1, 1 << 20):
                    (group.send if op == "send" else group.recv)(buf, peer, tag)
            except (RuntimeError, AssertionError):
                pass

        if op != "idle":
            threading.Thread(target=loop, name="spike", daemon=True).start()

    def spike_until_error(self, peer_op: str, nbytes: int) -> tuple[str, float]:
        """Do the opposite of the peer until an operation fails: the error and when
        (``time.monotonic``, comparable across processes)."""
        group, peer = self.spike_group, 1 - self.spike_group.rank
        buf = torch.zeros(nbytes, dtype=torch.uint8)
        try:
            if peer_op == "idle":
                group.recv(torch.zeros(1), peer, 7)
            for tag in range(1, 1 << 20):
                (group.recv if peer_op == "send" else group.send)(buf, peer, tag)
        except RuntimeError as exc:
            return str(exc), time.monotonic()
        raise AssertionError("no error")

    def spike_abort(self) -> float:
        """Tear the group down; how long that took."""
        start = time.monotonic()
        self.spike_group.abort()
        return time.monotonic() - start

    def spike_recv_ones(self, nbytes: int) -> bool:
        got = self.spike_group.recv(torch.zeros(nbytes, dtype=torch.uint8), 1 - self.spike_group.rank, 1)
        return bool((got == 1).all())

    def _setup(self, layout: KVLayout, tp_rank: int, tp_size: int, num_blocks: int,
               device: str = "cpu") -> None:
        assert self.sender is None and self.receiver is None, "agent already has a role"
        self.layout, self.tp = layout, (tp_rank, tp_size)
        if device.startswith("cuda"):
            torch.cuda.set_device(torch.device(device))
        dtype = getattr(torch, layout.cache_dtype)
        self.cache = torch.zeros(cache_shape(layout, tp_rank, tp_size, num_blocks), dtype=dtype,
                                 device=device)


def _fault_hook(kind: str, transfer_id: int, part: int, abort: Any) -> Any:
    """A sender hook acting on the ``part``-th part (0-based) of ``transfer_id``: flip a
    bit of it, kill or stop the process, or abort the transfer."""
    seen = [0]

    def hook(header: PartHeader, payload: torch.Tensor) -> None:
        if header.transfer_id != transfer_id:
            return
        seen[0] += 1
        if seen[0] - 1 != part:
            return
        if kind == "corrupt":
            payload[payload.numel() // 2] ^= 0x10  # one flipped bit, after the checksum
        elif kind.startswith("corrupt-at:"):  # one flipped bit of byte N of the payload
            payload[int(kind.partition(":")[2])] ^= 0x10
        elif kind == "forge":  # what an injected part looks like: valid checksum, no MAC
            payload[payload.numel() // 2] ^= 0x10
            _forge_next_part()
        elif kind.startswith("sleep:"):  # the part goes out N seconds late
            time.sleep(float(kind.partition(":")[2]))
        elif kind == "kill":
            os.kill(os.getpid(), signal.SIGKILL)
        elif kind == "stop":
            os.kill(os.getpid(), signal.SIGSTOP)
        elif kind == "abort":
            abort(transfer_id)

    return hook


def _forge_next_part() -> None:
    """The next part this process sends gets a checksum of its (changed) payload and a MAC
    under a key no receiver holds, as a third party injecting KV would send it."""
    original = Channel.send_part

    def send_part(channel: Channel, header: PartHeader, buffer: torch.Tensor) -> list[Pending]:
        Channel.send_part = original  # type: ignore[method-assign]
        payload = buffer[HEADER_BYTES : HEADER_BYTES + header.payload_nbytes]
        forged = dataclasses.replace(header, checksum=_u64_to_i64(
            checksum(payload, ChecksumAlgo(header.checksum_algo))))
        real, channel.mac = channel.mac, ChannelMac(os.urandom(32))
        try:
            return original(channel, forged, buffer)
        finally:
            channel.mac = real

    Channel.send_part = send_part  # type: ignore[method-assign]


def _role_threads() -> list[str]:
    return sorted(t.name for t in threading.enumerate() if t.name.startswith("kvtransfer-"))


def _native_threads() -> list[str]:
    """Names of this process's OS threads."""
    names = []
    for task in os.listdir("/proc/self/task"):
        try:
            with open(f"/proc/self/task/{task}/comm") as f:
                names.append(f.read().strip())
        except OSError:
            pass  # ended meanwhile
    return sorted(names)


def agent_main(conn: Connection) -> None:
    os.environ["OMP_NUM_THREADS"] = "1"
    torch.set_num_threads(1)
    state = AgentState()
    while True:
        try:
            method, args, kwargs = conn.recv()
        except EOFError:
            return
        try:
            conn.send(("ok", getattr(state, method)(*args, **kwargs)))
        except Exception as exc:  # report to the test, keep serving
            conn.send(("err", type(exc).__name__, f"{exc}\n{traceback.format_exc()[-2000:]}"))


class Agent:
    """Handle on one agent process (see module doc)."""

    def __init__(self, name: str) -> None:
        ctx = mp.get_context("spawn")
        self.conn, child = ctx.Pipe()
        self.proc = ctx.Process(target=agent_main, args=(child,), name=name, daemon=True)
        self.proc.start()
        child.close()
        self.pid = self.call("pid", timeout_s=60)

    def call(self, method: str, *args: Any, timeout_s: float = 60.0, **kwargs: Any) -> Any:
        self.submit(method, *args, **kwargs)
        return self.result(timeout_s, method)

    def submit(self, method: str, *args: Any, **kwargs: Any) -> None:
        """Start ``method`` in the agent; collect its outcome with ``result``."""
        self.conn.send((method, args, kwargs))

    def result(self, timeout_s: float = 60.0, what: str = "call") -> Any:
        if not self.conn.poll(timeout_s):
            raise TimeoutError(f"agent {self.proc.name}: {what} took over {timeout_s}s")
        reply = self.conn.recv()
        if reply[0] == "err":
            raise RemoteError(reply[1], reply[2])
        return reply[1]

    @property
    def alive(self) -> bool:
        return self.proc.is_alive()

    def signal(self, sig: int) -> None:
        os.kill(self.pid, sig)

    def kill(self) -> None:
        if self.proc.is_alive():
            self.proc.kill()
        self.proc.join(timeout=10)
        self.conn.close()
