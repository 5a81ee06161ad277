"""The decode worker's KV rank plugin: a ``KVReceiver`` on every rank of a decode engine.
The leader drives them through ``decode_worker.kv_leader.DecodeKVLeader``.

Install with ``EngineConfig(rank_plugin=PLUGIN, rank_plugin_config=DecodeKVConfig(...)
.to_json())``. Rank 0's receiver hosts the worker's rendezvous store on ``store_host``,
binding ``store_port`` itself (0: the OS picks, with no window between choosing and
binding); the other ranks' receivers start once the leader tells them the address the
store got (``ATTACH``), so no rank waits on another while the engine is built.

Calls (leader → every rank, ``worker.rank_calls``; never pickle): ``ADDRESS`` → rank 0:
its store's ``host:port``, other ranks: empty; ``ATTACH(host:port)``: ranks other than 0
start their receivers on that store; ``EXPECT(transfer_id, num_tokens, timeout_s,
block_ids)``: this rank's receiver may write the transfer's KV into ``block_ids`` from
now on (its first part due within ``start_timeout_s``, the rest within ``timeout_s`` of
it); rank 0's also waits for the transfer's trailer (first token, cached-token count);
and the shared ``STATUS`` (rank 0's DONE carries the trailer), ``ABORT`` and ``STATS``.

Block ownership on the decode side: the decode loop reserves the blocks in the engine
(``reserve_for_kv``); from EXPECT until every rank reported a final state (or ABORT
returned on every rank) the receivers may write them; only then does the loop admit the
request (all ranks done) or free the blocks (``abort_request``).

Test-only: with ``cluster.pause_points`` enabled, each rank records
``decode.layer_received`` when a layer of a transfer is complete in its blocks.
"""

from __future__ import annotations

import struct
from array import array
from collections.abc import Sequence
from dataclasses import dataclass

from cluster import pause_points
from engine.distributed import StoreAddress
from engine.rank_plugin import RankContext
from engine.scheduler import ScheduledChunk
from kvtransfer import KVLayout, KVReceiver, TransferConfig
from worker.rank_calls import (
    JsonConfig,
    KVRankPlugin,
    Op,
    RankStats,
    TransferStatus,
    final_status,
    ints,
)

PLUGIN = "decode_worker.kv_rank:make"


@dataclass(frozen=True)
class DecodeKVConfig(JsonConfig):
    """The decode plugin's settings (``EngineConfig.rank_plugin_config``, as JSON)."""

    store_host: str  # where rank 0's store listens (may be a wildcard)
    store_port: int  # 0: rank 0's store binds any free port (see ``DecodeKVLeader.address``)
    model_fingerprint: str
    timeout_s: float = 30.0  # a transfer not complete this long after EXPECT fails
    max_channels: int = 8
    part_bytes: int = 4 << 20
    advertise_host: str | None = None  # the store's address for others (default store_host)

    @property
    def reachable_host(self) -> str:
        return self.advertise_host or self.store_host

    def transfer_config(self) -> TransferConfig:
        return TransferConfig(timeout_s=self.timeout_s, max_channels=self.max_channels,
                              part_bytes=self.part_bytes, bind_host=self.reachable_host)


# ------------------------------------------------------------------------ messages

# op, transfer_id, num_tokens, timeout_s, start_timeout_s; then int64 block ids
_EXPECT = struct.Struct("<Bqqdd")


@dataclass(frozen=True)
class Expect:
    """The transfer's first part must arrive within ``start_timeout_s``; it must then
    complete within ``timeout_s``."""

    transfer_id: int
    num_tokens: int
    timeout_s: float
    start_timeout_s: float
    block_ids: tuple[int, ...]

    def encode(self) -> bytes:
        head = _EXPECT.pack(Op.EXPECT, self.transfer_id, self.num_tokens, self.timeout_s,
                            self.start_timeout_s)
        return head + array("q", self.block_ids).tobytes()

    @classmethod
    def decode(cls, raw: bytes) -> Expect:
        _, transfer_id, num_tokens, timeout_s, start_timeout_s = _EXPECT.unpack_from(raw)
        return cls(transfer_id, num_tokens, timeout_s, start_timeout_s,
                   tuple(ints(raw[_EXPECT.size:])))


def encode_address(address: StoreAddress) -> bytes:
    return f"{address.host}:{address.port}".encode()


def decode_address(raw: bytes) -> StoreAddress:
    host, _, port = raw.decode().rpartition(":")
    return StoreAddress(host, int(port))


# ------------------------------------------------------------------------ the rank plugin

class DecodeKVRank(KVRankPlugin):
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
                                    on_layer_received=observe,
                                    advertise_host=self.config.reachable_host)

    def _observe(self, transfer_id: int, layer: int) -> None:
        pause_points.record("decode.layer_received", transfer_id=transfer_id, layer=layer,
                            rank=self.ctx.rank)

    @property
    def receiver(self) -> KVReceiver:
        if self._receiver is None:
            raise RuntimeError(f"decode rank {self.ctx.rank}: no ATTACH yet")
        return self._receiver

    def handle_own(self, op: Op, request: bytes) -> bytes:
        if op is Op.EXPECT:
            msg = Expect.decode(request)
            self.receiver.expect(msg.transfer_id, self.ctx.kv_cache, msg.block_ids,
                                 msg.num_tokens, msg.timeout_s, trailer=self.ctx.rank == 0,
                                 start_timeout_s=msg.start_timeout_s)
            return b""
        if op is Op.ADDRESS:
            return encode_address(self.receiver.address) if self.ctx.rank == 0 else b""
        if op is Op.ATTACH:
            self._attach(decode_address(request[1:]))
            return b""
        return super().handle_own(op, request)

    def status(self, transfer_id: int) -> TransferStatus:
        """Pending, or the final state (then the receiver has forgotten the transfer)."""
        return final_status(transfer_id, self.receiver.done,
                            lambda t: self.receiver.wait(t, timeout_s=0))

    def abort(self, transfer_id: int) -> bool:
        return self.receiver.abort(transfer_id)

    def stats(self) -> RankStats:
        stats = self.receiver.stats
        return RankStats(self.receiver.num_pending, self.receiver.num_open_channels,
                         self.receiver.config.max_channels, stats.bytes_received,
                         stats.checksum_failures)

    def step_hook(self, chunks: Sequence[ScheduledChunk], payload: bytes) -> None:
        return None

    def close(self) -> None:
        if self._receiver is not None:
            self._receiver.close()


def make(ctx: RankContext) -> DecodeKVRank:
    return DecodeKVRank(ctx)
