"""The prefill worker's KV rank plugin: a ``KVSender`` on every rank of a prefill engine,
sending layer l of a request's KV as soon as layer l is written. The leader drives them
through ``prefill_worker.kv_leader.PrefillKVLeader``.

Install with ``EngineConfig(rank_plugin=PLUGIN, rank_plugin_config=PrefillKVConfig(...)
.to_json())`` and build ``PrefillKVLeader(core)`` (it sets ``core.step_payload``).

Step payload (leader → every rank, with each step): the sends this step starts, as
``SendOrder``s: index of the request's chunk in the step, transfer id, destination
store. Only the step holding a request's last prompt chunk (the one that samples)
carries its order; the layer hook then sends all of the request's blocks, layer by
layer. Followers see chunks without request ids, so everything they need is in here.

Calls (leader → every rank, ``worker.rank_calls``; none of them waits on the network):
``FINISH(transfer_id, first_token_id, num_cached_tokens)`` (every layer was sent; rank 0
queues the ``Trailer`` behind them, to the decode worker's rank 0), and the shared
``STATUS``, ``ABORT`` and ``STATS``.

Block ownership on the prefill side: a prefill-only request's blocks are the engine's
while it runs, then pinned (``RequestOutput.block_ids``). From the step that starts the
send until every rank reported a final state (or ABORT returned on every rank), the
senders may read them; only then does ``PrefillKVLeader`` unpin them (``release_pinned``;
they stay in the prefix cache).

Test-only: with ``cluster.pause_points`` enabled, the layer hook records and may pause at
``prefill.layer_sent`` after queuing each layer.
"""

from __future__ import annotations

import importlib
import logging
import struct
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from cluster import pause_points
from engine.attention.metadata import LayerHook
from engine.distributed import StoreAddress
from engine.rank_plugin import RankContext
from engine.scheduler import ScheduledChunk
from kvtransfer import KVLayout, KVSender, TransferConfig
from kvtransfer.config import LOOPBACK
from kvtransfer.protocol import Trailer
from kvtransfer.states import TransferState
from worker.rank_calls import (
    JsonConfig,
    KVRankPlugin,
    Op,
    RankStats,
    TransferStatus,
    final_status,
)

log = logging.getLogger(__name__)
PLUGIN = "prefill_worker.kv_rank:make"


@dataclass(frozen=True)
class PrefillKVConfig(JsonConfig):
    """The prefill plugin's settings (``EngineConfig.rank_plugin_config``, as JSON).
    ``fault_hook``: tests only, ``"module:factory"`` of a ``kvtransfer`` sender fault hook."""

    model_fingerprint: str
    timeout_s: float = 30.0
    max_channels: int = 8
    part_bytes: int = 4 << 20
    fault_hook: str | None = None
    bind_host: str = LOOPBACK  # the address its channels' groups bind (the advertised one)

    def transfer_config(self) -> TransferConfig:
        return TransferConfig(timeout_s=self.timeout_s, max_channels=self.max_channels,
                              part_bytes=self.part_bytes, bind_host=self.bind_host)


# ------------------------------------------------------------------------ messages

_ORDER = struct.Struct("<iqiH")  # chunk index, transfer_id, port, len(host); then host
_FINISH = struct.Struct("<Bqqq")  # op, transfer_id, first_token_id, num_cached_tokens


@dataclass(frozen=True)
class SendOrder:
    """Send all blocks of the request computed by ``chunks[chunk_index]`` of this step."""

    chunk_index: int
    transfer_id: int
    dest: StoreAddress


def encode_orders(orders: Sequence[SendOrder]) -> bytes:
    parts = []
    for o in orders:
        host = o.dest.host.encode()
        parts.append(_ORDER.pack(o.chunk_index, o.transfer_id, o.dest.port, len(host)) + host)
    return b"".join(parts)


def decode_orders(raw: bytes) -> list[SendOrder]:
    out, offset = [], 0
    while offset < len(raw):
        index, transfer_id, port, n = _ORDER.unpack_from(raw, offset)
        offset += _ORDER.size
        host = raw[offset:offset + n].decode()
        offset += n
        out.append(SendOrder(index, transfer_id, StoreAddress(host, port)))
    return out


def finish_request(transfer_id: int, trailer: Trailer) -> bytes:
    return _FINISH.pack(Op.FINISH, transfer_id, trailer.first_token_id,
                        trailer.num_cached_tokens)


# ------------------------------------------------------------------------ the rank plugin

def _load_fault_hook(spec: str | None) -> Callable[..., None] | None:
    if spec is None:
        return None
    module, _, attr = spec.partition(":")
    factory = getattr(importlib.import_module(module), attr)
    hook: Callable[..., None] = factory()
    return hook


class PrefillKVRank(KVRankPlugin):
    """One prefill rank's sender. Reads (never writes) the blocks named by a send order,
    from its step until a final STATUS or ABORT for that transfer returned on this rank."""

    def __init__(self, ctx: RankContext) -> None:
        self.ctx = ctx
        self.config = PrefillKVConfig.from_json(ctx.plugin_config)
        layout = KVLayout.from_engine_config(ctx.config, self.config.model_fingerprint)
        self.sender = KVSender(layout, tp_rank=ctx.rank, tp_size=ctx.tp_size,
                               name=f"prefill-rank{ctx.rank}",
                               config=self.config.transfer_config(),
                               fault_hook=_load_fault_hook(self.config.fault_hook))
        self._failed: dict[int, str] = {}  # transfer id -> why a send() raised

    def handle_own(self, op: Op, request: bytes) -> bytes:
        if op is not Op.FINISH:
            return super().handle_own(op, request)
        _, transfer_id, first_token_id, num_cached_tokens = _FINISH.unpack(request)
        self._finish(transfer_id, Trailer(first_token_id, num_cached_tokens))
        return b""

    def abort(self, transfer_id: int) -> bool:
        self._failed.pop(transfer_id, None)
        return self.sender.abort(transfer_id)

    def stats(self) -> RankStats:
        return RankStats(self.sender.num_pending + len(self._failed),
                         self.sender.num_open_channels, self.sender.config.max_channels,
                         self.sender.stats.bytes_sent,
                         unexpected_acks=self.sender.stats.unexpected_acks)

    def _finish(self, transfer_id: int, trailer: Trailer) -> None:
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

    def step_hook(self, chunks: Sequence[ScheduledChunk], payload: bytes) -> LayerHook | None:
        orders = decode_orders(payload)
        if not orders:
            return None
        # per order: (transfer id, block ids, num_tokens, dest); the chunk is the last one
        sends = [(o.transfer_id, chunks[o.chunk_index].block_ids,
                  chunks[o.chunk_index].start_position + len(chunks[o.chunk_index].token_ids),
                  o.dest) for o in orders]

        def send_layer(layer_idx: int) -> None:
            for transfer_id, block_ids, num_tokens, dest in sends:
                if transfer_id in self._failed:
                    continue
                try:
                    self.sender.send(transfer_id, self.ctx.kv_cache, block_ids, num_tokens,
                                     dest, layers=range(layer_idx, layer_idx + 1))
                except (ValueError, RuntimeError) as exc:  # reported by STATUS
                    log.warning("transfer %d: send failed: %s", transfer_id, exc)
                    self._failed[transfer_id] = f"{type(exc).__name__}: {exc}"
                if pause_points.enabled():
                    point = dict(transfer_id=transfer_id, layer=layer_idx, rank=self.ctx.rank)
                    pause_points.record("prefill.layer_sent", **point)
                    pause_points.pause("prefill.layer_sent", **point)

        return send_layer

    def close(self) -> None:
        self.sender.close()


def make(ctx: RankContext) -> PrefillKVRank:
    return PrefillKVRank(ctx)
