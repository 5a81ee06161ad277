"""The prefill worker's engine loop: the one thread that drives the prefill ``EngineCore``
and its ``PrefillKVLeader``.

Life of one request here: ``Submit`` (queued as a prefill-only request with a send order
to the decode store) → the engine prefills it in chunks with others (continuous
batching); the step that samples its first token sends its KV layer by layer → the loop
calls ``PrefillKVLeader.finish`` (the first token and cached-token count follow the KV as
its trailer) and steps on → between steps (or every ``IDLE_POLL_S`` when idle) it polls
the transfers; once every decode rank acknowledged this one, the blocks are unpinned into
the prefix cache and the request's ``OutputStream`` gets one ``PrefillDone``. ``Abort``
at any point stops the send, unpins or frees the blocks and fails the stream with
ABORTED. ``AbortAll`` and ``Info`` are ``worker.loop``'s.

Known limit: the first request to a decode worker this process has not sent to before
reads its advertised layout inside the step (bounded by the transfer timeout).
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass

import grpc

from engine.core import EngineCore, RequestOutput
from engine.distributed import StoreAddress
from engine.sampling_params import SamplingParams
from prefill_worker.kv_leader import PrefillKVLeader, SendOutcome
from worker.loop import Command, EngineLoop, OutputStream, WorkerError

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
        self.kv = PrefillKVLeader(core)
        super().__init__("pdserve-prefill-loop", core, self.kv)
        self._streams: dict[str, OutputStream[PrefillDone]] = {}

    def _handle_own(self, command: Command) -> object:
        if isinstance(command, Submit):
            self._submit(command)
            return None
        return super()._handle_own(command)

    def _submit(self, cmd: Submit) -> None:
        if cmd.request_id in self._streams:
            raise WorkerError(grpc.StatusCode.ALREADY_EXISTS,
                              f"request {cmd.request_id!r} is already being prefilled")
        try:
            self.kv.submit(cmd.request_id, cmd.prompt_token_ids, cmd.params, cmd.transfer_id,
                           cmd.dest)
        except ValueError as exc:
            raise WorkerError(grpc.StatusCode.INVALID_ARGUMENT, str(exc)) from None
        self._streams[cmd.request_id] = cmd.stream

    def _abort(self, request_id: str, code: grpc.StatusCode, reason: str) -> bool:
        stream = self._streams.pop(request_id, None)
        found = self.kv.abort(request_id)
        if stream is not None:
            stream.fail(code, reason)
        return found or stream is not None

    def _live_ids(self) -> list[str]:
        return list(self._streams)

    def _is_polling(self) -> bool:
        return bool(self.kv.num_sending)

    def _deliver(self, out: RequestOutput) -> None:
        if out.finished and out.request_id in self._streams:  # else: warm-up
            outcome = self.kv.finish(out)
            if outcome is not None:
                self._report(outcome)

    def _poll(self) -> None:
        for outcome in self.kv.poll():
            self._report(outcome)

    def _report(self, outcome: SendOutcome) -> None:
        stream = self._streams.pop(outcome.request_id, None)
        if stream is None:
            return
        if not outcome.ok or outcome.trailer is None:
            log.warning("KV send failed: %s", outcome.reason,
                        extra={"request_id": outcome.request_id})
            stream.fail(grpc.StatusCode.UNAVAILABLE, f"KV transfer failed: {outcome.reason}")
            return
        stream.put(PrefillDone(outcome.trailer.first_token_id, outcome.trailer.num_cached_tokens,
                               outcome.num_prompt_tokens))
