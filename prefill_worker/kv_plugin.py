"""The prefill side of the KV handoff: a ``KVSender`` on every rank of a prefill engine,
sending layer l of a request's KV as soon as layer l is written, and ``PrefillHandoff``,
the leader-side helper that drives them.

Install with ``EngineConfig(rank_plugin=PLUGIN, rank_plugin_config=PrefillKVConfig(...)
.to_json())`` and build ``PrefillHandoff(core)`` (it sets ``core.step_payload``).

Step payload (leader → every rank, with each step): the sends this step starts, as
``SendOrder``s: index of the request's chunk in the step, transfer id, destination
store. Only the step holding a request's last prompt chunk (the one that samples)
carries its order; the layer hook then sends all of the request's blocks, layer by
layer. Followers see chunks without request ids, so everything they need is in here.

Calls (leader → every rank): ``WAIT(transfer_id, timeout_s)`` → ``TransferStatus``
(done, or failed with the reason; the rank has finished the transfer either way);
``ABORT(transfer_id)`` (returns once the rank reads no block of it); ``STATS``.

Block ownership on the prefill side: a prefill-only request's blocks are the engine's
while it runs, then pinned (``RequestOutput.block_ids``). From the step that starts the
send until WAIT (or ABORT) returned on every rank, the senders may read them; only then
does ``PrefillHandoff`` unpin them (``release_pinned``; they stay in the prefix cache).
"""

from __future__ import annotations

import enum
import importlib
import json
import logging
import struct
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass

from engine.attention.metadata import LayerHook
from engine.core import EngineCore, RequestOutput
from engine.distributed import StoreAddress
from engine.rank_plugin import RankContext
from engine.sampling_params import SamplingParams
from engine.scheduler import ScheduledChunk, SchedulerOutput
from kvtransfer import KVLayout, KVSender, TransferConfig, TransferError

log = logging.getLogger(__name__)
PLUGIN = "prefill_worker.kv_plugin:make"


@dataclass(frozen=True)
class PrefillKVConfig:
    """The prefill plugin's settings (``EngineConfig.rank_plugin_config``, as JSON).
    ``fault_hook``: tests only, ``"module:factory"`` of a ``kvtransfer`` sender fault hook."""

    model_fingerprint: str
    timeout_s: float = 30.0
    max_channels: int = 8
    part_bytes: int = 4 << 20
    fault_hook: str | None = None

    def to_json(self) -> str:
        return json.dumps(asdict(self), sort_keys=True)

    @classmethod
    def from_json(cls, raw: str) -> PrefillKVConfig:
        """Parse; unknown or missing keys raise ``ValueError``."""
        try:
            return cls(**json.loads(raw))
        except TypeError as exc:
            raise ValueError(f"bad prefill KV plugin config: {exc}") from exc

    def transfer_config(self) -> TransferConfig:
        return TransferConfig(timeout_s=self.timeout_s, max_channels=self.max_channels,
                              part_bytes=self.part_bytes)


# ------------------------------------------------------------------------ messages

class Op(enum.IntEnum):
    WAIT = 1
    ABORT = 2
    STATS = 3


_ORDER = struct.Struct("<iqiH")  # chunk index, transfer_id, port, len(host); then host
_WAIT = struct.Struct("<Bqd")  # op, transfer_id, timeout_s
_STATUS = struct.Struct("<BI")  # ok, len(reason); then the UTF-8 reason
_STATS = struct.Struct("<qqq")  # pending, open channels, max channels


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


@dataclass(frozen=True)
class TransferStatus:
    ok: bool
    reason: str = ""

    def encode(self) -> bytes:
        reason = self.reason.encode()
        return _STATUS.pack(self.ok, len(reason)) + reason

    @classmethod
    def decode(cls, raw: bytes) -> TransferStatus:
        ok, n = _STATUS.unpack_from(raw)
        return cls(bool(ok), raw[_STATUS.size:_STATUS.size + n].decode())


@dataclass(frozen=True)
class RankStats:
    pending: int
    open_channels: int
    max_channels: int

    @classmethod
    def decode(cls, raw: bytes) -> RankStats:
        return cls(*_STATS.unpack(raw))


def wait_request(transfer_id: int, timeout_s: float) -> bytes:
    return _WAIT.pack(Op.WAIT, transfer_id, timeout_s)


def abort_request(transfer_id: int) -> bytes:
    return bytes([Op.ABORT]) + struct.pack("<q", transfer_id)


# ------------------------------------------------------------------------ the rank plugin

def _load_fault_hook(spec: str | None) -> Callable[..., None] | None:
    if spec is None:
        return None
    module, _, attr = spec.partition(":")
    factory = getattr(importlib.import_module(module), attr)
    hook: Callable[..., None] = factory()
    return hook


class PrefillKVPlugin:
    """One prefill rank's sender. Reads (never writes) the blocks named by a send order,
    from its step until WAIT or ABORT for that transfer returned on this rank."""

    def __init__(self, ctx: RankContext) -> None:
        self.ctx = ctx
        self.config = PrefillKVConfig.from_json(ctx.plugin_config)
        layout = KVLayout.from_engine_config(ctx.config, self.config.model_fingerprint)
        self.sender = KVSender(layout, tp_rank=ctx.rank, tp_size=ctx.tp_size,
                               name=f"prefill-rank{ctx.rank}",
                               config=self.config.transfer_config(),
                               fault_hook=_load_fault_hook(self.config.fault_hook))
        self._failed: dict[int, str] = {}  # transfer id -> why a send() raised

    def handle(self, request: bytes) -> bytes:
        op = Op(request[0])
        if op is Op.WAIT:
            _, transfer_id, timeout_s = _WAIT.unpack(request)
            return self._wait(transfer_id, timeout_s).encode()
        if op is Op.ABORT:
            (transfer_id,) = struct.unpack("<q", request[1:])
            self._failed.pop(transfer_id, None)
            return b"\x01" if self.sender.abort(transfer_id) else b"\x00"
        return _STATS.pack(self.sender.num_pending + len(self._failed),
                           self.sender.num_open_channels, self.sender.config.max_channels)

    def _wait(self, transfer_id: int, timeout_s: float) -> TransferStatus:
        failed = self._failed.pop(transfer_id, None)
        if failed is not None:
            self.sender.abort(transfer_id)
            return TransferStatus(False, failed)
        try:
            self.sender.wait(transfer_id, timeout_s)
        except KeyError:
            return TransferStatus(False, "never sent from this rank")
        except TransferError as exc:
            return TransferStatus(False, f"{type(exc).__name__}: {exc}")
        return TransferStatus(True)

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
                except (ValueError, RuntimeError) as exc:  # reported by WAIT
                    log.warning("transfer %d: send failed: %s", transfer_id, exc)
                    self._failed[transfer_id] = f"{type(exc).__name__}: {exc}"

        return send_layer

    def close(self) -> None:
        self.sender.close()


def make(ctx: RankContext) -> PrefillKVPlugin:
    return PrefillKVPlugin(ctx)


# ------------------------------------------------------------------------ leader side

@dataclass(frozen=True)
class PrefillResult:
    """A finished prefill: the first token (for the decode side's ``admit``) and whether
    the KV reached every decode rank. Its blocks are already unpinned."""

    request_id: str
    transfer_id: int
    first_token_id: int | None  # None when the prefill produced no token
    num_cached_tokens: int
    ok: bool
    reason: str = ""


@dataclass
class _Order:
    transfer_id: int
    dest: StoreAddress
    started: bool = False


class PrefillHandoff:
    """Leader-side driver of a prefill engine's senders (same thread as the engine).

    Lifecycle: ``submit`` → step the engine → on the request's finished output,
    ``complete`` (waits on every rank, then unpins) → the caller passes
    ``first_token_id`` to the decode side. ``abort`` at any point instead.
    """

    def __init__(self, core: EngineCore, wait_timeout_s: float | None = None) -> None:
        self.core = core
        config = PrefillKVConfig.from_json(core.config.rank_plugin_config)
        self.wait_timeout_s = wait_timeout_s or config.timeout_s
        self._orders: dict[str, _Order] = {}
        core.step_payload = self.step_payload

    def submit(self, request_id: str, prompt_ids: Sequence[int], params: SamplingParams,
               transfer_id: int, dest: StoreAddress) -> None:
        """Queue a prefill-only request whose KV goes to the decode store ``dest``."""
        self.core.add_request(request_id, prompt_ids, params, prefill_only=True)
        self._orders[request_id] = _Order(transfer_id, dest)

    def step_payload(self, out: SchedulerOutput) -> bytes:
        """The ``SendOrder``s of this step (installed as ``core.step_payload``)."""
        orders = []
        for index, chunk in enumerate(out.chunks):
            order = self._orders.get(chunk.request_id)
            if order is not None and chunk.sample and not order.started:
                order.started = True
                orders.append(SendOrder(index, order.transfer_id, order.dest))
        return encode_orders(orders)

    def complete(self, output: RequestOutput) -> PrefillResult:
        """For a submitted request's finished output: wait until every rank's send is
        acknowledged or failed, then unpin its blocks."""
        if not output.finished or output.request_id not in self._orders:
            raise ValueError(f"{output.request_id!r} is not a finished submitted request")
        order = self._orders.pop(output.request_id)
        replies = self.core.call_ranks(wait_request(order.transfer_id, self.wait_timeout_s))
        statuses = [TransferStatus.decode(r) for r in replies]
        reasons = [f"rank {i}: {s.reason}" for i, s in enumerate(statuses) if not s.ok]
        if reasons:  # ranks that did not fail have finished too (WAIT always finishes)
            self.core.call_ranks(abort_request(order.transfer_id))
        self.core.release_pinned(output.request_id)
        first = output.new_token_ids[0] if output.new_token_ids else None
        return PrefillResult(output.request_id, order.transfer_id, first,
                             output.num_cached_tokens, not reasons and first is not None,
                             "; ".join(reasons))

    def abort(self, request_id: str) -> bool:
        """Stop the request wherever it is; its blocks are freed or unpinned once no rank
        reads them. False if unknown."""
        order = self._orders.pop(request_id, None)
        if order is None:
            return False
        self.core.abort_request(request_id)
        if order.started:
            self.core.call_ranks(abort_request(order.transfer_id))
        self.core.release_pinned(request_id)
        return True

    @property
    def num_pending(self) -> int:
        return len(self._orders)

    def rank_stats(self) -> list[RankStats]:
        return [RankStats.decode(r) for r in self.core.call_ranks(bytes([Op.STATS]))]
