"""The model fingerprint: what names a checkpoint's identity across processes (torch-free).

Workers put it in their ``KVLayout`` (``engine.kvcache.layout``), the router computes it from
its own ``--model`` to ignore workers of another model, and registration refuses a worker
whose layout differs from the cluster's (``cluster.registry``).
"""

from __future__ import annotations

import struct
from pathlib import Path

import xxhash


def fingerprint_model_dir(model_dir: str | Path) -> str:
    """XXH3-128 hex digest of a checkpoint's identity: ``config.json`` and
    ``tokenizer.json`` in full, and every ``*.safetensors`` file's name, size and
    header (tensor names, dtypes, shapes, offsets). Weight bytes are not read, so this
    stays fast for large checkpoints; two checkpoints with equal headers and configs
    but different weight values are not told apart.
    """
    root = Path(model_dir)
    hasher = xxhash.xxh3_128(b"pdserve/model-fingerprint/v1")
    for name in ("config.json", "tokenizer.json"):
        path = root / name
        if path.is_file():
            _update_named(hasher, name, path.read_bytes())
    for path in sorted(root.glob("*.safetensors")):
        with path.open("rb") as f:
            (header_len,) = struct.unpack("<Q", f.read(8))
            header = f.read(min(header_len, 100 << 20))
        _update_named(hasher, f"{path.name}:{path.stat().st_size}", header)
    return hasher.hexdigest()


def _update_named(hasher: xxhash.xxh3_128, name: str, payload: bytes) -> None:
    raw = name.encode("utf-8")
    hasher.update(struct.pack("<QQ", len(raw), len(payload)))
    hasher.update(raw)
    hasher.update(payload)
