"""What two workers must agree on to exchange KV: the model fingerprint and KV layout — the
cluster's identity.

Torch-free, and below the data plane (``kvtransfer`` uses it; ``cluster`` and ``router``
read it without importing ``kvtransfer``): worker registration and the router may read it
without loading torch.
``KVLayout`` covers the model files, dtype, block size, block-hash algorithm and seed, the
global KV layout (layers, KV heads, head size) and the internal protocol version.
Tensor-parallel sizes are *not* part of it: they may differ between prefill and decode,
and KV is re-sharded in transit.
"""

from __future__ import annotations

import struct
from dataclasses import astuple, dataclass, fields
from typing import TYPE_CHECKING

import xxhash

if TYPE_CHECKING:
    from engine.config import EngineConfig

DTYPE_SIZES = {"float32": 4, "float16": 2, "bfloat16": 2}
"""Bytes per element of the KV dtypes the engine supports."""
KV_SCALE_BYTES = 4
"""An int8 cache's slot: ``head_dim`` int8 values, then their fp32 scale
(``engine.attention.kv_quant``)."""
QUANTIZED_CACHE_DTYPES = {"int8": "uint8", "fp8_e4m3": "float8_e4m3fn",
                          "fp8_e5m2": "float8_e5m2"}
"""``kv_cache_dtype`` → the cache tensor's dtype (torch's name), one byte per element: int8
slots (values and scale) as uint8, fp8 values as torch's fp8 dtypes."""

PROTOCOL_VERSION = 10
"""Version of what workers and the router exchange: the internal gRPC API
(``proto/cluster/internal/v1``), the KV wire protocol (``kvtransfer.wire.protocol``) and the
cluster records. Bump it with any change an older process would misread: it is part of
the fingerprint, so a rolling upgrade never mixes incompatible workers in one cluster
(0 names a layout written before the version was recorded). 2: the internal API names the
client's id ``client_request_id``, every call needs its ``attempt_id``, and Generate no
longer carries the router's copies of the first token. 4: Reserve, Prefill and
GenerateLocal carry ``num_resumed_tokens`` (a migrated stream's output so far, which an
older worker would take for prompt), and ``SamplingParams`` the penalties, ``min_p``,
``min_tokens`` and ``logit_bias`` (which an older worker would ignore). 6: ``KVTarget``
carries ``num_cached_blocks`` (blocks the decode worker holds; an older sender would send
them anyway and fail the transfer), ``SamplingParams`` ``prompt_logprobs``. 7: the layout
names the KV cache's dtype (``kv_cache_dtype``: an int8 cache's blocks carry their scales).
8: the layout names the transfer's dtype (``kv_transfer_dtype``: int8 parts on the wire).
9: ``kv_cache_dtype`` may be fp8 (``fp8_e4m3``, ``fp8_e5m2``: its blocks travel as their
bytes), which an older process would refuse as a malformed record rather than a
mismatch."""


@dataclass(frozen=True)
class KVLayout:
    """The model fingerprint plus the global KV layout; equal layouts can exchange KV.

    ``model_fingerprint`` names the model files (``cluster.fingerprint.fingerprint_model_dir``);
    ``hash_algorithm`` and ``hash_seed`` are the prefix-cache block-hash settings;
    ``kv_cache_dtype`` is ``CacheConfig.kv_cache_dtype`` ("auto": KV in ``dtype``; "int8":
    each token's K/V per head as int8 values and their fp32 scale, so workers of one cluster
    hold the same bytes and a block moves as it lies; "fp8_e4m3" / "fp8_e5m2": one fp8
    byte per value, moved as it lies too); ``kv_transfer_dtype`` is
    ``CacheConfig.kv_transfer_dtype`` ("auto": blocks travel as the cache holds them;
    "int8": as int8 slots whatever the cache holds, an fp32/bf16 cache's quantised by the
    sender and dequantised into the receiver's cache, so lossy: such blocks are keyed apart,
    ``engine.kvcache.block_hash.LOSSY_WIRE_SALT``); ``protocol_version`` is
    ``PROTOCOL_VERSION`` of the process that made it.
    """

    model_fingerprint: str
    dtype: str
    block_size: int
    hash_algorithm: str
    hash_seed: int
    num_layers: int
    num_kv_heads: int
    head_dim: int
    kv_cache_dtype: str = "auto"
    kv_transfer_dtype: str = "auto"
    protocol_version: int = PROTOCOL_VERSION

    def __post_init__(self) -> None:
        if self.dtype not in DTYPE_SIZES:
            raise ValueError(f"dtype must be one of {sorted(DTYPE_SIZES)}, got {self.dtype!r}")
        if self.kv_cache_dtype != "auto" and self.kv_cache_dtype not in QUANTIZED_CACHE_DTYPES:
            raise ValueError(f"kv_cache_dtype must be 'auto' or one of "
                             f"{sorted(QUANTIZED_CACHE_DTYPES)}, got {self.kv_cache_dtype!r}")
        if self.kv_transfer_dtype not in ("auto", "int8"):
            raise ValueError("kv_transfer_dtype must be 'auto' or 'int8', "
                             f"got {self.kv_transfer_dtype!r}")
        for name in ("block_size", "num_layers", "num_kv_heads", "head_dim"):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name} must be positive, got {getattr(self, name)}")
        if self.protocol_version < 0:
            raise ValueError(f"protocol_version must be >= 0, got {self.protocol_version}")

    @property
    def cache_dtype(self) -> str:
        """The KV cache tensor's dtype (torch's name): ``dtype``, uint8 (int8 slots) or an
        fp8 dtype."""
        return self.cache_dtype_of(self.kv_cache_dtype, self.dtype)

    @staticmethod
    def cache_dtype_of(kv_cache_dtype: str, dtype: str) -> str:
        """``cache_dtype`` of a cache of ``kv_cache_dtype`` in a model of ``dtype``."""
        return QUANTIZED_CACHE_DTYPES.get(kv_cache_dtype, dtype)

    @property
    def element_size(self) -> int:
        """Bytes of one element of the cache tensor."""
        return 1 if self.kv_cache_dtype in QUANTIZED_CACHE_DTYPES else DTYPE_SIZES[self.dtype]

    @property
    def slot_width(self) -> int:
        """Elements of one token's K (or V) of one head: ``head_dim``, or (int8) the
        values' bytes and their scale's."""
        return self.head_dim + KV_SCALE_BYTES if self.kv_cache_dtype == "int8" else self.head_dim

    @property
    def wire_int8(self) -> bool:
        """Whether blocks travel as int8 slots (an int8 cache's, or quantised for the wire)."""
        return self.kv_cache_dtype == "int8" or self.kv_transfer_dtype == "int8"

    @property
    def wire_quantized(self) -> bool:
        """Whether a transfer quantises (sender) and dequantises (receiver) the cache's
        values: int8 on the wire over a cache that is not int8. Such blocks are lossy."""
        return self.kv_transfer_dtype == "int8" and self.kv_cache_dtype != "int8"

    @property
    def wire_dtype(self) -> str:
        """The dtype (torch's name) of a transfer's payload elements (an fp8 cache's: its
        bytes, as uint8)."""
        return "uint8" if self.wire_int8 or self.element_size == 1 else self.dtype

    @property
    def wire_slot_width(self) -> int:
        """Elements of one token's K (or V) of one head in a transfer's payload."""
        return self.head_dim + KV_SCALE_BYTES if self.wire_int8 else self.head_dim

    def row_bytes(self, num_heads: int) -> int:
        """Bytes of one row of a transfer (``kvtransfer.wire.packing``): one block's
        ``[block_size, num_heads, wire_slot_width]`` slab of K or V of one layer."""
        element = 1 if self.wire_dtype == "uint8" else DTYPE_SIZES[self.dtype]
        return self.block_size * num_heads * self.wire_slot_width * element

    def diff(self, other: KVLayout) -> str | None:
        """``None`` when equal, else ``"field: mine != theirs"`` for the first differing
        field (the protocol version first: with another one, nothing else is comparable)."""
        for f in sorted(fields(self), key=lambda f: f.name != "protocol_version"):
            mine, theirs = getattr(self, f.name), getattr(other, f.name)
            if mine != theirs:
                return f"{f.name}: {mine!r} != {theirs!r}"
        return None

    def digest(self) -> int:
        """A 63-bit digest of every field (carried in each wire header)."""
        return xxhash.xxh3_64_intdigest(encode_layout(self)) >> 1

    @classmethod
    def from_engine_config(cls, config: EngineConfig, model_fingerprint: str) -> KVLayout:
        """The layout of an engine built from ``config`` (``model_fingerprint`` from
        ``cluster.fingerprint.fingerprint_model_dir``)."""
        from engine.kvcache.block_hash import HASH_ALGORITHM

        layers, kv_heads, head_dim = config.model.kv_layout
        return cls(
            model_fingerprint=model_fingerprint, dtype=config.model.dtype,
            block_size=config.cache.block_size, hash_algorithm=HASH_ALGORITHM,
            hash_seed=config.cache.hash_seed, num_layers=layers, num_kv_heads=kv_heads,
            head_dim=head_dim, kv_cache_dtype=config.cache.kv_cache_dtype,
            kv_transfer_dtype=config.cache.kv_transfer_dtype,
        )


_STR_FIELDS = frozenset({"model_fingerprint", "dtype", "hash_algorithm", "kv_cache_dtype",
                         "kv_transfer_dtype"})


def encode_layout(layout: KVLayout) -> bytes:
    """Field by field: strings length-prefixed UTF-8, ints little-endian int64."""
    parts: list[bytes] = []
    for f, value in zip(fields(layout), astuple(layout), strict=True):
        if f.name in _STR_FIELDS:
            raw = str(value).encode("utf-8")
            parts.append(struct.pack("<I", len(raw)) + raw)
        else:
            parts.append(struct.pack("<q", int(value)))
    return b"".join(parts)


def decode_layout(data: bytes, offset: int = 0) -> tuple[KVLayout, int]:
    """The layout encoded at ``data[offset:]`` and the offset just past it.

    Raises ``ValueError`` on truncated or malformed input.
    """
    values: dict[str, object] = {}
    try:
        for f in fields(KVLayout):
            if f.name in _STR_FIELDS:
                (length,) = struct.unpack_from("<I", data, offset)
                raw = data[offset + 4 : offset + 4 + length]
                if len(raw) != length:
                    raise ValueError("truncated string")
                values[f.name] = raw.decode("utf-8")
                offset += 4 + length
            else:
                (values[f.name],) = struct.unpack_from("<q", data, offset)
                offset += 8
    except (struct.error, UnicodeDecodeError) as exc:
        raise ValueError(f"malformed KV layout: {exc}") from exc
    return KVLayout(**values), offset  # type: ignore[arg-type]
