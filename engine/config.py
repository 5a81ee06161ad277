"""Frozen configuration dataclasses, one per concern, composed into ``EngineConfig``.

Torch-free: the router reads ``ModelConfig`` (context length, vocabulary, KV layout)
without loading any weights. Derived values are properties; values computed at run
time (the number of KV blocks that fit) are not config: ``CacheConfig.num_kv_blocks``
is only what the user asks for; the resolved count is the executor's ``num_kv_blocks``.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

# Hugging Face architectures this engine implements, and the family each belongs to.
SUPPORTED_ARCHITECTURES: dict[str, str] = {
    "LlamaForCausalLM": "llama",
    "MistralForCausalLM": "llama",
    "Qwen2ForCausalLM": "qwen2",
    "Qwen3ForCausalLM": "qwen3",
}

_DTYPES = ("float32", "float16", "bfloat16")
# engine.kernels.linear.KERNELS' names (kept here, torch-free, to validate configs).
LINEAR_KERNELS = ("auto", "onednn", "torch", "mm_t", "onednn_gemv", "packed", "int8_woq",
                  "int8_torch", "int8_packed", "packed_gemm", "int8_packed_gemm")
# weight quantisations EngineConfig.quantization takes besides None (engine.kernels.quant)
QUANTIZATIONS = ("int8",)
# CacheConfig.kv_cache_dtype: "auto" (the model's dtype), int8, or fp8 (vLLM's names: "fp8"
# is "fp8_e4m3"), engine.attention.kv_quant
KV_CACHE_DTYPES = ("auto", "int8", "fp8", "fp8_e4m3", "fp8_e5m2")
# CacheConfig.kv_transfer_dtype: "auto" (as the cache holds it) or int8 for the wire only
KV_TRANSFER_DTYPES = ("auto", "int8")


class ConfigError(ValueError):
    """A configuration or checkpoint that this engine cannot serve; the message says why."""


@dataclass(frozen=True)
class RopeScaling:
    """Llama-3 style frequency-dependent RoPE scaling (``rope_type == "llama3"``)."""

    factor: float
    low_freq_factor: float
    high_freq_factor: float
    original_max_position_embeddings: int


@dataclass(frozen=True)
class ModelConfig:
    """What the engine needs from a checkpoint's ``config.json``."""

    model_dir: str
    architecture: str
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    vocab_size: int
    max_position_embeddings: int
    rms_norm_eps: float
    rope_theta: float
    rope_scaling: RopeScaling | None = None
    tie_word_embeddings: bool = False
    attention_bias: bool = False
    qk_norm: bool = False
    dtype: str = "float32"

    @property
    def family(self) -> str:
        return SUPPORTED_ARCHITECTURES[self.architecture]

    @property
    def kv_layout(self) -> tuple[int, int, int]:
        """Global KV layout: (layers, KV heads, head size) — what must match to exchange KV."""
        return (self.num_layers, self.num_kv_heads, self.head_dim)

    @property
    def max_model_len(self) -> int:
        return self.max_position_embeddings


@dataclass(frozen=True)
class CacheConfig:
    """Paged KV cache: block size, pool size (None = fit to memory), prefix caching."""

    block_size: int = 16
    num_kv_blocks: int | None = None
    enable_prefix_caching: bool = True
    hash_seed: int = 0
    # Fraction of free memory the KV pool may take when num_kv_blocks is None.
    memory_fraction: float = 0.25
    # CPU only: cap of the KV pool (all TP ranks' together) when num_kv_blocks is None
    max_kv_bytes: int = 512 << 20
    # "auto": the model's dtype; "int8": int8 values and an fp32 scale per token and head;
    # "fp8" / "fp8_e4m3" (the same: kept as "fp8_e4m3") or "fp8_e5m2": one byte per value
    kv_cache_dtype: str = "auto"
    # "auto": blocks travel as the cache holds them; "int8": quantised for the wire only, and
    # the blocks a request received so are keyed apart in the prefix cache (lossy)
    kv_transfer_dtype: str = "auto"

    def __post_init__(self) -> None:
        if self.kv_cache_dtype not in KV_CACHE_DTYPES:
            raise ConfigError(f"kv_cache_dtype must be one of {KV_CACHE_DTYPES}, "
                              f"got {self.kv_cache_dtype!r}")
        if self.kv_transfer_dtype not in KV_TRANSFER_DTYPES:
            raise ConfigError(f"kv_transfer_dtype must be one of {KV_TRANSFER_DTYPES}, "
                              f"got {self.kv_transfer_dtype!r}")
        if self.kv_cache_dtype == "fp8":
            object.__setattr__(self, "kv_cache_dtype", "fp8_e4m3")
        if self.kv_cache_dtype.startswith("fp8") and self.kv_transfer_dtype != "auto":
            raise ConfigError(f"kv_transfer_dtype {self.kv_transfer_dtype!r} quantises a "
                              "full-precision cache for the wire; an fp8 cache travels as "
                              "it lies, one byte per value already")
        if self.block_size <= 0 or self.block_size & (self.block_size - 1):
            raise ConfigError(f"block_size must be a positive power of two, got {self.block_size}")
        if self.num_kv_blocks is not None and self.num_kv_blocks <= 0:
            raise ConfigError(f"num_kv_blocks must be positive, got {self.num_kv_blocks}")

    @property
    def received_kv_salt(self) -> str:
        """The prefix-cache salt of a request whose KV another worker sends
        (``EngineCore.reserve_for_kv``): ``LOSSY_WIRE_SALT`` when it arrives quantised
        for the wire only, else none (it is exactly what this engine would compute)."""
        from engine.kvcache.block_hash import LOSSY_WIRE_SALT  # xxhash: not in the SDK

        lossy = self.kv_transfer_dtype == "int8" and self.kv_cache_dtype != "int8"
        return LOSSY_WIRE_SALT if lossy else ""


@dataclass(frozen=True)
class ParallelConfig:
    """Tensor parallelism of one engine (one worker)."""

    tensor_parallel_size: int = 1
    # Seconds a collective may wait before a dead or hung peer becomes an error.
    collective_timeout_s: float = 120.0

    def __post_init__(self) -> None:
        if self.tensor_parallel_size < 1:
            raise ConfigError(f"tensor_parallel_size must be >= 1, got {self.tensor_parallel_size}")


RANK_GPUS_ENV = "PDSERVE_RANK_GPUS"
"""Set by a launcher that gives every tensor-parallel rank a GPU of its own (``pdserve up
--ray``): the GPU ids of ranks 0, 1, ... in order, comma-separated, as
``CUDA_VISIBLE_DEVICES`` names them. The launcher starts the leader (rank 0, the worker
process) with ``CUDA_VISIBLE_DEVICES`` set to rank 0's id; each follower sets its own id
(``rank_visible_gpu``) before CUDA starts in it. Every rank process then sees exactly one
GPU, as ``cuda:0``. Unset: rank r uses ``cuda:r`` of the devices visible to the worker."""


def rank_visible_gpu(rank: int, environ: Mapping[str, str]) -> str | None:
    """The one GPU id rank ``rank`` may see under ``RANK_GPUS_ENV`` in ``environ``; None
    when the variable is unset or empty. ``ConfigError`` when it names no GPU for the rank."""
    listed = str(environ.get(RANK_GPUS_ENV) or "").strip()
    if not listed:
        return None
    gpus = [g.strip() for g in listed.split(",")]
    if rank >= len(gpus) or not gpus[rank]:
        raise ConfigError(f"${RANK_GPUS_ENV}={listed!r} names no GPU for rank {rank}")
    return gpus[rank]


@dataclass(frozen=True)
class SchedulerConfig:
    """Continuous batching limits: sequences per step and tokens per step (chunk budget)."""

    max_num_seqs: int = 64
    max_num_batched_tokens: int = 512
    # speculative decoding (engine.core.speculative; from vLLM's speculative_config by
    # speculative_fields): "" (none), "ngram" (up to num_speculative_tokens drafts a step
    # from a suffix of prompt_lookup_min..prompt_lookup_max tokens seen before) or
    # "draft_model" (drafts from the checkpoint in speculative_model, engine.core.drafter)
    speculative_method: str = ""
    num_speculative_tokens: int = 0
    prompt_lookup_max: int = 0
    prompt_lookup_min: int = 1
    speculative_model: str = ""
    draft_quantization: str | None = None  # the draft's weights quantised at load ("int8")
    # a step with more running requests than this does not speculate (None: any step may)
    speculative_disable_by_batch_size: int | None = None

    def __post_init__(self) -> None:
        if self.max_num_seqs < 1:
            raise ConfigError(f"max_num_seqs must be >= 1, got {self.max_num_seqs}")
        if self.max_num_batched_tokens < 1:
            raise ConfigError(
                f"max_num_batched_tokens must be >= 1, got {self.max_num_batched_tokens}"
            )
        if self.speculative_method not in ("", *SPECULATIVE_METHODS):
            raise ConfigError(f"speculative method must be one of {SPECULATIVE_METHODS}, "
                              f"got {self.speculative_method!r}")
        if self.speculative_method and not (
                1 <= self.num_speculative_tokens <= MAX_SPECULATIVE_TOKENS):
            raise ConfigError(
                f"{self.speculative_method} speculation needs 1 <= num_speculative_tokens <= "
                f"{MAX_SPECULATIVE_TOKENS} (got {self.num_speculative_tokens})")
        if self.speculative_method == "ngram" and not (
                1 <= self.prompt_lookup_min <= self.prompt_lookup_max):
            raise ConfigError(
                f"ngram speculation needs 1 <= prompt_lookup_min <= prompt_lookup_max (got "
                f"{self.prompt_lookup_min} and {self.prompt_lookup_max})")
        if (self.speculative_method == "draft_model") != bool(self.speculative_model):
            raise ConfigError("speculative_config: a draft model directory (\"model\") is "
                              "what draft_model speculation needs, and only it")
        if self.speculative_disable_by_batch_size is not None and (
                not self.speculative_method or self.speculative_disable_by_batch_size < 1):
            raise ConfigError("speculative_config: disable_by_batch_size must be >= 1, with a "
                              f"method; got {self.speculative_disable_by_batch_size}")
        if self.draft_quantization is not None and (
                self.speculative_method != "draft_model"
                or self.draft_quantization not in QUANTIZATIONS):
            raise ConfigError(f"speculative_config: quantization is a draft model's, one of "
                              f"{QUANTIZATIONS}; got {self.draft_quantization!r}")


SPECULATIVE_METHODS = ("ngram", "draft_model")
MAX_SPECULATIVE_TOKENS = 16
_SPECULATIVE_KEYS = ("method", "num_speculative_tokens", "prompt_lookup_max",
                     "prompt_lookup_min", "disable_by_batch_size", "model", "quantization")
_NGRAM_ONLY = ("prompt_lookup_max", "prompt_lookup_min")


def speculative_fields(config: Mapping[str, Any] | str | None) -> dict[str, Any]:
    """``SchedulerConfig``'s speculative fields from vLLM's ``speculative_config`` (a dict,
    or its JSON text; None: none): ``{"method": "ngram", "num_speculative_tokens": k,
    "prompt_lookup_max": a, "prompt_lookup_min": b}`` (``prompt_lookup_min`` defaults to
    1, ``prompt_lookup_max`` to ``k``) or ``{"method": "draft_model", "model": DIR,
    "num_speculative_tokens": k, "quantization": "int8"}`` (the draft's weights quantised
    at load; optional); either takes ``"disable_by_batch_size": n`` (a step with more than
    ``n`` running requests does not speculate). ``ConfigError`` names what is wrong."""
    if config is None:
        return {}
    if isinstance(config, str):
        try:
            config = json.loads(config)
        except ValueError as exc:
            raise ConfigError(f"speculative_config is not JSON: {exc}") from None
    if not isinstance(config, Mapping):
        raise ConfigError("speculative_config must be an object")
    unknown = sorted(set(config) - set(_SPECULATIVE_KEYS))
    if unknown:
        raise ConfigError(f"speculative_config: unknown keys {unknown} (this engine takes "
                          f"{list(_SPECULATIVE_KEYS)}; method: {list(SPECULATIVE_METHODS)})")
    counts = _SPECULATIVE_KEYS[1:5]
    values = {key: config.get(key) for key in counts}
    if any(v is not None and (isinstance(v, bool) or not isinstance(v, int))
           for v in values.values()):
        raise ConfigError(f"speculative_config: {', '.join(counts)} must be integers")
    model = config.get("model")
    if model is not None and not (isinstance(model, str) and model):
        raise ConfigError("speculative_config: model must be a directory's path")
    if config.get("method") == "draft_model" and (ngram := [key for key in _NGRAM_ONLY
                                                            if key in config]):
        raise ConfigError(f"speculative_config: {ngram} are n-gram lookup's, not "
                          "draft_model's")
    k = values["num_speculative_tokens"] or 0
    return {"speculative_method": config.get("method"), "num_speculative_tokens": k,
            "prompt_lookup_max": values["prompt_lookup_max"] or k,
            "prompt_lookup_min": values["prompt_lookup_min"] or 1,
            "speculative_model": model or "", "draft_quantization": config.get("quantization"),
            "speculative_disable_by_batch_size": values["disable_by_batch_size"]}


@dataclass(frozen=True)
class EngineConfig:
    """Everything one engine (offline ``LLM`` or a worker) is built from."""

    model: ModelConfig
    cache: CacheConfig = field(default_factory=CacheConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    scheduler: SchedulerConfig = field(default_factory=SchedulerConfig)
    device: str = "cpu"
    # "auto": chosen by measurement per weight shape (engine.kernels.choice; the
    # PDSERVE_LINEAR_KERNEL environment variable can force one), or force one here.
    linear_kernel: str = "auto"
    # None: the linear weights as loaded; "int8": quantised at load to int8 with a scale
    # per output feature (weight-only; engine.kernels.quant), multiplied by the int8_*
    # kernels (linear_kernel "auto" chooses among them by measurement)
    quantization: str | None = None
    # "package.module:factory" built on every rank (see engine.tp.rank_plugin), or None,
    # and an opaque string handed to it (e.g. JSON of the plugin's own config dataclass).
    rank_plugin: str | None = None
    rank_plugin_config: str = ""

    def __post_init__(self) -> None:
        if self.linear_kernel not in LINEAR_KERNELS:
            raise ConfigError(f"linear_kernel must be one of {LINEAR_KERNELS}, got {self.linear_kernel!r}")
        if self.quantization is not None and self.quantization not in QUANTIZATIONS:
            raise ConfigError(f"quantization must be None or one of {QUANTIZATIONS}, "
                              f"got {self.quantization!r}")
        forced_int8 = self.linear_kernel.startswith("int8_")
        if self.linear_kernel != "auto" and forced_int8 != (self.quantization == "int8"):
            raise ConfigError(f"linear_kernel={self.linear_kernel!r} does not multiply "
                              f"{'int8' if self.quantization else 'unquantised'} weights "
                              f"(quantization={self.quantization!r}); int8 weights take "
                              "int8_packed, int8_packed_gemm, int8_woq or int8_torch, the "
                              "others the rest")
        tp = self.parallel.tensor_parallel_size
        m = self.model
        for name, value in (("num_attention_heads", m.num_heads), ("intermediate_size", m.intermediate_size)):
            if value % tp:
                raise ConfigError(f"{name}={value} is not divisible by tensor_parallel_size={tp}")
        if m.num_kv_heads % tp and tp % m.num_kv_heads:
            raise ConfigError(
                f"num_key_value_heads={m.num_kv_heads} and tensor_parallel_size={tp}: "
                "one must divide the other"
            )


def load_model_config(model_dir: str | Path, *, dtype: str = "float32") -> ModelConfig:
    """Read ``config.json`` of a Hugging Face checkpoint directory.

    Raises ``ConfigError`` naming the missing file, the unknown architecture or the
    unsupported feature (e.g. a sliding window, which this engine does not implement).
    """
    path = Path(model_dir) / "config.json"
    if not path.is_file():
        raise ConfigError(f"missing config.json in model directory {model_dir}")
    if dtype not in _DTYPES:
        raise ConfigError(f"dtype must be one of {_DTYPES}, got {dtype!r}")
    raw: dict[str, Any] = json.loads(path.read_text())
    architecture = _architecture(raw, path)
    _refuse_sliding_window(raw, SUPPORTED_ARCHITECTURES[architecture])
    num_heads = int(raw["num_attention_heads"])
    hidden = int(raw["hidden_size"])
    head_dim = raw.get("head_dim") or hidden // num_heads
    family = SUPPORTED_ARCHITECTURES[architecture]
    # transformers >= 5 writes "rope_parameters"; older checkpoints "rope_scaling" + "rope_theta".
    rope = dict(raw.get("rope_parameters") or raw.get("rope_scaling") or {})
    return ModelConfig(
        model_dir=str(model_dir),
        architecture=architecture,
        hidden_size=hidden,
        intermediate_size=int(raw["intermediate_size"]),
        num_layers=int(raw["num_hidden_layers"]),
        num_heads=num_heads,
        num_kv_heads=int(raw.get("num_key_value_heads") or num_heads),
        head_dim=int(head_dim),
        vocab_size=int(raw["vocab_size"]),
        max_position_embeddings=int(raw.get("max_position_embeddings", 2048)),
        rms_norm_eps=float(raw.get("rms_norm_eps", 1e-6)),
        rope_theta=float(rope.get("rope_theta", raw.get("rope_theta", 10000.0))),
        rope_scaling=_rope_scaling(rope),
        tie_word_embeddings=bool(raw.get("tie_word_embeddings", False)),
        attention_bias=family == "qwen2" or bool(raw.get("attention_bias", False)),
        qk_norm=family == "qwen3",
        dtype=dtype,
    )


def _architecture(raw: dict[str, Any], path: Path) -> str:
    archs = raw.get("architectures") or []
    for arch in archs:
        if arch in SUPPORTED_ARCHITECTURES:
            return str(arch)
    raise ConfigError(
        f"{path}: unsupported architecture {archs or '(none given)'}; "
        f"supported: {sorted(SUPPORTED_ARCHITECTURES)}"
    )


def _refuse_sliding_window(raw: dict[str, Any], family: str) -> None:
    window = raw.get("sliding_window")
    # Qwen honours use_sliding_window; Mistral applies sliding_window whenever it is set.
    if window is None or (family != "llama" and raw.get("use_sliding_window") is False):
        return
    if window >= raw.get("max_position_embeddings", window):
        return  # a window as long as the context is no window at all
    raise ConfigError(
        f"sliding_window={window} is not implemented by pdserve's attention; "
        "use a checkpoint without a sliding window"
    )


def _rope_scaling(raw: dict[str, Any]) -> RopeScaling | None:
    kind = raw.get("rope_type", raw.get("type", "default"))
    if kind == "default":
        return None
    if kind != "llama3":
        raise ConfigError(f"rope_scaling type {kind!r} is not supported (supported: llama3)")
    return RopeScaling(
        factor=float(raw["factor"]),
        low_freq_factor=float(raw["low_freq_factor"]),
        high_freq_factor=float(raw["high_freq_factor"]),
        original_max_position_embeddings=int(raw["original_max_position_embeddings"]),
    )
