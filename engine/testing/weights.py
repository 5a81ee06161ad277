"""The weights of a generated checkpoint: which tensors a tiny Llama/Qwen model has, how
each is initialised (seeded per tensor from the model's seed and the tensor's name),
and writing them as safetensors files (one, or shards with an index), one tensor at a
time. ``engine.testing.tiny_model`` builds the rest of the checkpoint around them."""

from __future__ import annotations

import hashlib
import json
import math
import struct
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

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


def weight_specs(config: Mapping[str, Any], arch: str) -> list[_TensorSpec]:
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


def write_weights(out_dir: Path, specs: list[_TensorSpec], seed: int, num_shards: int) -> None:
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
    (out_dir / _INDEX_FILE).write_text(json.dumps(index, indent=2, ensure_ascii=False) + "\n",
                                       encoding="utf-8")


# ---------------------------------------------------------------- public API


def write_tensors(out_dir: Path, tensors: Mapping[str, torch.Tensor]) -> None:
    """Writes ``tensors`` (fp32) as model.safetensors (one file; names sorted), replacing
    any weight files there (a trained checkpoint: ``engine.testing.training``)."""
    from safetensors.torch import save_file

    for stale in [*out_dir.glob("model*.safetensors"), out_dir / _INDEX_FILE]:
        stale.unlink(missing_ok=True)
    save_file({name: tensors[name].to(torch.float32).contiguous() for name in sorted(tensors)},
              str(out_dir / _WEIGHT_FILE), metadata={"format": "pt"})
