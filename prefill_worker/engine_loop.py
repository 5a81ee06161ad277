"""The prefill worker's engine loop: the one thread that drives the prefill ``EngineCore``
and the sending side of its KV plane (``worker.kv.sending.KVSendLeader``).

Life of one request here: ``Submit`` (queued as a prefill-only request with a send order
to the decode store) → the engine prefills it in chunks with others (continuous
batching); the step that samples its first token sends its KV layer by layer → the loop
calls ``KVSendLeader.finish`` (the first token and cached-token count follow the KV as
its trailer) and steps on → between steps (or every ``IDLE_POLL_S`` when idle) it polls
the transfers; once every decode rank acknowledged this one, the blocks are unpinned into
the prefix cache and the request's ``OutputStream`` gets one ``PrefillDone``. ``Abort``
at any point stops the send, unpins or frees the blocks and fails the stream with
ABORTED. A request whose deadline passes before any of its prompt was computed is dropped
with DEADLINE_EXCEEDED (counted in ``num_expired``); past ``max_requests`` held at once
``Submit`` is refused as busy (RESOURCE_EXHAUSTED). ``AbortAll`` and ``Info`` are
``worker.loop``'s.

Known limit: the first request to a decode worker this process has not sent to before
reads its advertised layout inside the step (bounded by the transfer timeout).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence
from dataclasses import dataclass

import grpc

from cluster import pause_points
from cluster.prefill_queue import queue_refusal
from engine.core.engine_core import RequestOutput
from engine.core.request import RequestStatus
from engine.sampling_params import SamplingParams, TokenLogprobs
from engine.tp.distributed import StoreAddress
from worker.commands import Command, WorkerError
from worker.kv.sending import SendOutcome
from worker.loop import EngineLoop
from worker.streams import OutputStream

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class PrefillTimes:
    """Seconds of one request here: received → first chunk scheduled (queue) → its last
    layer computed (compute) → every decode rank acknowledged (transfer)."""

    queue_s: float
    compute_s: float
    transfer_s: float


@dataclass(frozen=True)
class PrefillDone:
    """The request's KV and trailer reached every decode rank, verified."""

    first_token_id: int
    num_cached_tokens: int
    num_prompt_tokens: int
    times: PrefillTimes | None = None
    first_token_logprobs: TokenLogprobs | None = None  # when the request asked for them
    prompt_logprobs: tuple[TokenLogprobs, ...] = ()  # prompt tokens 1.., when asked for


@dataclass(frozen=True)
class Submit(Command[None]):
    """Queue a prefill whose KV goes to ``dest``; ``stream`` gets one ``PrefillDone``.
    ``deadline`` (monotonic; None: none): dropped unless its prefill started by then."""

    attempt_id: str
    prompt_token_ids: Sequence[int]
    params: SamplingParams
    transfer_id: int
    dest: StoreAddress
    stream: OutputStream[PrefillDone]
    deadline: float | None = None
    client_request_id: str = ""  # for logs
    num_resumed_tokens: int = 0  # output already streamed, ending the prompt (a migration)
    num_skipped_blocks: int = 0  # leading prompt blocks the receiver holds: not sent
    # a planned move: the parked request (attempt id) whose KV goes, not a prefill
    # (``role_worker.moves``); the prompt must be its tokens
    moved_from: str = ""
    # refused (RESOURCE_EXHAUSTED, ``cluster.prefill_queue``) while more prompt tokens
    # than this wait here (``PrefillLoop.queued_prompt_tokens``); 0: never
    max_queued_tokens: int = 0


@dataclass
class _Held:
    stream: OutputStream[PrefillDone]
    deadline: float | None
    transfer_id: int
    received_at: float = 0.0  # monotonic
    started: bool = False  # its prompt's first chunk was computed (pause point)
    first_token_logprobs: TokenLogprobs | None = None
    prompt_logprobs: tuple[TokenLogprobs, ...] = ()


class PrefillLoop(EngineLoop):
    """The prefill side of a worker's engine loop (``role_worker.engine_loop.WorkerLoop``
    combines it with the decode side); a finished request's blocks stay pinned
    unacknowledged at most the transfer timeout."""

    ROLE = "prefill"

    def init_prefill(self, max_requests: int) -> None:
        """The prefill side's own state (the worker's loop, ``role_worker``, calls it
        after ``EngineLoop.__init__``)."""
        self.sending = self.kv.sending
        self.max_prefills = max_requests
        self._held: dict[str, _Held] = {}

    def _handle_own(self, command: Command) -> object:
        if isinstance(command, Submit):
            self._submit(command)
            return None
        return super()._handle_own(command)

    def _submit(self, cmd: Submit) -> None:
        self.refuse_unless("prefill", "new prefills")
        if cmd.attempt_id in self._held:
            raise WorkerError(grpc.StatusCode.ALREADY_EXISTS,
                              f"request {cmd.attempt_id!r} is already being prefilled")
        # before the busy check: a queue refusal sends the request to its decode worker
        if cmd.max_queued_tokens and (queued := self.queued_prompt_tokens()) \
                > cmd.max_queued_tokens:
            raise WorkerError(grpc.StatusCode.RESOURCE_EXHAUSTED,
                              queue_refusal(queued, cmd.max_queued_tokens))
        if len(self._held) >= self.max_prefills:
            raise WorkerError(grpc.StatusCode.RESOURCE_EXHAUSTED,
                              f"busy: {len(self._held)} requests held, the worker's limit "
                              "(--max-requests)")
        try:
            self.sending.submit(cmd.attempt_id, cmd.prompt_token_ids, cmd.params, cmd.transfer_id,
                                cmd.dest, num_resumed_tokens=cmd.num_resumed_tokens,
                                num_skipped_blocks=cmd.num_skipped_blocks)
        except ValueError as exc:
            raise WorkerError(grpc.StatusCode.INVALID_ARGUMENT, str(exc)) from None
        self.named(cmd.attempt_id, cmd.client_request_id)
        self.hold(cmd.attempt_id, cmd.stream, cmd.transfer_id, cmd.deadline)

    def queued_prompt_tokens(self) -> int:
        """The prompt tokens this worker has yet to compute for the prefills it holds:
        each one's prompt (a resumed one's output included) less what it computed, or
        (not started, or preempted) less its prefix in the prefix cache now (all of them:
        a refusal says how many, ``cluster.prefill_queue.refused_queue``). Decode work it
        still finishes after a switch to prefill is not counted."""
        scheduler, total = self.core.scheduler, 0
        for rid in self._held:
            request = scheduler.requests.get(rid)
            if request is None or request.is_finished:
                continue
            done = request.num_computed_tokens or \
                len(scheduler.cached_prefix(request)) * scheduler.blocks.block_size
            total += max(0, request.num_prompt_tokens - done)
        return total

    def hold(self, request_id: str, stream: OutputStream[PrefillDone], transfer_id: int,
             deadline: float | None = None) -> None:
        """``stream`` gets the ``PrefillDone`` of ``request_id``, submitted to ``sending``."""
        self._held[request_id] = _Held(stream, deadline, transfer_id, time.monotonic())
        self.timings.received(request_id)

    def _abort(self, attempt_id: str, code: grpc.StatusCode, reason: str) -> bool:
        held = self._held.pop(attempt_id, None)
        self.timings.forget(attempt_id)
        if held is not None:  # the caller first: releasing calls into the ranks
            held.stream.fail(code, reason)
        sent = self.sending.abort(attempt_id) or held is not None
        return super()._abort(attempt_id, code, reason) or sent

    def _live_ids(self) -> list[str]:
        return list(self._held) + super()._live_ids()

    def _before_step(self) -> None:
        """Drop the queued requests whose deadline passed before their prefill started."""
        if pause_points.enabled():
            pause_points.pause("prefill.before_step", held=len(self._held))
            self._started_points()
        now, requests = time.monotonic(), self.core.scheduler.requests
        for rid, held in list(self._held.items()):
            request = requests.get(rid)
            if held.deadline is None or held.deadline > now or request is None:
                continue
            if request.status is RequestStatus.WAITING and request.num_computed_tokens == 0 \
                    and request.num_preemptions == 0:
                self.num_expired += 1
                log.info("dropped: its deadline passed before its prefill started",
                         extra=self.log_extra(rid))
                self._abort(rid, grpc.StatusCode.DEADLINE_EXCEEDED,
                            "the deadline passed before the prefill started")
        super()._before_step()

    def _started_points(self, also: str | None = None) -> None:
        """``prefill.started`` for each held request whose first chunk was computed since
        (``also``: one that just finished, possibly in its first step)."""
        requests = self.core.scheduler.requests
        for rid, held in self._held.items():
            request = requests.get(rid)
            if held.started or not (rid == also or request is not None
                                    and request.num_computed_tokens > 0):
                continue
            held.started = True
            pause_points.record("prefill.started", attempt_id=rid, transfer_id=held.transfer_id)
            pause_points.pause("prefill.started", attempt_id=rid, transfer_id=held.transfer_id)

    def _after_step(self) -> None:
        if pause_points.enabled():
            requests = self.core.scheduler.requests
            for rid in self._held:
                request = requests.get(rid)
                if request is not None and request.num_computed_tokens:
                    pause_points.record("prefill.computed", attempt_id=rid,
                                        num_computed_tokens=request.num_computed_tokens)
        super()._after_step()

    def _is_polling(self) -> bool:
        return bool(self.sending.num_sending) or super()._is_polling()

    def _deliver(self, out: RequestOutput) -> None:
        if out.request_id not in self._held:
            super()._deliver(out)
        elif out.finished:
            if out.logprobs:
                self._held[out.request_id].first_token_logprobs = out.logprobs[0]
            if out.prompt_logprobs:
                self._held[out.request_id].prompt_logprobs = tuple(out.prompt_logprobs)
            if pause_points.enabled():
                self._started_points(also=out.request_id)
            if self._computed_prompt(out.request_id):
                self.timings.prompt(out.num_prompt_tokens + out.num_resumed_tokens,
                                    out.num_cached_tokens)
            self.timings.output(out.request_id, len(out.new_token_ids), None)
            outcome = self.sending.finish(out)
            if outcome is not None:
                self._report(outcome)

    def _computed_prompt(self, request_id: str) -> bool:
        """Whether the held request's prompt was computed here (counted as prompt tokens)."""
        return True

    def _poll(self) -> None:
        for outcome in self.sending.poll():
            self._report(outcome)
        super()._poll()

    def _report(self, outcome: SendOutcome) -> None:
        held = self._held.pop(outcome.request_id, None)
        self.metrics.transfer("sent", outcome.ok, outcome.seconds)
        if held is None:
            return
        stream = held.stream
        if outcome.ok:
            self.timings.output(outcome.request_id, 0, "prefilled")
        else:
            self.timings.forget(outcome.request_id)
        if not outcome.ok or outcome.trailer is None:
            log.warning("KV send failed: %s", outcome.reason,
                        extra=self.log_extra(outcome.request_id))
            stream.fail(grpc.StatusCode.UNAVAILABLE, f"KV transfer failed: {outcome.reason}")
            return
        if pause_points.enabled():
            pause_points.record("prefill.transfer_done", attempt_id=outcome.request_id,
                                transfer_id=held.transfer_id)
            pause_points.pause("prefill.transfer_done", attempt_id=outcome.request_id,
                               transfer_id=held.transfer_id)
        times = _times(held, outcome)
        if times is not None:
            self.metrics.prefill_queue.labels(self.metrics.model_name).observe(times.queue_s)
        stream.put(PrefillDone(outcome.trailer.first_token_id, outcome.trailer.num_cached_tokens,
                               outcome.num_prompt_tokens, times,
                               held.first_token_logprobs, held.prompt_logprobs))


def _times(held: _Held, outcome: SendOutcome) -> PrefillTimes | None:
    if outcome.scheduled_at is None or outcome.computed_at is None or outcome.seconds is None:
        return None
    return PrefillTimes(outcome.scheduled_at - held.received_at,
                        outcome.computed_at - outcome.scheduled_at, outcome.seconds)
