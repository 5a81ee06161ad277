"""The decode side of the KV handoff: a ``KVReceiver`` on every rank of a decode engine,
and ``DecodeHandoff``, the leader-side helper that drives them.

Install with ``EngineConfig(rank_plugin=PLUGIN, rank_plugin_config=DecodeKVConfig(...)
.to_json())``. Rank 0's receiver hosts the worker's rendezvous store at
``(store_host, store_port)``; the port is chosen by whoever builds the config (e.g.
``engine.distributed.free_port()``), so no rank waits on another while it is built.

Calls (leader → every rank, typed messages below; never pickle):

- ``EXPECT(transfer_id, num_tokens, timeout_s, block_ids)``: this rank's receiver may
  write the transfer's KV into ``block_ids`` from now on;
- ``STATUS(transfer_ids)`` → one ``TransferStatus`` each: pending, done or failed (with
  the reason). A final state is reported once: after it the rank has let go of the
  blocks and forgotten the transfer (a later STATUS says failed, "unknown transfer");
- ``ABORT(transfer_id)``: returns once this rank writes no block of it (idempotent);
- ``STATS`` → ``RankStats`` (pending transfers, open channels, channel bound).

Block ownership on the decode side: ``DecodeHandoff.reserve`` takes the blocks from the
engine (``reserve_for_kv``); from EXPECT until every rank reported a final state (or
ABORT returned on every rank) the receivers may write them; only then does the leader
admit the request (all ranks done) or free the blocks (``abort_request``).
"""

from __future__ import annotations

import enum
import json
import struct
from array import array
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field

from engine.core import EngineCore, RequestOutput
from engine.distributed import StoreAddress
from engine.rank_plugin import RankContext
from engine.sampling_params import SamplingParams
from engine.scheduler import ScheduledChunk
from kvtransfer import KVLayout, KVReceiver, TransferConfig, TransferError

PLUGIN = "decode_worker.kv_plugin:make"


@dataclass(frozen=True)
class DecodeKVConfig:
    """The decode plugin's settings (``EngineConfig.rank_plugin_config``, as JSON)."""

    store_host: str
    store_port: int
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

    @property
    def address(self) -> StoreAddress:
        return StoreAddress(self.store_host, self.store_port)

    def transfer_config(self) -> TransferConfig:
        return TransferConfig(timeout_s=self.timeout_s, max_channels=self.max_channels,
                              part_bytes=self.part_bytes)


# ------------------------------------------------------------------------ messages

class Op(enum.IntEnum):
    EXPECT = 1
    STATUS = 2
    ABORT = 3
    STATS = 4


class State(enum.IntEnum):
    PENDING = 0
    DONE = 1
    FAILED = 2


_EXPECT = struct.Struct("<Bqqd")  # op, transfer_id, num_tokens, timeout_s; then int64 block ids
_STATUS = struct.Struct("<qBI")  # transfer_id, state, len(reason); then the UTF-8 reason
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


def encode_statuses(statuses: Sequence[TransferStatus]) -> bytes:
    parts = []
    for s in statuses:
        reason = s.reason.encode()
        parts.append(_STATUS.pack(s.transfer_id, s.state, len(reason)) + reason)
    return b"".join(parts)


def decode_statuses(raw: bytes) -> list[TransferStatus]:
    out, offset = [], 0
    while offset < len(raw):
        transfer_id, state, n = _STATUS.unpack_from(raw, offset)
        offset += _STATUS.size
        out.append(TransferStatus(transfer_id, State(state), raw[offset:offset + n].decode()))
        offset += n
    return out


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
    """One decode rank's receiver. Owns no block: it writes the blocks of an expected
    transfer until it reports the transfer's final state or ABORT returns."""

    def __init__(self, ctx: RankContext) -> None:
        self.ctx = ctx
        self.config = DecodeKVConfig.from_json(ctx.plugin_config)
        layout = KVLayout.from_engine_config(ctx.config, self.config.model_fingerprint)
        self.receiver = KVReceiver(layout, self.config.address, tp_rank=ctx.rank,
                                   tp_size=ctx.tp_size, device=ctx.kv_cache.device,
                                   config=self.config.transfer_config())

    def handle(self, request: bytes) -> bytes:
        op = Op(request[0])
        if op is Op.EXPECT:
            msg = Expect.decode(request)
            self.receiver.expect(msg.transfer_id, self.ctx.kv_cache, msg.block_ids,
                                 msg.num_tokens, msg.timeout_s)
            return b""
        if op is Op.STATUS:
            return encode_statuses([self._status(t) for t in _ints(request[1:])])
        if op is Op.ABORT:
            (transfer_id,) = struct.unpack("<q", request[1:])
            return b"\x01" if self.receiver.abort(transfer_id) else b"\x00"
        return RankStats(self.receiver.num_pending, self.receiver.num_open_channels,
                         self.receiver.config.max_channels).encode()

    def _status(self, transfer_id: int) -> TransferStatus:
        """Pending, or the final state (then the receiver has forgotten the transfer)."""
        try:
            if not self.receiver.done(transfer_id):
                return TransferStatus(transfer_id, State.PENDING)
            self.receiver.wait(transfer_id, timeout_s=0)
        except KeyError:
            return TransferStatus(transfer_id, State.FAILED, "unknown transfer")
        except TransferError as exc:
            return TransferStatus(transfer_id, State.FAILED, f"{type(exc).__name__}: {exc}")
        return TransferStatus(transfer_id, State.DONE)

    def step_hook(self, chunks: Sequence[ScheduledChunk], payload: bytes) -> None:
        return None

    def close(self) -> None:
        self.receiver.close()


def make(ctx: RankContext) -> DecodeKVPlugin:
    return DecodeKVPlugin(ctx)


# ------------------------------------------------------------------------ leader side

@dataclass(frozen=True)
class KVTarget:
    """Where the prefill side sends a reserved request's KV: the decode worker's
    rendezvous store, the transfer id, and the decode TP size (for information)."""

    transfer_id: int
    address: StoreAddress
    tp_size: int
    num_tokens: int


@dataclass(frozen=True)
class HandoffResult:
    request_id: str
    ok: bool
    reason: str = ""


@dataclass
class _Handoff:
    transfer_id: int
    states: list[State]
    reasons: list[str] = field(default_factory=list)
    arrived: bool = False


class DecodeHandoff:
    """Leader-side driver of a decode engine's receivers (same thread as the engine).

    Lifecycle of one request: ``reserve`` (blocks from the engine, EXPECT on every rank)
    → ``poll`` until it reports the request → ``admit`` (ok) or nothing to do (failed:
    the blocks were already freed). ``abort`` at any point before ``admit`` frees the
    blocks once no rank writes them any more.
    """

    def __init__(self, core: EngineCore) -> None:
        self.core = core
        self.config = DecodeKVConfig.from_json(core.config.rank_plugin_config)
        self.tp_size = core.config.parallel.tensor_parallel_size
        self._handoffs: dict[str, _Handoff] = {}

    def reserve(self, request_id: str, prompt_ids: Sequence[int], params: SamplingParams,
                transfer_id: int, timeout_s: float | None = None) -> KVTarget | None:
        """Reserve the prompt's blocks and announce the transfer on every rank; it fails
        (reported by ``poll``) unless complete ``timeout_s`` (default: the config's) from
        now. None when the blocks do not fit now (nothing held). Raises ``ValueError``
        for input that could never run, or ``RankCallError`` (then nothing is held)."""
        if any(h.transfer_id == transfer_id for h in self._handoffs.values()):
            raise ValueError(f"transfer id {transfer_id} is in use")
        block_ids = self.core.reserve_for_kv(request_id, prompt_ids, params)
        if block_ids is None:
            return None
        timeout = self.config.timeout_s if timeout_s is None else timeout_s
        msg = Expect(transfer_id, len(prompt_ids), timeout, tuple(block_ids))
        try:
            self.core.call_ranks(msg.encode())
        except BaseException:
            try:  # ranks that accepted the EXPECT let go before the blocks are freed
                self.core.call_ranks(abort_request(transfer_id))
            finally:
                self.core.abort_request(request_id)
            raise
        self._handoffs[request_id] = _Handoff(transfer_id, [State.PENDING] * self.tp_size)
        return KVTarget(transfer_id, self.config.address, self.tp_size, len(prompt_ids))

    def poll(self) -> list[HandoffResult]:
        """Requests whose transfer ended since the last poll. Ok: KV verified on every
        rank, ready to ``admit``. Failed: the blocks are already freed, the request is
        gone from the engine and never admitted."""
        waiting = {rid: h for rid, h in self._handoffs.items() if not h.arrived}
        if not waiting:
            return []
        ids = [h.transfer_id for h in waiting.values()]
        replies = [decode_statuses(r) for r in self.core.call_ranks(status_request(ids))]
        results = []
        for i, (rid, handoff) in enumerate(waiting.items()):
            for rank, statuses in enumerate(replies):
                if handoff.states[rank] is State.PENDING:
                    handoff.states[rank] = statuses[i].state
                    if statuses[i].reason:
                        handoff.reasons.append(f"rank {rank}: {statuses[i].reason}")
            result = self._settle(rid, handoff)
            if result is not None:
                results.append(result)
        return results

    def _settle(self, request_id: str, handoff: _Handoff) -> HandoffResult | None:
        if State.FAILED in handoff.states:
            self.abort(request_id)  # the other ranks stop writing before the blocks go
            return HandoffResult(request_id, False, "; ".join(handoff.reasons))
        if all(s is State.DONE for s in handoff.states):
            handoff.arrived = True
            return HandoffResult(request_id, True)
        return None

    def admit(self, request_id: str, first_token_id: int) -> RequestOutput:
        """Join the running batch with the prefill side's first token. Only for a
        request ``poll`` reported ok; the engine owns the blocks from here on."""
        handoff = self._handoffs.get(request_id)
        if handoff is None or not handoff.arrived:
            raise ValueError(f"request {request_id!r} has no arrived KV")
        del self._handoffs[request_id]
        return self.core.admit_with_kv(request_id, first_token_id)

    def abort(self, request_id: str) -> bool:
        """Stop the transfer on every rank, then free the blocks. False if unknown."""
        handoff = self._handoffs.pop(request_id, None)
        if handoff is None:
            return False
        self.core.call_ranks(abort_request(handoff.transfer_id))
        self.core.abort_request(request_id)
        return True

    @property
    def num_pending(self) -> int:
        return len(self._handoffs)

    def rank_stats(self) -> list[RankStats]:
        return [RankStats.decode(r) for r in self.core.call_ranks(bytes([Op.STATS]))]
