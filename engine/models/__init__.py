"""Model implementations by Hugging Face architecture name."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import torch

from engine.attention import AttentionBackend
from engine.config import ModelConfig
from engine.models.llama import LlamaForCausalLM
from engine.tp.distributed import Group


def build_model(cfg: ModelConfig, tp: Group, backend: AttentionBackend) -> LlamaForCausalLM:
    """Instantiate the model for ``cfg.architecture`` (all supported ones are Llama-family),
    its parameters in ``cfg.dtype`` from the start: built in float32 and converted after,
    a model took twice its bfloat16 bytes at its peak (the weights are loaded into them
    next)."""
    with _default_dtype(getattr(torch, cfg.dtype)):
        return LlamaForCausalLM(cfg, tp, backend)


@contextmanager
def _default_dtype(dtype: torch.dtype) -> Iterator[None]:
    """``dtype`` as torch's default while the model's parameters are made (explicitly
    typed tensors, the rotary tables' float32, are not affected)."""
    before = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        yield
    finally:
        torch.set_default_dtype(before)


__all__ = ["LlamaForCausalLM", "build_model"]
