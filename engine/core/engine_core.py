"""The step-level engine core that the offline ``LLM`` and the workers build on.

One ``EngineCore`` owns a scheduler, a block manager and an executor (one or more TP
ranks). It is single-threaded: callers add or abort requests between ``step()`` calls.

Besides plain generation it supports what disaggregation needs:
- prefill-only requests: the prompt is prefilled, the first token sampled, and the
  request's blocks stay pinned (``RequestOutput.block_ids``) until ``release_pinned``;
- requests whose KV is written into their blocks from outside: ``reserve_for_kv`` then
  ``admit_with_kv`` (with the first token sampled by the prefill side);
- ``layer_hook``: called with each layer index after that layer's KV is written.
"""

from __future__ import annotations

import itertools
import logging
import weakref
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace

from engine.attention.metadata import LayerHook
from engine.config import EngineConfig
from engine.core.choose import HistoryCache, choose_tokens
from engine.core.constrain import Constraints
from engine.core.drafter import DraftModel, draft_kv_bytes_per_block
from engine.core.logprobs import delivered_prompt_logprobs, prompt_logprobs
from engine.core.request import FinishReason, Request
from engine.core.runner import resolve_num_kv_blocks
from engine.core.scheduler import Scheduler, SchedulerOutput, StepUpdate
from engine.core.speculative import per_chunk, sampling_rows
from engine.grammar import Grammars
from engine.kvcache import BlockManager, KVCacheUsage
from engine.sampling_params import SamplingParams, TokenLogprobs
from engine.text.detokenizer import TextStream
from engine.text.tokenizer import TokenizerInfo
from engine.tp.executor import Executor, LocalExecutor, TPExecutor

log = logging.getLogger(__name__)


@dataclass
class RequestOutput:
    """What one step produced for one request. For a finished prefill-only request,
    ``block_ids`` are its KV blocks, pinned until the caller calls ``release_pinned``."""

    request_id: str
    new_token_ids: list[int]
    text_delta: str
    finished: bool
    finish_reason: str | None
    num_prompt_tokens: int  # the client's prompt (resumed output not included)
    num_cached_tokens: int
    num_resumed_tokens: int = 0  # output streamed before the request was resumed here
    block_ids: tuple[int, ...] | None = None  # pinned blocks of a finished prefill-only request
    # one per new token when the request asks for logprobs (None for a token sampled
    # elsewhere: the first one admitted with its KV); None when it does not ask
    logprobs: list[TokenLogprobs | None] | None = None
    # with the first token, when the request asks for them and its prompt ran here: prompt
    # tokens 1.. (``SamplingParams.prompt_logprobs``); None otherwise
    prompt_logprobs: list[TokenLogprobs] | None = None


@dataclass(frozen=True)
class KVReservation:
    """Blocks reserved for a prompt's KV (``EngineCore.reserve_for_kv``): the whole table,
    in order; its first ``num_cached_blocks`` already hold the prompt's KV (prefix-cache
    hits), the caller writes the rest."""

    block_ids: list[int]
    num_cached_blocks: int = 0

    @property
    def blocks_to_write(self) -> list[int]:
        return self.block_ids[self.num_cached_blocks:]


def merge_outputs(first: RequestOutput, later: Sequence[RequestOutput]) -> RequestOutput:
    """One request's consecutive outputs as one: the tokens, text and logprobs in order,
    the prompt's logprobs of the one that has them; the counts and the finish of the last
    (``first`` itself when ``later`` is empty)."""
    if not later:
        return first
    last = later[-1]
    outs = (first, *later)
    logprobs = None if first.logprobs is None else [
        lp for out in outs for lp in out.logprobs or [None] * len(out.new_token_ids)]
    prompt = next((out.prompt_logprobs for out in outs if out.prompt_logprobs is not None), None)
    return replace(last, new_token_ids=[t for out in outs for t in out.new_token_ids],
                   text_delta="".join(out.text_delta for out in outs),
                   logprobs=logprobs, prompt_logprobs=prompt)


def one_per_request(outputs: Sequence[RequestOutput]) -> list[RequestOutput]:
    """A step's outputs with a request's several (a speculated request's kept tokens)
    merged into one (``merge_outputs``), in the order each request first appears: one
    output a step per request, as its inter-token latency counts steps."""
    by_request: dict[str, list[RequestOutput]] = {}
    for out in outputs:
        by_request.setdefault(out.request_id, []).append(out)
    return [merge_outputs(outs[0], outs[1:]) for outs in by_request.values()]


def _grammars(config: EngineConfig, tokenizer: TokenizerInfo | None
              ) -> Callable[[], Grammars] | None:
    """How the engine makes its structured-output compiler, on first use (None without a
    tokenizer). No compile-time limit here: the router applied it before sending."""
    if tokenizer is None:
        return None
    return lambda: Grammars(tokenizer.tokenizer.to_str(), config.model.vocab_size,
                            tokenizer.eos_token_ids, compile_limit_s=None)


def validate_prompt(config: EngineConfig, blocks: BlockManager,
                    prompt_token_ids: Sequence[int], params: SamplingParams,
                    prefill_only: bool, num_resumed_tokens: int = 0) -> None:
    """``ValueError`` naming the limit a prompt breaks (``EngineCore.add_request``): none,
    a token id outside the vocabulary, the context with ``max_tokens``, the pool's blocks."""
    m, n = config.model, len(prompt_token_ids)
    if n == 0:
        raise ValueError("prompt is empty")
    bad = [t for t in prompt_token_ids if not 0 <= t < m.vocab_size]
    if bad:
        raise ValueError(f"token ids must be in [0, {m.vocab_size}); got {bad[:4]}")
    # the resumed output is in the prompt already and counts against max_tokens
    total = n - num_resumed_tokens + params.max_tokens
    if total > m.max_model_len:
        raise ValueError(
            f"prompt ({n - num_resumed_tokens} tokens) + max_tokens ({params.max_tokens}) "
            f"exceeds the context limit of {m.max_model_len} tokens")
    # a prefill-only request holds its prompt's blocks, never the output's
    num_tokens = n if prefill_only else total
    needed = blocks.num_blocks_needed(num_tokens)
    if needed > blocks.num_blocks:
        what = "prompt" if prefill_only else "prompt + max_tokens"
        raise ValueError(f"{what} needs {needed} KV blocks but the pool has only "
                         f"{blocks.num_blocks}")


class EngineCore:
    """Scheduler + block manager + executor of one engine; see the module docstring.

    Not thread-safe: one thread adds, aborts and steps. Every method that takes a
    request id raises ``ValueError`` for input that could never run, before anything is
    allocated. Block ownership: a request's blocks belong to the engine until it
    finishes (then they are freed, or pinned for prefill-only requests); blocks handed
    out by ``reserve_for_kv`` may be written by the caller until ``admit_with_kv`` or
    ``abort_request`` — the caller must stop writing before aborting.
    """

    def __init__(self, config: EngineConfig, tokenizer: TokenizerInfo | None = None,
                 executor: Executor | None = None) -> None:
        self.config = config
        self.tokenizer = tokenizer
        if executor is None:
            # the draft model's cache has a block for each of the target's: both fit
            num_blocks = resolve_num_kv_blocks(config, draft_kv_bytes_per_block(config))
            tp = config.parallel.tensor_parallel_size
            executor = LocalExecutor(config, num_blocks) if tp == 1 else TPExecutor(config, num_blocks)
        self.executor = executor
        self.block_manager = BlockManager(
            executor.num_kv_blocks, config.cache.block_size,
            enable_prefix_caching=config.cache.enable_prefix_caching)
        self.scheduler = Scheduler(config.scheduler, config.cache, self.block_manager,
                                   config.model.max_model_len)
        # speculative decoding's draft model, if it drafts (engine.core.drafter)
        self.drafter = DraftModel(config, executor.num_kv_blocks) if (
            config.scheduler.speculative_method == "draft_model") else None
        self.layer_hook: LayerHook | None = None
        self.last_step_chunks = 0  # chunks the last step computed (0: it could do nothing)
        self.last_step_prompt_tokens = 0  # prompt tokens the last step computed
        # Builds the payload every rank's plugin step_hook receives with a step (or None).
        self.step_payload: Callable[[SchedulerOutput], bytes] | None = None
        self._streams: dict[str, TextStream] = {}
        self._histories: HistoryCache = weakref.WeakKeyDictionary()  # engine.core.choose
        self._step_logprobs: dict[str, TokenLogprobs] = {}  # this step's, by request id
        self.constraints = Constraints(_grammars(config, tokenizer))  # structured outputs
        self._ids = itertools.count()

    # --- requests -----------------------------------------------------------------
    def new_request_id(self) -> str:
        return f"req-{next(self._ids)}"

    def add_request(self, request_id: str, prompt_token_ids: Sequence[int],
                    params: SamplingParams, *, prefill_only: bool = False,
                    num_resumed_tokens: int = 0) -> None:
        """Queue a request. Raises ``ValueError`` (naming the limit) for one that can never run.

        ``num_resumed_tokens``: the last that many of ``prompt_token_ids`` are the request's
        output so far (a stream resumed here after another worker failed it): computed
        like the prompt, counted as output by ``max_tokens``, the usage and the text
        stream, whose state (withheld text, a stop string being matched) they rebuild;
        the tokens sampled next are drawn at the same positions as without the move."""
        request = self._make_request(request_id, prompt_token_ids, params, prefill_only,
                                     num_resumed_tokens)
        self.constraints.open(request)
        self.scheduler.add(request)
        self._open_stream(request)

    def reserve_for_kv(self, request_id: str, prompt_token_ids: Sequence[int],
                       params: SamplingParams, *, num_resumed_tokens: int = 0,
                       reuse_prefix: bool = False,
                       max_reused_blocks: int | None = None) -> KVReservation | None:
        """Reserve blocks for a prompt whose KV will be written from outside (lossy KV
        keyed apart: ``CacheConfig.received_kv_salt``), or None when they do not fit now —
        then nothing is held. With ``reuse_prefix`` the leading blocks the prefix cache
        holds for the prompt (never its last token's) are taken as they are, and the caller
        writes only the blocks after them, at most ``max_reused_blocks`` of them (the
        sender skips exactly those). ``num_resumed_tokens``: as for ``add_request``."""
        request = self._make_request(request_id, prompt_token_ids, params, False,
                                     num_resumed_tokens)
        request.cache_salt = self.config.cache.received_kv_salt
        self.constraints.open(request)  # before anything is held: it may refuse
        cached = self.scheduler.cached_prefix(request) if reuse_prefix else []
        if max_reused_blocks is not None:
            cached = cached[:max_reused_blocks]
        block_ids = self.scheduler.reserve(request, request.num_prompt_tokens, cached)
        if block_ids is None:
            self.constraints.close(request_id)
            return None
        self._open_stream(request)
        return KVReservation(block_ids, len(cached))

    def admit_with_kv(self, request_id: str, first_token_id: int,
                      num_cached_tokens: int = 0) -> RequestOutput:
        """The reserved request's prompt KV is in its blocks and ``first_token_id`` was
        sampled by the prefill side, whose prefix cache served ``num_cached_tokens`` of
        the prompt (reported as the request's ``num_cached_tokens``): join the running
        batch (or finish at once)."""
        request = self.scheduler.reserved.get(request_id)
        if request is None:
            raise ValueError(f"request {request_id!r} has no KV reservation")
        if not 0 <= first_token_id < self.config.model.vocab_size:
            raise ValueError(
                f"first token id {first_token_id} is outside [0, {self.config.model.vocab_size})")
        if not 0 <= num_cached_tokens <= request.num_prompt_tokens:
            raise ValueError(f"{num_cached_tokens} cached tokens for a prompt of "
                             f"{request.num_prompt_tokens}")
        request.num_cached_tokens = num_cached_tokens
        self.constraints.follow(request_id, [first_token_id])
        update = self.scheduler.admit_with_kv(
            request_id, request.num_prompt_tokens, first_token_id)
        out = self._output(update)
        if out.finished:
            self.scheduler.forget([request_id])
        return out

    def abort_request(self, request_id: str) -> bool:
        """Stop a request wherever it is and free its blocks. False if unknown or finished."""
        request = self.scheduler.finish(request_id, FinishReason.ABORT)
        self._streams.pop(request_id, None)
        self.constraints.close(request_id)
        self.scheduler.forget([request_id])
        return request is not None

    def release_pinned(self, request_id: str) -> bool:
        """Unpin a finished prefill-only request's blocks (they stay in the prefix cache)."""
        return self.block_manager.unpin(request_id)

    def has_unfinished(self) -> bool:
        return self.scheduler.has_unfinished()

    def call_ranks(self, request: bytes) -> list[bytes]:
        """Ask every rank's plugin (``EngineConfig.rank_plugin``); replies in rank order."""
        return self.executor.call(request)

    # --- one step -----------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        """Schedule, execute and sample one step; returns the outputs it produced."""
        out = self.scheduler.schedule()
        self.last_step_chunks = len(out.chunks)
        self.last_step_prompt_tokens = sum(len(c.token_ids) for c in out.prefills)
        sampled = self._execute(out) if out.chunks else []
        updates = self.scheduler.update(out, sampled)
        if self.drafter is not None:
            self.drafter.settle(out, self.scheduler.requests)
        outputs = one_per_request([self._output(u) for u in updates])
        self._step_logprobs.clear()
        self.scheduler.forget(o.request_id for o in outputs if o.finished)
        return outputs

    def _execute(self, out: SchedulerOutput) -> list[int | tuple[int, ...]]:
        if self.drafter is not None:  # the draft's guesses into the speculated chunks
            self.drafter.fill(out, self.scheduler.requests)
        payload = self.step_payload(out) if self.step_payload is not None else b""
        logits = self.executor.execute(out.chunks, self.layer_hook, payload)
        if any(c.all_logits for c in out.chunks):
            logits = prompt_logprobs(logits, out.chunks, self.scheduler.requests)
        rows, positions = sampling_rows(out.chunks, self.scheduler.requests)
        choice = choose_tokens(logits, rows, positions, self._histories, self.constraints)
        self._step_logprobs = choice.logprobs
        return per_chunk(choice.token_ids, out.chunks)

    def _output(self, update: StepUpdate) -> RequestOutput:
        request = update.request
        new_ids = [update.new_token_id] if update.new_token_id is not None else []
        finished = update.finished
        if not finished and self.constraints.is_done(request.request_id):
            self.scheduler.finish(request.request_id, FinishReason.STOP)  # output complete
            finished = True
        delta, finished = self._detokenize(request, new_ids, finished)
        if finished:
            self.constraints.close(request.request_id)
        pinned = request.finish_reason is FinishReason.PREFILLED
        logprobs: list[TokenLogprobs | None] | None = None
        if request.params.logprobs is not None:
            found = self._step_logprobs.pop(request.request_id, None)
            logprobs = [found] if new_ids else []
        return RequestOutput(
            request_id=request.request_id,
            new_token_ids=new_ids,
            text_delta=delta,
            finished=finished,
            finish_reason=request.finish_reason.value if finished and request.finish_reason else None,
            num_prompt_tokens=request.num_client_prompt_tokens,
            num_cached_tokens=request.num_cached_tokens,
            num_resumed_tokens=request.num_resumed_tokens,
            block_ids=tuple(self.block_manager.pinned_block_ids(request.request_id)) if pinned else None,
            logprobs=logprobs,
            prompt_logprobs=delivered_prompt_logprobs(request, bool(new_ids)),
        )

    def _detokenize(self, request: Request, new_ids: list[int], finished: bool) -> tuple[str, bool]:
        """Text delta for ``new_ids``; a matched stop string finishes the request."""
        stream = self._streams.get(request.request_id)
        if stream is None:
            return "", finished
        delta, stopped = stream.add(
            new_ids, may_stop=request.num_output_tokens > request.params.min_tokens)
        if stopped and not finished:
            self.scheduler.finish(request.request_id, FinishReason.STOP)
            finished = True
        elif stopped and request.finish_reason is not FinishReason.PREFILLED:
            # the stop string came with the token that hit max_tokens
            request.finish_reason = FinishReason.STOP
        if finished:
            delta += stream.flush()
            del self._streams[request.request_id]
        return delta, finished

    def _make_request(self, request_id: str, prompt_token_ids: Sequence[int],
                      params: SamplingParams, prefill_only: bool,
                      num_resumed_tokens: int = 0) -> Request:
        if request_id in self.scheduler.requests or self.block_manager.is_pinned(request_id):
            raise ValueError(f"request id {request_id!r} is already in use")
        if params.stop and self.tokenizer is None:
            raise ValueError("stop strings need a tokenizer; this engine has none")
        if num_resumed_tokens < 0 or num_resumed_tokens and num_resumed_tokens >= len(
                prompt_token_ids):
            raise ValueError(f"{num_resumed_tokens} resumed tokens in a prompt of "
                             f"{len(prompt_token_ids)}: the client's prompt must remain")
        if num_resumed_tokens >= params.max_tokens:
            raise ValueError(f"{num_resumed_tokens} resumed tokens leave nothing to generate "
                             f"under max_tokens {params.max_tokens}")
        validate_prompt(self.config, self.block_manager, prompt_token_ids, params,
                        prefill_only, num_resumed_tokens)
        eos = self.tokenizer.eos_token_ids if self.tokenizer else ()
        request = Request(request_id, list(prompt_token_ids), params, eos, prefill_only,
                          num_resumed_tokens)
        self.constraints.check(request)
        return request

    def _open_stream(self, request: Request) -> None:
        if self.tokenizer is None:
            return
        prompt, resumed = request.prompt_token_ids, request.num_resumed_tokens
        stream = TextStream(self.tokenizer.tokenizer, prompt[:len(prompt) - resumed],
                            stop=request.params.stop)
        for n, token_id in enumerate(prompt[len(prompt) - resumed:], 1):  # sent: rebuild
            stream.add((token_id,), may_stop=n > request.params.min_tokens)
        self._streams[request.request_id] = stream

    # --- introspection ------------------------------------------------------------
    def kv_usage(self) -> KVCacheUsage:
        return self.block_manager.usage()

    def check_integrity(self) -> None:
        self.block_manager.check_integrity()

    def shutdown(self) -> None:
        self.constraints.shutdown()
        self.executor.shutdown()
