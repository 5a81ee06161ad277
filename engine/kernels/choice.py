"""Choosing each linear layer's kernel by measurement, once per CPU model and shape.

``choose_kernel_plan(config, threads)`` returns the ``KernelPlan`` an engine's ranks
apply after loading (the leader chooses; its ranks get the plan in their launch
message, so every rank runs the same kernels). In order of precedence:

1. ``EngineConfig.linear_kernel`` other than ``"auto"``: that kernel everywhere;
2. ``PDSERVE_LINEAR_KERNEL=NAME`` (any of ``engine.kernels.linear.KERNELS``) in the
   environment: likewise;
3. a speculating engine whose verifying steps pass the GEMV's rows (``1 +
   num_speculative_tokens > GEMV_MAX_ROWS``), where the compiled kernels run: the packed
   GEMM at every row count everywhere (``packed_gemm``, ``int8_packed_gemm`` for int8
   weights; ``engine.kernels.linear`` says why), so that its steps of a few rows and its
   verifying steps read one copy of each weight, and all of them run in the compiled
   decoder stack (``engine.models.decoder_stack``);
4. not a CPU, or only one kernel available: ``torch`` (``F.linear``; ``int8_torch``, its
   int8 form, for int8 weights): nothing is measured off the CPU, and a kernel that is
   no candidate of the measured choice (``int8_woq``, ``packed_gemm``) is never a default;
5. the cache (``$XDG_CACHE_HOME/pdserve/linear_kernels.json``, else
   ``~/.cache/pdserve/``), keyed by CPU model, torch version and CPU capability,
   thread count, dtype and the candidate kernels, then by weight shape and timed batch
   sizes;
6. else every candidate (``LinearKernel.measured``) is timed on this rank's real weight shapes (random weights) at
   a batch-1 decode, a batched decode and a prefill chunk (the LM head only at the two
   decode sizes: it sees one row per sequence); per shape the kernel with the lowest
   sum of its time relative to the fastest at each batch size wins (``pick_kernel``),
   and goes into the cache.

Measuring takes a few hundred milliseconds for a 55M-parameter model on 2 cores (less
for the tiny test models) and happens once per machine; forcing a kernel, or a present
cache entry, makes the choice deterministic.
"""

from __future__ import annotations

import json
import math
import os
import platform
import tempfile
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from engine.config import EngineConfig
from engine.kernels.cpu import GEMV_MAX_ROWS, native
from engine.kernels.linear import KERNELS, KernelPlan, available_kernels
from engine.models.layers import kv_head_range, shard_range

KERNEL_ENV = "PDSERVE_LINEAR_KERNEL"
CACHE_FILE = "linear_kernels.json"
CACHE_VERSION = 1
DECODE_BATCH = 32  # the batched-decode size timed (at most max_num_seqs)
PREFILL_BATCH = 256  # the prefill-chunk size timed (at most max_num_batched_tokens)
_COLD_BYTES = 16 << 20  # batch-1 timings rotate over copies of this many bytes in all
_MAX_COPIES = 16
_SAMPLES = (4, 30)  # calls timed per kernel in one block: at least, at most
_BUDGET_S = 0.025  # time per block (a shape at one batch size) that sets the sample count
_QUANTILE = 0.25  # of a kernel's call times: its figure for one batch size
_STALLED = 2.0  # a block whose quartile is this many times its best call was disturbed
_RETRIES = 2  # extra blocks sampled after a disturbed one
_TIE = 0.03  # scores within 3% are a tie: the earlier kernel (torch needs no weight copy) wins

# kernel -> batch size -> seconds of each timed call (the kernels' calls interleaved)
Timings = dict[str, dict[int, list[float]]]
Measure = Callable[["LinearShape", Sequence[str], torch.dtype], Timings]


@dataclass(frozen=True)
class LinearShape:
    """One distinct weight shape of a rank's shard and the batch sizes (rows of ``x``) it
    is timed at."""

    out_features: int
    in_features: int
    batch_sizes: tuple[int, ...]

    @property
    def cache_key(self) -> str:
        return f"{self.out_features}x{self.in_features}@{','.join(map(str, self.batch_sizes))}"


def cpu_model() -> str:
    """The CPU's model name from /proc/cpuinfo (Linux), else what ``platform`` says."""
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as f:
            for line in f:
                if line.lower().startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine() or "unknown"


def machine_key(dtype: torch.dtype, threads: int, candidates: Sequence[str] = ()) -> str:
    """What a cached timing is only valid for: CPU, torch build, threads, dtype, the
    kernels that were candidates (a choice made without a kernel says nothing about it)
    and, where they are among them, which build of pdserve's compiled kernels (its file
    name hashes the source, compiler, flags and target)."""
    key = (f"cpu={cpu_model()}|capability={torch.backends.cpu.get_cpu_capability()}"
           f"|torch={torch.__version__}|threads={threads}|dtype={str(dtype).removeprefix('torch.')}"
           f"|kernels={','.join(candidates)}")
    if any(KERNELS[k].uses_native for k in candidates):
        kernels = native()
        key += f"|library={Path(kernels.path).name if kernels is not None else 'none'}"
    return key


def default_cache_path() -> Path:
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "pdserve" / CACHE_FILE


def linear_weight_shapes(config: EngineConfig, rank: int = 0) -> dict[str, tuple[int, int]]:
    """``[out, in]`` of each linear weight of ``rank``'s shard, by role, following the
    layers' sharding rules (``engine.models.layers``; a test checks they agree)."""
    m, size = config.model, config.parallel.tensor_parallel_size
    q_start, q_end = shard_range(m.num_heads, rank, size)
    kv_start, kv_end = kv_head_range(m.num_kv_heads, rank, size)
    qkv_out = (q_end - q_start + 2 * (kv_end - kv_start)) * m.head_dim
    return {
        "qkv_proj": (qkv_out, m.hidden_size),
        "o_proj": (m.hidden_size, m.num_heads * m.head_dim // size),
        "gate_up_proj": (2 * m.intermediate_size // size, m.hidden_size),
        "down_proj": (m.hidden_size, m.intermediate_size // size),
        "lm_head": (-(-m.vocab_size // size), m.hidden_size),
    }


def linear_shapes(config: EngineConfig, rank: int = 0) -> list[LinearShape]:
    """The distinct linear weight shapes of ``rank``'s shard, each with the batch sizes
    to time it at (the LM head sees one row per sequence, never a prefill chunk)."""
    s = config.scheduler
    decode = {1, min(DECODE_BATCH, s.max_num_seqs)}
    prefill = {*decode, min(PREFILL_BATCH, s.max_num_batched_tokens)}
    sizes: dict[tuple[int, int], set[int]] = {}
    for role, shape in linear_weight_shapes(config, rank).items():
        sizes.setdefault(shape, set()).update(decode if role == "lm_head" else prefill)
    return [LinearShape(o, i, tuple(sorted(b))) for (o, i), b in sorted(sizes.items())]


def choose_kernel_plan(config: EngineConfig, threads: int, *,
                       cache_path: Path | None = None,
                       measure: Measure | None = None, env_fits_only: bool = False
                       ) -> KernelPlan:
    """The plan for ``config``'s ranks, run with ``threads`` torch threads each (see the
    module docstring for the order of precedence). Raises ``ValueError`` for a forced
    kernel that is unknown or cannot run on this device and dtype. ``env_fits_only``: a
    kernel the environment forces applies only where it multiplies ``config``'s weights
    (a draft model's, quantised otherwise than its target's), else it is not asked for."""
    device = torch.device(config.device)
    dtype = _dtype(config)
    shapes = linear_shapes(config)
    pairs = [(s.out_features, s.in_features) for s in shapes]
    candidates = available_kernels(device, dtype, config.quantization)
    env = os.environ.get(KERNEL_ENV)
    if env_fits_only and env in KERNELS and KERNELS[env].quantization != config.quantization:
        env = None
    for source, wanted in (("config", config.linear_kernel), ("env", env)):
        if wanted not in (None, "", "auto"):
            _check_forced(wanted, candidates, source, config.quantization)
            return KernelPlan.uniform(pairs, str(wanted), source)
    gemm_only = "int8_packed_gemm" if config.quantization == "int8" else "packed_gemm"
    if speculates_past_gemv(config) and gemm_only in candidates:
        return KernelPlan.uniform(pairs, gemm_only, "speculative")
    candidates = [name for name in candidates if KERNELS[name].measured]
    if device.type != "cpu" or len(candidates) == 1:  # torch's (int8_torch's) own
        return KernelPlan.uniform(pairs, candidates[0], "default")
    cache = KernelCache(cache_path or default_cache_path(), machine_key(dtype, threads, candidates))
    chosen = {s: cache.get(s, candidates) for s in shapes}
    missing = [s for s, kernel in chosen.items() if kernel is None]
    if missing and measure is None:
        warm_up(candidates, dtype)
    for shape in missing:
        timings = (measure or measure_kernels)(shape, candidates, dtype)
        kernel = chosen[shape] = pick_kernel(timings)
        cache.put(shape, kernel, timings)
    if missing:
        cache.save()
    plan = tuple((s.out_features, s.in_features, str(chosen[s])) for s in shapes)
    return KernelPlan(plan, "measured" if missing else "cache")


def speculates_past_gemv(config: EngineConfig) -> bool:
    """Whether ``config``'s verifying steps (a token and its guesses) pass the GEMV's rows."""
    s = config.scheduler
    return bool(s.speculative_method) and 1 + s.num_speculative_tokens > GEMV_MAX_ROWS


def _dtype(config: EngineConfig) -> torch.dtype:
    dtype = getattr(torch, config.model.dtype)
    assert isinstance(dtype, torch.dtype)
    return dtype


def _check_forced(wanted: str, candidates: Sequence[str], source: str,
                  quantization: str | None) -> None:
    where = "linear_kernel" if source == "config" else KERNEL_ENV
    if wanted not in KERNELS:
        raise ValueError(f"{where}={wanted!r} is not a linear kernel; known: "
                         f"{sorted(KERNELS)} or 'auto'")
    if KERNELS[wanted].quantization != quantization:
        raise ValueError(f"{where}={wanted!r} does not multiply the weights of "
                         f"quantization={quantization!r}; these do: "
                         f"{[k for k, v in KERNELS.items() if v.quantization == quantization]}")
    if wanted not in candidates:
        raise ValueError(f"{where}={wanted!r} cannot run here (available: {list(candidates)}); "
                         "onednn needs a CPU, float32 and a oneDNN-enabled torch; "
                         "onednn_gemv also, and packed, packed_gemm, int8_packed and "
                         "int8_packed_gemm only, a CPU, float32 and pdserve's compiled CPU "
                         "kernels (a C compiler)")


def pick_kernel(timings: Timings) -> str:
    """The kernel with the lowest score: the sum over batch sizes of its figure (the
    lower quartile of its call times) relative to the fastest kernel's. The kernels' calls
    were interleaved one by one, and disturbed blocks sampled again, so a spell of other
    work on a shared machine (which stalls multi-threaded kernels most: a thread waits
    for a core) rarely decides. Scores within ``_TIE`` of the best go to the first
    kernel in ``timings`` order."""
    scores = dict.fromkeys(timings, 0.0)
    for m in {m for per_size in timings.values() for m in per_size}:
        figures = {k: _quantile(timings[k][m], _QUANTILE) for k in timings}
        fastest = min(figures.values())
        for k, figure in figures.items():
            scores[k] += figure / fastest
    best = min(scores.values())
    return next(k for k, score in scores.items() if score <= best * (1 + _TIE))


def _quantile(values: Sequence[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def measure_kernels(shape: LinearShape, kernels: Sequence[str], dtype: torch.dtype) -> Timings:
    """Seconds of each call of each kernel at each of ``shape.batch_sizes``, on random
    weights. The kernels' calls are interleaved one by one; a block disturbed by other
    work (its calls spread out) is sampled again. Batch-1 calls rotate over copies of
    the weight, so that fewer of them find it in cache."""
    out_features, in_features = shape.out_features, shape.in_features
    weight = torch.randn(out_features, in_features, dtype=dtype) * in_features ** -0.5
    copies = max(1, min(_MAX_COPIES, _COLD_BYTES // (weight.numel() * weight.element_size())))
    weights = [weight] + [weight.clone() for _ in range(copies - 1)]
    prepared = {k: [KERNELS[k].prepare(w) for w in weights] for k in kernels}
    timings: Timings = {k: {} for k in kernels}
    with torch.inference_mode():
        for m in shape.batch_sizes:
            x = torch.randn(m, in_features, dtype=dtype)
            used = {k: prepared[k] if m == 1 else prepared[k][:1] for k in kernels}
            block = _sample_block(x, used)
            for _ in range(_RETRIES):
                if not _disturbed(block):
                    break
                more = _sample_block(x, used)
                block = {k: block[k] + more[k] for k in block}
            for k in kernels:
                timings[k][m] = block[k]
    return timings


def _sample_block(x: torch.Tensor, prepared: dict[str, list[Any]]) -> dict[str, list[float]]:
    """Interleaved calls of every kernel on ``x`` (each on the next of its prepared
    copies): a few, then as many more as fit in ``_BUDGET_S``."""
    block = {k: _sample_calls(KERNELS[k].apply, x, p, _SAMPLES[0]) for k, p in prepared.items()}
    per_round = sum(min(t) for t in block.values())
    more = min(_SAMPLES[1], int(_BUDGET_S / max(per_round, 1e-9))) - _SAMPLES[0]
    for i in range(max(0, more)):
        for k, p in prepared.items():
            block[k] += _sample_calls(KERNELS[k].apply, x, p, 1, start=i)
    return block


def _disturbed(block: dict[str, list[float]]) -> bool:
    return any(_quantile(t, _QUANTILE) > _STALLED * min(t) for t in block.values())


def warm_up(kernels: Sequence[str], dtype: torch.dtype, seconds: float = 0.03) -> None:
    """Run each kernel for about ``seconds`` on a throwaway shape: a fresh process's
    first calls (thread pools starting, libraries initialising, idle cores waking) are
    several times slower and would otherwise be timed against the first shape."""
    weight = torch.randn(1024, 1024, dtype=dtype)
    x = torch.randn(64, 1024, dtype=dtype)
    with torch.inference_mode():
        for k in kernels:
            kernel = KERNELS[k]
            prepared = kernel.prepare(weight)
            deadline = time.perf_counter() + seconds
            while time.perf_counter() < deadline:
                kernel.apply(x, prepared, None)


def _sample_calls(apply: Callable[[torch.Tensor, torch.Tensor, Any], torch.Tensor],
                  x: torch.Tensor, prepared: list[Any], num: int, *,
                  start: int | None = None) -> list[float]:
    """Seconds of ``num`` calls, each on the next prepared copy (``start=None``: the
    first sampling, after an untimed warm-up call)."""
    if start is None:
        apply(x, prepared[-1], None)
        start = 0
    seconds = []
    for i in range(start, start + num):
        weight = prepared[i % len(prepared)]
        t0 = time.perf_counter()
        apply(x, weight, None)
        seconds.append(time.perf_counter() - t0)
    return seconds


class KernelCache:
    """The JSON file of past choices, one section per ``machine_key``::

        {"version": 1, "machines": {KEY: {"768x512@1,32,256": {"kernel": "onednn",
                                                                "seconds": {...}}}}}

    A missing, unreadable or other-version file counts as empty; ``save`` replaces it
    atomically (concurrent writers: the last one wins, and a lost entry is measured
    again)."""

    def __init__(self, path: Path, key: str) -> None:
        self.path = path
        self.key = key
        self._data = self._load()

    def _load(self) -> dict[str, Any]:
        try:
            data = json.loads(self.path.read_text())
        except (OSError, ValueError):
            return {"version": CACHE_VERSION, "machines": {}}
        if not isinstance(data, dict) or data.get("version") != CACHE_VERSION \
                or not isinstance(data.get("machines"), dict):
            return {"version": CACHE_VERSION, "machines": {}}
        return data

    def _section(self) -> dict[str, Any]:
        section = self._data["machines"].setdefault(self.key, {})
        assert isinstance(section, dict)
        return section

    def get(self, shape: LinearShape, candidates: Sequence[str]) -> str | None:
        """The cached kernel for ``shape``, if any and still one of ``candidates``."""
        entry = self._data["machines"].get(self.key, {}).get(shape.cache_key)
        kernel = entry.get("kernel") if isinstance(entry, dict) else None
        return kernel if kernel in candidates else None

    def put(self, shape: LinearShape, kernel: str, timings: Timings) -> None:
        """Record ``kernel`` for ``shape`` with each kernel's best time per batch size."""
        seconds = {k: {str(m): min(t) for m, t in per.items() if t and math.isfinite(min(t))}
                   for k, per in timings.items()}
        self._section()[shape.cache_key] = {"kernel": kernel, "seconds": seconds}

    def save(self) -> None:
        """Write the file (best effort: an unwritable cache only costs a re-measure)."""
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            fd, tmp = tempfile.mkstemp(prefix=f".{self.path.name}.", dir=self.path.parent)
            with os.fdopen(fd, "w") as f:
                json.dump(self._data, f, indent=1, sort_keys=True)
            os.replace(tmp, self.path)
        except OSError:
            pass
