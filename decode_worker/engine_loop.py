"""The decode worker's engine loop: the one thread that drives the decode ``EngineCore``
and its ``DecodeHandoff``.

Life of one request here (commands from gRPC handlers, see ``pdserve.worker_loop``):
``Reserve`` (blocks + EXPECT on every rank) → ``Open`` (a Generate stream) → the loop
polls the transfer; when the KV arrived on every rank, with its trailer (the first token
and the prefill side's cached-token count) on rank 0, and a stream is open, it admits
the request with that first token and streams every step's output → finished (engine
frees). ``Abort`` at any point frees everything and fails an open stream with ABORTED.

The router may still send its copies of the first token and cached-token count with
``Open`` (from the Prefill response; 0 counts as absent). They are only checked: one
that differs from what arrived with the KV ends the request with INTERNAL (and frees it).

Ownership: from Reserve until admit, the blocks are ``DecodeHandoff``'s (it frees them on
abort or failed transfer); after admit they are the engine's. A reservation whose KV
arrived but whose stream was not opened within the transfer timeout is aborted by the
loop, so nothing is held without a deadline.
"""

from __future__ import annotations

import logging
import time
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass

import grpc

from decode_worker.handoff import DecodeHandoff, KVTarget
from engine.core import EngineCore, RequestOutput
from engine.sampling_params import SamplingParams
from kvtransfer.protocol import Trailer
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

log = logging.getLogger(__name__)
MAX_REMEMBERED_FAILURES = 1024


@dataclass(frozen=True)
class Reserve(Command[KVTarget | None]):
    request_id: str
    prompt_token_ids: Sequence[int]
    params: SamplingParams
    transfer_id: int


@dataclass(frozen=True)
class Open(Command[OutputStream[RequestOutput]]):
    """Open the request's Generate stream: returns the stream of its ``RequestOutput``s
    (room for every token, so the loop never waits on a slow reader). The router's
    copies of the first token and cached-token count (None: absent) are checked against
    the trailer that arrives with the KV."""

    request_id: str
    first_token_id: int | None = None
    num_cached_tokens: int | None = None


@dataclass(frozen=True)
class Local(Command[OutputStream[RequestOutput]]):
    """Colocated mode: prefill the prompt here and stream every token (no KV transfer)."""

    request_id: str
    prompt_token_ids: Sequence[int]
    params: SamplingParams


@dataclass
class _Live:
    transfer_id: int
    reserved_at: float
    max_tokens: int
    stream: OutputStream[RequestOutput] | None = None
    claimed: Open | None = None  # the router's copies, from Open
    trailer: Trailer | None = None  # arrived with the KV
    arrived: bool = False
    admitted: bool = False

    def mismatch(self) -> str | None:
        """Why the router's copies disagree with the trailer (None: they agree or are
        absent, or one of the two is not there yet)."""
        if self.claimed is None or self.trailer is None:
            return None
        pairs = (("first_token_id", self.claimed.first_token_id, self.trailer.first_token_id),
                 ("num_cached_tokens", self.claimed.num_cached_tokens,
                  self.trailer.num_cached_tokens))
        for name, claimed, arrived in pairs:
            if claimed is not None and claimed != arrived:
                return (f"GenerateRequest.{name} {claimed} differs from the {arrived} that "
                        "arrived with the KV")
        return None


class DecodeLoop(EngineLoop):
    """Owns ``core`` (built with the decode KV plugin) from ``start`` until ``stop``."""

    def __init__(self, core: EngineCore, transfer_timeout_s: float) -> None:
        super().__init__("pdserve-decode-loop")
        self.core = core
        self.handoff = DecodeHandoff(core)
        self.transfer_timeout_s = transfer_timeout_s
        self._live: dict[str, _Live] = {}
        # request id -> why its transfer failed before a stream was open (told to Generate)
        self._failed: OrderedDict[str, str] = OrderedDict()

    # --- commands -----------------------------------------------------------------
    def _handle(self, command: Command) -> object:
        if isinstance(command, Reserve):
            return self._reserve(command)
        if isinstance(command, Open):
            return self._open(command)
        if isinstance(command, Local):
            return self._local(command)
        if isinstance(command, Abort):
            return self._abort(command.request_id, grpc.StatusCode.ABORTED, command.reason)
        if isinstance(command, AbortAll):
            ids = list(self._live)
            for rid in ids:
                self._abort(rid, grpc.StatusCode.UNAVAILABLE, command.reason)
            return len(ids)
        if isinstance(command, Info):
            return self._info()
        raise TypeError(f"unknown command {command!r}")

    def _reserve(self, cmd: Reserve) -> KVTarget | None:
        live = self._live.get(cmd.request_id)
        if live is not None:
            if live.transfer_id == cmd.transfer_id:
                return KVTarget(live.transfer_id, self.handoff.address,
                                self.handoff.tp_size, len(cmd.prompt_token_ids))
            raise WorkerError(grpc.StatusCode.ALREADY_EXISTS,
                              f"request {cmd.request_id!r} holds transfer {live.transfer_id}")
        try:
            target = self.handoff.reserve(cmd.request_id, cmd.prompt_token_ids, cmd.params,
                                          cmd.transfer_id, self.transfer_timeout_s)
        except ValueError as exc:
            raise WorkerError(grpc.StatusCode.INVALID_ARGUMENT, str(exc)) from None
        if target is not None:
            self._failed.pop(cmd.request_id, None)
            self._live[cmd.request_id] = _Live(cmd.transfer_id, time.monotonic(),
                                               cmd.params.max_tokens)
        return target

    def _open(self, cmd: Open) -> OutputStream[RequestOutput]:
        live = self._live.get(cmd.request_id)
        if live is None:
            failed = self._failed.pop(cmd.request_id, None)
            if failed is not None:
                raise WorkerError(grpc.StatusCode.UNAVAILABLE, f"KV transfer failed: {failed}")
            raise WorkerError(grpc.StatusCode.NOT_FOUND,
                              f"no live reservation for {cmd.request_id!r}")
        if live.stream is not None:
            raise WorkerError(grpc.StatusCode.FAILED_PRECONDITION,
                              f"a Generate stream is already open for {cmd.request_id!r}")
        if cmd.first_token_id is not None and not (
                0 <= cmd.first_token_id < self.core.config.model.vocab_size):
            raise WorkerError(grpc.StatusCode.INVALID_ARGUMENT,
                              f"first_token_id {cmd.first_token_id} is outside the vocabulary")
        live.claimed = cmd
        problem = live.mismatch()
        if problem is not None:
            self._abort(cmd.request_id, grpc.StatusCode.INTERNAL, problem)
            raise WorkerError(grpc.StatusCode.INTERNAL, problem)
        live.stream = OutputStream(live.max_tokens + 2)
        if live.arrived:
            self._admit(cmd.request_id, live)
        return live.stream

    def _local(self, cmd: Local) -> OutputStream[RequestOutput]:
        if cmd.request_id in self._live:
            raise WorkerError(grpc.StatusCode.ALREADY_EXISTS,
                              f"request {cmd.request_id!r} is live here")
        try:
            self.core.add_request(cmd.request_id, list(cmd.prompt_token_ids), cmd.params)
        except ValueError as exc:
            raise WorkerError(grpc.StatusCode.INVALID_ARGUMENT, str(exc)) from None
        self._failed.pop(cmd.request_id, None)
        live = _Live(0, time.monotonic(), cmd.params.max_tokens, arrived=True, admitted=True)
        live.stream = OutputStream(live.max_tokens + 2)
        self._live[cmd.request_id] = live
        return live.stream

    def _abort(self, request_id: str, code: grpc.StatusCode, reason: str) -> bool:
        self._failed.pop(request_id, None)
        live = self._live.pop(request_id, None)
        if live is None:
            return False
        if live.admitted:
            self.core.abort_request(request_id)
        else:
            self.handoff.abort(request_id)
        if live.stream is not None:
            live.stream.fail(code, reason)
        log.info("aborted", extra={"request_id": request_id, "role": "decode"})
        return True

    def _info(self) -> LoopInfo:
        stats = self.handoff.rank_stats()
        sched = self.core.scheduler
        return LoopInfo(
            kv=self.core.kv_usage(),
            pending_transfers=self.handoff.num_pending + sum(s.pending for s in stats),
            open_kv_channels=sum(s.open_channels for s in stats),
            running=len(sched.running),
            waiting=len(sched.waiting) + sum(1 for v in self._live.values() if not v.admitted),
            num_preemptions=sched.stats.num_preemptions)

    # --- the loop -----------------------------------------------------------------
    def _has_work(self) -> bool:
        return self.core.has_unfinished()

    def _is_polling(self) -> bool:
        return bool(self.handoff.num_pending)

    def _tick(self) -> None:
        if self.core.has_unfinished():
            for out in self.core.step():
                self._deliver(out)

    def _serve_commands(self) -> bool:
        alive = super()._serve_commands()
        if alive and self.handoff.num_pending:
            self._poll_transfers()
        return alive

    def _poll_transfers(self) -> None:
        for result in self.handoff.poll():
            live = self._live.get(result.request_id)
            if live is None:
                continue
            if not result.ok:  # the handoff already freed the blocks
                del self._live[result.request_id]
                self._fail(result.request_id, live, result.reason)
                continue
            live.arrived, live.trailer = True, result.trailer
            if live.stream is not None:
                self._admit(result.request_id, live)
        self._expire_unopened()

    def _fail(self, request_id: str, live: _Live, reason: str) -> None:
        log.warning("KV transfer failed: %s", reason, extra={"request_id": request_id})
        if live.stream is not None:
            live.stream.fail(grpc.StatusCode.UNAVAILABLE, f"KV transfer failed: {reason}")
            return
        self._failed[request_id] = reason
        while len(self._failed) > MAX_REMEMBERED_FAILURES:
            self._failed.popitem(last=False)

    def _expire_unopened(self) -> None:
        deadline = time.monotonic() - self.transfer_timeout_s
        for rid in [r for r, v in self._live.items()
                    if v.arrived and v.stream is None and v.reserved_at < deadline]:
            self._abort(rid, grpc.StatusCode.UNAVAILABLE, "no Generate before the deadline")
            self._failed[rid] = "no Generate stream opened before the transfer deadline"

    def _admit(self, request_id: str, live: _Live) -> None:
        problem = live.mismatch()
        if problem is not None:
            log.error("refusing the request: %s", problem, extra={"request_id": request_id})
            self._abort(request_id, grpc.StatusCode.INTERNAL, problem)
            return
        live.admitted = True
        self._deliver(self.handoff.admit(request_id))

    def _deliver(self, out: RequestOutput) -> None:
        live = self._live.get(out.request_id)
        if live is None or live.stream is None:
            return
        live.stream.put(out)
        if out.finished:
            del self._live[out.request_id]

    def _close(self) -> None:
        try:
            for rid in list(self._live):
                self._abort(rid, grpc.StatusCode.UNAVAILABLE, "the worker is shutting down")
        finally:
            self.core.shutdown()
