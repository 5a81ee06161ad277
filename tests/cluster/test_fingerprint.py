"""The model fingerprint: equal checkpoints agree, a changed config or tensor shape differs."""

from __future__ import annotations

import json
import struct
from pathlib import Path

from cluster.fingerprint import fingerprint_model_dir


def _write_checkpoint(root: Path, config: dict[str, object], tensors: dict[str, object],
                      weights: bytes) -> Path:
    root.mkdir(parents=True, exist_ok=True)
    (root / "config.json").write_text(json.dumps(config))
    header = json.dumps(tensors).encode()
    (root / "model.safetensors").write_bytes(struct.pack("<Q", len(header)) + header + weights)
    return root


def test_model_fingerprint(tmp_path: Path) -> None:
    tensors = {"w": {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]}}
    a = fingerprint_model_dir(_write_checkpoint(tmp_path / "a", {"x": 1}, tensors, b"\0" * 8))
    same = fingerprint_model_dir(_write_checkpoint(tmp_path / "b", {"x": 1}, tensors, b"\0" * 8))
    other_config = fingerprint_model_dir(_write_checkpoint(tmp_path / "c", {"x": 2}, tensors,
                                                           b"\0" * 8))
    other_shape = fingerprint_model_dir(_write_checkpoint(
        tmp_path / "d", {"x": 1}, {"w": {"dtype": "F32", "shape": [1, 2], "data_offsets": [0, 8]}},
        b"\0" * 8))
    assert a == same and len({a, other_config, other_shape}) == 3
