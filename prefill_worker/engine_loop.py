"""The prefill worker's engine loop: the one thread that drives the prefill ``EngineCore``
and its ``PrefillHandoff``.

Life of one request here: ``Submit`` (queued as a prefill-only request with a send order
to the decode store) → the engine prefills it in chunks with others (continuous
batching); the step that samples its first token sends its KV layer by layer → the loop
calls ``PrefillHandoff.finish`` (the first token and cached-token count follow the KV as
its trailer) and steps on → between steps (or every ``IDLE_POLL_S`` when idle) it polls
the transfers; once every decode rank acknowledged this one, the blocks are unpinned into
the prefix cache and the request's ``OutputStream`` gets one ``PrefillDone``. ``Abort``
at any point stops the send, unpins or frees the blocks and fails the stream with
ABORTED.

Known limit: the first request to a decode worker this process has not sent to before
reads its advertised layout inside the step (bounded by the transfer timeout).
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass

import grpc

from engine.core import EngineCore
from engine.distributed import StoreAddress
from engine.sampling_params import SamplingParams
from pdserve.worker_loop import (
    Abort,
    AbortAll,
    Command,
    EngineLoop,
    Info,
    LoopInfo,
    OutputStream,
    WorkerError,
)
from prefill_worker.handoff import PrefillHandoff, PrefillResult

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class PrefillDone:
    """The request's KV and trailer reached every decode rank, verified."""

    first_token_id: int
    num_cached_tokens: int
    num_prompt_tokens: int


@dataclass(frozen=True)
class Submit(Command[None]):
    """Queue a prefill whose KV goes to ``dest``; ``stream`` gets one ``PrefillDone``."""

    request_id: str
    prompt_token_ids: Sequence[int]
    params: SamplingParams
    transfer_id: int
    dest: StoreAddress
    stream: OutputStream[PrefillDone]


class PrefillLoop(EngineLoop):
    """Owns ``core`` (built with the prefill KV plugin) from ``start`` until ``stop``."""

    def __init__(self, core: EngineCore) -> None:
        super().__init__("pdserve-prefill-loop")
        self.core = core
        self.handoff = PrefillHandoff(core)
        self._streams: dict[str, OutputStream[PrefillDone]] = {}

    def _handle(self, command: Command) -> object:
        if isinstance(command, Submit):
            self._submit(command)
            return None
        if isinstance(command, Abort):
            return self._abort(command.request_id, grpc.StatusCode.ABORTED, command.reason)
        if isinstance(command, AbortAll):
            ids = list(self._streams)
            for rid in ids:
                self._abort(rid, grpc.StatusCode.UNAVAILABLE, command.reason)
            return len(ids)
        if isinstance(command, Info):
            return self._info()
        raise TypeError(f"unknown command {command!r}")

    def _submit(self, cmd: Submit) -> None:
        if cmd.request_id in self._streams:
            raise WorkerError(grpc.StatusCode.ALREADY_EXISTS,
                              f"request {cmd.request_id!r} is already being prefilled")
        try:
            self.handoff.submit(cmd.request_id, cmd.prompt_token_ids, cmd.params,
                                cmd.transfer_id, cmd.dest)
        except ValueError as exc:
            raise WorkerError(grpc.StatusCode.INVALID_ARGUMENT, str(exc)) from None
        self._streams[cmd.request_id] = cmd.stream

    def _abort(self, request_id: str, code: grpc.StatusCode, reason: str) -> bool:
        stream = self._streams.pop(request_id, None)
        found = self.handoff.abort(request_id)
        if stream is not None:
            stream.fail(code, reason)
        return found or stream is not None

    def _info(self) -> LoopInfo:
        stats = self.handoff.rank_stats()
        sched = self.core.scheduler
        return LoopInfo(
            kv=self.core.kv_usage(),
            pending_transfers=self.handoff.num_pending + sum(s.pending for s in stats),
            open_kv_channels=sum(s.open_channels for s in stats),
            running=len(sched.running), waiting=len(sched.waiting),
            num_preemptions=sched.stats.num_preemptions)

    def _has_work(self) -> bool:
        return self.core.has_unfinished()

    def _is_polling(self) -> bool:
        return bool(self.handoff.num_sending)

    def _tick(self) -> None:
        for out in self.core.step():
            if out.finished and out.request_id in self._streams:  # else: warm-up
                result = self.handoff.finish(out)
                if result is not None:
                    self._report(result)

    def _serve_commands(self) -> bool:
        alive = super()._serve_commands()
        if alive and self.handoff.num_sending:
            for result in self.handoff.poll():
                self._report(result)
        return alive

    def _report(self, result: PrefillResult) -> None:
        stream = self._streams.pop(result.request_id, None)
        if stream is None:
            return
        if not result.ok or result.trailer is None:
            log.warning("KV send failed: %s", result.reason,
                        extra={"request_id": result.request_id})
            stream.fail(grpc.StatusCode.UNAVAILABLE, f"KV transfer failed: {result.reason}")
            return
        stream.put(PrefillDone(result.trailer.first_token_id, result.trailer.num_cached_tokens,
                               result.num_prompt_tokens))

    def _close(self) -> None:
        try:
            for rid in list(self._streams):
                self._abort(rid, grpc.StatusCode.UNAVAILABLE, "the worker is shutting down")
        finally:
            self.core.shutdown()
