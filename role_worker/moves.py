"""Planned moves on a worker's engine loop: a decode worker that drains (or is switched to
prefill and asked to) hands its decoding requests' KV to other decode workers instead of
their streams being replayed (the words and the router's part: ``cluster.moves``).

``OfferMoves`` parks every decoding request whose stream is open (``engine.core.parking``:
out of the batch, blocks kept; a drain also stops the loop taking new work) and ends its
Generate stream with the move offer, after every token it produced. A parked request
waits at most ``wait_s`` for the router's ``Submit`` naming it (``moved_from``); then it
is freed. That Submit must carry exactly the request's tokens; its KV is then sent like a
prefill's (``worker.kv.sending.KVSendLeader.move``) and the Submit's stream gets the
``PrefillDone`` — from here on it is a held prefill under the parked request's engine id,
which the Submit's attempt id names too (an Abort of the new attempt reaches it). The
Abort that the old attempt's ended stream posts (``Abort.call_ended``) leaves a parked or
moving request alone; any other Abort of the old attempt (the router's, when it does not
take the offer) frees it, as does the end of its wait. ``MovesPending`` counts what is
parked or still sending, for the drain to wait on.
"""

from __future__ import annotations

import logging
import time

import grpc

from cluster.moves import MOVE_OFFER
from decode_worker.engine_loop import DecodeLoop, Phase
from engine.core.parking import park
from prefill_worker.engine_loop import PrefillLoop, Submit
from worker.commands import Abort, Command, MovesPending, OfferMoves, WorkerError

log = logging.getLogger(__name__)


class MovingLoop(PrefillLoop, DecodeLoop):
    """The prefill and decode sides with planned moves between them (module docstring)."""

    def init_moves(self) -> None:
        self._parked: dict[str, float] = {}  # engine request id -> monotonic deadline
        self._moving: dict[str, str] = {}  # the move's attempt id -> the engine request id

    def _handle(self, command: Command) -> object:
        if isinstance(command, Abort) and command.call_ended and (
                command.attempt_id in self._parked or command.attempt_id in self._moving.values()):
            return False  # its stream's call ended; the offer, or the move, stands
        return super()._handle(command)

    def _handle_own(self, command: Command) -> object:
        if isinstance(command, Submit) and command.moved_from:
            self._move(command)
            return None
        if isinstance(command, OfferMoves):
            return self._offer(command.wait_s, command.draining)
        if isinstance(command, MovesPending):
            return len(self._parked) + sum(1 for rid in self._moving.values() if rid in self._held) \
                + (len(self._live) if self.draining else 0)
        return super()._handle_own(command)

    def _offer(self, wait_s: float, draining: bool) -> int:
        self.draining = self.draining or draining
        deadline = time.monotonic() + wait_s
        offered = 0
        for rid, live in list(self._live.items()):
            if live.phase is not Phase.RUNNING or live.stream is None \
                    or not park(self.core.scheduler, rid):
                continue
            del self._live[rid]
            self.timings.forget(rid)
            live.stream.fail(grpc.StatusCode.UNAVAILABLE, MOVE_OFFER)
            self._parked[rid] = deadline
            offered += 1
        if offered:
            log.info("%s: %d decoding requests parked, their KV offered to move",
                     "draining" if draining else f"switched to {self.role}", offered)
        return offered

    def _move(self, cmd: Submit) -> None:
        rid = cmd.moved_from
        if rid not in self._parked:
            raise WorkerError(grpc.StatusCode.FAILED_PRECONDITION,
                              f"no request {rid!r} is parked here to move")
        if cmd.attempt_id in self._moving or cmd.attempt_id in self._held:
            raise WorkerError(grpc.StatusCode.ALREADY_EXISTS,
                              f"request {cmd.attempt_id!r} is already being moved")
        request = self.core.scheduler.parked[rid]
        if request.all_token_ids != list(cmd.prompt_token_ids):  # the router replays it
            del self._parked[rid]
            self.core.abort_request(rid)
            raise WorkerError(grpc.StatusCode.FAILED_PRECONDITION,
                              f"the parked request {rid!r} has {request.num_tokens} tokens, "
                              f"not the {len(cmd.prompt_token_ids)} asked to move")
        try:
            self.sending.move(rid, cmd.transfer_id, cmd.dest,
                              num_skipped_blocks=cmd.num_skipped_blocks)
        except ValueError as exc:
            raise WorkerError(grpc.StatusCode.INVALID_ARGUMENT, str(exc)) from None
        del self._parked[rid]
        self._moving[cmd.attempt_id] = rid
        self.named(rid, cmd.client_request_id)
        self.hold(rid, cmd.stream, cmd.transfer_id)
        log.info("moving its KV as attempt %s", cmd.attempt_id, extra=self.log_extra(rid))

    def _abort(self, attempt_id: str, code: grpc.StatusCode, reason: str) -> bool:
        if attempt_id in self._parked:
            del self._parked[attempt_id]
            return self.core.abort_request(attempt_id)
        rid = self._moving.pop(attempt_id, None)
        return super()._abort(attempt_id if rid is None else rid, code, reason)

    def _live_ids(self) -> list[str]:
        return list(self._parked) + super()._live_ids()

    def _computed_prompt(self, request_id: str) -> bool:
        return request_id not in self._moving.values()  # a move computes no prompt

    def _is_polling(self) -> bool:
        return bool(self._parked) or super()._is_polling()

    def _poll(self) -> None:
        now = time.monotonic()
        for rid in [r for r, deadline in self._parked.items() if deadline < now]:
            log.warning("a parked request's move was not asked for in time: freed",
                        extra=self.log_extra(rid))
            del self._parked[rid]
            self.core.abort_request(rid)
        super()._poll()
        for attempt_id, rid in list(self._moving.items()):
            if rid not in self._held:  # reported (or aborted): the move is over
                del self._moving[attempt_id]
