"""Speculative decoding with a draft model (vLLM's ``{"method": "draft_model", "model":
DIR, "num_speculative_tokens": k}``): a small checkpoint with the target's vocabulary
guesses the next ``k`` tokens greedily, and the target verifies them in one chunk exactly
as it verifies n-gram guesses (``engine.core.speculative``: kept while they equal what the
sampler draws in their place, so greedy and seeded streams are unchanged and an unseeded
one keeps the target's distribution — a greedy draft is a one-token guess).

The scheduler reserves the guesses' slots (``DRAFT_PLACEHOLDER`` tokens, as many as the
step has room for); ``DraftModel.fill`` runs the draft and writes the guesses into the
step's chunks before the target runs, so everything after it — the forward, the
verification, the prefix cache — sees an ordinary speculated chunk.

The draft's own KV lives in a cache of its own, indexed by the target's block ids: a
request's blocks hold its KV of both models, so the block manager, prefix caching and
preemption need nothing new. What the draft holds for a request is tracked here: the
length of its sequence whose draft KV is right (``_Progress``).

A prompt this engine prefills has its draft KV computed in the same steps, a draft chunk
beside each of the target's prompt chunks (the step grows by the draft's share of that
chunk: about a fifth for the benchmarks' draft), so its first decode step guesses. A
prompt found in the prefix cache finds the draft's KV in those blocks too where the draft
computed it (``engine.core.draft_kv``: the drafter records which blocks hold the draft's
KV of which content), and the draft computes the rest: a draft chunk may run up to
``CATCH_UP_TOKENS`` longer than the target's, catching up cached blocks without draft KV.

Each decode step, the draft first catches up from where its KV is right to the request's
last token, then guesses one token per pass. For a request whose target KV came from a
prefill worker that is the whole prompt (less what the decode worker's prefix cache held,
draft KV included): recomputed on the decode worker, nothing extra travels, up to
``CATCH_UP_TOKENS`` a step (``CATCH_UP_STEP_TOKENS`` for all requests together), the
request guessing nothing until it has caught up, so prompts arriving stall no step by
more than that much draft prefill. A catch-up of at most
``ROWS_CATCH_UP_TOKENS`` that ends the sequence (after a step whose guesses were kept:
the last guess and the target's next token) runs as decode rows, each attending up to
itself, so the compiled decoder stack takes it (0.5 ms for two tokens on the benchmarks'
draft here, against 2.0 ms as a prefill chunk by the per-layer forward). A guess the
target rejected leaves draft KV past the kept tokens, which the next catch-up
overwrites; a preempted request starts again from nothing (or from what the prefix cache
holds). Two requests sharing cached blocks write the same draft KV into them, and a
draft KV that is stale only makes guesses worse, never a token wrong.

The draft runs in this process (the engine core's, which is rank 0's under tensor
parallelism), unsharded, on rank 0's device, with the linear kernels measured fastest for
its shapes (``engine.kernels.choice``); ``"quantization": "int8"`` in the
speculative_config quantises its weights at load (a draft pass reads a quarter of the
bytes; a guess only has to be likely, and the target checks every one).
"""

from __future__ import annotations

import weakref
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace

import torch

from engine.config import (
    ConfigError,
    EngineConfig,
    ModelConfig,
    ParallelConfig,
    SchedulerConfig,
    load_model_config,
)
from engine.core.draft_kv import DraftBlocks
from engine.core.request import Request
from engine.core.runner import ModelRunner, kv_bytes_per_block
from engine.core.scheduler import ScheduledChunk, SchedulerOutput
from engine.core.speculative import may_speculate
from engine.kernels.choice import choose_kernel_plan
from engine.tp.distributed import Group

# the most draft KV a request catches up in one step, and all requests together: a
# prompt received from a prefill worker is caught up over several steps, each of them a
# little longer for every stream
CATCH_UP_TOKENS = 64
CATCH_UP_STEP_TOKENS = 256
# a catch-up this short that ends the sequence runs as decode rows (each attending up to
# itself, as a target's verifying chunk does): the compiled decoder stack takes it
ROWS_CATCH_UP_TOKENS = 8


def draft_model_config(config: EngineConfig) -> ModelConfig:
    """The draft model's configuration (``SchedulerConfig.speculative_model``, read from
    its ``config.json`` only), checked against the target's: ``ConfigError`` for a missing
    or unusable checkpoint, another vocabulary, or fewer positions."""
    draft_dir = config.scheduler.speculative_model
    try:
        model = load_model_config(draft_dir, dtype=config.model.dtype)
    except ConfigError as exc:
        raise ConfigError(f"speculative_config's draft model: {exc}") from None
    target = config.model
    if model.vocab_size != target.vocab_size:
        raise ConfigError(f"speculative_config's draft model {draft_dir} has a vocabulary "
                          f"of {model.vocab_size}; the target's is {target.vocab_size}")
    if model.max_model_len < target.max_model_len:
        raise ConfigError(f"speculative_config's draft model {draft_dir} takes "
                          f"{model.max_model_len} positions; the target takes "
                          f"{target.max_model_len}")
    return model


def draft_engine_config(config: EngineConfig) -> EngineConfig:
    """The engine configuration the draft model of ``config`` runs under: one rank, its KV
    in the model's dtype, its own quantisation (speculative_config's), with the target's
    forced linear kernel where that one multiplies such weights."""
    quantization = config.scheduler.draft_quantization
    linear = config.linear_kernel if config.linear_kernel.startswith("int8_") == (
        quantization == "int8") else "auto"
    return EngineConfig(
        model=draft_model_config(config),
        cache=replace(config.cache, kv_cache_dtype="auto", kv_transfer_dtype="auto"),
        parallel=ParallelConfig(), scheduler=SchedulerConfig(),
        device=config.device, linear_kernel=linear, quantization=quantization)


def draft_kv_bytes_per_block(config: EngineConfig) -> int:
    """Bytes the draft model's KV of one block takes (its cache is indexed by the target's
    block ids, on the first rank): 0 without a draft model."""
    if config.scheduler.speculative_method != "draft_model":
        return 0
    return kv_bytes_per_block(draft_engine_config(config))


@dataclass
class _Progress:
    """A request's draft KV: right for its first ``valid`` tokens, as long as it has not
    been preempted since (``num_preemptions``); after a step that guessed, ``guessed`` is
    how far the draft wrote (the guesses' positions, the last excluded) until
    ``settle`` learns how many were kept."""

    num_preemptions: int
    valid: int
    guessed: int = 0
    recorded: int = 0  # its first blocks recorded in DraftBlocks


class DraftModel:
    """The draft checkpoint of ``config.scheduler.speculative_model``, loaded next to a
    target of ``config`` whose KV pool has ``num_kv_blocks`` blocks. ``ConfigError`` when
    it cannot draft for that target (another vocabulary, a shorter context)."""

    def __init__(self, config: EngineConfig, num_kv_blocks: int) -> None:
        draft = draft_engine_config(config)
        try:
            # PDSERVE_LINEAR_KERNEL, set for the target, forces the draft's kernel only
            # where it multiplies the draft's weights (as linear_kernel does)
            plan = choose_kernel_plan(draft, torch.get_num_threads(), env_fits_only=True)
        except ValueError as exc:  # a kernel forced by the environment it cannot use
            raise ConfigError(f"speculative_config's draft model: {exc}") from None
        self.runner = ModelRunner(draft, Group.single(), num_kv_blocks, plan)
        self._disable_above = config.scheduler.speculative_disable_by_batch_size
        # the draft's KV of the prompt chunks this engine prefills, computed in their step
        # (False: as on a decode worker whose prompts' KV all arrive from a prefill
        # worker, which bench.draft_kv measures)
        self.with_prompt_chunks = True
        self.blocks = DraftBlocks(config.cache.block_size)
        self._progress: weakref.WeakKeyDictionary[Request, _Progress] = (
            weakref.WeakKeyDictionary())

    def fill(self, out: SchedulerOutput, requests: Mapping[str, Request]) -> None:
        """Write the draft's guesses into ``out``'s speculated chunks (in place), and the
        draft's KV of its prompt chunks (``_with_prompts``). A request whose draft KV is
        more than ``CATCH_UP_TOKENS`` behind catches up by that much this step and guesses
        nothing (its chunk becomes a plain decode)."""
        spec = [(i, chunk, requests[chunk.request_id])
                for i, chunk in enumerate(out.decodes) if chunk.num_draft_tokens]
        prompts = self._with_prompts(out, requests)
        if not spec and not prompts:
            return
        catch_up, guessing, budget = prompts, [], CATCH_UP_STEP_TOKENS
        for i, chunk, request in spec:
            start = self._start(request, chunk.block_ids)
            end = min(request.num_tokens, start + min(CATCH_UP_TOKENS, budget))
            if end < request.num_tokens:  # catching up: no guesses this step
                out.decodes[i] = chunk._replace(token_ids=chunk.token_ids[:1],
                                         num_draft_tokens=0)
                self._set(request, start, end)
            else:
                guessing.append((i, chunk, request, start))
            if end > start:
                budget -= end - start
                last = end == request.num_tokens
                rows = end - start - 1 if last and end - start <= ROWS_CATCH_UP_TOKENS else 0
                catch_up.append(ScheduledChunk(
                    chunk.request_id, tuple(request.all_token_ids[start:end]), start,
                    chunk.block_ids, sample=last, num_draft_tokens=rows))
        firsts = iter(self._greedy(catch_up))
        guesses = [[next(firsts)] for _ in guessing]
        for j in range(1, max((chunk.num_draft_tokens for _, chunk, _, _ in guessing),
                              default=0)):
            live = [n for n, (_, chunk, _, _) in enumerate(guessing) if chunk.num_draft_tokens > j]
            step = [ScheduledChunk(guessing[n][1].request_id, (guesses[n][-1],),
                                   guessing[n][2].num_tokens + j - 1, guessing[n][1].block_ids,
                                   sample=True) for n in live]
            for n, token in zip(live, self._greedy(step), strict=True):
                guesses[n].append(token)
        for (i, chunk, request, start), drafts in zip(guessing, guesses, strict=True):
            out.decodes[i] = chunk._replace(token_ids=(chunk.token_ids[0], *drafts))
            # the draft wrote KV up to the last guess's position (excluded)
            self._set(request, start, request.num_tokens, request.num_tokens + len(drafts) - 1)

    def _with_prompts(self, out: SchedulerOutput, requests: Mapping[str, Request]
                      ) -> list[ScheduledChunk]:
        """The draft's chunks that go with the step's prompt chunks: for each request that
        may speculate (its sampling parameters allow it, and its ``max_tokens`` leaves
        room for a guess), its draft KV from where it is right up to the target's chunk's
        end (at most ``CATCH_UP_TOKENS`` more than the chunk: a prompt found in the prefix
        cache may have no draft KV in its cached blocks), so that a prompt prefilled here
        is caught up by its first decode step. None in a step of more chunks than
        ``speculative_disable_by_batch_size`` (the scheduler's test is on the running
        requests: a step that large would likely not speculate)."""
        crowded = self._disable_above is not None and len(out.chunks) > self._disable_above
        if not out.prefills or not self.with_prompt_chunks or crowded:
            return []
        chunks = []
        for chunk in out.prefills:
            request = requests[chunk.request_id]
            if (not may_speculate(request)
                    or request.params.max_tokens < request.num_output_tokens + 3):
                continue  # never a guess: after its first token, no room for one
            start = min(self._valid(request, chunk.block_ids, chunk.start_position),
                        chunk.start_position)
            end = min(chunk.start_position + len(chunk.token_ids),
                      start + len(chunk.token_ids) + CATCH_UP_TOKENS)
            chunks.append(ScheduledChunk(chunk.request_id, tuple(request.all_token_ids[start:end]),
                                         start, chunk.block_ids, sample=False))
            self._set(request, start, end)
        return chunks

    def settle(self, out: SchedulerOutput, requests: Mapping[str, Request]) -> None:
        """After ``Scheduler.update``: the draft KV of the guesses the target kept is right
        (it was computed from those very tokens), the rest is not. The whole blocks of
        draft KV that are right go on record (``DraftBlocks``)."""
        for chunk in out.chunks:
            request = requests.get(chunk.request_id)
            if request is None:
                continue  # finished and forgotten, or aborted
            progress = self._progress.get(request)
            if progress is None or progress.num_preemptions != request.num_preemptions:
                continue
            if progress.guessed:
                progress.valid = min(request.num_computed_tokens, progress.guessed)
                progress.guessed = 0
            progress.recorded = self.blocks.record(request, chunk.block_ids, progress.recorded,
                                                   progress.valid)

    def written(self, request: Request, num_tokens: int, block_ids: Sequence[int]) -> None:
        """The draft's KV of ``request``'s first ``num_tokens`` tokens is in its blocks
        ``block_ids`` (its block table) already, written by something other than this
        drafter (as a prefill worker's, were it shipped with the target's): it catches up
        from there, and the blocks' records go (``DraftBlocks``: they are recorded again
        once the request's steps settle). ``bench.draft_kv`` measures that way against
        the catch-up from nothing."""
        self.blocks.forget(block_ids[:-(-num_tokens // self.blocks.block_size)])
        self._progress[request] = _Progress(request.num_preemptions, num_tokens)

    def _start(self, request: Request, block_ids: Sequence[int]) -> int:
        """Where the request's catch-up chunk starts: its draft KV's right length, short of
        its last token (whose logits give the first guess)."""
        return min(self._valid(request, block_ids, request.num_tokens - 1),
                   request.num_tokens - 1)

    def _valid(self, request: Request, block_ids: Sequence[int], limit: int) -> int:
        """The length of ``request``'s sequence whose draft KV is right: as the drafter
        left it, else (new, or preempted since) the whole blocks at its start, up to
        ``limit`` tokens, that hold the draft's KV of their content (``DraftBlocks``)."""
        progress = self._progress.get(request)
        if progress is None or progress.num_preemptions != request.num_preemptions:
            return self.blocks.prefix(request, block_ids, limit)
        return progress.valid

    def _set(self, request: Request, start: int, valid: int, guessed: int = 0) -> None:
        """The draft writes ``request``'s KV from ``start`` this step; right up to
        ``valid`` after it (``guessed``: as ``_Progress`` says)."""
        progress = self._progress.get(request)
        recorded = 0 if progress is None or (
            progress.num_preemptions != request.num_preemptions) else min(
                progress.recorded, start // self.blocks.block_size)
        self._progress[request] = _Progress(request.num_preemptions, valid, guessed, recorded)

    def _greedy(self, chunks: Sequence[ScheduledChunk]) -> list[int]:
        """The draft's argmax after each sampling chunk, in ``chunks``' order (chunks that
        do not sample only write their KV). The runner takes decode rows (one-token chunks,
        and short catch-ups marked as rows, whose last row is the one wanted) before the
        others, as the scheduler orders a step: they run first."""
        order = sorted(range(len(chunks)),
                       key=lambda n: not (chunks[n].is_decode or chunks[n].num_draft_tokens))
        self.blocks.writing(chunks)
        logits = self.runner.execute([chunks[n] for n in order])
        drawn = iter(torch.argmax(logits, dim=-1).tolist())
        by_chunk = {}
        for n in order:
            for _ in range(chunks[n].num_logit_rows):
                by_chunk[n] = next(drawn)
        return [by_chunk[n] for n in range(len(chunks)) if chunks[n].sample]
