"""Rank plugins: worker code that runs on every rank of an engine, beside its runner.

A tensor-parallel engine's followers are processes the leader spawned; worker code
that must act on each rank's KV shard (a KV sender on every prefill rank, a KV receiver
on every decode rank) is given to the engine as an importable factory path
(``EngineConfig.rank_plugin = "package.module:factory"``) and built once on each rank
with that rank's ``RankContext``. The leader then talks to all of them through the
executor:

- ``Executor.call(request) -> [reply of rank 0, reply of rank 1, ...]``: a control call
  (e.g. "expect transfer T into blocks B", "which transfers have arrived?"), answered
  by every rank's ``handle``, between steps;
- ``Executor.execute(chunks, payload=...)``: each rank's ``step_hook(chunks, payload)``
  may return a layer hook for that step (e.g. "send layer l of these blocks").

Requests and replies are bytes: each plugin defines its own small typed messages and
their encoding (never pickled objects). An exception in ``handle`` is reported to the
leader as ``RankCallError``; one in a layer hook is logged on followers and raised on
the leader after the step, so the ranks always stay in step.
"""

from __future__ import annotations

import importlib
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

if TYPE_CHECKING:
    import torch

    from engine.attention.metadata import LayerHook
    from engine.config import EngineConfig
    from engine.core.scheduler import ScheduledChunk
    from engine.kernels.linear import KernelPlan


@dataclass(frozen=True)
class RankContext:
    """What a plugin gets on its rank. ``kv_cache`` is this rank's KV shard, laid out as
    ``engine.core.runner`` documents; the plugin may read and write blocks it was told about.
    ``kernel_plan``: the linear kernels this rank's model runs (the leader's choice)."""

    rank: int
    tp_size: int
    config: EngineConfig
    kv_cache: torch.Tensor
    kernel_plan: KernelPlan | None = None

    @property
    def plugin_config(self) -> str:
        """``EngineConfig.rank_plugin_config``: the plugin's own settings, as a string."""
        return self.config.rank_plugin_config


class RankPlugin(Protocol):
    def handle(self, request: bytes) -> bytes:
        """Answer a control call from the leader (runs on every rank, between steps)."""
        ...

    def step_hook(self, chunks: Sequence[ScheduledChunk], payload: bytes) -> LayerHook | None:
        """Called before each step with its chunks and the leader's payload; may return a
        hook run after each layer's KV is written."""
        ...

    def close(self) -> None:
        """Release what the plugin holds (threads, channels); called at shutdown."""
        ...


class RankCallError(RuntimeError):
    """A rank's plugin raised while handling a control call."""

    def __init__(self, rank: int, message: str) -> None:
        super().__init__(f"rank {rank}: {message}")
        self.rank = rank


def load_rank_plugin(spec: str, ctx: RankContext) -> RankPlugin:
    """Build the plugin named ``"module:factory"`` for this rank."""
    module_name, sep, attr = spec.partition(":")
    if not sep or not module_name or not attr:
        raise ValueError(f"rank_plugin must look like 'package.module:factory', got {spec!r}")
    factory = getattr(importlib.import_module(module_name), attr)
    plugin: RankPlugin = factory(ctx)
    return plugin


# Replies cross the pipe as one status byte + data.
_OK, _ERR = b"\x00", b"\x01"


def run_call(plugin: RankPlugin, request: bytes) -> bytes:
    """Run ``plugin.handle`` and frame its reply (or its error) for the leader."""
    try:
        return _OK + plugin.handle(request)
    except Exception as exc:  # reported to the leader, the rank keeps serving
        return _ERR + f"{type(exc).__name__}: {exc}".encode()


def unframe_reply(rank: int, framed: bytes) -> bytes:
    """The reply's data, or ``RankCallError`` when the rank's plugin raised."""
    if framed[:1] == _OK:
        return framed[1:]
    raise RankCallError(rank, framed[1:].decode(errors="replace"))
