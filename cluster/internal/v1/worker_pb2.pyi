from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class SamplingParams(_message.Message):
    __slots__ = ("max_tokens", "temperature", "top_p", "top_k", "seed", "stop", "stop_token_ids", "ignore_eos", "min_p", "min_tokens", "presence_penalty", "frequency_penalty", "repetition_penalty", "logit_bias", "logprobs", "structured", "prompt_logprobs")
    class LogitBiasEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: int
        value: float
        def __init__(self, key: _Optional[int] = ..., value: _Optional[float] = ...) -> None: ...
    MAX_TOKENS_FIELD_NUMBER: _ClassVar[int]
    TEMPERATURE_FIELD_NUMBER: _ClassVar[int]
    TOP_P_FIELD_NUMBER: _ClassVar[int]
    TOP_K_FIELD_NUMBER: _ClassVar[int]
    SEED_FIELD_NUMBER: _ClassVar[int]
    STOP_FIELD_NUMBER: _ClassVar[int]
    STOP_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    IGNORE_EOS_FIELD_NUMBER: _ClassVar[int]
    MIN_P_FIELD_NUMBER: _ClassVar[int]
    MIN_TOKENS_FIELD_NUMBER: _ClassVar[int]
    PRESENCE_PENALTY_FIELD_NUMBER: _ClassVar[int]
    FREQUENCY_PENALTY_FIELD_NUMBER: _ClassVar[int]
    REPETITION_PENALTY_FIELD_NUMBER: _ClassVar[int]
    LOGIT_BIAS_FIELD_NUMBER: _ClassVar[int]
    LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    STRUCTURED_FIELD_NUMBER: _ClassVar[int]
    PROMPT_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    max_tokens: int
    temperature: float
    top_p: float
    top_k: int
    seed: int
    stop: _containers.RepeatedScalarFieldContainer[str]
    stop_token_ids: _containers.RepeatedScalarFieldContainer[int]
    ignore_eos: bool
    min_p: float
    min_tokens: int
    presence_penalty: float
    frequency_penalty: float
    repetition_penalty: float
    logit_bias: _containers.ScalarMap[int, float]
    logprobs: int
    structured: StructuredOutput
    prompt_logprobs: int
    def __init__(self, max_tokens: _Optional[int] = ..., temperature: _Optional[float] = ..., top_p: _Optional[float] = ..., top_k: _Optional[int] = ..., seed: _Optional[int] = ..., stop: _Optional[_Iterable[str]] = ..., stop_token_ids: _Optional[_Iterable[int]] = ..., ignore_eos: _Optional[bool] = ..., min_p: _Optional[float] = ..., min_tokens: _Optional[int] = ..., presence_penalty: _Optional[float] = ..., frequency_penalty: _Optional[float] = ..., repetition_penalty: _Optional[float] = ..., logit_bias: _Optional[_Mapping[int, float]] = ..., logprobs: _Optional[int] = ..., structured: _Optional[_Union[StructuredOutput, _Mapping]] = ..., prompt_logprobs: _Optional[int] = ...) -> None: ...

class StructuredOutput(_message.Message):
    __slots__ = ("kind", "spec")
    KIND_FIELD_NUMBER: _ClassVar[int]
    SPEC_FIELD_NUMBER: _ClassVar[int]
    kind: str
    spec: str
    def __init__(self, kind: _Optional[str] = ..., spec: _Optional[str] = ...) -> None: ...

class TokenLogprobs(_message.Message):
    __slots__ = ("token_id", "logprob", "rank", "top_token_ids", "top_logprobs")
    TOKEN_ID_FIELD_NUMBER: _ClassVar[int]
    LOGPROB_FIELD_NUMBER: _ClassVar[int]
    RANK_FIELD_NUMBER: _ClassVar[int]
    TOP_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    TOP_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    token_id: int
    logprob: float
    rank: int
    top_token_ids: _containers.RepeatedScalarFieldContainer[int]
    top_logprobs: _containers.RepeatedScalarFieldContainer[float]
    def __init__(self, token_id: _Optional[int] = ..., logprob: _Optional[float] = ..., rank: _Optional[int] = ..., top_token_ids: _Optional[_Iterable[int]] = ..., top_logprobs: _Optional[_Iterable[float]] = ...) -> None: ...

class KVTarget(_message.Message):
    __slots__ = ("kv_address", "tensor_parallel_size", "transfer_id", "num_cached_blocks")
    KV_ADDRESS_FIELD_NUMBER: _ClassVar[int]
    TENSOR_PARALLEL_SIZE_FIELD_NUMBER: _ClassVar[int]
    TRANSFER_ID_FIELD_NUMBER: _ClassVar[int]
    NUM_CACHED_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    kv_address: str
    tensor_parallel_size: int
    transfer_id: int
    num_cached_blocks: int
    def __init__(self, kv_address: _Optional[str] = ..., tensor_parallel_size: _Optional[int] = ..., transfer_id: _Optional[int] = ..., num_cached_blocks: _Optional[int] = ...) -> None: ...

class Lease(_message.Message):
    __slots__ = ("key", "ttl_ms")
    KEY_FIELD_NUMBER: _ClassVar[int]
    TTL_MS_FIELD_NUMBER: _ClassVar[int]
    key: str
    ttl_ms: int
    def __init__(self, key: _Optional[str] = ..., ttl_ms: _Optional[int] = ...) -> None: ...

class ReserveRequest(_message.Message):
    __slots__ = ("client_request_id", "prompt_token_ids", "sampling", "transfer_id", "wait_ms", "attempt_id", "lease", "num_resumed_tokens", "expected_cached_blocks")
    CLIENT_REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    PROMPT_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    SAMPLING_FIELD_NUMBER: _ClassVar[int]
    TRANSFER_ID_FIELD_NUMBER: _ClassVar[int]
    WAIT_MS_FIELD_NUMBER: _ClassVar[int]
    ATTEMPT_ID_FIELD_NUMBER: _ClassVar[int]
    LEASE_FIELD_NUMBER: _ClassVar[int]
    NUM_RESUMED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    EXPECTED_CACHED_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    client_request_id: str
    prompt_token_ids: _containers.RepeatedScalarFieldContainer[int]
    sampling: SamplingParams
    transfer_id: int
    wait_ms: int
    attempt_id: str
    lease: Lease
    num_resumed_tokens: int
    expected_cached_blocks: int
    def __init__(self, client_request_id: _Optional[str] = ..., prompt_token_ids: _Optional[_Iterable[int]] = ..., sampling: _Optional[_Union[SamplingParams, _Mapping]] = ..., transfer_id: _Optional[int] = ..., wait_ms: _Optional[int] = ..., attempt_id: _Optional[str] = ..., lease: _Optional[_Union[Lease, _Mapping]] = ..., num_resumed_tokens: _Optional[int] = ..., expected_cached_blocks: _Optional[int] = ...) -> None: ...

class ReserveResponse(_message.Message):
    __slots__ = ("accepted", "reason", "num_blocks", "target")
    ACCEPTED_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    NUM_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    TARGET_FIELD_NUMBER: _ClassVar[int]
    accepted: bool
    reason: str
    num_blocks: int
    target: KVTarget
    def __init__(self, accepted: _Optional[bool] = ..., reason: _Optional[str] = ..., num_blocks: _Optional[int] = ..., target: _Optional[_Union[KVTarget, _Mapping]] = ...) -> None: ...

class GenerateRequest(_message.Message):
    __slots__ = ("client_request_id", "attempt_id")
    CLIENT_REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    ATTEMPT_ID_FIELD_NUMBER: _ClassVar[int]
    client_request_id: str
    attempt_id: str
    def __init__(self, client_request_id: _Optional[str] = ..., attempt_id: _Optional[str] = ...) -> None: ...

class GenerateLocalRequest(_message.Message):
    __slots__ = ("client_request_id", "prompt_token_ids", "sampling", "attempt_id", "lease", "num_resumed_tokens")
    CLIENT_REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    PROMPT_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    SAMPLING_FIELD_NUMBER: _ClassVar[int]
    ATTEMPT_ID_FIELD_NUMBER: _ClassVar[int]
    LEASE_FIELD_NUMBER: _ClassVar[int]
    NUM_RESUMED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    client_request_id: str
    prompt_token_ids: _containers.RepeatedScalarFieldContainer[int]
    sampling: SamplingParams
    attempt_id: str
    lease: Lease
    num_resumed_tokens: int
    def __init__(self, client_request_id: _Optional[str] = ..., prompt_token_ids: _Optional[_Iterable[int]] = ..., sampling: _Optional[_Union[SamplingParams, _Mapping]] = ..., attempt_id: _Optional[str] = ..., lease: _Optional[_Union[Lease, _Mapping]] = ..., num_resumed_tokens: _Optional[int] = ...) -> None: ...

class TokenChunk(_message.Message):
    __slots__ = ("token_ids", "text", "finish_reason", "usage", "timings", "logprobs", "prompt_logprobs")
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    TEXT_FIELD_NUMBER: _ClassVar[int]
    FINISH_REASON_FIELD_NUMBER: _ClassVar[int]
    USAGE_FIELD_NUMBER: _ClassVar[int]
    TIMINGS_FIELD_NUMBER: _ClassVar[int]
    LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    PROMPT_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    text: str
    finish_reason: str
    usage: Usage
    timings: DecodeTimings
    logprobs: _containers.RepeatedCompositeFieldContainer[TokenLogprobs]
    prompt_logprobs: _containers.RepeatedCompositeFieldContainer[TokenLogprobs]
    def __init__(self, token_ids: _Optional[_Iterable[int]] = ..., text: _Optional[str] = ..., finish_reason: _Optional[str] = ..., usage: _Optional[_Union[Usage, _Mapping]] = ..., timings: _Optional[_Union[DecodeTimings, _Mapping]] = ..., logprobs: _Optional[_Iterable[_Union[TokenLogprobs, _Mapping]]] = ..., prompt_logprobs: _Optional[_Iterable[_Union[TokenLogprobs, _Mapping]]] = ...) -> None: ...

class DecodeTimings(_message.Message):
    __slots__ = ("first_chunk_us",)
    FIRST_CHUNK_US_FIELD_NUMBER: _ClassVar[int]
    first_chunk_us: int
    def __init__(self, first_chunk_us: _Optional[int] = ...) -> None: ...

class Usage(_message.Message):
    __slots__ = ("prompt_tokens", "completion_tokens", "cached_tokens")
    PROMPT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    COMPLETION_TOKENS_FIELD_NUMBER: _ClassVar[int]
    CACHED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int
    def __init__(self, prompt_tokens: _Optional[int] = ..., completion_tokens: _Optional[int] = ..., cached_tokens: _Optional[int] = ...) -> None: ...

class PrefillRequest(_message.Message):
    __slots__ = ("client_request_id", "prompt_token_ids", "sampling", "target", "attempt_id", "lease", "num_resumed_tokens", "moved_from", "max_queued_tokens")
    CLIENT_REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    PROMPT_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    SAMPLING_FIELD_NUMBER: _ClassVar[int]
    TARGET_FIELD_NUMBER: _ClassVar[int]
    ATTEMPT_ID_FIELD_NUMBER: _ClassVar[int]
    LEASE_FIELD_NUMBER: _ClassVar[int]
    NUM_RESUMED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    MOVED_FROM_FIELD_NUMBER: _ClassVar[int]
    MAX_QUEUED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    client_request_id: str
    prompt_token_ids: _containers.RepeatedScalarFieldContainer[int]
    sampling: SamplingParams
    target: KVTarget
    attempt_id: str
    lease: Lease
    num_resumed_tokens: int
    moved_from: str
    max_queued_tokens: int
    def __init__(self, client_request_id: _Optional[str] = ..., prompt_token_ids: _Optional[_Iterable[int]] = ..., sampling: _Optional[_Union[SamplingParams, _Mapping]] = ..., target: _Optional[_Union[KVTarget, _Mapping]] = ..., attempt_id: _Optional[str] = ..., lease: _Optional[_Union[Lease, _Mapping]] = ..., num_resumed_tokens: _Optional[int] = ..., moved_from: _Optional[str] = ..., max_queued_tokens: _Optional[int] = ...) -> None: ...

class PrefillResponse(_message.Message):
    __slots__ = ("first_token_id", "num_cached_tokens", "num_prompt_tokens", "timings", "first_token_logprobs", "prompt_logprobs", "prefill_tokens_per_s")
    FIRST_TOKEN_ID_FIELD_NUMBER: _ClassVar[int]
    NUM_CACHED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    NUM_PROMPT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    TIMINGS_FIELD_NUMBER: _ClassVar[int]
    FIRST_TOKEN_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    PROMPT_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    PREFILL_TOKENS_PER_S_FIELD_NUMBER: _ClassVar[int]
    first_token_id: int
    num_cached_tokens: int
    num_prompt_tokens: int
    timings: PrefillTimings
    first_token_logprobs: TokenLogprobs
    prompt_logprobs: _containers.RepeatedCompositeFieldContainer[TokenLogprobs]
    prefill_tokens_per_s: float
    def __init__(self, first_token_id: _Optional[int] = ..., num_cached_tokens: _Optional[int] = ..., num_prompt_tokens: _Optional[int] = ..., timings: _Optional[_Union[PrefillTimings, _Mapping]] = ..., first_token_logprobs: _Optional[_Union[TokenLogprobs, _Mapping]] = ..., prompt_logprobs: _Optional[_Iterable[_Union[TokenLogprobs, _Mapping]]] = ..., prefill_tokens_per_s: _Optional[float] = ...) -> None: ...

class PrefillTimings(_message.Message):
    __slots__ = ("queue_us", "compute_us", "transfer_us")
    QUEUE_US_FIELD_NUMBER: _ClassVar[int]
    COMPUTE_US_FIELD_NUMBER: _ClassVar[int]
    TRANSFER_US_FIELD_NUMBER: _ClassVar[int]
    queue_us: int
    compute_us: int
    transfer_us: int
    def __init__(self, queue_us: _Optional[int] = ..., compute_us: _Optional[int] = ..., transfer_us: _Optional[int] = ...) -> None: ...

class AbortRequest(_message.Message):
    __slots__ = ("client_request_id", "attempt_id")
    CLIENT_REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    ATTEMPT_ID_FIELD_NUMBER: _ClassVar[int]
    client_request_id: str
    attempt_id: str
    def __init__(self, client_request_id: _Optional[str] = ..., attempt_id: _Optional[str] = ...) -> None: ...

class AbortResponse(_message.Message):
    __slots__ = ("found",)
    FOUND_FIELD_NUMBER: _ClassVar[int]
    found: bool
    def __init__(self, found: _Optional[bool] = ...) -> None: ...

class InfoRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class KVCacheUsage(_message.Message):
    __slots__ = ("total_blocks", "free_blocks", "cached_blocks", "pinned_blocks", "in_use_blocks")
    TOTAL_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    FREE_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    CACHED_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    PINNED_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    IN_USE_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    total_blocks: int
    free_blocks: int
    cached_blocks: int
    pinned_blocks: int
    in_use_blocks: int
    def __init__(self, total_blocks: _Optional[int] = ..., free_blocks: _Optional[int] = ..., cached_blocks: _Optional[int] = ..., pinned_blocks: _Optional[int] = ..., in_use_blocks: _Optional[int] = ...) -> None: ...

class WorkerInfo(_message.Message):
    __slots__ = ("worker_id", "role", "tensor_parallel_size", "model_fingerprint", "kv", "pending_transfers", "open_kv_channels", "running_requests", "waiting_requests", "num_preemptions", "num_expired_requests", "num_started_requests", "num_failed_transfers", "attempt_ids", "watched_leases", "queued_commands", "num_lease_aborts", "num_expired_commands", "num_unexpected_acks")
    WORKER_ID_FIELD_NUMBER: _ClassVar[int]
    ROLE_FIELD_NUMBER: _ClassVar[int]
    TENSOR_PARALLEL_SIZE_FIELD_NUMBER: _ClassVar[int]
    MODEL_FINGERPRINT_FIELD_NUMBER: _ClassVar[int]
    KV_FIELD_NUMBER: _ClassVar[int]
    PENDING_TRANSFERS_FIELD_NUMBER: _ClassVar[int]
    OPEN_KV_CHANNELS_FIELD_NUMBER: _ClassVar[int]
    RUNNING_REQUESTS_FIELD_NUMBER: _ClassVar[int]
    WAITING_REQUESTS_FIELD_NUMBER: _ClassVar[int]
    NUM_PREEMPTIONS_FIELD_NUMBER: _ClassVar[int]
    NUM_EXPIRED_REQUESTS_FIELD_NUMBER: _ClassVar[int]
    NUM_STARTED_REQUESTS_FIELD_NUMBER: _ClassVar[int]
    NUM_FAILED_TRANSFERS_FIELD_NUMBER: _ClassVar[int]
    ATTEMPT_IDS_FIELD_NUMBER: _ClassVar[int]
    WATCHED_LEASES_FIELD_NUMBER: _ClassVar[int]
    QUEUED_COMMANDS_FIELD_NUMBER: _ClassVar[int]
    NUM_LEASE_ABORTS_FIELD_NUMBER: _ClassVar[int]
    NUM_EXPIRED_COMMANDS_FIELD_NUMBER: _ClassVar[int]
    NUM_UNEXPECTED_ACKS_FIELD_NUMBER: _ClassVar[int]
    worker_id: str
    role: str
    tensor_parallel_size: int
    model_fingerprint: str
    kv: KVCacheUsage
    pending_transfers: int
    open_kv_channels: int
    running_requests: int
    waiting_requests: int
    num_preemptions: int
    num_expired_requests: int
    num_started_requests: int
    num_failed_transfers: int
    attempt_ids: _containers.RepeatedScalarFieldContainer[str]
    watched_leases: int
    queued_commands: int
    num_lease_aborts: int
    num_expired_commands: int
    num_unexpected_acks: int
    def __init__(self, worker_id: _Optional[str] = ..., role: _Optional[str] = ..., tensor_parallel_size: _Optional[int] = ..., model_fingerprint: _Optional[str] = ..., kv: _Optional[_Union[KVCacheUsage, _Mapping]] = ..., pending_transfers: _Optional[int] = ..., open_kv_channels: _Optional[int] = ..., running_requests: _Optional[int] = ..., waiting_requests: _Optional[int] = ..., num_preemptions: _Optional[int] = ..., num_expired_requests: _Optional[int] = ..., num_started_requests: _Optional[int] = ..., num_failed_transfers: _Optional[int] = ..., attempt_ids: _Optional[_Iterable[str]] = ..., watched_leases: _Optional[int] = ..., queued_commands: _Optional[int] = ..., num_lease_aborts: _Optional[int] = ..., num_expired_commands: _Optional[int] = ..., num_unexpected_acks: _Optional[int] = ...) -> None: ...

class RouterHoldings(_message.Message):
    __slots__ = ("router_id", "inflight_requests", "request_ids", "attempt_ids", "pending_aborts", "open_channels", "lease_keys", "unwritten_leases", "prompts_in_flight")
    ROUTER_ID_FIELD_NUMBER: _ClassVar[int]
    INFLIGHT_REQUESTS_FIELD_NUMBER: _ClassVar[int]
    REQUEST_IDS_FIELD_NUMBER: _ClassVar[int]
    ATTEMPT_IDS_FIELD_NUMBER: _ClassVar[int]
    PENDING_ABORTS_FIELD_NUMBER: _ClassVar[int]
    OPEN_CHANNELS_FIELD_NUMBER: _ClassVar[int]
    LEASE_KEYS_FIELD_NUMBER: _ClassVar[int]
    UNWRITTEN_LEASES_FIELD_NUMBER: _ClassVar[int]
    PROMPTS_IN_FLIGHT_FIELD_NUMBER: _ClassVar[int]
    router_id: str
    inflight_requests: int
    request_ids: _containers.RepeatedScalarFieldContainer[str]
    attempt_ids: _containers.RepeatedScalarFieldContainer[str]
    pending_aborts: int
    open_channels: int
    lease_keys: _containers.RepeatedScalarFieldContainer[str]
    unwritten_leases: int
    prompts_in_flight: int
    def __init__(self, router_id: _Optional[str] = ..., inflight_requests: _Optional[int] = ..., request_ids: _Optional[_Iterable[str]] = ..., attempt_ids: _Optional[_Iterable[str]] = ..., pending_aborts: _Optional[int] = ..., open_channels: _Optional[int] = ..., lease_keys: _Optional[_Iterable[str]] = ..., unwritten_leases: _Optional[int] = ..., prompts_in_flight: _Optional[int] = ...) -> None: ...

class KVSnapshotRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class KVSnapshotReply(_message.Message):
    __slots__ = ("publishing", "epoch", "seq", "block_hashes")
    PUBLISHING_FIELD_NUMBER: _ClassVar[int]
    EPOCH_FIELD_NUMBER: _ClassVar[int]
    SEQ_FIELD_NUMBER: _ClassVar[int]
    BLOCK_HASHES_FIELD_NUMBER: _ClassVar[int]
    publishing: bool
    epoch: int
    seq: int
    block_hashes: bytes
    def __init__(self, publishing: _Optional[bool] = ..., epoch: _Optional[int] = ..., seq: _Optional[int] = ..., block_hashes: _Optional[bytes] = ...) -> None: ...

class SetRoleRequest(_message.Message):
    __slots__ = ("role", "move_decoding")
    ROLE_FIELD_NUMBER: _ClassVar[int]
    MOVE_DECODING_FIELD_NUMBER: _ClassVar[int]
    role: str
    move_decoding: bool
    def __init__(self, role: _Optional[str] = ..., move_decoding: _Optional[bool] = ...) -> None: ...

class SetRoleReply(_message.Message):
    __slots__ = ("role", "previous_role", "roles")
    ROLE_FIELD_NUMBER: _ClassVar[int]
    PREVIOUS_ROLE_FIELD_NUMBER: _ClassVar[int]
    ROLES_FIELD_NUMBER: _ClassVar[int]
    role: str
    previous_role: str
    roles: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, role: _Optional[str] = ..., previous_role: _Optional[str] = ..., roles: _Optional[_Iterable[str]] = ...) -> None: ...
