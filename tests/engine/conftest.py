"""Fixtures shared by the engine tests."""

from __future__ import annotations

import pytest

from engine.cpu_kernels import NativeKernels, native


@pytest.fixture(scope="module")
def kernels() -> NativeKernels:
    """pdserve's compiled CPU kernels; the test is skipped where they cannot be built."""
    loaded = native()
    if loaded is None:
        pytest.skip("pdserve's compiled CPU kernels could not be built here")
    return loaded
