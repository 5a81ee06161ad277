"""The decode side of the KV handoff, leader side: ``DecodeHandoff`` drives the receivers
of every rank (``decode_worker.kv_plugin``) from the engine's thread.

Life of one request: ``reserve`` (blocks from the engine, EXPECT on every rank) → ``poll``
until every rank reports the transfer's final state → ok: the KV is verified on every
rank and rank 0 holds the transfer's ``Trailer`` (the prefill side's first token and
cached-token count), ready to ``admit``; failed: the blocks are already freed.

Block ownership: from ``reserve`` until ``admit`` (then the engine's) or until the
transfer failed or ``abort`` (then freed once no rank writes them any more).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

from decode_worker.kv_plugin import (
    DecodeKVConfig,
    Expect,
    Op,
    RankStats,
    State,
    abort_request,
    decode_address,
    decode_statuses,
    encode_address,
    status_request,
)
from engine.core import EngineCore, RequestOutput
from engine.distributed import StoreAddress
from engine.sampling_params import SamplingParams
from kvtransfer.protocol import Trailer


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
    """A transfer's end. Ok: ``trailer`` is what arrived with the KV."""

    request_id: str
    ok: bool
    reason: str = ""
    trailer: Trailer | None = None


@dataclass
class _Handoff:
    transfer_id: int
    states: list[State]
    reasons: list[str] = field(default_factory=list)
    trailer: Trailer | None = None
    arrived: bool = False


class DecodeHandoff:
    """Leader-side driver of a decode engine's receivers (same thread as the engine).

    Lifecycle of one request: ``reserve`` → ``poll`` until it reports the request →
    ``admit`` (ok) or nothing to do (failed: the blocks were already freed). ``abort`` at
    any point before ``admit`` frees the blocks once no rank writes them any more.

    Building it starts the other ranks' receivers on rank 0's store: ``address`` is the
    port that store actually bound.
    """

    def __init__(self, core: EngineCore) -> None:
        self.core = core
        self.config = DecodeKVConfig.from_json(core.config.rank_plugin_config)
        self.tp_size = core.config.parallel.tensor_parallel_size
        self.address = decode_address(core.call_ranks(bytes([Op.ADDRESS]))[0])
        core.call_ranks(bytes([Op.ATTACH]) + encode_address(self.address))
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
        return KVTarget(transfer_id, self.address, self.tp_size, len(prompt_ids))

    def poll(self) -> list[HandoffResult]:
        """Requests whose transfer ended since the last poll. Ok: KV verified on every
        rank and the trailer arrived, ready to ``admit``. Failed: the blocks are already
        freed, the request is gone from the engine and never admitted."""
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
                    if statuses[i].trailer is not None:
                        handoff.trailer = statuses[i].trailer
                    if statuses[i].reason:
                        handoff.reasons.append(f"rank {rank}: {statuses[i].reason}")
            result = self._settle(rid, handoff)
            if result is not None:
                results.append(result)
        return results

    def _settle(self, request_id: str, handoff: _Handoff) -> HandoffResult | None:
        if all(s is State.DONE for s in handoff.states):
            problem = self._check_trailer(handoff.trailer)
            if problem is None:
                handoff.arrived = True
                return HandoffResult(request_id, True, trailer=handoff.trailer)
            handoff.states[0] = State.FAILED
            handoff.reasons.append(f"rank 0: {problem}")
        if State.FAILED in handoff.states:
            self.abort(request_id)  # the other ranks stop writing before the blocks go
            return HandoffResult(request_id, False, "; ".join(handoff.reasons))
        return None

    def _check_trailer(self, trailer: Trailer | None) -> str | None:
        vocab_size = self.core.config.model.vocab_size
        if trailer is None:
            return "no trailer (first token) arrived with the KV"
        if not 0 <= trailer.first_token_id < vocab_size:
            return f"first token id {trailer.first_token_id} outside [0, {vocab_size})"
        return None

    def admit(self, request_id: str) -> RequestOutput:
        """Join the running batch with the first token that arrived with the KV. Only for
        a request ``poll`` reported ok; the engine owns the blocks from here on."""
        handoff = self._handoffs.get(request_id)
        if handoff is None or not handoff.arrived or handoff.trailer is None:
            raise ValueError(f"request {request_id!r} has no arrived KV")
        del self._handoffs[request_id]
        return self.core.admit_with_kv(request_id, handoff.trailer.first_token_id,
                                       handoff.trailer.num_cached_tokens)

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
