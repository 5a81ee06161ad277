"""Reading Hugging Face checkpoint directories: single or sharded safetensors."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import torch
from safetensors import safe_open

from engine.config import ConfigError

INDEX_FILE = "model.safetensors.index.json"
SINGLE_FILE = "model.safetensors"


def checkpoint_files(model_dir: str | Path) -> list[Path]:
    """The safetensors files of a checkpoint, from its index when sharded.

    Raises ``ConfigError`` naming what is missing.
    """
    root = Path(model_dir)
    index = root / INDEX_FILE
    if index.is_file():
        weight_map: dict[str, str] = json.loads(index.read_text())["weight_map"]
        files = [root / name for name in sorted(set(weight_map.values()))]
        missing = [f.name for f in files if not f.is_file()]
        if missing:
            raise ConfigError(f"{index} lists shards that are missing: {missing}")
        return files
    if (root / SINGLE_FILE).is_file():
        return [root / SINGLE_FILE]
    found = sorted(root.glob("*.safetensors"))
    if found:
        return found
    raise ConfigError(f"no {SINGLE_FILE} or {INDEX_FILE} in model directory {model_dir}")


def iter_weights(model_dir: str | Path, dtype: torch.dtype) -> Iterator[tuple[str, torch.Tensor]]:
    """Yield ``(name, tensor)`` for every tensor of the checkpoint, cast to ``dtype``."""
    for path in checkpoint_files(model_dir):
        with safe_open(str(path), framework="pt") as f:
            for name in f.keys():  # noqa: SIM118 - safe_open is not a mapping
                yield name, f.get_tensor(name).to(dtype)
