"""Model implementations by Hugging Face architecture name."""

from __future__ import annotations

from engine.attention import AttentionBackend
from engine.config import ModelConfig
from engine.models.llama import LlamaForCausalLM
from engine.tp.distributed import Group


def build_model(cfg: ModelConfig, tp: Group, backend: AttentionBackend) -> LlamaForCausalLM:
    """Instantiate the model for ``cfg.architecture`` (all supported ones are Llama-family)."""
    return LlamaForCausalLM(cfg, tp, backend)


__all__ = ["LlamaForCausalLM", "build_model"]
