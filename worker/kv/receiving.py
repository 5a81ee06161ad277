"""The receiving side of a worker's KV plane, on the leader: ``KVReceiveLeader`` drives the
receiver of every rank (``worker.kv.rank.ReceiveSide``) from the engine's thread. It owns
each transfer (its id and what every rank reported) from ``expect`` until ``poll``
reports how it ended; the request around it — its blocks, whether its KV arrived, its
admission — is the engine loop's (``decode_worker.engine_loop``).

Life of one transfer: ``expect`` (EXPECT on every rank: they may write its blocks) →
``poll`` until every rank reported a final state → ``Arrival``: ok (the KV is verified on
every rank and rank 0 holds the trailer: the prefill side's first token and cached-token
count) or failed (no rank writes the blocks any more; the caller frees them). ``abort``
at any point before: returns once no rank writes the blocks.
"""

from __future__ import annotations

import time
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass, field

from cluster.kv_target import KVTarget
from engine.core.engine_core import EngineCore
from kvtransfer.wire.protocol import Trailer
from worker.kv.messages import (
    Direction,
    Expect,
    abort_request,
    address_request,
    attach_request,
    decode_address,
)
from worker.kv.reports import RankStates, poll_transfers

MAX_REFUSED_REMEMBERED = 4096  # refused transfer ids a leader names as such when reused


@dataclass(frozen=True)
class Arrival:
    """How a request's transfer ended. Ok: ``trailer`` is what arrived with the KV."""

    request_id: str
    ok: bool
    reason: str = ""
    trailer: Trailer | None = None
    seconds: float | None = None  # from ``expect`` to its end


@dataclass
class _Transfer:
    transfer_id: int
    ranks: RankStates
    expected_at: float = field(default_factory=time.monotonic)


class KVReceiveLeader:
    """Leader-side driver of an engine's receivers (same thread as the engine).

    Building it starts rank 0's rendezvous store and the other ranks' receivers on it:
    ``address`` is the port that store actually bound. ``timeout_s`` is a transfer's
    default time to complete.
    """

    def __init__(self, core: EngineCore, timeout_s: float) -> None:
        self.core = core
        self.timeout_s = timeout_s
        self.tp_size = core.config.parallel.tensor_parallel_size
        self.address = decode_address(core.call_ranks(address_request())[0])
        core.call_ranks(attach_request(self.address))
        self._transfers: dict[str, _Transfer] = {}  # request id -> its pending transfer
        self._num_failed = 0
        self._refused: OrderedDict[int, None] = OrderedDict()  # the latest refused ids

    def expect(self, request_id: str, transfer_id: int, num_tokens: int,
               block_ids: Sequence[int], timeout_s: float | None = None,
               start_timeout_s: float | None = None) -> KVTarget:
        """Announce the request's transfer on every rank: its ``num_tokens`` tokens of KV
        go into ``block_ids``; it fails (reported by ``poll``) unless its first part
        arrives within ``start_timeout_s`` (default: ``timeout_s``) and it completes
        within ``timeout_s`` (default: the config's) of that. Raises ``ValueError`` for a
        transfer id in use, or ``RankCallError`` (then no rank writes the blocks)."""
        if any(t.transfer_id == transfer_id for t in self._transfers.values()):
            raise ValueError(f"transfer id {transfer_id} is in use")
        if transfer_id in self._refused:
            raise ValueError(f"transfer id {transfer_id} was refused here before")
        timeout = self.timeout_s if timeout_s is None else timeout_s
        start = timeout if start_timeout_s is None else start_timeout_s
        try:
            self.core.call_ranks(Expect(transfer_id, num_tokens, timeout, start,
                                        tuple(block_ids)).encode())
        except BaseException:  # ranks that accepted the EXPECT let go before the caller frees
            self.core.call_ranks(abort_request(Direction.RECEIVE, transfer_id))
            raise
        self._transfers[request_id] = _Transfer(transfer_id, RankStates(self.tp_size))
        return self.target(transfer_id)

    def target(self, transfer_id: int) -> KVTarget:
        """Where the sending side sends the KV of ``transfer_id``."""
        return KVTarget(transfer_id, f"{self.address.host}:{self.address.port}", self.tp_size)

    def transfer_id(self, request_id: str) -> int | None:
        """The request's pending transfer, if any."""
        transfer = self._transfers.get(request_id)
        return None if transfer is None else transfer.transfer_id

    def poll(self) -> list[Arrival]:
        """The requests whose transfer ended since the last poll (forgotten here). Ok: KV
        verified on every rank and the trailer arrived. Failed: no rank writes the blocks
        any more."""
        reports = poll_transfers(self.core.call_ranks, Direction.RECEIVE,
                                 [t.transfer_id for t in self._transfers.values()])
        arrivals = []
        for (rid, transfer), statuses in zip(list(self._transfers.items()), reports, strict=True):
            transfer.ranks.update(statuses)
            arrival = self._settle(rid, transfer)
            if arrival is not None:
                arrivals.append(arrival)
        return arrivals

    def _settle(self, request_id: str, transfer: _Transfer) -> Arrival | None:
        ranks = transfer.ranks
        if ranks.done:
            problem = self._check_trailer(request_id, ranks)
            if problem is None:
                del self._transfers[request_id]
                return Arrival(request_id, True, trailer=ranks.trailer,
                               seconds=time.monotonic() - transfer.expected_at)
            ranks.fail(f"rank 0: {problem}")
        if ranks.failed:
            self._num_failed += 1
            self.abort(request_id)  # the other ranks stop writing before the blocks go
            return Arrival(request_id, False, ranks.reason,
                           seconds=time.monotonic() - transfer.expected_at)
        return None

    def _check_trailer(self, request_id: str, ranks: RankStates) -> str | None:
        vocab_size = self.core.config.model.vocab_size
        if ranks.trailer is None:
            return "no trailer (first token) arrived with the KV"
        if not 0 <= ranks.trailer.first_token_id < vocab_size:
            return f"first token id {ranks.trailer.first_token_id} outside [0, {vocab_size})"
        request = self.core.scheduler.reserved.get(request_id)
        if request is not None and ranks.trailer.num_cached_tokens > request.num_prompt_tokens:
            return (f"{ranks.trailer.num_cached_tokens} cached tokens for a prompt of "
                    f"{request.num_prompt_tokens}")
        return None

    def abort(self, request_id: str) -> bool:
        """Stop the request's transfer on every rank; returns once no rank writes its
        blocks. False if it has none pending."""
        transfer = self._transfers.pop(request_id, None)
        if transfer is None:
            return False
        self.core.call_ranks(abort_request(Direction.RECEIVE, transfer.transfer_id))
        return True

    def refuse(self, transfer_id: int) -> None:
        """Refuse a transfer this worker did not take (a refused Reserve whose Prefill went
        out ahead of it): every rank ignores its parts, those that came early at once. A
        transfer id pending here (another request's) is left alone."""
        if any(t.transfer_id == transfer_id for t in self._transfers.values()):
            return
        self._refused[transfer_id] = None
        while len(self._refused) > MAX_REFUSED_REMEMBERED:
            self._refused.popitem(last=False)
        self.core.call_ranks(abort_request(Direction.RECEIVE, transfer_id))

    @property
    def num_pending(self) -> int:
        return len(self._transfers)

    @property
    def num_failed(self) -> int:
        """Transfers that failed since the start."""
        return self._num_failed
