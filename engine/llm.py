"""Offline entry point: the whole engine in one process (plus TP rank processes).

``LLM`` is the reference every cluster test compares against: same checkpoint, same
sampling parameters → same tokens.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from types import TracebackType
from typing import Any

from engine.config import (
    CacheConfig,
    EngineConfig,
    ParallelConfig,
    SchedulerConfig,
    load_model_config,
    speculative_fields,
)
from engine.core.engine_core import EngineCore
from engine.core.scheduler import SchedulerStats
from engine.sampling_params import SamplingParams, TokenLogprobs
from engine.text.tokenizer import load_tokenizer

Prompt = str | Sequence[int]


@dataclass
class GenerationResult:
    """One prompt's completion: tokens, text (stop string excluded), why it ended
    (``"stop"`` or ``"length"``), how many prompt tokens came from the prefix cache, and
    (when its ``SamplingParams.logprobs`` asked) one ``TokenLogprobs`` per token; (when
    ``prompt_logprobs`` asked) one per prompt token after the first."""

    prompt_token_ids: list[int]
    token_ids: list[int]
    text: str
    finish_reason: str  # "stop" or "length"
    num_cached_tokens: int
    logprobs: list[TokenLogprobs] | None = None
    prompt_logprobs: list[TokenLogprobs] | None = None


class LLM:
    """Generate completions offline with continuous batching, chunked prefill,
    preemption by recompute and prefix caching.

    ``tensor_parallel_size > 1`` starts ranks 1..t-1 as processes of their own
    (``python -m engine.tp.rank_main``; they never re-run the caller's main module, and die
    with this process). Call ``shutdown()`` or use the object as a context manager.
    ``speculative_config``: vLLM's, n-gram lookup (``engine.core.speculative``):
    ``{"method": "ngram", "num_speculative_tokens": k, "prompt_lookup_max": a,
    "prompt_lookup_min": b}``, or a draft model (``engine.core.drafter``: a checkpoint
    with this one's vocabulary): ``{"method": "draft_model", "model": DIR,
    "num_speculative_tokens": k}``.
    """

    def __init__(self, model_dir: str | Path, *, dtype: str = "float32",
                 tensor_parallel_size: int = 1, block_size: int = 16,
                 num_kv_blocks: int | None = None, max_num_seqs: int = 64,
                 max_num_batched_tokens: int = 512, enable_prefix_caching: bool = True,
                 device: str = "cpu", linear_kernel: str = "auto",
                 quantization: str | None = None, kv_cache_dtype: str = "auto",
                 speculative_config: Mapping[str, Any] | str | None = None) -> None:
        self.config = EngineConfig(
            model=load_model_config(model_dir, dtype=dtype),
            cache=CacheConfig(block_size=block_size, num_kv_blocks=num_kv_blocks,
                              enable_prefix_caching=enable_prefix_caching,
                              kv_cache_dtype=kv_cache_dtype),
            parallel=ParallelConfig(tensor_parallel_size=tensor_parallel_size),
            scheduler=SchedulerConfig(max_num_seqs=max_num_seqs,
                                      max_num_batched_tokens=max_num_batched_tokens,
                                      **speculative_fields(speculative_config)),
            device=device,
            linear_kernel=linear_kernel,
            quantization=quantization,
        )
        self.tokenizer = load_tokenizer(model_dir)
        self.core = EngineCore(self.config, self.tokenizer)

    @property
    def stats(self) -> SchedulerStats:
        return self.core.scheduler.stats

    def encode(self, prompt: Prompt) -> list[int]:
        if isinstance(prompt, str):
            return list(self.tokenizer.tokenizer.encode(prompt).ids)
        return list(prompt)

    def generate(self, prompts: Sequence[Prompt],
                 sampling: SamplingParams | Sequence[SamplingParams] | None = None
                 ) -> list[GenerationResult]:
        """One result per prompt, in order. ``sampling``: one for all or one per prompt."""
        if isinstance(prompts, str):
            raise TypeError("prompts must be a list of strings or of token-id lists")
        self._check_idle()
        params = self._per_prompt(sampling, len(prompts))
        ids: list[str] = []
        results: dict[str, GenerationResult] = {}
        texts: dict[str, list[str]] = {}
        try:
            for prompt, p in zip(prompts, params, strict=True):
                rid = self.core.new_request_id()
                token_ids = self.encode(prompt)
                self.core.add_request(rid, token_ids, p)
                ids.append(rid)
                results[rid] = GenerationResult(token_ids, [], "", "", 0)
                texts[rid] = []
            while self.core.has_unfinished():
                for out in self.core.step():
                    result = results[out.request_id]
                    result.token_ids.extend(out.new_token_ids)
                    if out.logprobs is not None:
                        if result.logprobs is None:
                            result.logprobs = []
                        result.logprobs.extend(lp for lp in out.logprobs if lp is not None)
                    if out.prompt_logprobs is not None:
                        result.prompt_logprobs = out.prompt_logprobs
                    texts[out.request_id].append(out.text_delta)
                    if out.finished:
                        result.finish_reason = out.finish_reason or ""
                        result.num_cached_tokens = out.num_cached_tokens
        except BaseException:
            for rid in ids:
                self.core.abort_request(rid)
            raise
        for rid in ids:
            results[rid].text = "".join(texts[rid])
        return [results[rid] for rid in ids]

    def stream(self, prompt: Prompt, sampling: SamplingParams | None = None) -> Iterator[str]:
        """Yield the completion's text as it is generated (never half a UTF-8 character)."""
        self._check_idle()
        rid = self.core.new_request_id()
        self.core.add_request(rid, self.encode(prompt), sampling or SamplingParams())
        try:
            finished = False
            while not finished:
                for out in self.core.step():
                    finished = out.finished
                    if out.text_delta:
                        yield out.text_delta
        finally:
            self.core.abort_request(rid)

    def _check_idle(self) -> None:
        if self.core.has_unfinished():
            raise RuntimeError("this LLM is still running another generate() or an unfinished "
                               "stream(); finish or close it first")

    @staticmethod
    def _per_prompt(sampling: SamplingParams | Sequence[SamplingParams] | None,
                    n: int) -> list[SamplingParams]:
        if sampling is None:
            return [SamplingParams()] * n
        if isinstance(sampling, SamplingParams):
            return [sampling] * n
        if len(sampling) != n:
            raise ValueError(f"got {len(sampling)} SamplingParams for {n} prompts")
        return list(sampling)

    def shutdown(self) -> None:
        self.core.shutdown()

    def __enter__(self) -> LLM:
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        self.shutdown()
