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

The ``trained`` preset is the exception to "random": a 5M-parameter Llama trained for a
few minutes on the Python standard library's own sources (``engine.testing.training``),
its tokenizer trained on the same text; deterministic on a given machine and torch build.

Depends on torch, tokenizers, safetensors (trained weights) and the stdlib only (random
weights are written directly, streaming one tensor at a time).
"""

from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

from engine.testing import training
from engine.testing.cache import built_once
from engine.testing.tokenizer_corpus import (
    BOS_TOKEN_ID,
    EOS_TOKEN_ID,
    PAD_TOKEN_ID,
    tokenizer_config,
    train_tokenizer,
)
from engine.testing.weights import weight_specs, write_tensors, write_weights

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
    # trained (engine.testing.training) for TRAIN_STEPS steps, about 4-5 minutes on 2 cores
    "trained": {
        "hidden_size": 256,
        "intermediate_size": 768,
        "num_hidden_layers": 4,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "max_position_embeddings": 2048,
        "vocab_size": None,
        "tokenizer_vocab_size": 4096,
    },
    # bench55m's shape with the trained preset's tokenizer and vocabulary (so the trained
    # preset can draft for it) and its context, trained the same way: a target large
    # enough to be bound by memory for the speculative-decoding figures; about 30 minutes
    "trained55m": {
        "hidden_size": 512,
        "intermediate_size": 1408,
        "num_hidden_layers": 8,
        "num_attention_heads": 8,
        "num_key_value_heads": 2,
        "max_position_embeddings": 2048,
        "vocab_size": None,
        "tokenizer_vocab_size": 4096,
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

# the presets whose weights are trained, for how many steps, and at what peak rate
TRAIN_STEPS = {"trained": 720, "trained55m": 720}
TRAIN_LEARNING_RATES = {"trained": 3e-3, "trained55m": 2e-3}
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


def make_tiny_model(
    out_dir: str | Path,
    *,
    arch: str = "llama",
    preset: str = "tiny",
    seed: int = 0,
    overrides: Mapping[str, Any] | None = None,
    num_shards: int = 1,
    train_steps: int | None = None,
    progress: Callable[[str], None] | None = None,
) -> Path:
    """Writes a random-weight HF checkpoint with a trained BPE tokenizer into `out_dir`.

    `arch` is one of ARCHS, `preset` one of PRESETS (else ValueError naming the choices).
    `overrides` are merged into config.json last (unknown keys are kept); head_dim,
    vocab_size and max_window_layers are derived from the result unless overridden.
    Files: config.json, model.safetensors (or `num_shards` shards plus an index),
    tokenizer.json, tokenizer_config.json (with a ChatML-like chat template),
    generation_config.json. Existing weight files in
    `out_dir` are replaced. Deterministic: the same arguments give byte-identical files.
    A preset of TRAIN_STEPS (llama only, one weight file) is trained instead, for
    `train_steps` steps (default its own), `progress` getting a line now and then.
    Returns `out_dir` as a Path.
    """
    _check_choice(arch, ARCHS, "arch")
    _check_choice(preset, PRESETS, "preset")
    out = Path(out_dir)
    trained = preset in TRAIN_STEPS
    if trained and (arch != "llama" or num_shards != 1):
        raise ValueError(f"the {preset} preset is a llama in one weight file")
    text = training.training_text() if trained else None
    tokenizer = train_tokenizer(arch, PRESETS[preset]["tokenizer_vocab_size"], text)
    config = _build_config(arch, preset, overrides or {}, tokenizer.get_vocab_size())
    out.mkdir(parents=True, exist_ok=True)
    if text is not None:
        steps = TRAIN_STEPS[preset] if train_steps is None else train_steps
        ids = tokenizer.encode(text, add_special_tokens=False).ids
        write_tensors(out, training.train_weights(config, ids, seed=seed, steps=steps,
                                                  learning_rate=TRAIN_LEARNING_RATES[preset],
                                                  progress=progress))
    else:
        write_weights(out, weight_specs(config, arch), seed, num_shards)
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
    here = Path(__file__)
    for name in (here.name, "tokenizer_corpus.py", "weights.py", "training.py"):
        digest.update(here.with_name(name).read_bytes())
    return digest.hexdigest()[:12]


def ensure_cached_model(*, arch: str = "llama", preset: str = "tiny", seed: int = 0,
                        progress: Callable[[str], None] | None = None) -> Path:
    """Returns a generated model under `default_model_cache_dir()`, building it on first use.

    The directory is named `{preset}-{arch}-seed{seed}-{source hash}`, so editing the
    generator invalidates old entries. It is built in a temporary sibling directory and
    renamed into place: a present directory is complete. When a concurrent builder wins
    the rename, its copy is used and ours is discarded.
    """
    _check_choice(arch, ARCHS, "arch")
    _check_choice(preset, PRESETS, "preset")
    text = f"-{training.text_identity()}" if preset in TRAIN_STEPS else ""  # what it learnt
    final = default_model_cache_dir() / f"{preset}-{arch}-seed{seed}{text}-" \
        f"{_generator_fingerprint()}"
    return built_once(final, lambda tmp: make_tiny_model(tmp, arch=arch, preset=preset,
                                                         seed=seed, progress=progress))


def ensure_demo_model() -> Path:
    """The demo model (tiny llama, seed 0) in the model cache; see `ensure_cached_model`."""
    return ensure_cached_model(arch="llama", preset="tiny", seed=0)
