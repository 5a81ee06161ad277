"""pdserve's inference core, shared by prefill and decode workers.

``import engine`` does not import torch: the torch-free parts (config, sampling
parameters, block manager, block hashing, scheduler) are importable by the router.
``engine.LLM`` and friends load lazily on first access.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from engine.sampling_params import SamplingParams, TokenLogprobs

if TYPE_CHECKING:
    from engine.core.engine_core import EngineCore, RequestOutput
    from engine.llm import LLM, GenerationResult

_LAZY = {
    "LLM": "engine.llm",
    "GenerationResult": "engine.llm",
    "EngineCore": "engine.core.engine_core",
    "RequestOutput": "engine.core.engine_core",
}

__all__ = ["LLM", "EngineCore", "GenerationResult", "RequestOutput", "SamplingParams",
           "TokenLogprobs"]


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'engine' has no attribute {name!r}")
    return getattr(importlib.import_module(module), name)
