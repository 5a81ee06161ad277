"""``RouterCore``: the router's protocol-agnostic core — one client request from validation
to its last chunk. The two API edges, gRPC (``router.service``) and HTTP (``router.http``),
turn their own messages into a ``ClientRequest``, call ``RouterCore.start`` and relay
``ServedRequest.chunks``; everything else is shared: validation, admission (budgets and
the FIFO queue, ``router.admission``), the request lifecycle through the workers (the
handoff, ``router.lifecycle``), bounded buffering towards a slow client
(``router.served``), and cancellation.

Order of business, each step failing fast with its status (``InvalidRequest`` for
validation, else ``RouteError``): deadline already passed (DEADLINE_EXCEEDED) → the
budgets, checked against a cheap upper bound of the prompt's tokens before anything is
tokenized (RESOURCE_EXHAUSTED) → validation and tokenization (INVALID_ARGUMENT) → workers
known and big enough (UNAVAILABLE / INVALID_ARGUMENT) → admitted (RESOURCE_EXHAUSTED over
a budget; a client request id already in flight is served too: every attempt has its own
id on the workers; a resumed stream's token checked, ``router.resume``) → queued until a decode worker takes it (DEADLINE_EXCEEDED if its
deadline passes first) → the handoff streams.

The router's identity: ``router_id`` (random per process) names its attempts
(``router.lifecycle.attempt.AttemptIds``) and so its leases.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import secrets
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import Any, TypeVar

import grpc
import tokenizers

from cluster.leases import LeaseKeeper, new_router_id
from engine.grammar import Grammars
from engine.kvcache.block_hash import LOSSY_WIRE_SALT
from engine.tp.sharding import num_blocks_for
from router.admission import Admission, Ticket
from router.config import AdmissionConfig, HandoffConfig
from router.errors import RouteError
from router.kv_index import KVIndex
from router.lifecycle.ahead import AheadGate
from router.lifecycle.attempt import AttemptIds
from router.lifecycle.context import RequestContext, SharedDecode
from router.lifecycle.handoff import Handoff
from router.lifecycle.placement import Placement
from router.metrics import RouterMetrics
from router.parallel import ParallelRequest, choice_requests
from router.resume import ResumeSeal
from router.served import ServedRequest
from router.trace import Trace
from router.validation import ClientRequest, InvalidRequest, ModelLimits, ValidRequest, validate
from router.worker_calls import WorkerCalls
from router.workers import WorkerPool

logger = logging.getLogger(__name__)
T = TypeVar("T")

TOKENIZE_IN_THREAD_CHARS = 4096  # longer prompts are tokenized off the event loop
TEXT_THREADS = 2  # threads that tokenize long prompts and render chat templates
MAX_TIMEOUT_S = 24 * 3600.0
"""The longest deadline a request may have (a longer one is INVALID_ARGUMENT: every wait
and every worker call of the request is bounded by it)."""


def token_bound(request: ClientRequest, limits: ModelLimits) -> int:
    """An upper bound of the prompt's tokens, without tokenizing (a byte-level BPE makes
    at most one token per byte, plus a few special ones)."""
    if request.token_ids is not None:  # a longer prompt is refused (400) by validation
        return min(len(request.token_ids), limits.context_length)
    return min(len((request.text or "").encode("utf-8", "replace")) + 4, limits.context_length)


class RouterCore:
    """Starts ``ServedRequest``s for one model over a ``WorkerPool`` (see module doc).
    ``leases``: the attempts' leases in Redis (None: none, e.g. unit tests — attempts then
    get ids and no lease)."""

    def __init__(self, pool: WorkerPool, limits: ModelLimits, tokenizer: tokenizers.Tokenizer,
                 *, handoff: HandoffConfig, admission: AdmissionConfig,
                 metrics: RouterMetrics | None = None, leases: LeaseKeeper | None = None,
                 router_id: str | None = None, seal: ResumeSeal | None = None) -> None:
        self.pool = pool
        self.limits = limits
        self.config = admission
        self.metrics = metrics or RouterMetrics()
        self.metrics.watch_rates(pool.reported_rates)
        self.admission = Admission(admission.max_inflight, admission.max_queued_tokens)
        self.router_id = router_id or new_router_id()
        self.attempt_ids = AttemptIds(self.router_id)
        self.leases = leases or LeaseKeeper(None, handoff.lease_ttl_s)
        # resume tokens (router.resume); the server sets the cluster's key once it has it
        self.seal = seal or ResumeSeal(())
        self._tokenizer = tokenizer
        # structured outputs, compiled as the workers will (refused here with the reason);
        # built on the first request that asks (a tokenizer llguidance cannot read then
        # refuses structured requests, not the router's start)
        self._grammars: Grammars | str | None = None
        self._handoff = handoff
        # unique per attempt within this router, random across routers; never 0
        self._transfer_ids: Iterator[int] = itertools.count((secrets.randbits(40) << 16) + 1)
        self._prefill_turns: Iterator[int] = itertools.count()  # round-robin routing
        self._ahead_gate = AheadGate()  # which decode workers get a Prefill with the Reserve
        self.kv_index: KVIndex | None = None  # kv-aware routing's (the server's feed fills it)
        self._background: set[asyncio.Future[object]] = set()
        self._live: set[ServedRequest] = set()  # requests whose chunks are being served
        self._text = ThreadPoolExecutor(TEXT_THREADS, thread_name_prefix="pdserve-text")
        self.draining = False  # set by the server's stop: new requests get UNAVAILABLE

    async def start(self, client: ClientRequest, timeout_s: float | None
                    ) -> ServedRequest | ParallelRequest:
        """Validate and admit ``client`` (see module doc); its deadline is ``timeout_s``
        from now (None: the router's default). n > 1 choices: a ``ParallelRequest``, each
        choice admitted as a request of its own."""
        received_at = time.monotonic()
        try:
            self.gate(token_bound(client, self.limits), timeout_s)
            deadline = received_at + (self.config.default_timeout_s if timeout_s is None
                                      else timeout_s)
            request = await self._validate(client)
            self._check_n(request)
            if request.resume_token is not None:
                self.seal.check(request, request.resume_token, request.resumed)
            self._check_fits(request)
            choices = choice_requests(request) if request.n > 1 else [request]
            tickets: list[Ticket] = []
            try:
                for choice in choices:
                    tickets.append(self.admission.enter(choice.request_id,
                                                        choice.num_prompt_tokens))
            except RouteError:
                for ticket in tickets:
                    ticket.leave()
                raise
            if request.resume_token is not None:
                self.metrics.resumes.inc()
        except RouteError as exc:
            self.metrics.rejections.labels(exc.limit or exc.code.name.lower()).inc()
            raise
        except InvalidRequest:
            self.metrics.rejections.labels("invalid").inc()
            raise
        shared = SharedDecode() if request.n > 1 else None
        served = [self._served(c, t, deadline, received_at, shared, i)
                  for i, (c, t) in enumerate(zip(choices, tickets, strict=True))]
        return served[0] if request.n == 1 else ParallelRequest(request, served)

    def _check_n(self, request: ValidRequest) -> None:
        """``InvalidRequest`` for more choices than the router takes: over ``--max-n``, or
        more than admission could ever hold at once (each choice is admitted)."""
        n, config = request.n, self.config
        if n > config.max_n:
            raise InvalidRequest(f"n must be at most {config.max_n} (the router's --max-n), "
                                 f"got {n}")
        if n > 1 and n > config.max_inflight:
            raise InvalidRequest(f"n={n} choices are more than the router admits at once "
                                 f"(--max-inflight {config.max_inflight})")
        total = n * request.num_prompt_tokens
        if n > 1 and config.max_queued_tokens is not None and total > config.max_queued_tokens:
            raise InvalidRequest(f"n={n} choices of a {request.num_prompt_tokens}-token prompt "
                                 f"are {total} prompt tokens, more than the router queues "
                                 f"(--max-queued-tokens {config.max_queued_tokens})")

    def _served(self, request: ValidRequest, ticket: Ticket, deadline: float,
                received_at: float, shared: SharedDecode | None = None,
                choice: int = 0) -> ServedRequest:
        return ServedRequest(request, ticket, deadline, received_at,
                             lambda trace: self.handoff(request, ticket, deadline, trace,
                                                        shared, choice),
                             metrics=self.metrics,
                             max_buffered_chunks=self.config.max_buffered_chunks,
                             live=self._live, choice=choice)

    def gate(self, num_tokens: int, timeout_s: float | None) -> None:
        """The cheap checks every request passes before any heavy work (tokenizing, a chat
        template): the router is not draining, the deadline is sane, the budgets have room
        for ``num_tokens`` (an upper bound of the prompt's tokens). ``RouteError`` else."""
        if self.draining:
            raise RouteError(grpc.StatusCode.UNAVAILABLE,
                             "the router is shutting down; retry on another router", "draining")
        if timeout_s is not None and timeout_s <= 0:
            raise RouteError(grpc.StatusCode.DEADLINE_EXCEEDED,
                             "the deadline passed before the request was admitted", "deadline")
        if timeout_s is not None and not timeout_s <= MAX_TIMEOUT_S:
            raise RouteError(grpc.StatusCode.INVALID_ARGUMENT,
                             f"the request's deadline is {timeout_s:.3g}s away; at most "
                             f"{MAX_TIMEOUT_S:g}s (24 hours) is allowed", "deadline")
        self.admission.check(num_tokens, upper_bound=True)

    async def run_text_work(self, fn: Callable[..., T], *args: Any) -> T:
        """``fn(*args)`` — tokenizing, rendering a chat template — on the router's text
        threads (not the default executor, which the event loop's other work shares)."""
        return await asyncio.get_running_loop().run_in_executor(self._text, fn, *args)

    async def _validate(self, client: ClientRequest) -> ValidRequest:
        if (client.text is not None and len(client.text) > TOKENIZE_IN_THREAD_CHARS
                or client.structured is not None):  # a grammar may take a while to compile
            return await self.run_text_work(validate, client, self.limits, self._tokenizer,
                                            self.grammars())
        return validate(client, self.limits, self._tokenizer)

    def grammars(self) -> Grammars:
        """The router's structured-output compiler (``InvalidRequest`` when this model's
        tokenizer cannot be used for them)."""
        if self._grammars is None:
            try:
                self._grammars = Grammars(self._tokenizer.to_str(), self.limits.vocab_size,
                                          self.limits.eos_token_ids)
            except ValueError as exc:
                self._grammars = f"structured outputs are unavailable for this model: {exc}"
        if isinstance(self._grammars, str):
            raise InvalidRequest(self._grammars)
        return self._grammars

    def _check_fits(self, request: ValidRequest) -> None:
        layout = self.pool.layout()
        if layout is None:
            raise RouteError(grpc.StatusCode.UNAVAILABLE, "no healthy worker is registered")
        need, largest = request.num_blocks(layout.block_size), self.pool.max_decode_blocks()
        if largest and need > largest:
            raise RouteError(grpc.StatusCode.INVALID_ARGUMENT,
                             f"prompt + max_tokens needs {need} KV blocks of "
                             f"{layout.block_size} tokens; the largest decode worker holds "
                             f"{largest}")
        # a prompt no prefill worker can hold fails before any work (a decode worker may
        # prefill it instead where local prefill is allowed)
        prompt_blocks = num_blocks_for(request.num_prompt_tokens, layout.block_size)
        largest = self.pool.max_blocks("prefill")
        if self._handoff.local_prefill == "never" and largest and prompt_blocks > largest:
            raise RouteError(grpc.StatusCode.INVALID_ARGUMENT,
                             f"the prompt needs {prompt_blocks} KV blocks of "
                             f"{layout.block_size} tokens; the largest prefill worker holds "
                             f"{largest}")

    def handoff(self, request: ValidRequest, ticket: Ticket, deadline: float,
                trace: Trace | None = None, shared: SharedDecode | None = None,
                choice: int = 0) -> Handoff:
        """The lifecycle of an admitted request (``router.lifecycle``); UNAVAILABLE when
        no worker is known (the cluster's KV layout names the block size). ``shared``:
        the decode worker its sibling choices share (n > 1), ``choice`` its index."""
        layout = self.pool.layout()
        if layout is None:
            raise RouteError(grpc.StatusCode.UNAVAILABLE, "no healthy worker is registered")
        ctx = RequestContext(self.pool, request, ticket, deadline, self._handoff, self.metrics,
                             self.leases, WorkerCalls(self.pool, request, self.leases.ttl_ms),
                             self._keep, trace or Trace(time.monotonic()), layout.block_size,
                             layout.hash_seed, shared_decode=shared, choice=choice,
                             kv_index=self.kv_index,
                             received_kv_salt=LOSSY_WIRE_SALT if layout.wire_quantized else "")
        placement = Placement(ctx, self.attempt_ids, self._transfer_ids, self._prefill_turns,
                              self._ahead_gate)
        return Handoff(ctx, placement, resumed=request.resumed)

    @property
    def inflight(self) -> int:
        return self.admission.inflight

    @property
    def num_pending_aborts(self) -> int:
        """Worker Aborts sent in the background and not answered yet."""
        return len(self._background)

    @property
    def num_prompts_in_flight(self) -> int:
        """Prompts on their way to a decode worker that requests may wait for
        (``router.inflight_kv``)."""
        return len(self._ahead_gate.in_flight)

    def _keep(self, future: asyncio.Future[object]) -> None:
        self._background.add(future)
        future.add_done_callback(self._background.discard)

    async def wait_idle(self, timeout_s: float) -> bool:
        """Waits up to ``timeout_s`` until no request is in flight; whether none is."""
        deadline = time.monotonic() + timeout_s
        while self.inflight and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        return not self.inflight

    def end_all(self) -> int:
        """Ends every request being served with UNAVAILABLE (the router stops): their
        clients resume them on another router (``router.resume``). How many."""
        live = list(self._live)
        for served in live:
            served.end(RouteError(grpc.StatusCode.UNAVAILABLE,
                                  "the router is shutting down; resume the stream on another "
                                  "router", "draining"))
        return len(live)

    async def drain_background(self, timeout_s: float = 5.0) -> None:
        """Waits (bounded) for the pending worker aborts."""
        if self._background:
            await asyncio.wait(list(self._background), timeout=timeout_s)

    def close(self) -> None:
        """Lets its text threads go (once no request is served any more)."""
        self._text.shutdown(wait=False, cancel_futures=True)
