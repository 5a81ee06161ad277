"""The sending side of a worker's KV plane, on the leader: ``KVSendLeader`` drives the
sender of every rank (``worker.kv.rank.SendSide``) from the engine's thread, never waiting
on the network, so the engine keeps stepping while transfers are in flight.

Life of one request: ``submit`` (a prefill-only request with a send order) → the step
holding its last prompt chunk sends its KV layer by layer and samples the first token →
``finish(output)`` (FINISH on every rank: rank 0 queues the ``Trailer`` — first token and
cached-token count — behind the layers) → ``poll`` until every rank reports the
transfer acknowledged (or failed, or the deadline passed) → the blocks are unpinned and
``poll`` returns the ``SendOutcome``. ``abort`` at any point instead.

A planned move (``move``) sends a parked decoding request's KV the same way
(``engine.core.parking``): its next step computes its last token and samples the one after
it, the "first token" of the trailer; from there on it is a submitted request like any
other.

Block ownership: pinned from the request's last step until its outcome or ``abort``;
unpinned (left in the prefix cache) only once no rank reads them any more.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass, field

from engine.core.engine_core import EngineCore, RequestOutput
from engine.core.parking import unpark_to_send
from engine.core.scheduler import SchedulerOutput
from engine.sampling_params import SamplingParams
from engine.tp.distributed import StoreAddress
from kvtransfer.wire.protocol import Trailer
from worker.kv.messages import Direction, SendOrder, abort_request, encode_orders, finish_request
from worker.kv.reports import RankStates, poll_transfers


@dataclass(frozen=True)
class SendOutcome:
    """A finished send: whether the KV and the trailer reached every receiving rank,
    verified. Its blocks are already unpinned."""

    request_id: str
    transfer_id: int
    trailer: Trailer | None  # None when the prefill produced no token
    num_prompt_tokens: int
    ok: bool
    reason: str = ""
    seconds: float | None = None  # from the last layer computed to the outcome
    scheduled_at: float | None = None  # monotonic: its first prompt chunk was scheduled
    computed_at: float | None = None  # monotonic: the step with its last layer ended


@dataclass
class _Order:
    transfer_id: int
    dest: StoreAddress
    num_skipped_blocks: int = 0  # leading blocks the receiver holds: not sent
    started: bool = False
    scheduled_at: float | None = None  # monotonic, its first chunk's step
    # set by finish(): the request's output, and when the leader gives up waiting
    output: RequestOutput | None = None
    trailer: Trailer | None = None
    deadline: float = 0.0
    ranks: RankStates | None = None
    reasons: list[str] = field(default_factory=list)


class KVSendLeader:
    """Leader-side driver of an engine's senders (same thread as the engine).

    Lifecycle: ``submit`` → step the engine → for the request's finished output,
    ``finish`` → ``poll`` (every loop round) until it returns the request's outcome.
    ``abort`` at any point instead. ``wait_timeout_s`` bounds how long a finished
    request's blocks stay pinned unacknowledged. Installs itself as ``core.step_payload``.
    """

    def __init__(self, core: EngineCore, wait_timeout_s: float) -> None:
        self.core = core
        self.wait_timeout_s = wait_timeout_s
        self.tp_size = core.config.parallel.tensor_parallel_size
        self._orders: dict[str, _Order] = {}
        self._num_failed = 0
        core.step_payload = self.step_payload

    def submit(self, request_id: str, prompt_ids: Sequence[int], params: SamplingParams,
               transfer_id: int, dest: StoreAddress, *, num_resumed_tokens: int = 0,
               num_skipped_blocks: int = 0) -> None:
        """Queue a prefill-only request whose KV goes to the receiving worker's store ``dest``
        (``num_resumed_tokens``: as for ``EngineCore.add_request``), all but its first
        ``num_skipped_blocks`` blocks (the receiver holds those; ``ValueError`` unless the
        last prompt token's block is still sent)."""
        block_size = self.core.config.cache.block_size
        if not 0 <= num_skipped_blocks * block_size < len(prompt_ids):
            raise ValueError(f"{num_skipped_blocks} cached blocks of {block_size} tokens on "
                             f"the receiver leave nothing of a {len(prompt_ids)}-token prompt "
                             "to send")
        self.core.add_request(request_id, prompt_ids, params, prefill_only=True,
                              num_resumed_tokens=num_resumed_tokens)
        self._orders[request_id] = _Order(transfer_id, dest, num_skipped_blocks)

    def move(self, request_id: str, transfer_id: int, dest: StoreAddress, *,
             num_skipped_blocks: int = 0) -> None:
        """Send the KV of the parked request ``request_id`` (all but its first
        ``num_skipped_blocks`` blocks) to ``dest`` with its next token as the trailer, then
        end it (see the module docstring). ``KeyError`` if it is not parked, ``ValueError``
        (it stays parked) when the skipped blocks leave nothing to send."""
        request = self.core.scheduler.parked[request_id]
        block_size = self.core.config.cache.block_size
        if not 0 <= num_skipped_blocks * block_size < request.num_tokens:
            raise ValueError(f"{num_skipped_blocks} cached blocks of {block_size} tokens on "
                             f"the receiver leave nothing of {request.num_tokens} tokens to send")
        unpark_to_send(self.core.scheduler, request_id)
        self._orders[request_id] = _Order(transfer_id, dest, num_skipped_blocks)

    def step_payload(self, out: SchedulerOutput) -> bytes:
        """The ``SendOrder``s of this step (installed as ``core.step_payload``)."""
        orders = []
        now = time.monotonic()
        for index, chunk in enumerate(out.chunks):
            order = self._orders.get(chunk.request_id)
            if order is not None and order.scheduled_at is None:
                order.scheduled_at = now
            if order is not None and chunk.sample and not order.started:
                order.started = True
                orders.append(SendOrder(index, order.transfer_id, order.dest,
                                        order.num_skipped_blocks))
        return encode_orders(orders)

    def finish(self, output: RequestOutput) -> SendOutcome | None:
        """For a submitted request's finished output: send its trailer (first token and
        cached-token count) behind its KV. None: ``poll`` reports the outcome later; an
        outcome here means the send failed at once (its blocks are unpinned)."""
        order = self._orders.get(output.request_id)
        if not output.finished or order is None or order.output is not None:
            raise ValueError(f"{output.request_id!r} is not a finished submitted request")
        order.output = output
        order.deadline = time.monotonic() + self.wait_timeout_s
        order.ranks = RankStates(self.tp_size)
        if not output.new_token_ids:
            order.reasons.append("the prefill produced no token")
            return self._settle(output.request_id, order, failed=True)
        order.trailer = Trailer(output.new_token_ids[0], output.num_cached_tokens)
        self.core.call_ranks(finish_request(order.transfer_id, order.trailer))
        return None

    def poll(self) -> list[SendOutcome]:
        """Outcomes of the finished requests whose transfer ended (acknowledged by every
        receiving rank, failed, or past the deadline) since the last poll."""
        sending = {rid: o for rid, o in self._orders.items() if o.ranks is not None}
        reports = poll_transfers(self.core.call_ranks, Direction.SEND,
                                 [o.transfer_id for o in sending.values()])
        now, outcomes = time.monotonic(), []
        for (rid, order), statuses in zip(sending.items(), reports, strict=True):
            ranks = order.ranks
            assert ranks is not None
            ranks.update(statuses)
            failed = ranks.failed
            if not failed and not ranks.done and now > order.deadline:
                order.reasons.append(f"not acknowledged within {self.wait_timeout_s:.1f}s")
                failed = True
            if failed or ranks.done:
                outcomes.append(self._settle(rid, order, failed))
        return outcomes

    def _settle(self, request_id: str, order: _Order, failed: bool) -> SendOutcome:
        """End the send: stop every rank (if it failed), unpin, report."""
        del self._orders[request_id]
        if failed:  # ranks that finished already ignore the abort
            self._num_failed += 1
            self.core.call_ranks(abort_request(Direction.SEND, order.transfer_id))
        self.core.release_pinned(request_id)
        assert order.output is not None
        reasons = (order.ranks.reasons if order.ranks is not None else []) + order.reasons
        computed_at = order.deadline - self.wait_timeout_s
        return SendOutcome(request_id, order.transfer_id, order.trailer,
                           order.output.num_prompt_tokens, not failed, "; ".join(reasons),
                           time.monotonic() - computed_at, order.scheduled_at, computed_at)

    def abort(self, request_id: str) -> bool:
        """Stop the request wherever it is; its blocks are freed or unpinned once no rank
        reads them. False if unknown."""
        order = self._orders.pop(request_id, None)
        if order is None:
            return False
        self.core.abort_request(request_id)
        if order.started:
            self.core.call_ranks(abort_request(Direction.SEND, order.transfer_id))
        self.core.release_pinned(request_id)
        return True

    @property
    def num_pending(self) -> int:
        """Requests submitted and not yet reported by ``poll`` (or aborted)."""
        return len(self._orders)

    @property
    def num_sending(self) -> int:
        """Finished requests whose transfer ``poll`` has not reported yet."""
        return sum(1 for o in self._orders.values() if o.ranks is not None)

    @property
    def num_failed(self) -> int:
        """Transfers that failed since the start."""
        return self._num_failed
