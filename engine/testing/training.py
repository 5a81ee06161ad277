"""Training the ``trained`` and ``trained55m`` presets: small Llamas that have learnt
something, so that quantisation quality (top-1 agreement, KL) and speculative acceptance
measure a model rather than random weights, where near-tied logits flip under any
rounding (``trained55m``, bench55m's layers, is the target the speed figures need; the
5M-parameter ``trained`` one, with the same tokenizer, drafts for it).

The text is one every machine with Python has: the standard library's own top-level
``*.py`` files, in name order, cut at ``TEXT_BYTES`` (``training_text``); the files after
them are held out (``held_out_text``) for the benchmarks' quality figures. The model is a
plain-torch Llama (``_Trainer``: the Hugging Face layout's names and maths: RMSNorm,
rotate-half RoPE, grouped-query attention, SwiGLU), trained with AdamW on random
windows of the tokenised text for a fixed number of steps. Deterministic from the seed
on a given machine and torch build (the thread count is fixed for the run; another CPU
may round differently). ``engine.testing.tiny_model`` writes the result as a checkpoint.
"""

from __future__ import annotations

import math
import sys
import sysconfig
import time
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

TEXT_BYTES = 3 << 20  # of the standard library's source, for training
HELD_OUT_BYTES = 256 << 10  # the files after it, for quality figures
SEQ_LEN = 256
BATCH = 8
LEARNING_RATE = 3e-3
WARMUP_STEPS = 20
TRAIN_THREADS = 2


def _stdlib_files() -> list[Path]:
    root = Path(sysconfig.get_paths()["stdlib"])
    return sorted(p for p in root.glob("*.py") if p.is_file())


def _read(files: list[Path], limit: int) -> tuple[str, int]:
    """Files concatenated (each under a ``# file:`` line) until ``limit`` bytes; and how
    many files were used."""
    parts, size, used = [], 0, 0
    for path in files:
        text = path.read_text(encoding="utf-8", errors="replace")
        parts.append(f"# file: {path.name}\n{text}\n")
        size += len(parts[-1].encode())
        used += 1
        if size >= limit:
            break
    return "".join(parts), used


def training_text() -> str:
    """The standard library's top-level sources, in name order, to ``TEXT_BYTES``."""
    return _read(_stdlib_files(), TEXT_BYTES)[0]


def held_out_text() -> str:
    """The sources after ``training_text``'s, to ``HELD_OUT_BYTES`` (never trained on)."""
    files = _stdlib_files()
    used = _read(files, TEXT_BYTES)[1]
    return _read(files[used:], HELD_OUT_BYTES)[0]


def text_identity() -> str:
    """What the text depends on (the cache key of a trained model): the Python version."""
    return f"py{sys.version_info[0]}.{sys.version_info[1]}.{sys.version_info[2]}"


# ---------------------------------------------------------------- the model


class _Norm(nn.Module):
    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps) * self.weight


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


class _Attention(nn.Module):
    def __init__(self, c: Mapping[str, Any]) -> None:
        super().__init__()
        hidden, self.heads, self.kv_heads = (c["hidden_size"], c["num_attention_heads"],
                                             c["num_key_value_heads"])
        self.head_dim = c["head_dim"]
        self.q_proj = nn.Linear(hidden, self.heads * self.head_dim, bias=False)
        self.k_proj = nn.Linear(hidden, self.kv_heads * self.head_dim, bias=False)
        self.v_proj = nn.Linear(hidden, self.kv_heads * self.head_dim, bias=False)
        self.o_proj = nn.Linear(self.heads * self.head_dim, hidden, bias=False)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        b, t, _ = x.shape
        q = self.q_proj(x).view(b, t, self.heads, self.head_dim).transpose(1, 2)
        k = self.k_proj(x).view(b, t, self.kv_heads, self.head_dim).transpose(1, 2)
        v = self.v_proj(x).view(b, t, self.kv_heads, self.head_dim).transpose(1, 2)
        q, k = q * cos + _rotate_half(q) * sin, k * cos + _rotate_half(k) * sin
        group = self.heads // self.kv_heads
        k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.o_proj(out.transpose(1, 2).reshape(b, t, -1))


class _Mlp(nn.Module):
    def __init__(self, c: Mapping[str, Any]) -> None:
        super().__init__()
        hidden, inter = c["hidden_size"], c["intermediate_size"]
        self.gate_proj = nn.Linear(hidden, inter, bias=False)
        self.up_proj = nn.Linear(hidden, inter, bias=False)
        self.down_proj = nn.Linear(inter, hidden, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class _Layer(nn.Module):
    def __init__(self, c: Mapping[str, Any]) -> None:
        super().__init__()
        self.input_layernorm = _Norm(c["hidden_size"], c["rms_norm_eps"])
        self.self_attn = _Attention(c)
        self.post_attention_layernorm = _Norm(c["hidden_size"], c["rms_norm_eps"])
        self.mlp = _Mlp(c)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        x = x + self.self_attn(self.input_layernorm(x), cos, sin)
        return x + self.mlp(self.post_attention_layernorm(x))


class _Body(nn.Module):
    def __init__(self, c: Mapping[str, Any]) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(c["vocab_size"], c["hidden_size"])
        self.layers = nn.ModuleList(_Layer(c) for _ in range(c["num_hidden_layers"]))
        self.norm = _Norm(c["hidden_size"], c["rms_norm_eps"])


class _Trainer(nn.Module):
    """A Llama whose ``state_dict`` names are the Hugging Face checkpoint's."""

    inv_freq: torch.Tensor

    def __init__(self, c: Mapping[str, Any]) -> None:
        super().__init__()
        self.model = _Body(c)
        self.lm_head = nn.Linear(c["hidden_size"], c["vocab_size"], bias=False)
        dim = c["head_dim"]
        inv_freq = 1.0 / (c["rope_theta"] ** (torch.arange(0, dim, 2, dtype=torch.float32) / dim))
        self.register_buffer("inv_freq", inv_freq, persistent=False)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        freqs = torch.outer(torch.arange(ids.shape[1], dtype=torch.float32), self.inv_freq)
        angles = torch.cat((freqs, freqs), dim=-1)
        cos, sin = angles.cos(), angles.sin()
        x = self.model.embed_tokens(ids)
        for layer in self.model.layers:
            x = layer(x, cos, sin)
        logits: torch.Tensor = self.lm_head(self.model.norm(x))
        return logits


# ---------------------------------------------------------------- training


def train_weights(config: Mapping[str, Any], token_ids: list[int], *, seed: int, steps: int,
                  learning_rate: float = LEARNING_RATE,
                  progress: Callable[[str], None] | None = None) -> dict[str, torch.Tensor]:
    """The weights (Hugging Face names, fp32, contiguous) of a Llama of ``config``
    trained for ``steps`` AdamW steps on random ``SEQ_LEN`` windows of ``token_ids``
    (``BATCH`` per step, warm-up to ``learning_rate`` then cosine decay); ``progress``
    gets a line about every
    10 % of the steps. ``ValueError`` for a text shorter than one window or a config
    with biases, per-head norms or tied embeddings (Llama only)."""
    if config.get("attention_bias") or config.get("tie_word_embeddings") \
            or config.get("model_type") != "llama":
        raise ValueError("training covers the llama architecture without biases or tied "
                         "embeddings")
    if len(token_ids) <= SEQ_LEN + 1 or steps < 1:
        raise ValueError(f"training needs more than {SEQ_LEN + 1} tokens and a step, got "
                         f"{len(token_ids)} tokens and {steps} steps")
    threads = torch.get_num_threads()
    torch.set_num_threads(TRAIN_THREADS)
    try:
        return _train(config, torch.tensor(token_ids), seed, steps, learning_rate, progress)
    finally:
        torch.set_num_threads(threads)


def _train(config: Mapping[str, Any], data: torch.Tensor, seed: int, steps: int,
           learning_rate: float, progress: Callable[[str], None] | None
           ) -> dict[str, torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    torch.manual_seed(seed)
    model = _Trainer(config)
    for name, p in model.named_parameters():
        if name.endswith("norm.weight"):
            continue
        std = 0.02 / math.sqrt(2 * config["num_hidden_layers"]) \
            if name.endswith(("o_proj.weight", "down_proj.weight")) else 0.02
        with torch.no_grad():
            p.normal_(0.0, std, generator=generator)
    optimizer = torch.optim.AdamW(model.parameters(), lr=learning_rate, betas=(0.9, 0.95),
                                  weight_decay=0.1)
    started, every = time.monotonic(), max(1, steps // 10)
    for step in range(steps):
        lr = learning_rate * min(1.0, (step + 1) / WARMUP_STEPS) * \
            0.5 * (1 + math.cos(math.pi * step / steps))
        for group in optimizer.param_groups:
            group["lr"] = lr
        starts = torch.randint(0, data.numel() - SEQ_LEN - 1, (BATCH,), generator=generator)
        window = torch.stack([data[s:s + SEQ_LEN + 1] for s in starts.tolist()])
        logits = model(window[:, :-1])
        loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), window[:, 1:].reshape(-1))
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        if progress is not None and ((step + 1) % every == 0 or step + 1 == steps):
            progress(f"step {step + 1}/{steps}: loss {loss.item():.3f} "
                     f"({time.monotonic() - started:.0f} s)")
    return {name: t.detach().contiguous() for name, t in model.state_dict().items()}
