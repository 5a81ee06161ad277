"""The decode worker's engine loop: the one thread that drives the decode ``EngineCore``
and the receiving side of its KV plane (``worker.kv.receiving.KVReceiveLeader``).

Life of one request here (commands from gRPC handlers, see ``worker.loop``), each phase
recorded in one place, the request's ``_Live.phase``:

- ``Reserve``: blocks reserved in the engine (``reserve_for_kv``: the leading blocks its
  prefix cache holds for the prompt are taken as they are, and the target's
  ``num_cached_blocks`` tells the sender to skip them), the transfer of the rest announced
  to every rank (``KVReceiveLeader.expect``) — phase RESERVED. A Reserve whose Prefill
  went out ahead of it (``expected_cached_blocks`` set: the sender skips that many) takes
  exactly those blocks, or is refused — and then its transfer id is refused on every rank
  (``KVReceiveLeader.refuse``), so that KV already on its way is dropped at once, not
  parked; as it is when such a Reserve's call fails or is cancelled (``Refuse``: the
  command may never have run);
- the loop polls the leader; once the KV arrived on every rank, with its trailer (the
  first token and the prefill side's cached-token count) on rank 0 — phase ARRIVED;
- once the KV arrived and a Generate stream is open (``Open``), the request is admitted
  with that first token (``admit_with_kv``) and every step's output is streamed — phase
  RUNNING; finished: the engine frees its blocks.

A request's first token is its time to first token: before the next step takes the core
(and the GIL) from the gRPC side, the loop waits — at most ``FIRST_CHUNK_WAIT_S`` after it
put it — for each stream given its first token to have sent it on (``release_first_chunks``).

``Local`` (colocated mode) starts a request RUNNING: it is prefilled here. ``Abort`` at
any point stops the transfer (if one is pending), frees everything and fails an open
stream with ABORTED. ``AbortAll`` and ``Info`` are ``worker.loop``'s.

Ownership: from Reserve until admit, the blocks are reserved in the engine and written by
the ranks' receivers while the transfer is pending; the loop frees them on abort or a
failed transfer (after the leader made every rank stop writing); after admit they are the
engine's. A reservation's transfer must start within the Reserve's wait (the request's deadline)
and complete within the transfer timeout of that (the leader fails it otherwise); a
request whose KV arrived but whose stream was not opened within the transfer timeout of
its arrival is aborted by the loop, so nothing is held without a deadline. Past
``max_requests`` held at once, a Reserve is not accepted and a Local is refused as busy.
"""

from __future__ import annotations

import enum
import logging
import time
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass, replace

import grpc

from cluster import pause_points
from cluster.kv_target import KVTarget
from decode_worker.local_waits import LocalPrefillWaits
from engine.core.engine_core import RequestOutput
from engine.sampling_params import SamplingParams
from kvtransfer.wire.protocol import Trailer
from worker.commands import Command, WorkerError
from worker.kv.receiving import Arrival
from worker.loop import EngineLoop
from worker.streams import OutputStream

log = logging.getLogger(__name__)
MAX_REMEMBERED_FAILURES = 1024
# how long a first token may hold the next step back while its stream's reader sends it
FIRST_CHUNK_WAIT_S = 0.002


@dataclass(frozen=True)
class Reserve(Command[KVTarget | str]):
    """Reserve blocks and announce the transfer: its target, or why not now (out of KV
    blocks, or busy). The transfer must start within ``wait_s`` (None: the transfer
    timeout)."""

    attempt_id: str
    prompt_token_ids: Sequence[int]
    params: SamplingParams
    transfer_id: int
    wait_s: float | None = None
    client_request_id: str = ""  # for logs
    num_resumed_tokens: int = 0  # output already streamed, ending the prompt (a migration)
    expected_cached_blocks: int | None = None  # the Prefill went out ahead, skipping these


@dataclass(frozen=True)
class Refuse(Command[None]):
    """Refuse ``transfer_id``: its Reserve, whose Prefill went out with it, failed or never
    ran (its call was cancelled or expired): KV that comes for it is dropped at once."""

    transfer_id: int


@dataclass(frozen=True)
class Open(Command[None]):
    """Open the request's Generate stream: ``stream`` (made by the caller; the loop bounds
    it to the reservation's ``max_tokens + 2`` items, and never waits on a slow reader)
    gets its ``RequestOutput``s, starting with the first token that arrives with the KV."""

    attempt_id: str
    stream: OutputStream[RequestOutput]


@dataclass(frozen=True)
class Local(Command[None]):
    """Colocated mode: prefill the prompt here and stream every token (no KV transfer)
    into ``stream`` (made by the caller, room for ``max_tokens + 2`` items)."""

    attempt_id: str
    prompt_token_ids: Sequence[int]
    params: SamplingParams
    stream: OutputStream[RequestOutput]
    client_request_id: str = ""  # for logs
    num_resumed_tokens: int = 0  # output already streamed, ending the prompt (a migration)


class Phase(enum.Enum):
    RESERVED = "reserved"  # blocks reserved, the KV on its way (the leader tracks the transfer)
    ARRIVED = "arrived"  # KV verified on every rank, trailer kept; waits for its stream
    RUNNING = "running"  # admitted (or prefilled here): the engine owns the blocks


@dataclass
class _Live:
    phase: Phase
    max_tokens: int
    arrived_at: float | None = None  # monotonic, once its KV arrived
    stream: OutputStream[RequestOutput] | None = None
    trailer: Trailer | None = None  # arrived with the KV
    local: bool = False  # prefilled here (colocated)
    transfer_id: int = 0  # 0 when prefilled here
    num_cached_blocks: int = 0  # leading prompt blocks the prefix cache had (not sent)
    num_streamed: int = 0  # tokens put on its stream


class DecodeLoop(EngineLoop):
    """The decode side of a worker's engine loop (``role_worker.engine_loop.WorkerLoop``
    combines it with the prefill side); ``init_decode`` starts receiving KV (rank 0's
    rendezvous store)."""

    ROLE = "decode"

    def init_decode(self, transfer_timeout_s: float, max_requests: int) -> None:
        """The decode side's own state (the worker's loop, ``role_worker``, calls it
        after ``EngineLoop.__init__``); starts receiving KV."""
        self.receiving = self.kv.start_receiving()
        self.transfer_timeout_s = transfer_timeout_s
        self.max_requests = max_requests
        self._live: dict[str, _Live] = {}
        # request id -> why its transfer failed before a stream was open (told to Generate)
        self._failed: OrderedDict[str, str] = OrderedDict()
        # streams given their first token since the last step, and when
        self._first_chunks: list[tuple[OutputStream[RequestOutput], float]] = []
        self._local_waits = LocalPrefillWaits(
            self.metrics.prefill_queue.labels(self.metrics.model_name).observe)

    # --- commands -----------------------------------------------------------------
    def _handle_own(self, command: Command) -> object:
        if isinstance(command, Reserve):
            return self._reserve(command)
        if isinstance(command, Open):
            self._open(command)
            return None
        if isinstance(command, Refuse):
            self.receiving.refuse(command.transfer_id)
            return None
        if isinstance(command, Local):
            self._local(command)
            return None
        return super()._handle_own(command)

    def _reserve(self, cmd: Reserve) -> KVTarget | str:
        if cmd.expected_cached_blocks is None:
            return self._reserve_now(cmd)
        try:  # its Prefill went out ahead: KV may be on its way to a refused transfer
            reserved = self._reserve_now(cmd)
        except BaseException:
            self.receiving.refuse(cmd.transfer_id)
            raise
        if isinstance(reserved, str):
            self.receiving.refuse(cmd.transfer_id)
        return reserved

    def _reserve_now(self, cmd: Reserve) -> KVTarget | str:
        rid = cmd.attempt_id
        if rid in self._live:
            if self.receiving.transfer_id(rid) == cmd.transfer_id:  # a repeated Reserve
                return replace(self.receiving.target(cmd.transfer_id),
                               num_cached_blocks=self._live[rid].num_cached_blocks)
            raise WorkerError(grpc.StatusCode.ALREADY_EXISTS,
                              f"request {rid!r} is live here with another transfer")
        if self.role != "decode" or self.draining:
            return (f"busy: this worker {'is draining' if self.draining else 'serves ' + self.role}"
                    " now, it takes no new reservations")
        if self.busy:
            return (f"busy: {len(self._live)} requests held, the worker's limit "
                    "(--max-requests)")
        try:
            expected = cmd.expected_cached_blocks
            reserved = self.core.reserve_for_kv(rid, cmd.prompt_token_ids, cmd.params,
                                                num_resumed_tokens=cmd.num_resumed_tokens,
                                                reuse_prefix=True, max_reused_blocks=expected)
            if reserved is None:
                usage = self.core.kv_usage()
                return f"out of KV blocks ({usage.free + usage.cached} of {usage.total} free)"
            if expected is not None and reserved.num_cached_blocks < expected:
                self.core.abort_request(rid)
                return (f"its prefix cache holds {reserved.num_cached_blocks} of the "
                        f"{expected} leading blocks the Prefill skips")
            # the prefix cache's hits stay as they are: only the blocks after them arrive
            skipped = reserved.num_cached_blocks * self.core.config.cache.block_size
            try:
                target = self.receiving.expect(rid, cmd.transfer_id,
                                               len(cmd.prompt_token_ids) - skipped,
                                               reserved.blocks_to_write,
                                               self.transfer_timeout_s, cmd.wait_s)
            except BaseException:
                self.core.abort_request(rid)
                raise
        except ValueError as exc:
            raise WorkerError(grpc.StatusCode.INVALID_ARGUMENT, str(exc)) from None
        self._failed.pop(rid, None)
        self.named(rid, cmd.client_request_id)
        self._live[rid] = _Live(Phase.RESERVED, cmd.params.max_tokens,
                                transfer_id=cmd.transfer_id,
                                num_cached_blocks=reserved.num_cached_blocks)
        self.metrics.kv_blocks_reused(reserved.num_cached_blocks)
        self.timings.received(rid)
        return replace(target, num_cached_blocks=reserved.num_cached_blocks)

    @property
    def busy(self) -> bool:
        """It holds its limit of requests (``max_requests``)."""
        return len(self._live) >= self.max_requests

    def _open(self, cmd: Open) -> None:
        live = self._live.get(cmd.attempt_id)
        if live is None:
            failed = self._failed.pop(cmd.attempt_id, None)
            if failed is not None:
                raise WorkerError(grpc.StatusCode.UNAVAILABLE, f"KV transfer failed: {failed}")
            raise WorkerError(grpc.StatusCode.NOT_FOUND,
                              f"no live reservation for {cmd.attempt_id!r}")
        if live.stream is not None:
            raise WorkerError(grpc.StatusCode.FAILED_PRECONDITION,
                              f"a Generate stream is already open for {cmd.attempt_id!r}")
        live.stream = cmd.stream
        live.stream.bound(live.max_tokens + 2)
        if live.phase is Phase.ARRIVED:
            self._admit(cmd.attempt_id, live)

    def _local(self, cmd: Local) -> None:
        self.refuse_unless("decode", "new requests to prefill here")
        if cmd.attempt_id in self._live:
            raise WorkerError(grpc.StatusCode.ALREADY_EXISTS,
                              f"request {cmd.attempt_id!r} is live here")
        if self.busy:
            raise WorkerError(grpc.StatusCode.RESOURCE_EXHAUSTED,
                              f"busy: {len(self._live)} requests held, the worker's limit "
                              "(--max-requests)")
        try:
            self.core.add_request(cmd.attempt_id, list(cmd.prompt_token_ids), cmd.params,
                                  num_resumed_tokens=cmd.num_resumed_tokens)
        except ValueError as exc:
            raise WorkerError(grpc.StatusCode.INVALID_ARGUMENT, str(exc)) from None
        self._failed.pop(cmd.attempt_id, None)
        self.named(cmd.attempt_id, cmd.client_request_id)
        self._live[cmd.attempt_id] = _Live(Phase.RUNNING, cmd.params.max_tokens,
                                           stream=cmd.stream, local=True)
        self.timings.received(cmd.attempt_id)
        self._local_waits.came(cmd.attempt_id)

    def _abort(self, attempt_id: str, code: grpc.StatusCode, reason: str) -> bool:
        self._failed.pop(attempt_id, None)
        self._local_waits.dropped(attempt_id)
        live = self._live.pop(attempt_id, None)
        if live is None:
            return super()._abort(attempt_id, code, reason)
        self.timings.forget(attempt_id)
        if live.stream is not None:  # the caller first: releasing calls into the ranks
            live.stream.fail(code, reason)
        if live.phase is Phase.RESERVED:
            self.receiving.abort(attempt_id)  # every rank stops writing before the blocks go
        self.core.abort_request(attempt_id)
        log.info("aborted", extra=self.log_extra(attempt_id))
        return True

    def _live_ids(self) -> list[str]:
        return list(self._live) + super()._live_ids()

    def _num_unadmitted(self) -> int:
        return sum(1 for v in self._live.values() if v.phase is not Phase.RUNNING) \
            + super()._num_unadmitted()

    # --- the loop -----------------------------------------------------------------
    def _is_polling(self) -> bool:
        """Transfers pending, or arrived KV waiting for its stream (it expires)."""
        return bool(self.receiving.num_pending) or any(
            v.phase is Phase.ARRIVED for v in self._live.values()) or super()._is_polling()

    def _poll(self) -> None:
        for arrival in self.receiving.poll():
            self._arrived(arrival)
        self._expire_unopened()
        super()._poll()

    def _arrived(self, arrival: Arrival) -> None:
        rid = arrival.request_id
        self.metrics.transfer("received", arrival.ok, arrival.seconds)
        live = self._live.get(rid)
        if live is None:
            return
        if not arrival.ok:  # no rank writes the blocks any more: free them
            del self._live[rid]
            self.timings.forget(rid)
            self.core.abort_request(rid)
            self._fail(rid, live, arrival.reason)
            return
        live.phase, live.trailer, live.arrived_at = Phase.ARRIVED, arrival.trailer, time.monotonic()
        if live.stream is not None:
            self._admit(rid, live)

    def _fail(self, attempt_id: str, live: _Live, reason: str) -> None:
        log.warning("KV transfer failed: %s", reason, extra=self.log_extra(attempt_id))
        if live.stream is not None:
            live.stream.fail(grpc.StatusCode.UNAVAILABLE, f"KV transfer failed: {reason}")
            return
        self._failed[attempt_id] = reason
        while len(self._failed) > MAX_REMEMBERED_FAILURES:
            self._failed.popitem(last=False)

    def _expire_unopened(self) -> None:
        """KV that arrived but got no Generate stream within the transfer timeout is freed."""
        deadline = time.monotonic() - self.transfer_timeout_s
        for rid in [r for r, v in self._live.items()
                    if v.phase is Phase.ARRIVED and v.stream is None
                    and v.arrived_at is not None and v.arrived_at < deadline]:
            self._abort(rid, grpc.StatusCode.UNAVAILABLE, "no Generate before the deadline")
            self._failed[rid] = "no Generate stream opened before the transfer deadline"

    def _before_step(self) -> None:
        release_first_chunks(self._first_chunks)
        super()._before_step()
        self._local_waits.step_starts()

    def _after_step(self) -> None:
        self._local_waits.step_ended(self.core.scheduler.requests)
        super()._after_step()

    def _admit(self, attempt_id: str, live: _Live) -> None:
        assert live.trailer is not None
        if pause_points.enabled():
            pause_points.record("decode.admitted", attempt_id=attempt_id,
                                transfer_id=live.transfer_id)
            pause_points.pause("decode.admitted", attempt_id=attempt_id,
                               transfer_id=live.transfer_id)
        live.phase = Phase.RUNNING
        if live.stream is not None:
            live.stream.inputs_arrived_at = live.arrived_at
        self._deliver(self.core.admit_with_kv(attempt_id, live.trailer.first_token_id,
                                              live.trailer.num_cached_tokens))

    def _deliver(self, out: RequestOutput) -> None:
        live = self._live.get(out.request_id)
        if live is None:
            super()._deliver(out)
            return
        if live.stream is None:
            return
        if live.local and live.trailer is None and out.new_token_ids:  # its first token
            live.trailer = Trailer(out.new_token_ids[0], out.num_cached_tokens)
            self.timings.prompt(out.num_prompt_tokens + out.num_resumed_tokens,
                                out.num_cached_tokens)
        self.timings.output(out.request_id, len(out.new_token_ids),
                            out.finish_reason if out.finished else None)
        live.stream.put(out)
        first, live.num_streamed = live.num_streamed, live.num_streamed + len(out.new_token_ids)
        if first == 0 and live.num_streamed and not out.finished:  # (a last chunk's reader
            self._first_chunks.append((live.stream, time.monotonic()))  # never asks again)
        if out.finished:
            del self._live[out.request_id]
        if pause_points.enabled():
            for n in range(first + 1, live.num_streamed + 1):
                pause_points.record("decode.token", attempt_id=out.request_id, n=n)
                pause_points.pause("decode.token", attempt_id=out.request_id, n=n)


def release_first_chunks(first_chunks: list[tuple[OutputStream[RequestOutput], float]]
                         ) -> None:
    """Wait (bounded, see the module docstring) until each stream given its first token
    since the last step (when) has handed it on, and forget them: sleeping here leaves the
    core to the gRPC side, where the step would otherwise share it with the chunk's
    sending."""
    for stream, put_at in first_chunks:
        stream.wait_taken(max(0.0, put_at + FIRST_CHUNK_WAIT_S - time.monotonic()))
    first_chunks.clear()
