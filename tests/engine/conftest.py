"""Fixtures shared by the engine tests."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from engine.kernels.cpu import DecoderLayers, NativeKernels, native


@pytest.fixture(scope="module")
def kernels() -> NativeKernels:
    """pdserve's compiled CPU kernels; the test is skipped where they cannot be built."""
    loaded = native()
    if loaded is None:
        pytest.skip("pdserve's compiled CPU kernels could not be built here")
    return loaded


@pytest.fixture
def step_rows(monkeypatch: pytest.MonkeyPatch, kernels: NativeKernels) -> list[int]:
    """The batch size of every compiled decode step (``NativeKernels.decoder_step``, the
    model's fast path; the real kernel runs); skipped where the kernels cannot be built."""
    rows: list[int] = []
    real = NativeKernels.decoder_step

    def counted(self: NativeKernels, layers: DecoderLayers, token_ids: torch.Tensor,
                *args: Any) -> torch.Tensor:
        rows.append(token_ids.shape[0])
        return real(self, layers, token_ids, *args)

    monkeypatch.setattr(NativeKernels, "decoder_step", counted)
    return rows
