"""The decode side of the KV handoff, rank side: a ``KVReceiver`` on every rank of a
decode engine. The leader drives them through ``decode_worker.handoff.DecodeHandoff``.

Install with ``EngineConfig(rank_plugin=PLUGIN, rank_plugin_config=DecodeKVConfig(...)
.to_json())``. Rank 0's receiver hosts the worker's rendezvous store on ``store_host``,
binding ``store_port`` itself (0: the OS picks, with no window between choosing and
binding); the other ranks' receivers start once the leader tells them the address the
store got (``ATTACH``), so no rank waits on another while the engine is built.

Calls (leader → every rank, typed messages below; never pickle):

- ``ADDRESS`` → rank 0: its store's ``host:port``; other ranks: empty;
- ``ATTACH(host:port)``: ranks other than 0 start their receivers on that store;
- ``EXPECT(transfer_id, num_tokens, timeout_s, block_ids)``: this rank's receiver may
  write the transfer's KV into ``block_ids`` from now on; rank 0's also waits for the
  transfer's trailer (first token, cached-token count);
- ``STATUS(transfer_ids)`` → one ``TransferStatus`` each: pending, done (rank 0: with
  the trailer) or failed (with the reason). A final state is reported once: after it the
  rank has let go of the blocks and forgotten the transfer (a later STATUS says failed,
  "unknown transfer");
- ``ABORT(transfer_id)``: returns once this rank writes no block of it (idempotent);
- ``STATS`` → ``RankStats`` (pending transfers, open channels, channel bound).

Block ownership on the decode side: ``DecodeHandoff.reserve`` takes the blocks from the
engine (``reserve_for_kv``); from EXPECT until every rank reported a final state (or
ABORT returned on every rank) the receivers may write them; only then does the leader
admit the request (all ranks done) or free the blocks (``abort_request``).

Test-only: with ``pdserve.pause_points`` enabled, each rank records
``decode.layer_received`` when a layer of a transfer is complete in its blocks.
"""

from __future__ import annotations

import enum
import json
import struct
from array import array
from collections.abc import Sequence
from dataclasses import asdict, dataclass

from engine.distributed import StoreAddress
from engine.rank_plugin import RankContext
from engine.scheduler import ScheduledChunk
from kvtransfer import KVLayout, KVReceiver, TransferConfig, TransferError
from kvtransfer.protocol import Trailer
from pdserve import pause_points

PLUGIN = "decode_worker.kv_plugin:make"


@dataclass(frozen=True)
class DecodeKVConfig:
    """The decode plugin's settings (``EngineConfig.rank_plugin_config``, as JSON)."""

    store_host: str
    store_port: int  # 0: rank 0's store binds any free port (see ``DecodeHandoff.address``)
    model_fingerprint: str
    timeout_s: float = 30.0  # a transfer not complete this long after EXPECT fails
    max_channels: int = 8
    part_bytes: int = 4 << 20

    def to_json(self) -> str:
        return json.dumps(asdict(self), sort_keys=True)

    @classmethod
    def from_json(cls, raw: str) -> DecodeKVConfig:
        """Parse; unknown or missing keys raise ``ValueError``."""
        data = json.loads(raw)
        try:
            return cls(**data)
        except TypeError as exc:
            raise ValueError(f"bad decode KV plugin config: {exc}") from exc

    def transfer_config(self) -> TransferConfig:
        return TransferConfig(timeout_s=self.timeout_s, max_channels=self.max_channels,
                              part_bytes=self.part_bytes)


# ------------------------------------------------------------------------ messages

class Op(enum.IntEnum):
    EXPECT = 1
    STATUS = 2
    ABORT = 3
    STATS = 4
    ADDRESS = 5
    ATTACH = 6


class State(enum.IntEnum):
    PENDING = 0
    DONE = 1
    FAILED = 2


_EXPECT = struct.Struct("<Bqqd")  # op, transfer_id, num_tokens, timeout_s; then int64 block ids
# transfer_id, state, has trailer, first token id, cached tokens, len(reason); then reason
_STATUS = struct.Struct("<qBBqqI")
_STATS = struct.Struct("<qqq")  # pending, open channels, max channels


def _ints(raw: bytes) -> list[int]:
    values = array("q")
    values.frombytes(raw)
    return values.tolist()


@dataclass(frozen=True)
class Expect:
    transfer_id: int
    num_tokens: int
    timeout_s: float
    block_ids: tuple[int, ...]

    def encode(self) -> bytes:
        head = _EXPECT.pack(Op.EXPECT, self.transfer_id, self.num_tokens, self.timeout_s)
        return head + array("q", self.block_ids).tobytes()

    @classmethod
    def decode(cls, raw: bytes) -> Expect:
        _, transfer_id, num_tokens, timeout_s = _EXPECT.unpack_from(raw)
        return cls(transfer_id, num_tokens, timeout_s, tuple(_ints(raw[_EXPECT.size:])))


@dataclass(frozen=True)
class TransferStatus:
    transfer_id: int
    state: State
    reason: str = ""
    trailer: Trailer | None = None  # DONE on rank 0 only


def encode_statuses(statuses: Sequence[TransferStatus]) -> bytes:
    parts = []
    for s in statuses:
        reason, t = s.reason.encode(), s.trailer or Trailer(0, 0)
        parts.append(_STATUS.pack(s.transfer_id, s.state, s.trailer is not None,
                                  t.first_token_id, t.num_cached_tokens, len(reason)) + reason)
    return b"".join(parts)


def decode_statuses(raw: bytes) -> list[TransferStatus]:
    out, offset = [], 0
    while offset < len(raw):
        transfer_id, state, has_trailer, first, cached, n = _STATUS.unpack_from(raw, offset)
        offset += _STATUS.size
        trailer = Trailer(first, cached) if has_trailer else None
        out.append(TransferStatus(transfer_id, State(state), raw[offset:offset + n].decode(),
                                  trailer))
        offset += n
    return out


def encode_address(address: StoreAddress) -> bytes:
    return f"{address.host}:{address.port}".encode()


def decode_address(raw: bytes) -> StoreAddress:
    host, _, port = raw.decode().rpartition(":")
    return StoreAddress(host, int(port))


@dataclass(frozen=True)
class RankStats:
    pending: int
    open_channels: int
    max_channels: int

    def encode(self) -> bytes:
        return _STATS.pack(self.pending, self.open_channels, self.max_channels)

    @classmethod
    def decode(cls, raw: bytes) -> RankStats:
        return cls(*_STATS.unpack(raw))


def status_request(transfer_ids: Sequence[int]) -> bytes:
    return bytes([Op.STATUS]) + array("q", transfer_ids).tobytes()


def abort_request(transfer_id: int) -> bytes:
    return bytes([Op.ABORT]) + struct.pack("<q", transfer_id)


# ------------------------------------------------------------------------ the rank plugin

class DecodeKVPlugin:
    """One decode rank's receiver (rank 0's from the start, the others' from ATTACH).
    Owns no block: it writes the blocks of an expected transfer until it reports the
    transfer's final state or ABORT returns."""

    def __init__(self, ctx: RankContext) -> None:
        self.ctx = ctx
        self.config = DecodeKVConfig.from_json(ctx.plugin_config)
        self.layout = KVLayout.from_engine_config(ctx.config, self.config.model_fingerprint)
        self._receiver: KVReceiver | None = None
        if ctx.rank == 0:
            self._attach(StoreAddress(self.config.store_host, self.config.store_port))

    def _attach(self, address: StoreAddress) -> None:
        if self._receiver is not None:
            return
        observe = self._observe if pause_points.enabled() else None
        self._receiver = KVReceiver(self.layout, address, tp_rank=self.ctx.rank,
                                    tp_size=self.ctx.tp_size, device=self.ctx.kv_cache.device,
                                    config=self.config.transfer_config(),
                                    on_layer_received=observe)

    def _observe(self, transfer_id: int, layer: int) -> None:
        pause_points.record("decode.layer_received", transfer_id=transfer_id, layer=layer,
                            rank=self.ctx.rank)

    @property
    def receiver(self) -> KVReceiver:
        if self._receiver is None:
            raise RuntimeError(f"decode rank {self.ctx.rank}: no ATTACH yet")
        return self._receiver

    def handle(self, request: bytes) -> bytes:
        op = Op(request[0])
        if op is Op.EXPECT:
            msg = Expect.decode(request)
            self.receiver.expect(msg.transfer_id, self.ctx.kv_cache, msg.block_ids,
                                 msg.num_tokens, msg.timeout_s, trailer=self.ctx.rank == 0)
            return b""
        if op is Op.STATUS:
            return encode_statuses([self._status(t) for t in _ints(request[1:])])
        if op is Op.ABORT:
            (transfer_id,) = struct.unpack("<q", request[1:])
            return b"\x01" if self.receiver.abort(transfer_id) else b"\x00"
        if op is Op.ADDRESS:
            return encode_address(self.receiver.address) if self.ctx.rank == 0 else b""
        if op is Op.ATTACH:
            self._attach(decode_address(request[1:]))
            return b""
        return RankStats(self.receiver.num_pending, self.receiver.num_open_channels,
                         self.receiver.config.max_channels).encode()

    def _status(self, transfer_id: int) -> TransferStatus:
        """Pending, or the final state (then the receiver has forgotten the transfer)."""
        try:
            if not self.receiver.done(transfer_id):
                return TransferStatus(transfer_id, State.PENDING)
            trailer = self.receiver.wait(transfer_id, timeout_s=0)
        except KeyError:
            return TransferStatus(transfer_id, State.FAILED, "unknown transfer")
        except TransferError as exc:
            return TransferStatus(transfer_id, State.FAILED, f"{type(exc).__name__}: {exc}")
        return TransferStatus(transfer_id, State.DONE, trailer=trailer)

    def step_hook(self, chunks: Sequence[ScheduledChunk], payload: bytes) -> None:
        return None

    def close(self) -> None:
        if self._receiver is not None:
            self._receiver.close()


def make(ctx: RankContext) -> DecodeKVPlugin:
    return DecodeKVPlugin(ctx)
