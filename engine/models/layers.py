"""Tensor-parallel building blocks. Each layer owns its sharding and its weight loader
and receives the TP group explicitly (never the default process group).

Sharding rules (t = TP size, rank i):
- column-parallel: output rows [i*out/t, (i+1)*out/t); row-parallel: input columns likewise,
  followed by an all-reduce of the partial outputs.
- KV heads (H of them): heads [i*H/t, (i+1)*H/t) when t <= H; when t > H each rank holds
  the single head floor(i*H/t) (heads are replicated over t/H ranks).
- vocabulary: padded to a multiple of t, rank i holds rows [i*V/t, (i+1)*V/t).

Weights keep the checkpoint layout ``[out_features, in_features]``. ``apply_kernel_plan``
gives every linear the kernel (``engine.kernels.linear``) the plan names for its weight
shape, with that kernel's prepared copy of the weight (e.g. oneDNN's packed layout).
"""

from __future__ import annotations

import itertools
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from engine.kernels.cpu import native
from engine.kernels.linear import KERNELS, KernelPlan, LinearKernel
from engine.kernels.quant import Int8Weight, quantize_int8
from engine.tp.distributed import Group
from engine.tp.sharding import kv_head_range, shard_range

__all__ = ["kv_head_range", "shard_range"]  # defined in engine.tp.sharding (torch-free)


_kernel_changes = itertools.count(1)
_kernel_generation = 0


def kernel_generation() -> int:
    """A number that changes whenever any linear layer is given a kernel (``set_kernel``):
    what is built from the layers' prepared weights is rebuilt when it moves."""
    return _kernel_generation


def _new_param(*shape: int) -> nn.Parameter:
    return nn.Parameter(torch.empty(*shape), requires_grad=False)


class _Linear(nn.Module):
    """Base of the linear layers: ``weight [out, in]``, optional ``bias [out]``, and the
    kernel ``set_kernel`` chose with its prepared copy of the weight (``F.linear`` on the
    weight itself until then)."""

    weight: nn.Parameter
    bias: nn.Parameter | None

    def __init__(self) -> None:
        super().__init__()
        self._init_kernel()

    def _init_kernel(self) -> None:
        self._kernel: LinearKernel = KERNELS["torch"]
        self._prepared: Any = None
        # a shard's rows' largest magnitudes over the whole rows, where the shard holds
        # part rows (row-parallel): what a quantising kernel scales by (engine.kernels.quant)
        self.row_amax: torch.Tensor | None = None
        self._released_shape: tuple[int, int] | None = None  # see release_weight

    @property
    def kernel_name(self) -> str:
        return self._kernel.name if self._prepared is not None else "torch"

    @property
    def weight_shape(self) -> tuple[int, int]:
        """``[out, in]`` of this rank's weight (also once ``release_weight`` freed it)."""
        if self._released_shape is not None:
            return self._released_shape
        out_features, in_features = self.weight.shape
        return int(out_features), int(in_features)

    def set_kernel(self, name: str) -> None:
        """Multiply with kernel ``name`` from now on, (re)preparing its copy of the weight;
        call after loading, and again if the weight changes. Once the weight was released
        only a quantising kernel can be set (from the int8 weight kept); another raises
        ``RuntimeError``."""
        kernel = KERNELS[name]
        global _kernel_generation
        if kernel.quantization == "int8":
            int8 = self._int8_weight()
            self._prepared = kernel.prepare(int8 if int8 is not None else
                                            quantize_int8(self.weight.detach(), self.row_amax))
        elif self._released_shape is not None:
            raise RuntimeError(f"linear kernel {name} needs the weight as loaded, which was "
                               "released after int8 quantisation")
        else:
            self._prepared = kernel.prepare(self.weight.detach())
        self._kernel = kernel
        _kernel_generation = next(_kernel_changes)

    def _int8_weight(self) -> Int8Weight | None:
        prepared = self._prepared
        int8 = prepared if isinstance(prepared, Int8Weight) else getattr(prepared, "weight", None)
        return int8 if isinstance(int8, Int8Weight) else None

    def release_weight(self) -> bool:
        """Free the weight as loaded where the kernel multiplies by its int8 copy (the
        memory a quantised model saves); ``False`` where it does not. The caller keeps a
        weight another module shares (a tied embedding)."""
        if self._int8_weight() is None or self._released_shape is not None:
            return False
        self._released_shape = self.weight_shape
        self.weight.data = torch.empty(0, dtype=self.weight.dtype, device=self.weight.device)
        return True

    @property
    def weight_read_bytes(self) -> int:
        """Bytes of weight one multiply reads: the int8 weight and its scales where the
        kernel quantised it (``engine.kernels.quant``), else the weight as loaded."""
        int8 = self._int8_weight()
        if int8 is not None:
            return int8.q.numel() + int8.scales.numel() * int8.scales.element_size()
        return self.weight.numel() * self.weight.element_size()

    def _apply_weight(self, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        if self._prepared is None:
            return F.linear(x, self.weight, bias)
        return self._kernel.apply(x, self._prepared, bias)


def linear_layers(model: nn.Module) -> list[_Linear]:
    """Every linear layer of ``model`` (the LM head included), in module order."""
    return [m for m in model.modules() if isinstance(m, _Linear)]


def apply_kernel_plan(model: nn.Module, plan: KernelPlan) -> int:
    """Give each linear layer the kernel ``plan`` names for its weight shape; returns how
    many layers were set. A layer on a quantising kernel frees its weight as loaded
    (``release_weight``) unless another module shares it (a tied embedding, which
    keeps it). Raises ``KeyError`` for a shape the plan lacks."""
    layers = linear_layers(model)
    shared = {id(p) for m in model.modules() if not isinstance(m, _Linear)
              for p in m.parameters(recurse=False)}
    for layer in layers:
        layer.set_kernel(plan.kernel_for(*layer.weight_shape))
        if id(layer.weight) not in shared:
            layer.release_weight()
    return len(layers)


class ColumnParallelLinear(_Linear):
    """y = x W^T + b with W's output rows sharded; output stays sharded."""

    def __init__(self, in_features: int, out_features: int, tp: Group, *, bias: bool = False) -> None:
        super().__init__()
        self.tp = tp
        self.out_start, self.out_end = shard_range(out_features, tp.rank, tp.size)
        self.weight = _new_param(self.out_end - self.out_start, in_features)
        self.bias = _new_param(self.out_end - self.out_start) if bias else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self._apply_weight(x, self.bias)

    def load_weight(self, name: str, loaded: torch.Tensor) -> None:
        """``name`` is "weight" or "bias"; ``loaded`` is the full, unsharded tensor."""
        param = getattr(self, name)
        param.data.copy_(loaded[self.out_start : self.out_end])


class MergedColumnParallelLinear(_Linear):
    """Several column-parallel projections of the same input fused into one matmul
    (gate_proj and up_proj). Local weight rows: [shard of part 0; shard of part 1; ...]."""

    def __init__(self, in_features: int, out_parts: list[int], tp: Group) -> None:
        super().__init__()
        self.tp = tp
        self.out_parts = out_parts
        self.local_parts = [p // tp.size for p in out_parts]
        self.weight = _new_param(sum(self.local_parts), in_features)
        self.bias = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self._apply_weight(x, None)

    def load_weight(self, part: int, loaded: torch.Tensor) -> None:
        start, end = shard_range(self.out_parts[part], self.tp.rank, self.tp.size)
        offset = sum(self.local_parts[:part])
        self.weight.data[offset : offset + end - start].copy_(loaded[start:end])


class QKVParallelLinear(_Linear):
    """Fused q/k/v projection. Local output: [q heads of this rank | its k heads | its v heads],
    each head ``head_dim`` wide; KV heads follow ``kv_head_range`` (replicated when t > H)."""

    def __init__(self, hidden: int, head_dim: int, num_heads: int, num_kv_heads: int,
                 tp: Group, *, bias: bool = False) -> None:
        super().__init__()
        self.tp = tp
        self.head_dim = head_dim
        self.q_heads = shard_range(num_heads, tp.rank, tp.size)
        self.kv_heads = kv_head_range(num_kv_heads, tp.rank, tp.size)
        self.num_local_heads = self.q_heads[1] - self.q_heads[0]
        self.num_local_kv_heads = self.kv_heads[1] - self.kv_heads[0]
        self.q_size = self.num_local_heads * head_dim
        self.kv_size = self.num_local_kv_heads * head_dim
        out = self.q_size + 2 * self.kv_size
        self.weight = _new_param(out, hidden)
        self.bias = _new_param(out) if bias else None

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        return self.project(x).split([self.q_size, self.kv_size, self.kv_size], dim=-1)  # type: ignore[return-value]

    def project(self, x: torch.Tensor) -> torch.Tensor:
        """The fused projection ``[..., q_size + 2 * kv_size]`` (q heads | k heads | v heads)."""
        return self._apply_weight(x, self.bias)

    def load_weight(self, name: str, part: str, loaded: torch.Tensor) -> None:
        """``part`` is "q", "k" or "v"; ``loaded`` the full checkpoint tensor (weight or bias)."""
        heads = self.q_heads if part == "q" else self.kv_heads
        offset = {"q": 0, "k": self.q_size, "v": self.q_size + self.kv_size}[part]
        rows = loaded[heads[0] * self.head_dim : heads[1] * self.head_dim]
        getattr(self, name).data[offset : offset + rows.shape[0]].copy_(rows)


class RowParallelLinear(_Linear):
    """y = x W^T + b with W's input columns sharded; partial outputs are all-reduced.
    The bias is added once, after the reduction."""

    def __init__(self, in_features: int, out_features: int, tp: Group, *, bias: bool = False) -> None:
        super().__init__()
        self.tp = tp
        self.in_start, self.in_end = shard_range(in_features, tp.rank, tp.size)
        self.weight = _new_param(out_features, self.in_end - self.in_start)
        self.bias = _new_param(out_features) if bias else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.tp.all_reduce(self._apply_weight(x, None))
        return y + self.bias if self.bias is not None else y

    def load_weight(self, name: str, loaded: torch.Tensor) -> None:
        if name == "bias":
            assert self.bias is not None
            self.bias.data.copy_(loaded)
        else:
            self.weight.data.copy_(loaded[:, self.in_start : self.in_end])
            if self.tp.size > 1:  # part rows: int8 scales come from the whole ones
                self.row_amax = loaded.detach().abs().amax(dim=1).to(torch.float32)


class VocabParallelEmbedding(nn.Module):
    """Token embedding with vocabulary rows sharded (padded to a multiple of the TP size)."""

    def __init__(self, vocab_size: int, hidden: int, tp: Group) -> None:
        super().__init__()
        self.tp = tp
        self.vocab_size = vocab_size
        per_rank = -(-vocab_size // tp.size)
        self.vocab_start = tp.rank * per_rank
        self.vocab_end = min(self.vocab_start + per_rank, vocab_size)
        self.weight = _new_param(per_rank, hidden)
        self.weight.data.zero_()

    def forward(self, token_ids: torch.Tensor) -> torch.Tensor:
        if self.tp.size == 1:
            return F.embedding(token_ids, self.weight)
        local = token_ids - self.vocab_start
        outside = (token_ids < self.vocab_start) | (token_ids >= self.vocab_end)
        out = F.embedding(local.masked_fill(outside, 0), self.weight)
        out.masked_fill_(outside.unsqueeze(-1), 0.0)
        return self.tp.all_reduce(out)

    def load_weight(self, name: str, loaded: torch.Tensor) -> None:
        rows = loaded[self.vocab_start : self.vocab_end]
        self.weight.data[: rows.shape[0]].copy_(rows)


class ParallelLMHead(VocabParallelEmbedding, _Linear):
    """Output projection to the vocabulary, column-parallel over vocabulary rows.
    ``forward`` returns full logits ``[num_tokens, vocab_size]`` on every rank.
    With tied embeddings it shares the embedding's weight (its kernel's prepared copy is its own)."""

    def __init__(self, vocab_size: int, hidden: int, tp: Group) -> None:
        super().__init__(vocab_size, hidden, tp)
        self._init_kernel()
        self.bias = None

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        logits = self._apply_weight(hidden, None)
        logits = self.tp.all_gather(logits, dim=-1)
        return logits[..., : self.vocab_size]


class RMSNorm(nn.Module):
    """RMSNorm over the last dim: pdserve's compiled kernel for contiguous fp32 CPU
    inputs where it could be built (``engine.kernels.cpu``), else ``F.rms_norm``."""

    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.eps = eps
        self.weight = _new_param(dim)
        self.weight.data.fill_(1.0)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.device.type == "cpu" and x.dtype == torch.float32:
            kernels = native()
            out = kernels.rms_norm(x, self.weight, self.eps) if kernels is not None else None
            if out is not None:
                return out
        return F.rms_norm(x, (x.shape[-1],), self.weight, self.eps)

    def load_weight(self, name: str, loaded: torch.Tensor) -> None:
        self.weight.data.copy_(loaded)


def silu_and_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """SwiGLU: silu(gate) * up over the last dim split in halves (one new tensor); in one
    pass by pdserve's compiled kernel for contiguous fp32 CPU inputs where it was built."""
    if gate_up.device.type == "cpu" and gate_up.dtype == torch.float32:
        kernels = native()
        out = kernels.silu_and_mul(gate_up) if kernels is not None else None
        if out is not None:
            return out
    gate, up = gate_up.chunk(2, dim=-1)
    return F.silu(gate).mul_(up)
