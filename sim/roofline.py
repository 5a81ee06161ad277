"""Profiles derived from datasheet figures, for hardware this project cannot measure on.

``derive(shape, gpu, tps)`` builds a ``sim.profile.Profile`` with ``source: derived`` —
roofline arithmetic, never a measurement — for a dense Llama-family model of ``shape`` on
``gpu`` at each tensor-parallel size of ``tps``:

- ``base_s``: one pass over a rank's weight shard at ``MEMORY_EFFICIENCY`` of the HBM
  bandwidth, plus two all-reduces per layer over NVLink (latency + the activations) at
  TP > 1, plus ``STEP_OVERHEAD_S`` (launches, scheduling, sampling);
- ``per_prefill_token_s``: ``2 × parameters`` FLOPs per token over the TP group's peak at
  ``MFU``; ``per_prefill_attention_s``: ``4 × layers × heads × head_dim`` FLOPs per
  (query, key) pair likewise;
- ``per_decode_seq_s``: the same ``2 × parameters`` FLOPs per decoded token (hidden under
  the weight read at small batches, it is what grows a large batch);
- ``per_decode_context_s``: one token's KV bytes read per step at the same bandwidth;
- ``multi_token_s``, ``prefill_step_s``: 0 (a roofline has no fixed cost of a step's kind);
- ``num_kv_blocks``: the group's memory at ``MEMORY_UTILIZATION`` less the weights, in
  blocks;
- the KV transfer: ``NETWORK_BYTES_PER_S`` (a 400 Gb/s NIC per GPU of the prefill group)
  with ``NETWORK_LATENCY_S``; router and handoff overheads as measured for pdserve on CPU
  (``ROUTER_OVERHEAD_S``, ``HANDOFF_OVERHEAD_S``: pdserve's own costs, not the GPU's).

Every assumption is a module constant and is written into the profile's ``points``.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import asdict, dataclass

from sim.profile import ModelFacts, Profile, StepModel

MEMORY_EFFICIENCY = 0.8  # share of the HBM datasheet bandwidth a decode step reaches
MFU = 0.5  # share of the dense peak a prefill reaches
MEMORY_UTILIZATION = 0.9  # of HBM for weights + KV (vLLM's gpu_memory_utilization)
STEP_OVERHEAD_S = 1e-3
ALLREDUCE_LATENCY_S = 10e-6
NETWORK_BYTES_PER_S = 50e9  # 400 Gb/s
NETWORK_LATENCY_S = 50e-6
ROUTER_OVERHEAD_S = 1e-3
HANDOFF_OVERHEAD_S = 5e-3
BLOCK_SIZE = 16


@dataclass(frozen=True)
class GPU:
    name: str
    hbm_bytes_per_s: float
    hbm_bytes: float
    bf16_flops: float  # dense
    nvlink_bytes_per_s: float  # per direction


@dataclass(frozen=True)
class ModelShape:
    name: str
    num_layers: int
    hidden_size: int
    intermediate_size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    vocab_size: int
    dtype_bytes: int = 2  # bf16
    max_model_len: int = 8192

    @property
    def parameters(self) -> int:
        h, kv = self.hidden_size, self.num_kv_heads * self.head_dim
        attention = h * self.num_heads * self.head_dim * 2 + h * kv * 2
        mlp = 3 * h * self.intermediate_size
        return self.num_layers * (attention + mlp) + 2 * self.vocab_size * h

    @property
    def kv_bytes_per_token(self) -> int:
        return 2 * self.num_layers * self.num_kv_heads * self.head_dim * self.dtype_bytes


GPUS = {
    "h100": GPU("H100 SXM", 3.35e12, 80e9, 989e12, 450e9),
    "h200": GPU("H200 SXM", 4.8e12, 141e9, 989e12, 450e9),
}
MODELS = {
    "llama-3-8b": ModelShape("Llama-3-8B", 32, 4096, 14336, 32, 8, 128, 128256),
    "llama-3-70b": ModelShape("Llama-3-70B", 80, 8192, 28672, 64, 8, 128, 128256),
}


def step_model(shape: ModelShape, gpu: GPU, tp: int) -> StepModel:
    """The step model of one ``tp``-GPU group (see the module doc)."""
    bandwidth = gpu.hbm_bytes_per_s * MEMORY_EFFICIENCY * tp
    flops = gpu.bf16_flops * MFU * tp
    weights = shape.parameters * shape.dtype_bytes
    allreduce = 0.0 if tp == 1 else 2 * shape.num_layers * ALLREDUCE_LATENCY_S
    free = gpu.hbm_bytes * tp * MEMORY_UTILIZATION - weights
    blocks = int(free // (shape.kv_bytes_per_token * BLOCK_SIZE))
    if blocks < 1:
        raise ValueError(f"{shape.name} does not fit on {tp} x {gpu.name}")
    return StepModel(
        base_s=weights / bandwidth + allreduce + STEP_OVERHEAD_S,
        per_prefill_token_s=2 * shape.parameters / flops,
        per_prefill_attention_s=4 * shape.num_layers * shape.num_heads * shape.head_dim / flops,
        per_decode_seq_s=2 * shape.parameters / flops,
        per_decode_context_s=shape.kv_bytes_per_token / bandwidth,
        num_kv_blocks=blocks)


def derive(shape: ModelShape, gpu: GPU, tps: Sequence[int] = (1, 2, 4, 8)) -> Profile:
    """A derived profile of ``shape`` on ``gpu`` at each TP size of ``tps`` that fits."""
    steps = {}
    for tp in tps:
        try:
            steps[tp] = step_model(shape, gpu, tp)
        except ValueError:
            continue
    if not steps:
        raise ValueError(f"{shape.name} fits on no TP size of {list(tps)} x {gpu.name}")
    return Profile(
        source="derived",
        model=ModelFacts(shape.name, shape.num_layers, shape.kv_bytes_per_token, BLOCK_SIZE,
                         shape.max_model_len),
        steps=steps, transfer_latency_s=NETWORK_LATENCY_S,
        transfer_bytes_per_s=NETWORK_BYTES_PER_S, router_overhead_s=ROUTER_OVERHEAD_S,
        handoff_overhead_s=HANDOFF_OVERHEAD_S,
        description=f"{shape.name} on {gpu.name}: derived from datasheet figures by roofline "
                    "arithmetic (sim.roofline), not measured",
        points={"gpu": asdict(gpu), "model": asdict(shape), "parameters": shape.parameters,
                "assumptions": {"memory_efficiency": MEMORY_EFFICIENCY, "mfu": MFU,
                                "memory_utilization": MEMORY_UTILIZATION,
                                "step_overhead_s": STEP_OVERHEAD_S,
                                "allreduce_latency_s": ALLREDUCE_LATENCY_S,
                                "network_bytes_per_s": NETWORK_BYTES_PER_S,
                                "network_latency_s": NETWORK_LATENCY_S}})
