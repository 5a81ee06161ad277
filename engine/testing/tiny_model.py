"""Random-weight checkpoints in the Hugging Face layout, built without `transformers`.

`make_tiny_model` writes a directory that `transformers.AutoModelForCausalLM` and
`AutoTokenizer` load as-is (config.json, safetensors weights, tokenizer.json,
tokenizer_config.json, generation_config.json), so the engine's loader is exercised on the
same files it reads for real checkpoints, and HF serves as the correctness reference.

Weights are drawn from `torch.Generator` seeded per tensor from (seed, tensor name), with a
scale large enough that top-1/top-2 logits rarely tie (std-0.02 random models produce
near-ties that flip greedy choices under float noise). The tokenizer is a byte-level BPE
trained on an embedded multilingual corpus, so some tokens are partial UTF-8 sequences.
Everything is deterministic: the same arguments give byte-identical files.

Depends on torch, tokenizers and the stdlib only (the safetensors files are written
directly, streaming one tensor at a time).
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import shutil
import struct
import tempfile
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from engine.testing.tokenizer_corpus import (
    BOS_TOKEN_ID,
    EOS_TOKEN_ID,
    PAD_TOKEN_ID,
    tokenizer_config,
    train_tokenizer,
)

ARCHS = ("llama", "mistral", "qwen2", "qwen3")

__all__ = [
    "ARCHS",
    "BOS_TOKEN_ID",
    "EOS_TOKEN_ID",
    "PAD_TOKEN_ID",
    "PRESETS",
    "default_model_cache_dir",
    "ensure_cached_model",
    "ensure_demo_model",
    "make_tiny_model",
]
# Model sizes per preset. `tokenizer_vocab_size` is the BPE training target (the corpus
# may support fewer merges); `vocab_size: None` means "tokenizer size rounded up to the
# next multiple of 64, strictly above it", so some model ids have no text.
PRESETS: dict[str, dict[str, Any]] = {
    "tiny": {
        "hidden_size": 64,
        "intermediate_size": 128,
        "num_hidden_layers": 4,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "max_position_embeddings": 2048,
        "vocab_size": None,
        "tokenizer_vocab_size": 700,
    },
    "bench55m": {
        "hidden_size": 512,
        "intermediate_size": 1408,
        "num_hidden_layers": 8,
        "num_attention_heads": 8,
        "num_key_value_heads": 2,
        "max_position_embeddings": 4096,
        "vocab_size": 32000,
        "tokenizer_vocab_size": 4096,
    },
}

# Architecture-specific config.json keys (model_type is the arch name itself).
_ARCH_CLASS = {
    "llama": "LlamaForCausalLM",
    "mistral": "MistralForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
    "qwen3": "Qwen3ForCausalLM",
}
_NO_SLIDING = {"sliding_window": None, "use_sliding_window": False}
_ARCH_CONFIG: dict[str, dict[str, Any]] = {
    "llama": {"attention_bias": False, "mlp_bias": False, "rms_norm_eps": 1e-5},
    "mistral": {**_NO_SLIDING, "rms_norm_eps": 1e-5},
    "qwen2": {**_NO_SLIDING, "rms_norm_eps": 1e-6, "tie_word_embeddings": True},
    "qwen3": {**_NO_SLIDING, "attention_bias": False, "rms_norm_eps": 1e-6},
}
# qwen3's head_dim is 2 * hidden / heads (as in Qwen3-0.6B), so code that assumes
# head_dim == hidden / heads fails on it.
_HEAD_DIM_FACTOR = {"qwen3": 2}

# Init scales. Linear weights: N(0, (gain / sqrt(fan_in))^2), which keeps each
# projection's output RMS near its input's; q/k get gain 2 so attention is peaked enough
# that continuations depend on context. Output heads give logits of std ~4, so top-1/top-2
# gaps below 1e-3 are rare. A tied embedding (also the head) is drawn 4x smaller and the
# final norm 4x larger: with a full-size tied embedding the input token dominates the
# final hidden state and greedy decoding falls into 1- and 2-token loops.
_EMBED_STD = 1.0
_HEAD_GAIN = 4.0
_QK_GAIN = 2.0
_TIED_SCALE = 4.0
_BIAS_STD = 0.2
_NORM_JITTER = 0.1  # norm weights: scale * (1 + jitter * N(0, 1))

# A ChatML-like chat template (tokenizer_config.json "chat_template"), so the demo serves
# /v1/chat/completions. The markers are plain text to this tokenizer; llama/mistral
# tokenizers add <s> themselves when encoding text, so their template places it too (chat
# prompts are tokenized without special tokens, as transformers does).
_CHAT_TEMPLATE = (
    "{%- for message in messages %}"
    "{{- '<|im_start|>' + message['role'] + '\\n' + (message['content'] or '') + '<|im_end|>\\n' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)
_BOS_CHAT_TEMPLATE = "{{- bos_token }}" + _CHAT_TEMPLATE

_WEIGHT_FILE = "model.safetensors"
_INDEX_FILE = "model.safetensors.index.json"


@dataclass(frozen=True)
class _TensorSpec:
    """One checkpoint tensor: HF name, shape, and its init distribution N(mean, std^2)."""

    name: str
    shape: tuple[int, ...]
    std: float
    mean: float = 0.0

    @property
    def num_bytes(self) -> int:
        return 4 * math.prod(self.shape)  # fp32


def _linear(name: str, out_features: int, in_features: int, gain: float = 1.0) -> _TensorSpec:
    return _TensorSpec(name, (out_features, in_features), gain / math.sqrt(in_features))


def _norm(name: str, dim: int, scale: float = 1.0) -> _TensorSpec:
    return _TensorSpec(name, (dim,), scale * _NORM_JITTER, mean=scale)


def _bias(name: str, dim: int) -> _TensorSpec:
    return _TensorSpec(name, (dim,), _BIAS_STD)


def _check_choice(value: str, choices: Any, what: str) -> None:
    if value not in choices:
        raise ValueError(f"unknown {what} {value!r}; valid choices: {', '.join(choices)}")


def _write_json(path: Path, obj: Any) -> None:
    path.write_text(json.dumps(obj, indent=2, ensure_ascii=False) + "\n", encoding="utf-8")


# ---------------------------------------------------------------- config


def _round_up_vocab(tokenizer_size: int) -> int:
    """Next multiple of 64 strictly above `tokenizer_size` (ids past the tokenizer exist)."""
    return (tokenizer_size // 64 + 1) * 64


def _build_config(
    arch: str, preset: str, overrides: Mapping[str, Any], tokenizer_size: int
) -> dict[str, Any]:
    """Returns config.json's contents; `overrides` win, derived values follow them."""
    sizes = {k: v for k, v in PRESETS[preset].items() if k != "tokenizer_vocab_size"}
    config: dict[str, Any] = {
        "architectures": [_ARCH_CLASS[arch]],
        "model_type": arch,
        "tie_word_embeddings": False,
        **_ARCH_CONFIG[arch],
        **sizes,
    }
    config.update(
        hidden_act="silu",
        rope_theta=10000.0,
        rope_scaling=None,
        initializer_range=0.02,
        bos_token_id=BOS_TOKEN_ID,
        eos_token_id=EOS_TOKEN_ID,
        pad_token_id=PAD_TOKEN_ID,
        use_cache=True,
        torch_dtype="float32",
    )
    config.update(overrides)
    if "head_dim" not in overrides:
        base = config["hidden_size"] // config["num_attention_heads"]
        config["head_dim"] = base * _HEAD_DIM_FACTOR.get(arch, 1)
    if config["vocab_size"] is None:
        config["vocab_size"] = _round_up_vocab(tokenizer_size)
    if config["vocab_size"] < tokenizer_size:
        raise ValueError(
            f"vocab_size {config['vocab_size']} is below the tokenizer's {tokenizer_size} tokens"
        )
    if arch.startswith("qwen") and "max_window_layers" not in overrides:
        config["max_window_layers"] = config["num_hidden_layers"]
    return config


# ---------------------------------------------------------------- weights


def _attention_specs(prefix: str, config: Mapping[str, Any], arch: str) -> list[_TensorSpec]:
    """Self-attention tensors of one layer, in HF names."""
    hidden, head_dim = config["hidden_size"], config["head_dim"]
    q_dim = config["num_attention_heads"] * head_dim
    kv_dim = config["num_key_value_heads"] * head_dim
    own_bias = arch in ("llama", "qwen3") and bool(config.get("attention_bias"))
    qkv_bias = own_bias or arch == "qwen2"
    attn = f"{prefix}self_attn."
    specs = []
    for proj, out_dim, gain in (
        ("q_proj", q_dim, _QK_GAIN),
        ("k_proj", kv_dim, _QK_GAIN),
        ("v_proj", kv_dim, 1.0),
    ):
        specs.append(_linear(f"{attn}{proj}.weight", out_dim, hidden, gain))
        if qkv_bias:
            specs.append(_bias(f"{attn}{proj}.bias", out_dim))
    if arch == "qwen3":
        specs += [_norm(f"{attn}q_norm.weight", head_dim), _norm(f"{attn}k_norm.weight", head_dim)]
    specs.append(_linear(f"{attn}o_proj.weight", hidden, q_dim))
    if own_bias:
        specs.append(_bias(f"{attn}o_proj.bias", hidden))
    return specs


def _mlp_specs(prefix: str, config: Mapping[str, Any], arch: str) -> list[_TensorSpec]:
    """SwiGLU MLP tensors of one layer, in HF names."""
    hidden, inter = config["hidden_size"], config["intermediate_size"]
    bias = arch == "llama" and bool(config.get("mlp_bias"))
    specs = []
    for proj, out_dim, in_dim in (
        ("gate_proj", inter, hidden),
        ("up_proj", inter, hidden),
        ("down_proj", hidden, inter),
    ):
        specs.append(_linear(f"{prefix}mlp.{proj}.weight", out_dim, in_dim))
        if bias:
            specs.append(_bias(f"{prefix}mlp.{proj}.bias", out_dim))
    return specs


def _weight_specs(config: Mapping[str, Any], arch: str) -> list[_TensorSpec]:
    """All checkpoint tensors in a fixed order (the order they are written in)."""
    hidden, vocab = config["hidden_size"], config["vocab_size"]
    tied = bool(config["tie_word_embeddings"])
    embed_std = _HEAD_GAIN / _TIED_SCALE / math.sqrt(hidden) if tied else _EMBED_STD
    specs = [_TensorSpec("model.embed_tokens.weight", (vocab, hidden), embed_std)]
    for i in range(config["num_hidden_layers"]):
        prefix = f"model.layers.{i}."
        specs.append(_norm(f"{prefix}input_layernorm.weight", hidden))
        specs += _attention_specs(prefix, config, arch)
        specs.append(_norm(f"{prefix}post_attention_layernorm.weight", hidden))
        specs += _mlp_specs(prefix, config, arch)
    specs.append(_norm("model.norm.weight", hidden, _TIED_SCALE if tied else 1.0))
    if not tied:
        specs.append(_linear("lm_head.weight", vocab, hidden, _HEAD_GAIN))
    return specs


def _tensor_seed(seed: int, name: str) -> int:
    """Per-tensor seed: a tensor's values depend only on (seed, name), not on order."""
    digest = hashlib.sha256(f"{seed}/{name}".encode()).digest()
    return int.from_bytes(digest[:8], "little") & (2**63 - 1)


def _init_tensor(spec: _TensorSpec, seed: int) -> torch.Tensor:
    """Draws one contiguous fp32 tensor from N(spec.mean, spec.std^2)."""
    gen = torch.Generator().manual_seed(_tensor_seed(seed, spec.name))
    noise = torch.randn(spec.shape, generator=gen, dtype=torch.float32)
    return noise.mul_(spec.std).add_(spec.mean)


def _write_safetensors(path: Path, specs: list[_TensorSpec], seed: int) -> None:
    """Streams tensors into a safetensors file one at a time (peak memory: one tensor).

    Layout: u64 little-endian header length, JSON header (padded with spaces to 8
    bytes), then the raw little-endian data of each tensor back to back.
    """
    header: dict[str, Any] = {"__metadata__": {"format": "pt"}}
    offset = 0
    for spec in specs:
        end = offset + spec.num_bytes
        header[spec.name] = {
            "dtype": "F32",
            "shape": list(spec.shape),
            "data_offsets": [offset, end],
        }
        offset = end
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(raw)))
        f.write(raw)
        for spec in specs:
            array = _init_tensor(spec, seed).numpy().astype("<f4", copy=False)
            f.write(array.data)


def _split_into_shards(specs: list[_TensorSpec], num_shards: int) -> list[list[_TensorSpec]]:
    """Contiguous runs of `specs` with about equal bytes; every shard gets >= 1 tensor."""
    if not 1 <= num_shards <= len(specs):
        raise ValueError(f"num_shards must be in [1, {len(specs)}], got {num_shards}")
    total = sum(s.num_bytes for s in specs)
    shards: list[list[_TensorSpec]] = [[] for _ in range(num_shards)]
    cumulative, last = 0, 0
    for i, spec in enumerate(specs):
        by_bytes = int((cumulative + spec.num_bytes / 2) * num_shards // total)
        # Never skip a shard, and leave one tensor for each shard still to fill.
        index = max(min(by_bytes, last + 1, num_shards - 1), num_shards - (len(specs) - i))
        shards[index].append(spec)
        cumulative, last = cumulative + spec.num_bytes, index
    return shards


def _write_weights(out_dir: Path, specs: list[_TensorSpec], seed: int, num_shards: int) -> None:
    """Writes model.safetensors, or N shards plus model.safetensors.index.json."""
    for stale in [*out_dir.glob("model*.safetensors"), out_dir / _INDEX_FILE]:
        stale.unlink(missing_ok=True)
    if num_shards == 1:
        _write_safetensors(out_dir / _WEIGHT_FILE, specs, seed)
        return
    weight_map: dict[str, str] = {}
    for i, shard in enumerate(_split_into_shards(specs, num_shards)):
        filename = f"model-{i + 1:05d}-of-{num_shards:05d}.safetensors"
        _write_safetensors(out_dir / filename, shard, seed)
        weight_map.update({spec.name: filename for spec in shard})
    index = {
        "metadata": {"total_size": sum(s.num_bytes for s in specs)},
        "weight_map": dict(sorted(weight_map.items())),
    }
    _write_json(out_dir / _INDEX_FILE, index)


# ---------------------------------------------------------------- public API


def make_tiny_model(
    out_dir: str | Path,
    *,
    arch: str = "llama",
    preset: str = "tiny",
    seed: int = 0,
    overrides: Mapping[str, Any] | None = None,
    num_shards: int = 1,
) -> Path:
    """Writes a random-weight HF checkpoint with a trained BPE tokenizer into `out_dir`.

    `arch` is one of ARCHS, `preset` one of PRESETS (else ValueError naming the choices).
    `overrides` are merged into config.json last (unknown keys are kept); head_dim,
    vocab_size and max_window_layers are derived from the result unless overridden.
    Files: config.json, model.safetensors (or `num_shards` shards plus an index),
    tokenizer.json, tokenizer_config.json (with a ChatML-like chat template),
    generation_config.json. Existing weight files in
    `out_dir` are replaced. Deterministic: the same arguments give byte-identical files.
    Returns `out_dir` as a Path.
    """
    _check_choice(arch, ARCHS, "arch")
    _check_choice(preset, PRESETS, "preset")
    out = Path(out_dir)
    tokenizer = train_tokenizer(arch, PRESETS[preset]["tokenizer_vocab_size"])
    config = _build_config(arch, preset, overrides or {}, tokenizer.get_vocab_size())
    specs = _weight_specs(config, arch)
    out.mkdir(parents=True, exist_ok=True)
    _write_weights(out, specs, seed, num_shards)
    _write_json(out / "config.json", config)
    tokenizer.save(str(out / "tokenizer.json"))
    chat_template = _BOS_CHAT_TEMPLATE if arch in ("llama", "mistral") else _CHAT_TEMPLATE
    _write_json(
        out / "tokenizer_config.json",
        {**tokenizer_config(arch, config["max_position_embeddings"]),
         "chat_template": chat_template},
    )
    generation = {
        "bos_token_id": BOS_TOKEN_ID,
        "eos_token_id": EOS_TOKEN_ID,
        "pad_token_id": PAD_TOKEN_ID,
    }
    _write_json(out / "generation_config.json", generation)
    return out


def default_model_cache_dir() -> Path:
    """`$XDG_CACHE_HOME/pdserve/models`, or `~/.cache/pdserve/models` when unset."""
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "pdserve" / "models"


def _generator_fingerprint() -> str:
    """Hash of this generator's sources: a changed generator gets a fresh cache entry."""
    digest = hashlib.sha256()
    for module_file in (__file__, Path(__file__).with_name("tokenizer_corpus.py")):
        digest.update(Path(module_file).read_bytes())
    return digest.hexdigest()[:12]


def ensure_cached_model(*, arch: str = "llama", preset: str = "tiny", seed: int = 0) -> Path:
    """Returns a generated model under `default_model_cache_dir()`, building it on first use.

    The directory is named `{preset}-{arch}-seed{seed}-{source hash}`, so editing the
    generator invalidates old entries. It is built in a temporary sibling directory and
    renamed into place: a present directory is complete. When a concurrent builder wins
    the rename, its copy is used and ours is discarded.
    """
    _check_choice(arch, ARCHS, "arch")
    _check_choice(preset, PRESETS, "preset")
    cache_dir = default_model_cache_dir()
    final = cache_dir / f"{preset}-{arch}-seed{seed}-{_generator_fingerprint()}"
    if final.is_dir():
        return final
    cache_dir.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{final.name}.", dir=cache_dir))
    try:
        make_tiny_model(tmp, arch=arch, preset=preset, seed=seed)
        os.rename(tmp, final)
    except OSError:
        if not final.is_dir():
            raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return final


def ensure_demo_model() -> Path:
    """The demo model (tiny llama, seed 0) in the model cache; see `ensure_cached_model`."""
    return ensure_cached_model(arch="llama", preset="tiny", seed=0)
