"""The model runner: the only place where block ids become tensors.

KV-cache layout (per rank), one contiguous tensor::

    kv_cache[layer, 0 = K | 1 = V, block_id, offset_in_block, local_kv_head, head_dim]

(an int8 cache: uint8, the last axis ``head_dim + 4`` bytes; an fp8 cache: torch's fp8
dtype; ``engine.attention.kv_quant``)

A token at sequence position p lives in block ``block_ids[p // block_size]`` at offset
``p % block_size``; its slot is ``block_id * block_size + offset``. A KV transfer copies
whole blocks of this layout (all layers, or one layer at a time).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from engine.attention import (
    AttentionMetadata,
    ForwardContext,
    PrefillSpan,
    forward_context,
    select_backend,
)
from engine.attention.kv_quant import slot_bytes
from engine.attention.metadata import LayerHook
from engine.config import EngineConfig
from engine.core.scheduler import ScheduledChunk
from engine.kernels.linear import KernelPlan
from engine.kvcache.layout import KVLayout
from engine.models import build_model
from engine.models.layers import apply_kernel_plan, kv_head_range
from engine.models.loader import iter_weights
from engine.tp.distributed import Group

_TORCH_DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}


def torch_dtype(name: str) -> torch.dtype:
    return _TORCH_DTYPES[name]


def kv_bytes_per_block(config: EngineConfig, tp_rank: int = 0) -> int:
    """Bytes one block takes on one rank (all layers, K and V)."""
    m = config.model
    start, end = kv_head_range(m.num_kv_heads, tp_rank, config.parallel.tensor_parallel_size)
    return m.num_layers * 2 * config.cache.block_size * (end - start) * kv_slot_bytes(config)


def kv_slot_bytes(config: EngineConfig) -> int:
    """Bytes of one token's K (or V) of one KV head in the cache."""
    m = config.model
    if config.cache.kv_cache_dtype == "int8":
        return slot_bytes(m.head_dim)
    return m.head_dim * torch.tensor([], dtype=kv_cache_torch_dtype(config)).element_size()


def kv_cache_torch_dtype(config: EngineConfig) -> torch.dtype:
    """The cache tensor's dtype: uint8 (int8 slots), an fp8 dtype, or the model's."""
    return getattr(torch, KVLayout.cache_dtype_of(config.cache.kv_cache_dtype,
                                                  config.model.dtype))


def resolve_num_kv_blocks(config: EngineConfig, extra_bytes_per_block: int = 0) -> int:
    """The KV pool size: the configured one, else what fits the memory budget, capped at
    what ``max_num_seqs`` full-length sequences could use. ``extra_bytes_per_block``:
    what else each block costs on the first rank (a draft model's KV of it). On CUDA each
    rank has a GPU of its own and the budget is the first rank's; on the CPU the ranks of a
    TP group share the host's memory, and the budget is the whole group's."""
    if config.cache.num_kv_blocks is not None:
        return config.cache.num_kv_blocks
    per_block = kv_bytes_per_block(config) + extra_bytes_per_block
    if torch.device(config.device).type == "cuda":
        free, _ = torch.cuda.mem_get_info(torch.device(config.device))
        budget = int(free * config.cache.memory_fraction)
    else:
        budget = min(config.cache.max_kv_bytes, int(_available_ram() * config.cache.memory_fraction))
        per_block += sum(kv_bytes_per_block(config, rank)
                         for rank in range(1, config.parallel.tensor_parallel_size))
    blocks_per_seq = -(-config.model.max_model_len // config.cache.block_size)
    useful = config.scheduler.max_num_seqs * blocks_per_seq
    return max(1, min(budget // per_block, useful))


def _rank_device(device: str, rank: int, size: int) -> torch.device:
    """CUDA ranks of a TP group each take their own GPU (``cuda:rank``)."""
    dev = torch.device(device)
    if dev.type == "cuda" and size > 1 and dev.index is None:
        return torch.device("cuda", rank)
    return dev


def _available_ram() -> int:
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 4 << 30


class LayerHookError(RuntimeError):
    """The layer hook raised during a step; the step itself completed on every rank."""


class _DeferredErrors:
    """Wraps a layer hook: records its first exception instead of raising it mid-forward."""

    def __init__(self, hook: LayerHook) -> None:
        self.hook = hook
        self.error: BaseException | None = None

    def __call__(self, layer_idx: int) -> None:
        if self.error is None:
            try:
                self.hook(layer_idx)
            except Exception as exc:  # re-raised by ModelRunner.execute after the step
                self.error = exc


class ModelRunner:
    """Holds one rank's model shard and KV cache; runs one step of scheduled chunks.

    ``kernel_plan`` (``engine.kernels.choice.choose_kernel_plan``, made by the leader for
    every rank) names each linear layer's kernel; without one, ``F.linear`` everywhere.
    """

    def __init__(self, config: EngineConfig, tp: Group, num_kv_blocks: int,
                 kernel_plan: KernelPlan | None = None) -> None:
        self.config = config
        self.tp = tp
        self.device = _rank_device(config.device, tp.rank, tp.size)
        self.dtype = torch_dtype(config.model.dtype)
        self.block_size = config.cache.block_size
        self.num_kv_blocks = num_kv_blocks
        self.backend = select_backend(self.device, self.block_size, self.dtype,
                                      config.cache.kv_cache_dtype)
        with torch.device(self.device):
            self.model = build_model(config.model, tp, self.backend).to(self.dtype)
        self.model.load_weights(iter_weights(config.model.model_dir, self.dtype))
        self.model.eval()
        self.kernel_plan = kernel_plan
        if kernel_plan is not None:
            apply_kernel_plan(self.model, kernel_plan)
        local_kv_heads = self.model.num_local_kv_heads
        m = config.model
        # zero-filled: masked-out slots are multiplied by 0 and must not hold NaNs (an
        # int8 cache: uint8 slots of values and a scale, engine.attention.kv_quant)
        int8 = config.cache.kv_cache_dtype == "int8"
        self.kv_cache = torch.zeros(
            m.num_layers, 2, num_kv_blocks, self.block_size, local_kv_heads,
            slot_bytes(m.head_dim) if int8 else m.head_dim,
            dtype=kv_cache_torch_dtype(config), device=self.device)
        self.model.set_kv_cache(self.kv_cache)

    @property
    def linear_kernel(self) -> str:
        """The kernel the linear layers use (``KernelPlan.summary``)."""
        return self.kernel_plan.summary if self.kernel_plan is not None else "torch"

    @property
    def num_parameters(self) -> int:
        """Parameter elements this rank holds (a tied embedding counts once)."""
        return sum(p.numel() for p in self.model.parameters())

    @torch.inference_mode()
    def execute(self, chunks: Sequence[ScheduledChunk],
                layer_hook: LayerHook | None = None) -> torch.Tensor:
        """Run one forward over ``chunks`` (decodes first, then prefills); returns logits
        ``[rows, vocab]``: in chunk order, one row per token of a chunk with ``all_logits``
        or drafts (its last one the sampling row when it has ``sample``; a speculated
        chunk samples from each), else one for the last token of a chunk with ``sample``
        (``ScheduledChunk.num_logit_rows``).

        An exception from ``layer_hook`` does not interrupt the forward (other ranks are
        in its collectives); the first one is re-raised once the step is complete."""
        token_ids, positions, meta, sample_rows = self._prepare(chunks)
        hook = _DeferredErrors(layer_hook) if layer_hook is not None else None
        with forward_context(ForwardContext(meta, hook)):
            hidden = self.model(token_ids, positions)
        if sample_rows is not None:
            hidden = hidden[sample_rows]
        logits = self.model.compute_logits(hidden).float()
        if hook is not None and hook.error is not None:
            raise LayerHookError(f"layer hook failed: {hook.error!r}") from hook.error
        return logits

    def _prepare(self, chunks: Sequence[ScheduledChunk]
                 ) -> tuple[torch.Tensor, torch.Tensor, AttentionMetadata, torch.Tensor | None]:
        """The step's inputs: token ids, positions, the attention metadata and the rows to
        sample (``None``: every row, as in a decode-only step). Every integer goes to the
        device in one tensor, which the others are views of."""
        bs = self.block_size
        token_ids: list[int] = []
        positions: list[int] = []
        slots: list[int] = []
        sample_rows: list[int] = []
        # decode rows: (position, block table); a speculated chunk's tokens are decode rows
        # of their own, each attending up to itself (every row's K/V is written first)
        decodes: list[tuple[int, tuple[int, ...]]] = []
        prefills: list[tuple[int, ScheduledChunk]] = []  # (first row, chunk)
        for c in chunks:
            start = len(token_ids)
            token_ids.extend(c.token_ids)
            pos = range(c.start_position, c.start_position + len(c.token_ids))
            positions.extend(pos)
            slots.extend(c.block_ids[p // bs] * bs + p % bs for p in pos)
            sample_rows.extend(range(len(token_ids) - c.num_logit_rows, len(token_ids)))
            if c.is_decode or c.num_draft_tokens:
                if prefills:  # attention takes the first num_decode_tokens rows as decodes
                    raise ValueError("a step's decode chunks must come before its prefills")
                decodes.extend((p, c.block_ids) for p in pos)
            else:
                prefills.append((start, c))
        context_lens = [p + 1 for p, _ in decodes]
        max_context = max(context_lens, default=0)
        width = -(-max_context // bs)  # blocks that hold any decode key
        tables = [b for _, table in decodes
                  for b in (*table[:width], *[0] * (width - len(table)))]
        parts = [token_ids, positions, slots, sample_rows, context_lens, tables,
                 *(c.block_ids for _, c in prefills)]
        flat = self._tensor([v for part in parts for v in part])
        ids, pos_t, slot_t, rows_t, lens, tables_t, *block_tables = flat.split(
            [len(part) for part in parts])
        meta = AttentionMetadata(
            slot_mapping=slot_t,
            num_decode_tokens=len(decodes),
            decode_block_tables=tables_t.view(len(decodes), width),
            decode_context_lens=lens,
            max_decode_context_len=max_context,
            prefills=[PrefillSpan(start, len(c.token_ids), c.start_position + len(c.token_ids),
                                  table) for (start, c), table in zip(prefills, block_tables)],
        )
        return ids, pos_t, meta, None if len(sample_rows) == len(token_ids) else rows_t

    def _tensor(self, values: Sequence[int]) -> torch.Tensor:
        return torch.tensor(values, dtype=torch.int64, device=self.device)
