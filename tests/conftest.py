"""Shared fixtures: tiny checkpoints built once per session, one torch thread per process.

Several processes share 2 cores in these tests (TP ranks, later workers), so every
process runs one torch thread; OpenMP pools fighting over cores make tiny matmuls
three orders of magnitude slower.
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
# TCPStore reverse-resolves 127.0.0.1; a dropped DNS query would stall it for 5 s.
os.environ.setdefault("RES_OPTIONS", "timeout:1 attempts:1")

try:
    import torch

    torch.set_num_threads(1)
except ImportError:  # torch-free tests still run
    torch = None  # type: ignore[assignment]

from hypothesis import settings  # noqa: E402

from tests.factories import make_model_dir  # noqa: E402

# Timing-based health checks are noise on shared 2-core machines.
settings.register_profile("pdserve", deadline=None)
settings.load_profile("pdserve")


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    has_cuda = torch is not None and torch.cuda.is_available()
    skip_gpu = pytest.mark.skip(reason="needs a CUDA device")
    for item in items:
        if "gpu" in item.keywords and not has_cuda:
            item.add_marker(skip_gpu)


@pytest.fixture(scope="session")
def model_factory(tmp_path_factory: pytest.TempPathFactory) -> Callable[..., Path]:
    """``model_factory(arch="llama", **overrides)`` → a tiny checkpoint dir, cached per args."""
    cache: dict[tuple[str, int, str], Path] = {}
    root = tmp_path_factory.mktemp("models")

    def build(arch: str = "llama", seed: int = 0, **overrides: Any) -> Path:
        key = (arch, seed, json.dumps(overrides, sort_keys=True))
        if key not in cache:
            cache[key] = make_model_dir(root / f"m{len(cache)}-{arch}", arch, seed, overrides)
        return cache[key]

    return build


@pytest.fixture(scope="session")
def llama_dir(model_factory: Callable[..., Path]) -> Path:
    return model_factory("llama")


@pytest.fixture(scope="module")
def up(tmp_path_factory: pytest.TempPathFactory, llama_dir: Path) -> Iterator[Any]:
    """A ``pdserve up`` of this module (``LocalLauncher``, the library the command runs):
    the tiny Llama, one prefill and one decode worker, any free gRPC and HTTP ports."""
    from deploy.local import LocalLauncher  # server extra
    from deploy.spec import ClusterSpec

    config = ClusterSpec(model_dir=llama_dir, port=0, http_port=0,
                                log_dir=tmp_path_factory.mktemp("up"))
    with LocalLauncher(config, progress=lambda line: None) as cluster:
        yield cluster
