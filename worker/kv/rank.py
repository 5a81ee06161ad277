"""``KVRank``: the KV rank plugin every worker installs on each of its ranks
(``EngineConfig(rank_plugin=PLUGIN, rank_plugin_config=KVPlaneConfig(...).to_json())``),
with one side per direction. The leader drives it through ``worker.kv.sending`` and
``worker.kv.receiving``; the calls are ``worker.kv.messages``'.

- ``SendSide``: a ``KVSender`` (built at the first send), sending layer l of a request's KV
  as soon as layer l is written. Only the step holding a request's last prompt chunk
  (the one that samples) carries its ``SendOrder``; the layer hook then sends all of the
  request's blocks, layer by layer. It reads (never writes) the blocks named by an order,
  from its step until a final STATUS or ABORT of that transfer returned on this rank.
- ``ReceiveSide``: a ``KVReceiver``. Rank 0's starts on ``ADDRESS`` (its rendezvous store
  binds ``bind_host:store_port``; 0: the OS picks, with no window between choosing and
  binding), the other ranks' on ``ATTACH`` with the address that store got, so no rank
  waits on another while the engine is built. It owns no block: it writes the blocks of an
  expected transfer until it reports the transfer's final state or ABORT returns.

Test-only: with ``cluster.pause_points`` enabled, the layer hook records and may pause at
``kv.layer_sent`` after queuing each layer, and each rank records ``kv.layer_received``
when a layer of a transfer is complete in its blocks.
"""

from __future__ import annotations

import importlib
import logging
from collections.abc import Callable, Sequence

from cluster import pause_points
from engine.attention.metadata import LayerHook
from engine.core.scheduler import ScheduledChunk
from engine.kvcache.layout import KVLayout
from engine.tp.distributed import StoreAddress
from engine.tp.rank_plugin import RankContext
from kvtransfer import KVReceiver, KVSender
from kvtransfer.states import TransferState
from kvtransfer.wire.protocol import Trailer
from worker.kv.config import KVPlaneConfig
from worker.kv.messages import (
    Direction,
    Expect,
    Op,
    RankStats,
    TransferStatus,
    decode_abort,
    decode_address,
    decode_directed,
    decode_finish,
    decode_orders,
    encode_address,
    encode_statuses,
    ints,
)
from worker.kv.reports import final_status

log = logging.getLogger(__name__)
PLUGIN = "worker.kv.rank:make"


def _load_fault_hook(spec: str | None) -> Callable[..., None] | None:
    if spec is None:
        return None
    module, _, attr = spec.partition(":")
    factory = getattr(importlib.import_module(module), attr)
    hook: Callable[..., None] = factory()
    return hook


class SendSide:
    """One rank's sender (see the module docstring)."""

    def __init__(self, ctx: RankContext, config: KVPlaneConfig, layout: KVLayout) -> None:
        self.ctx, self.config, self.layout = ctx, config, layout
        self._sender: KVSender | None = None
        self._failed: dict[int, str] = {}  # transfer id -> why a send() raised

    @property
    def sender(self) -> KVSender:
        if self._sender is None:
            self._sender = KVSender(self.layout, tp_rank=self.ctx.rank, tp_size=self.ctx.tp_size,
                                    name=f"kv-send-rank{self.ctx.rank}",
                                    config=self.config.transfer_config(),
                                    fault_hook=_load_fault_hook(self.config.fault_hook))
        return self._sender

    def finish(self, transfer_id: int, trailer: Trailer) -> None:
        if self.ctx.rank != 0 or transfer_id in self._failed:
            return
        try:
            self.sender.finish(transfer_id, trailer)
        except (KeyError, ValueError) as exc:  # reported by STATUS
            self._failed[transfer_id] = f"trailer not sent: {exc}"

    def status(self, transfer_id: int) -> TransferStatus:
        """Pending, or the final state (then the sender has forgotten the transfer)."""
        failed = self._failed.pop(transfer_id, None)
        if failed is not None:
            self.sender.abort(transfer_id)
            return TransferStatus(transfer_id, TransferState.FAILED, failed)
        return final_status(transfer_id, self.sender.done,
                            lambda t: self.sender.wait(t, timeout_s=0),
                            unknown="never sent from this rank")

    def abort(self, transfer_id: int) -> bool:
        self._failed.pop(transfer_id, None)
        return self._sender is not None and self._sender.abort(transfer_id)

    def step_hook(self, chunks: Sequence[ScheduledChunk], payload: bytes) -> LayerHook | None:
        orders = decode_orders(payload)
        if not orders:
            return None
        # per order: (transfer id, block ids, num_tokens, dest); the chunk is the last one.
        # Blocks the receiver holds are skipped: the rest goes as a transfer of its own
        # tokens, into the receiver's blocks after the ones it holds.
        block_size = self.layout.block_size
        sends = [(o.transfer_id, chunks[o.chunk_index].block_ids[o.num_skipped_blocks:],
                  chunks[o.chunk_index].start_position + len(chunks[o.chunk_index].token_ids)
                  - o.num_skipped_blocks * block_size, o.dest) for o in orders]
        sender = self.sender

        def send_layer(layer_idx: int) -> None:
            for transfer_id, block_ids, num_tokens, dest in sends:
                if transfer_id in self._failed:
                    continue
                try:
                    sender.send(transfer_id, self.ctx.kv_cache, block_ids, num_tokens, dest,
                                layers=range(layer_idx, layer_idx + 1))
                except (ValueError, RuntimeError) as exc:  # reported by STATUS
                    log.warning("transfer %d: send failed: %s", transfer_id, exc)
                    self._failed[transfer_id] = f"{type(exc).__name__}: {exc}"
                if pause_points.enabled():
                    point = dict(transfer_id=transfer_id, layer=layer_idx, rank=self.ctx.rank)
                    pause_points.record("kv.layer_sent", **point)
                    pause_points.pause("kv.layer_sent", **point)

        return send_layer

    def stats(self) -> tuple[int, int, int, int]:
        """(pending transfers, open channels, bytes sent, unexpected acknowledgements)."""
        s = self._sender
        if s is None:
            return len(self._failed), 0, 0, 0
        return (s.num_pending + len(self._failed), s.num_open_channels, s.stats.bytes_sent,
                s.stats.unexpected_acks)

    def close(self) -> None:
        if self._sender is not None:
            self._sender.close()


class ReceiveSide:
    """One rank's receiver, once started (see the module docstring)."""

    def __init__(self, ctx: RankContext, config: KVPlaneConfig, layout: KVLayout) -> None:
        self.ctx, self.config, self.layout = ctx, config, layout
        self._receiver: KVReceiver | None = None

    def start(self, address: StoreAddress) -> None:
        """Start receiving on the store at ``address`` (rank 0: hosts it); idempotent."""
        if self._receiver is not None:
            return
        observe = self._observe if pause_points.enabled() else None
        self._receiver = KVReceiver(self.layout, address, tp_rank=self.ctx.rank,
                                    tp_size=self.ctx.tp_size, device=self.ctx.kv_cache.device,
                                    config=self.config.transfer_config(),
                                    on_layer_received=observe,
                                    advertise_host=self.config.reachable_host)

    def _observe(self, transfer_id: int, layer: int) -> None:
        pause_points.record("kv.layer_received", transfer_id=transfer_id, layer=layer,
                            rank=self.ctx.rank)

    @property
    def receiver(self) -> KVReceiver:
        if self._receiver is None:
            raise RuntimeError(f"rank {self.ctx.rank}: not receiving (no ADDRESS or ATTACH yet)")
        return self._receiver

    def address(self) -> bytes:
        """Rank 0: starts its store (once) and returns where it listens; others: empty."""
        if self.ctx.rank != 0:
            return b""
        self.start(StoreAddress(self.config.bind_host, self.config.store_port))
        return encode_address(self.receiver.address)

    def expect(self, msg: Expect) -> None:
        self.receiver.expect(msg.transfer_id, self.ctx.kv_cache, msg.block_ids, msg.num_tokens,
                             msg.timeout_s, trailer=self.ctx.rank == 0,
                             start_timeout_s=msg.start_timeout_s)

    def status(self, transfer_id: int) -> TransferStatus:
        """Pending, or the final state (then the receiver has forgotten the transfer)."""
        if self._receiver is None:
            return TransferStatus(transfer_id, TransferState.FAILED, "not receiving")
        return final_status(transfer_id, self._receiver.done,
                            lambda t: self.receiver.wait(t, timeout_s=0))

    def abort(self, transfer_id: int) -> bool:
        return self._receiver is not None and self._receiver.abort(transfer_id)

    def stats(self) -> tuple[int, int, int, int]:
        """(pending transfers, open channels, bytes received, checksum failures)."""
        r = self._receiver
        if r is None:
            return 0, 0, 0, 0
        return r.num_pending, r.num_open_channels, r.stats.bytes_received, r.stats.checksum_failures

    def close(self) -> None:
        if self._receiver is not None:
            self._receiver.close()


class KVRank:
    """The plugin on one rank: answers the leader's calls with the side they are about."""

    def __init__(self, ctx: RankContext) -> None:
        self.ctx = ctx
        self.config = KVPlaneConfig.from_json(ctx.plugin_config)
        layout = KVLayout.from_engine_config(ctx.config, self.config.model_fingerprint)
        self.sending = SendSide(ctx, self.config, layout)
        self.receiving = ReceiveSide(ctx, self.config, layout)

    def handle(self, request: bytes) -> bytes:
        op = Op(request[0])
        if op is Op.STATUS:
            direction, body = decode_directed(request)
            side = self.sending if direction is Direction.SEND else self.receiving
            return encode_statuses([side.status(t) for t in ints(body)])
        if op is Op.ABORT:
            direction, transfer_id = decode_abort(request)
            side_ = self.sending if direction is Direction.SEND else self.receiving
            return b"\x01" if side_.abort(transfer_id) else b"\x00"
        if op is Op.STATS:
            return self._stats().encode()
        if op is Op.FINISH:
            self.sending.finish(*decode_finish(request))
            return b""
        if op is Op.EXPECT:
            self.receiving.expect(Expect.decode(request))
            return b""
        if op is Op.ADDRESS:
            return self.receiving.address()
        if op is Op.ATTACH:
            if self.ctx.rank != 0:
                self.receiving.start(decode_address(request[1:]))
            return b""
        raise ValueError(f"op {op.name} is not served by {type(self).__name__}")

    def _stats(self) -> RankStats:
        pending_sent, sending, sent, unexpected = self.sending.stats()
        pending_received, receiving, received, corrupt = self.receiving.stats()
        return RankStats(pending_sent, pending_received, sending, receiving, sent, received,
                         self.config.max_channels, corrupt, unexpected)

    def step_hook(self, chunks: Sequence[ScheduledChunk], payload: bytes) -> LayerHook | None:
        return self.sending.step_hook(chunks, payload)

    def close(self) -> None:
        self.sending.close()
        self.receiving.close()


def make(ctx: RankContext) -> KVRank:
    return KVRank(ctx)
