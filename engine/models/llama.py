"""Llama-family decoder (Llama 2/3, Mistral, Qwen2, Qwen3) over the paged KV cache.

Input is a flat batch of tokens ``[T]`` with positions ``[T]``; attention metadata
(which tokens belong to which sequence, where their K/V goes) comes from the forward
context. Family differences: Qwen2 has q/k/v biases, Qwen3 RMS-normalises q and k per
head; all use GQA, RoPE, RMSNorm and SwiGLU.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any, cast

import torch
from torch import nn

from engine.attention import AttentionBackend, get_forward_context
from engine.config import ModelConfig
from engine.models.decoder_stack import CompiledDecoderStack
from engine.models.layers import (
    MergedColumnParallelLinear,
    ParallelLMHead,
    QKVParallelLinear,
    RMSNorm,
    RowParallelLinear,
    VocabParallelEmbedding,
    kernel_generation,
    silu_and_mul,
)
from engine.models.rotary import RotaryEmbedding
from engine.tp.distributed import Group


class Attention(nn.Module):
    def __init__(self, cfg: ModelConfig, tp: Group, rotary: RotaryEmbedding,
                 backend: AttentionBackend) -> None:
        super().__init__()
        self.head_dim = cfg.head_dim
        self.qkv_proj = QKVParallelLinear(cfg.hidden_size, cfg.head_dim, cfg.num_heads,
                                          cfg.num_kv_heads, tp, bias=cfg.attention_bias)
        self.o_proj = RowParallelLinear(cfg.num_heads * cfg.head_dim, cfg.hidden_size, tp)
        self.q_norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps) if cfg.qk_norm else None
        self.k_norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps) if cfg.qk_norm else None
        self.backend = backend
        self.scale = cfg.head_dim ** -0.5
        self.kv_cache = torch.empty(0)  # [2, num_blocks, block_size, local KV heads, head_dim]

    def forward(self, rope: tuple[torch.Tensor, torch.Tensor], x: torch.Tensor) -> torch.Tensor:
        num_tokens, num_q_heads = x.shape[0], self.qkv_proj.num_local_heads
        qkv = self.qkv_proj.project(x)  # [T, (Hq + 2 Hk) * D]: q heads | k heads | v heads
        qk_size = self.qkv_proj.q_size + self.qkv_proj.kv_size
        qk = qkv[:, :qk_size].view(num_tokens, -1, self.head_dim)  # [T, Hq + Hk, D]
        v = qkv[:, qk_size:].view(num_tokens, -1, self.head_dim)  # [T, Hk, D]
        if self.q_norm is not None and self.k_norm is not None:
            qk = torch.cat((self.q_norm(qk[:, :num_q_heads]), self.k_norm(qk[:, num_q_heads:])), 1)
        qk = RotaryEmbedding.rotate(qk, rope)
        q, k = qk[:, :num_q_heads], qk[:, num_q_heads:]
        meta = get_forward_context().attn
        out = self.backend.forward(q, k, v, self.kv_cache, meta, self.scale)
        return self.o_proj(out.reshape(num_tokens, -1))


class MLP(nn.Module):
    def __init__(self, cfg: ModelConfig, tp: Group) -> None:
        super().__init__()
        self.gate_up_proj = MergedColumnParallelLinear(
            cfg.hidden_size, [cfg.intermediate_size, cfg.intermediate_size], tp)
        self.down_proj = RowParallelLinear(cfg.intermediate_size, cfg.hidden_size, tp)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(silu_and_mul(self.gate_up_proj(x)))


class DecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, tp: Group, rotary: RotaryEmbedding,
                 backend: AttentionBackend) -> None:
        super().__init__()
        self.self_attn = Attention(cfg, tp, rotary, backend)
        self.mlp = MLP(cfg, tp)
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)

    def forward(self, rope: tuple[torch.Tensor, torch.Tensor], h: torch.Tensor) -> torch.Tensor:
        h = h + self.self_attn(rope, self.input_layernorm(h))
        return h + self.mlp(self.post_attention_layernorm(h))


# checkpoint name fragment -> (module attribute, loader argument)
_STACKED: dict[str, tuple[str, Any]] = {
    "q_proj": ("qkv_proj", "q"),
    "k_proj": ("qkv_proj", "k"),
    "v_proj": ("qkv_proj", "v"),
    "gate_proj": ("gate_up_proj", 0),
    "up_proj": ("gate_up_proj", 1),
}


class LlamaForCausalLM(nn.Module):
    """The model. ``forward`` returns the final hidden states ``[T, hidden]``;
    ``compute_logits`` turns selected rows into full-vocabulary logits."""

    def __init__(self, cfg: ModelConfig, tp: Group, backend: AttentionBackend) -> None:
        super().__init__()
        self.cfg = cfg
        rotary = RotaryEmbedding(cfg.head_dim, cfg.max_position_embeddings, cfg.rope_theta,
                                 cfg.rope_scaling)
        self.rotary = rotary
        self.embed_tokens = VocabParallelEmbedding(cfg.vocab_size, cfg.hidden_size, tp)
        self.layers = nn.ModuleList(
            DecoderLayer(cfg, tp, rotary, backend) for _ in range(cfg.num_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.lm_head = ParallelLMHead(cfg.vocab_size, cfg.hidden_size, tp)
        if cfg.tie_word_embeddings:
            self.lm_head.weight = self.embed_tokens.weight
        self._stack: CompiledDecoderStack | None = None
        self._stack_key: int | None = None  # the kernel_generation() it was built at

    def forward(self, token_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        ctx = get_forward_context()
        hook = ctx.layer_hook
        if hook is None and not ctx.attn.prefills:  # a decode step: the compiled stack's
            stack = self._compiled_stack()
            if stack is not None and stack.takes(token_ids, positions, ctx.attn):
                return stack.run(token_ids, positions, ctx.attn)
        h = self.embed_tokens(token_ids)
        rope = self.rotary.cos_sin(positions, h.dtype)
        for idx, layer in enumerate(self.layers):
            h = layer(rope, h)
            if hook is not None:
                hook(idx)
        return self.norm(h)

    def _compiled_stack(self) -> CompiledDecoderStack | None:
        """The decode fast path (``engine.models.decoder_stack``), built on first use and
        again once any linear's kernel or the cache changed."""
        key = kernel_generation()
        if key != self._stack_key:
            self._stack, self._stack_key = CompiledDecoderStack.build(self), key
        return self._stack

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.lm_head(hidden)

    def set_kv_cache(self, kv_cache: torch.Tensor) -> None:
        """Attach ``kv_cache [layers, 2, blocks, block_size, local KV heads, head_dim]``."""
        for idx, layer in enumerate(self.decoder_layers):
            layer.self_attn.kv_cache = kv_cache[idx]
        self._stack, self._stack_key = None, None  # built again on the new cache

    @property
    def decoder_layers(self) -> list[DecoderLayer]:
        return [cast(DecoderLayer, layer) for layer in self.layers]

    @property
    def num_local_kv_heads(self) -> int:
        """KV heads this rank's cache holds."""
        return self.decoder_layers[0].self_attn.qkv_proj.num_local_kv_heads

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Load Hugging Face-named tensors; raises ``ValueError`` naming missing or unknown ones.

        Names are compared at the checkpoint's granularity: a fused parameter (qkv_proj,
        gate_up_proj) counts as loaded only when every one of its parts was.
        """
        loaded: set[str] = set()
        for name, tensor in weights:
            if "rotary_emb.inv_freq" in name:
                continue
            if name == "lm_head.weight" and self.cfg.tie_word_embeddings:
                continue
            self._load_one(name, tensor)
            loaded.add(name.removeprefix("model."))
        missing = sorted(self._expected_checkpoint_names() - loaded)
        if missing:
            raise ValueError(f"checkpoint is missing weights: {missing[:8]}"
                             f"{' ...' if len(missing) > 8 else ''}")

    def _expected_checkpoint_names(self) -> set[str]:
        fused = {target: [k for k, (t, _) in _STACKED.items() if t == target]
                 for target, _ in _STACKED.values()}
        names = set()
        for name, _ in self.named_parameters(remove_duplicate=True):
            module_path, _, param = name.rpartition(".")
            owner, _, leaf = module_path.rpartition(".")
            for part in fused.get(leaf, [leaf]):
                names.add(f"{owner}.{part}.{param}" if owner else f"{part}.{param}")
        return names

    def _load_one(self, name: str, tensor: torch.Tensor) -> None:
        """Load one checkpoint tensor into the parameter (or fused part) it belongs to."""
        path = name.removeprefix("model.")
        module_path, _, param = path.rpartition(".")
        owner, _, leaf = module_path.rpartition(".")
        target, part = _STACKED.get(leaf, (leaf, None))
        try:
            module: Any = self.get_submodule(f"{owner}.{target}" if owner else target)
        except AttributeError:
            raise ValueError(f"unexpected weight in checkpoint: {name}") from None
        if not isinstance(getattr(module, param, None), nn.Parameter):
            raise ValueError(f"unexpected weight in checkpoint: {name}")
        if target == "qkv_proj":
            module.load_weight(param, part, tensor)
        elif part is not None:
            module.load_weight(part, tensor)
        else:
            module.load_weight(param, tensor)
