"""``Attempt``: one try at serving a request on workers, and ``AttemptIds``, the one place
attempt ids are minted.

An attempt is a Reserve (or a local prefill) and everything that follows it: the Prefill
(which may go out ahead of the Reserve's reply, ``send_ahead``), the Generate stream, the
Aborts. It has its own id — never the client's request id, which
clients may reuse — and every worker call names it, so nothing sent for one attempt (a
late or timed-out Abort, a late end of a call) can touch another. It has a lease in Redis
(``cluster.leases``), opened when the attempt is made, before any worker is asked to hold
anything, naming the workers asked; a worker that holds something for an attempt whose
lease is gone (its router died) frees it within the lease's TTL.

States (``AttemptState``), each transition a method here::

    RESERVING --reserved()--> PLACED --streaming()--> STREAMING --finished()--> FINISHED
         \\________________________\\________________________\\______ end() ______ ENDED

Ownership: the workers own their blocks. ``end()`` — however the attempt ends, once —
cancels its calls (a Prefill sent ahead first) and, unless it FINISHED (then the decode
worker freed everything and the prefill worker unpins on the decode side's
acknowledgement), sends ``Abort`` to the
decode worker (unless ``abort_decode_now`` already did) and to the prefill worker while
a Prefill call of it is unanswered, from background tasks, so cleanup happens even while
the request's task is being cancelled; then it closes the lease.
"""

from __future__ import annotations

import asyncio
import enum
import itertools
from collections.abc import Callable, Coroutine
from typing import Any

import grpc

from cluster.kv_target import KVTarget
from router.lifecycle.context import RequestContext
from router.worker_calls import Prefilled


class AttemptIds:
    """Mints attempt ids: ``{router_id}-{n}``, ``n`` counting from 1 in this router process;
    ``router_id`` is random per process (``cluster.leases.new_router_id``), so ids are
    unique across routers too."""

    def __init__(self, router_id: str) -> None:
        self.router_id = router_id
        self._numbers = itertools.count(1)

    def new(self) -> str:
        return f"{self.router_id}-{next(self._numbers)}"


class AttemptState(enum.Enum):
    RESERVING = "reserving"  # its Reserve is under way (the decode worker may hold blocks)
    PLACED = "placed"  # the decode worker holds its reservation, or prefills it locally
    STREAMING = "streaming"  # its chunks are being relayed to the client
    FINISHED = "finished"  # its stream ended with a finish reason: the workers freed all
    ENDED = "ended"  # released: calls cancelled, Aborts sent, lease closed


class Attempt:
    """One attempt of the request of ``ctx`` on decode worker ``decode_id`` (see the module
    docstring). ``transfer_id`` is 0 and ``local`` True when it prefills there."""

    def __init__(self, ctx: RequestContext, attempt_id: str, decode_id: str, *,
                 transfer_id: int = 0, local: bool = False) -> None:
        self.ctx = ctx
        self.id = attempt_id
        self.decode_id = decode_id
        self.transfer_id = transfer_id
        self.local = local
        self.target: KVTarget | None = None  # where its KV goes, once reserved
        self.prefill_id: str | None = None  # the prefill worker of its unanswered Prefill
        self.ahead: asyncio.Future[Prefilled] | None = None  # its Prefill, if sent ahead
        self._answered = asyncio.Event()  # its Reserve was answered, or it ended
        self.state = AttemptState.PLACED if local else AttemptState.RESERVING
        self.lease = ctx.leases.open(attempt_id, ctx.client_request_id)
        self._calls: list[grpc.aio.Call] = []
        self._decode_aborted = False
        self.hold(decode_id)

    # ----------------------------------------------------------------- transitions

    def send_ahead(self, target: KVTarget,
                   prefill: Callable[[Attempt], Coroutine[Any, Any, Prefilled]]) -> None:
        """Its Prefill goes out now, naming ``target``, ahead of its Reserve's reply (which
        reserves that very target, or refuses); ``ahead`` is that Prefill's task."""
        self.target = target
        self.ahead = asyncio.ensure_future(prefill(self))
        self.ahead.add_done_callback(_retrieve)

    def reserved(self, target: KVTarget) -> None:
        """The decode worker holds its reservation: the KV goes to ``target``."""
        self.target = target
        self.state = AttemptState.PLACED
        self._answered.set()

    async def reservation_known(self) -> None:
        """Until its Reserve was answered with a reservation (at once if it was, or it
        prefills locally). Ended meanwhile (refused), a Prefill sent ahead is cancelled
        here: its KV was refused, no worker failed."""
        if self.state is AttemptState.RESERVING:
            await self._answered.wait()

    def streaming(self) -> None:
        if self.state is AttemptState.PLACED:
            self.state = AttemptState.STREAMING

    def finished(self) -> None:
        """Its stream ended with a finish reason: the workers hold nothing for it."""
        if self.state is not AttemptState.ENDED:
            self.state = AttemptState.FINISHED

    @property
    def is_finished(self) -> bool:
        return self.state is AttemptState.FINISHED

    # ----------------------------------------------------------------- what it holds

    def hold(self, worker_id: str) -> None:
        """``worker_id`` is about to be asked to hold something for it (named in its lease)."""
        self.ctx.leases.hold(self.lease, worker_id)

    def track(self, call: grpc.aio.Call) -> None:
        """A worker call of it: cancelled when it ends."""
        self._calls.append(call)

    def prefill_started(self, prefill_id: str) -> None:
        self.hold(prefill_id)
        self.prefill_id = prefill_id

    def decode_holds_nothing(self) -> None:
        """The decode worker holds nothing of it (it refused, or never got the call): no
        Abort goes there."""
        self._decode_aborted = True

    def prefill_released(self) -> None:
        """Its Prefill returned, or was refused: the prefill worker holds nothing to abort."""
        self.prefill_id = None

    # ----------------------------------------------------------------- ending

    async def abort_decode_now(self) -> None:
        """Cancels its calls and waits (bounded) for the decode worker's Abort, so that the
        next attempt finds the blocks free. If the request's task is cancelled meanwhile,
        ``end()`` sends the Abort again in the background."""
        self._cancel_ahead()
        self._cancel_calls()
        call = self.ctx.calls.start_abort(self.decode_id, "decode", self.id)
        if call is not None:
            await self._await_abort(call, self.decode_id)
        self._decode_aborted = True

    def end(self) -> None:
        """Releases everything it holds (see the module docstring); idempotent."""
        if self.state is AttemptState.ENDED:
            return
        finished = self.state is AttemptState.FINISHED
        self.state = AttemptState.ENDED
        self._answered.set()
        self._cancel_ahead()
        self._cancel_calls()
        if not finished:
            if not self._decode_aborted:
                self._abort_later(self.decode_id, "decode")
            if self.prefill_id is not None:
                self._abort_later(self.prefill_id, "prefill")
        self.ctx.leases.close(self.lease)

    def _cancel_ahead(self) -> None:
        """Cancel a Prefill sent ahead that is still under way: the task first, so that its
        call's cancellation reads as ours, not as a hung worker's."""
        if self.ahead is not None and not self.ahead.done():
            self.ahead.cancel()

    def _cancel_calls(self) -> None:
        for call in self._calls:
            call.cancel()

    def _abort_later(self, worker_id: str, role: str) -> None:
        """Abort the attempt on the worker in the background (should the Abort not reach
        it, the worker frees the attempt once its lease is gone)."""
        call = self.ctx.calls.start_abort(worker_id, role, self.id)
        if call is not None:
            self.ctx.background(asyncio.ensure_future(self._await_abort(call, worker_id)))

    async def _await_abort(self, call: grpc.aio.UnaryUnaryCall, worker_id: str) -> object:
        try:
            return await call
        except grpc.aio.AioRpcError as exc:
            self.ctx.log.warning("abort of %s on %s failed: %s %s", self.id, worker_id,
                                 exc.code().name, exc.details())
            return None


def _retrieve(task: asyncio.Future[Prefilled]) -> None:
    """A Prefill sent ahead whose attempt ended before reading it: its failure was dealt
    with (the attempt ended), so it is not reported again as never retrieved."""
    if not task.cancelled():
        task.exception()
