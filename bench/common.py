"""Helpers shared by pdserve's benchmarks: memory bandwidth, machine facts, statistics,
a plain-text table and JSON output.

Benchmarks on the shared 2-core development machines compare two things in the same run
(see BENCHMARKS.md); these helpers make the context (bandwidth, CPU, load, threads) easy
to print next to the figures.
"""

from __future__ import annotations

import json
import math
import os
import platform
import statistics
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch

from engine.kernels.choice import cpu_model
from sim.metrics import percentile, write_json  # one copy of each, shared with the simulator

GB = 1e9
MIB = 1 << 20


# ---------------------------------------------------------------- bandwidth


class BandwidthProbe:
    """Read-only passes over one large fp32 buffer (``torch.sum``, which streams at close
    to the machine's read bandwidth with a few threads). Keep one probe for the whole run
    so repeated measurements, interleaved with the timed work, reuse the same buffer.
    """

    def __init__(self, num_bytes: int = 1 << 30, threads: int = 2) -> None:
        self.threads = threads
        # Distinct contents on every page (a buffer of equal pages could be deduplicated
        # by the host into one cache-resident page); filling also backs every page.
        self.buffer = torch.arange(max(1, num_bytes // 4), dtype=torch.float32)
        self.samples_gbps: list[float] = []

    @property
    def num_bytes(self) -> int:
        return self.buffer.numel() * self.buffer.element_size()

    def measure(self, passes: int = 3) -> float:
        """Best of ``passes`` read passes in GB/s (1e9 bytes/s); also recorded in
        ``samples_gbps``."""
        best = 0.0
        with torch_threads(self.threads):
            for _ in range(passes):
                start = time.perf_counter()
                self.buffer.sum()
                elapsed = time.perf_counter() - start
                best = max(best, self.num_bytes / elapsed / GB)
        self.samples_gbps.append(best)
        return best

    @property
    def best_gbps(self) -> float:
        if not self.samples_gbps:
            raise RuntimeError("no bandwidth measured yet: call measure() first")
        return max(self.samples_gbps)

    def release(self) -> None:
        self.buffer = torch.empty(0)


@contextmanager
def torch_threads(threads: int) -> Iterator[None]:
    """Run the block with ``torch.set_num_threads(threads)``, restoring the old count."""
    previous = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        yield
    finally:
        torch.set_num_threads(previous)


# ---------------------------------------------------------------- machine facts


def load_average() -> tuple[float, float, float]:
    try:
        return os.getloadavg()
    except OSError:
        return (math.nan, math.nan, math.nan)


def machine_info() -> dict[str, Any]:
    return {
        "cpu_model": cpu_model(),
        "cpu_count": os.cpu_count(),
        "load_avg_1m_5m_15m": [round(x, 2) for x in load_average()],
        "torch_version": torch.__version__,
        "python_version": platform.python_version(),
    }


def model_facts(model_dir: str | Path) -> dict[str, Any]:
    """Size and shape of a checkpoint, from its ``config.json`` and the safetensors headers
    (no weights loaded): parameters, the weights' dtype, layers, hidden size, KV heads."""
    root = Path(model_dir)
    config = json.loads((root / "config.json").read_text(encoding="utf-8"))
    parameters, dtypes = 0, set()
    for path in sorted(root.glob("*.safetensors")):
        with open(path, "rb") as f:
            header = json.loads(f.read(int.from_bytes(f.read(8), "little")))
        for name, tensor in header.items():
            if name != "__metadata__":
                parameters += math.prod(tensor["shape"])
                dtypes.add(tensor["dtype"])
    return {"model_dir": str(root), "parameters": parameters,
            "weights_dtype": ",".join(sorted(dtypes)),
            **{k: config.get(k) for k in ("hidden_size", "num_hidden_layers",
                                          "num_attention_heads", "num_key_value_heads",
                                          "vocab_size", "max_position_embeddings",
                                          "head_dim")}}


# ---------------------------------------------------------------- statistics


def summarize(values: Sequence[float], prefix: str = "", unit: str = "") -> dict[str, float]:
    """mean / median / p90 / p99 keys named the vLLM way, e.g. ``mean_ttft_ms`` for
    ``prefix="ttft", unit="ms"``."""
    suffix = f"_{prefix}" if prefix else ""
    suffix += f"_{unit}" if unit else ""
    return {
        f"mean{suffix}": statistics.fmean(values),
        f"median{suffix}": statistics.median(values),
        f"p90{suffix}": percentile(values, 90),
        f"p99{suffix}": percentile(values, 99),
    }


def timed(fn: Callable[[], Any]) -> tuple[float, Any]:
    """Seconds ``fn()`` took (perf_counter), and its result."""
    start = time.perf_counter()
    result = fn()
    return time.perf_counter() - start, result


# ---------------------------------------------------------------- output


def format_value(value: Any) -> str:
    if isinstance(value, float):
        if math.isnan(value) or math.isinf(value):
            return str(value)
        if abs(value) >= 100:
            return f"{value:,.1f}"
        if abs(value) >= 1:
            return f"{value:.2f}"
        return f"{value:.3f}"
    return str(value)


def format_table(rows: Sequence[Sequence[Any]], headers: Sequence[str] | None = None) -> str:
    """A left-aligned plain-text table (first column) with right-aligned figures."""
    cells = [[format_value(v) for v in row] for row in rows]
    if headers is not None:
        cells.insert(0, list(headers))
    if not cells:
        return ""
    widths = [max(len(row[i]) for row in cells if i < len(row)) for i in range(len(cells[0]))]
    lines = []
    for n, row in enumerate(cells):
        parts = [c.ljust(widths[i]) if i == 0 else c.rjust(widths[i]) for i, c in enumerate(row)]
        lines.append("  ".join(parts).rstrip())
        if n == 0 and headers is not None:
            lines.append("  ".join("-" * w for w in widths))
    return "\n".join(lines)


def publish(table: str, json_path: str | Path | None, obj: Mapping[str, Any]) -> None:
    """Print a benchmark's table, and write ``obj`` to ``json_path`` when one is given."""
    print(table, flush=True)
    if json_path is not None:
        write_json(json_path, obj)
        print(f"wrote {json_path}")
