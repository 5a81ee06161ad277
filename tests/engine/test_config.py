"""Reading config.json into ModelConfig, and the checks the frozen configs make."""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from engine.config import (
    SUPPORTED_ARCHITECTURES,
    CacheConfig,
    ConfigError,
    EngineConfig,
    ModelConfig,
    ParallelConfig,
    RopeScaling,
    SchedulerConfig,
    load_model_config,
    rank_visible_gpu,
)

ModelFactory = Callable[..., Path]

LLAMA3_ROPE = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
               "high_freq_factor": 4.0, "original_max_position_embeddings": 256}


def edited_config(model_dir: Path, out_dir: Path, **changes: Any) -> Path:
    """A directory holding ``model_dir``'s config.json with ``changes`` (None deletes a key)."""
    raw = json.loads((model_dir / "config.json").read_text())
    for key, value in changes.items():
        if value is None:
            raw.pop(key, None)
        else:
            raw[key] = value
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / "config.json").write_text(json.dumps(raw))
    return out_dir


def make_model_config(**changes: Any) -> ModelConfig:
    base = ModelConfig(model_dir="unused", architecture="LlamaForCausalLM", hidden_size=64,
                       intermediate_size=128, num_layers=2, num_heads=4, num_kv_heads=2,
                       head_dim=16, vocab_size=128, max_position_embeddings=256,
                       rms_norm_eps=1e-5, rope_theta=10000.0)
    return dataclasses.replace(base, **changes)


# ------------------------------------------------------------------ architectures
def test_llama(model_factory: ModelFactory) -> None:
    cfg = load_model_config(model_factory("llama"))
    assert (cfg.architecture, cfg.family) == ("LlamaForCausalLM", "llama")
    assert (cfg.hidden_size, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim) == (64, 4, 2, 16)
    assert (cfg.num_layers, cfg.intermediate_size, cfg.max_model_len) == (4, 128, 2048)
    assert cfg.rms_norm_eps == pytest.approx(1e-5) and cfg.rope_theta == 10000.0
    assert not (cfg.attention_bias or cfg.qk_norm or cfg.tie_word_embeddings)
    assert cfg.rope_scaling is None and cfg.dtype == "float32"
    assert cfg.kv_layout == (4, 2, 16)


def test_mistral_without_window(model_factory: ModelFactory) -> None:
    cfg = load_model_config(model_factory("mistral"))
    assert (cfg.architecture, cfg.family) == ("MistralForCausalLM", "llama")


def test_qwen2_has_qkv_bias_and_tied_embeddings(model_factory: ModelFactory) -> None:
    model_dir = model_factory("qwen2")
    assert "attention_bias" not in json.loads((model_dir / "config.json").read_text())
    cfg = load_model_config(model_dir)
    assert cfg.family == "qwen2"
    assert cfg.attention_bias and cfg.tie_word_embeddings and not cfg.qk_norm


def test_qwen3_head_dim_comes_from_config(model_factory: ModelFactory) -> None:
    cfg = load_model_config(model_factory("qwen3"))
    assert cfg.family == "qwen3" and cfg.qk_norm and not cfg.attention_bias
    assert cfg.head_dim == 32 != cfg.hidden_size // cfg.num_heads
    assert cfg.kv_layout == (4, 2, 32)


def test_head_dim_defaults_to_hidden_over_heads(model_factory: ModelFactory,
                                                tmp_path: Path) -> None:
    model_dir = edited_config(model_factory("qwen3"), tmp_path, head_dim=None,
                              num_key_value_heads=None)
    cfg = load_model_config(model_dir)
    assert cfg.head_dim == 64 // 4
    assert cfg.num_kv_heads == cfg.num_heads  # no num_key_value_heads: multi-head attention


def test_dtype_is_validated(model_factory: ModelFactory) -> None:
    assert load_model_config(model_factory("llama"), dtype="bfloat16").dtype == "bfloat16"
    with pytest.raises(ConfigError, match="dtype"):
        load_model_config(model_factory("llama"), dtype="int8")


# ---------------------------------------------------------------------------- rope
def test_llama3_rope_scaling(model_factory: ModelFactory) -> None:
    cfg = load_model_config(model_factory("llama", rope_scaling=LLAMA3_ROPE, rope_theta=500000.0))
    assert cfg.rope_scaling == RopeScaling(factor=8.0, low_freq_factor=1.0,
                                           high_freq_factor=4.0,
                                           original_max_position_embeddings=256)
    assert cfg.rope_theta == 500000.0


def test_llama3_rope_parameters_transformers5(model_factory: ModelFactory,
                                              tmp_path: Path) -> None:
    # transformers >= 5: one "rope_parameters" dict holds the theta too.
    params = {**LLAMA3_ROPE, "rope_theta": 500000.0}
    model_dir = edited_config(model_factory("llama"), tmp_path, rope_parameters=params,
                              rope_scaling=None, rope_theta=None)
    cfg = load_model_config(model_dir)
    assert cfg.rope_theta == 500000.0
    assert cfg.rope_scaling is not None and cfg.rope_scaling.factor == 8.0
    assert cfg.rope_scaling.original_max_position_embeddings == 256


def test_default_rope_parameters_mean_no_scaling(model_factory: ModelFactory,
                                                 tmp_path: Path) -> None:
    model_dir = edited_config(model_factory("qwen3"), tmp_path,
                              rope_parameters={"rope_type": "default", "rope_theta": 1e6})
    cfg = load_model_config(model_dir)
    assert cfg.rope_scaling is None and cfg.rope_theta == 1e6


def test_unsupported_rope_type_is_refused(model_factory: ModelFactory, tmp_path: Path) -> None:
    model_dir = edited_config(model_factory("llama"), tmp_path,
                              rope_scaling={"rope_type": "yarn", "factor": 4.0})
    with pytest.raises(ConfigError, match="yarn"):
        load_model_config(model_dir)


# ---------------------------------------------------------------- refused configs
def test_unknown_architecture_names_the_supported_ones(model_factory: ModelFactory,
                                                       tmp_path: Path) -> None:
    model_dir = edited_config(model_factory("llama"), tmp_path, architectures=["GPT2LMHeadModel"])
    with pytest.raises(ConfigError, match="GPT2LMHeadModel") as info:
        load_model_config(model_dir)
    assert all(arch in str(info.value) for arch in SUPPORTED_ARCHITECTURES)


def test_missing_config_json_is_named(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="config.json"):
        load_model_config(tmp_path)


def test_sliding_window_is_refused(model_factory: ModelFactory, tmp_path: Path) -> None:
    model_dir = edited_config(model_factory("mistral"), tmp_path, sliding_window=16,
                              use_sliding_window=None, max_position_embeddings=2048)
    with pytest.raises(ConfigError, match="sliding_window"):
        load_model_config(model_dir)


def test_mistral_sliding_window_is_refused_whatever_use_sliding_window_says(
        model_factory: ModelFactory) -> None:
    # make_tiny_model's mistral config carries "use_sliding_window": false
    model_dir = model_factory("mistral", sliding_window=16)
    assert json.loads((model_dir / "config.json").read_text())["use_sliding_window"] is False
    with pytest.raises(ConfigError, match="sliding_window"):
        load_model_config(model_dir)


@pytest.mark.parametrize("changes", [{"sliding_window": 2048}, {"sliding_window": None},
                                     {"sliding_window": 16, "use_sliding_window": False}],
                         ids=["window_as_long_as_context", "no_window", "qwen_window_off"])
def test_ineffective_sliding_window_is_accepted(model_factory: ModelFactory, tmp_path: Path,
                                                changes: dict[str, Any]) -> None:
    model_dir = edited_config(model_factory("qwen2"), tmp_path, **changes)
    assert load_model_config(model_dir).family == "qwen2"


def test_vocab_larger_than_tokenizer_is_the_models_vocab(model_factory: ModelFactory) -> None:
    from engine import LLM, SamplingParams
    from engine.text.tokenizer import load_tokenizer

    model_dir = model_factory("llama", vocab_size=1024)
    tokenizer_size = load_tokenizer(model_dir).vocab_size
    cfg = load_model_config(model_dir)
    assert tokenizer_size < 1000 < cfg.vocab_size == 1024
    # ids past the tokenizer are valid model ids: embedded, and in the logits
    with LLM(model_dir, num_kv_blocks=8) as llm:
        assert llm.config.model.vocab_size == 1024
        params = SamplingParams(max_tokens=3, temperature=0.0, ignore_eos=True)
        (result,) = llm.generate([[5, 1000, 1023]], params)
    assert len(result.token_ids) == 3 and all(0 <= t < 1024 for t in result.token_ids)


# ----------------------------------------------------------------- frozen configs
@pytest.mark.parametrize(("config", "field"), [
    (make_model_config(), "head_dim"),
    (CacheConfig(), "block_size"),
    (SchedulerConfig(), "max_num_seqs"),
    (ParallelConfig(), "tensor_parallel_size"),
    (EngineConfig(model=make_model_config()), "device"),
], ids=lambda v: type(v).__name__ if not isinstance(v, str) else v)
def test_configs_are_frozen(config: object, field: str) -> None:
    with pytest.raises(dataclasses.FrozenInstanceError):
        setattr(config, field, 1)


@pytest.mark.parametrize("block_size", [0, -4, 3, 12, 24])
def test_cache_config_rejects_non_power_of_two_block_size(block_size: int) -> None:
    with pytest.raises(ConfigError, match="block_size"):
        CacheConfig(block_size=block_size)


def test_cache_config_accepts_powers_of_two() -> None:
    assert [CacheConfig(block_size=b).block_size for b in (1, 2, 16, 256)] == [1, 2, 16, 256]
    with pytest.raises(ConfigError, match="num_kv_blocks"):
        CacheConfig(num_kv_blocks=0)


def test_scheduler_and_parallel_configs_reject_non_positive_sizes() -> None:
    with pytest.raises(ConfigError, match="max_num_seqs"):
        SchedulerConfig(max_num_seqs=0)
    with pytest.raises(ConfigError, match="max_num_batched_tokens"):
        SchedulerConfig(max_num_batched_tokens=0)
    with pytest.raises(ConfigError, match="tensor_parallel_size"):
        ParallelConfig(tensor_parallel_size=0)


# ------------------------------------------------------------ tensor parallelism
@pytest.mark.parametrize(("num_heads", "num_kv_heads", "tp", "error"), [
    (4, 2, 3, "num_attention_heads=4"),
    (6, 3, 2, "num_key_value_heads=3"),
    (8, 2, 8, None),  # tp > KV heads: each KV head replicated on 4 ranks
    (4, 1, 4, None),  # MQA
    (4, 4, 2, None),
    (4, 2, 4, None),
])
def test_engine_config_tensor_parallel_sizes(num_heads: int, num_kv_heads: int, tp: int,
                                             error: str | None) -> None:
    model = make_model_config(num_heads=num_heads, num_kv_heads=num_kv_heads,
                              hidden_size=16 * num_heads, intermediate_size=96)
    parallel = ParallelConfig(tensor_parallel_size=tp)
    if error is None:
        assert EngineConfig(model=model, parallel=parallel).parallel.tensor_parallel_size == tp
    else:
        with pytest.raises(ConfigError, match=error):
            EngineConfig(model=model, parallel=parallel)


def test_engine_config_rejects_intermediate_size_not_divisible_by_tp() -> None:
    with pytest.raises(ConfigError, match="intermediate_size=130"):
        EngineConfig(model=make_model_config(intermediate_size=130),
                     parallel=ParallelConfig(tensor_parallel_size=4))


def test_rank_visible_gpu_gives_each_rank_its_own() -> None:
    environ = {"PDSERVE_RANK_GPUS": "3, 5,7"}
    assert [rank_visible_gpu(r, environ) for r in range(3)] == ["3", "5", "7"]
    assert rank_visible_gpu(0, {}) is None and rank_visible_gpu(1, {"PDSERVE_RANK_GPUS": ""}) is None
    with pytest.raises(ConfigError, match="no GPU for rank 3"):
        rank_visible_gpu(3, environ)
    with pytest.raises(ConfigError, match="no GPU for rank 1"):
        rank_visible_gpu(1, {"PDSERVE_RANK_GPUS": "0,,2"})
