"""A request's state inside one engine. Torch-free."""

from __future__ import annotations

import enum
from dataclasses import dataclass, field

from engine.kvcache import BlockHash, hash_block_tokens, root_hash
from engine.sampling_params import SamplingParams, TokenLogprobs


class RequestStatus(enum.Enum):
    WAITING = "waiting"  # queued for (re)prefill
    WAITING_FOR_KV = "waiting_for_kv"  # blocks reserved; KV is written from outside
    KV_READY = "kv_ready"  # that KV is in its blocks; joins the running batch at the next step
    RUNNING = "running"
    PARKED = "parked"  # out of the batch, its blocks kept: its KV may move (engine.core.parking)
    FINISHED = "finished"


class FinishReason(enum.StrEnum):
    STOP = "stop"  # EOS, stop token or stop string
    LENGTH = "length"  # max_tokens or the context limit
    ABORT = "abort"
    PREFILLED = "prefilled"  # prefill-only request: first token sampled, KV pinned


@dataclass(eq=False)
class Request:
    """Token state of one sequence.

    Invariant: ``num_computed_tokens <= num_tokens``; the KV of tokens
    ``[0, num_computed_tokens)`` is in the request's blocks. A step computes tokens
    ``[num_computed_tokens, num_tokens)`` (or a chunk of them) and, when that reaches
    ``num_tokens``, samples the token at position ``num_tokens``.

    A resumed request (one migrated from another worker after some of its output was
    streamed) has that output as the last ``num_resumed_tokens`` of ``prompt_token_ids``:
    computed like the prompt, counted as output (by ``max_tokens`` and the client's usage).
    """

    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    eos_token_ids: tuple[int, ...] = ()
    prefill_only: bool = False
    num_resumed_tokens: int = 0  # output streamed before, at the end of prompt_token_ids
    # keys its blocks apart in the prefix cache (``engine.kvcache.block_hash.root_hash``)
    cache_salt: str = ""
    status: RequestStatus = RequestStatus.WAITING
    num_computed_tokens: int = 0
    num_cached_tokens: int = 0  # prompt tokens served from the prefix cache at first admission
    num_prefill_chunks: int = 0
    num_preemptions: int = 0
    finish_reason: FinishReason | None = None
    output_token_ids: list[int] = field(default_factory=list)
    all_token_ids: list[int] = field(default_factory=list)
    block_hashes: list[BlockHash] = field(default_factory=list)
    # prompt tokens 1.. given the ones before (``SamplingParams.prompt_logprobs``), in order
    prompt_logprobs: list[TokenLogprobs] = field(default_factory=list)

    def __post_init__(self) -> None:
        self.all_token_ids = list(self.prompt_token_ids)

    @property
    def wants_prompt_logprobs(self) -> bool:
        """Its prompt's logprobs are computed here: asked for, and not yet all found (a
        resumed request's client has them already)."""
        return (self.params.prompt_logprobs is not None and self.num_resumed_tokens == 0
                and len(self.prompt_logprobs) < self.num_prompt_tokens - 1)

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_client_prompt_tokens(self) -> int:
        """The client's prompt (``prompt_token_ids`` less the resumed output)."""
        return len(self.prompt_token_ids) - self.num_resumed_tokens

    @property
    def num_output_tokens(self) -> int:
        """Output tokens of the request so far, the resumed ones included."""
        return self.num_resumed_tokens + len(self.output_token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.all_token_ids)

    @property
    def is_finished(self) -> bool:
        return self.status is RequestStatus.FINISHED

    def append_output(self, token_id: int) -> None:
        self.output_token_ids.append(token_id)
        self.all_token_ids.append(token_id)

    def full_block_hashes(self, num_blocks: int, block_size: int, seed: int) -> list[BlockHash]:
        """Chained hashes of the first ``num_blocks`` full blocks (extended incrementally;
        the request's own list when it is exactly that long: read it, do not keep it)."""
        while len(self.block_hashes) < num_blocks:
            i = len(self.block_hashes)
            parent = self.block_hashes[-1] if i else root_hash(seed, self.cache_salt)
            tokens = self.all_token_ids[i * block_size : (i + 1) * block_size]
            self.block_hashes.append(hash_block_tokens(parent, tokens))
        if len(self.block_hashes) == num_blocks:
            return self.block_hashes
        return self.block_hashes[:num_blocks]

    def check_token_stop(self, max_model_len: int) -> FinishReason | None:
        """Why the request stops after its latest output token, or None to go on."""
        last, params = self.output_token_ids[-1], self.params
        if last in params.stop_token_set:
            return FinishReason.STOP
        if not params.ignore_eos and last in self.eos_token_ids:
            return FinishReason.STOP
        outputs = self.num_resumed_tokens + len(self.output_token_ids)  # num_output_tokens
        if outputs >= params.max_tokens or len(self.all_token_ids) >= max_model_len:
            return FinishReason.LENGTH
        return None
