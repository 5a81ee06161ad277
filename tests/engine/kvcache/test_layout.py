"""KVLayout: what must match between prefill and decode, and how a mismatch is named."""

from __future__ import annotations

import dataclasses

import pytest

from engine.config import CacheConfig, EngineConfig, ModelConfig
from engine.kvcache.layout import KVLayout, decode_layout, encode_layout
from tests.kvtransfer.topology import LAYOUT

CHANGES = {"model_fingerprint": "other", "dtype": "bfloat16", "block_size": 32,
           "hash_algorithm": "sha256", "hash_seed": 1, "num_layers": 4, "num_kv_heads": 8,
           "head_dim": 64, "kv_cache_dtype": "int8", "kv_transfer_dtype": "int8"}


def test_equal_layouts_have_no_diff() -> None:
    assert LAYOUT.diff(dataclasses.replace(LAYOUT)) is None


@pytest.mark.parametrize("field", sorted(CHANGES))
def test_diff_names_the_field(field: str) -> None:
    other = dataclasses.replace(LAYOUT, **{field: CHANGES[field]})
    diff = LAYOUT.diff(other)
    assert diff is not None and diff.startswith(f"{field}:"), diff
    assert LAYOUT.digest() != other.digest()


def test_diff_names_the_first_differing_field() -> None:
    other = dataclasses.replace(LAYOUT, block_size=8, head_dim=16)
    assert LAYOUT.diff(other) == "block_size: 16 != 8"


def test_encoding_round_trips_and_rejects_garbage() -> None:
    data = encode_layout(LAYOUT)
    assert decode_layout(data) == (LAYOUT, len(data))
    with pytest.raises(ValueError):
        decode_layout(data[:-3])


@pytest.mark.parametrize("bad", [{"dtype": "int8"}, {"block_size": 0}, {"num_kv_heads": -1}])
def test_invalid_layouts_are_refused(bad: dict[str, object]) -> None:
    with pytest.raises(ValueError):
        dataclasses.replace(LAYOUT, **bad)


def test_the_wire_format_of_each_kv_dtype() -> None:
    """What a transfer's rows hold: the cache's elements, or int8 slots (values, then an
    fp32 scale) when the cache or the transfer is int8; only the latter over an fp32 cache
    quantises."""
    slot = LAYOUT.head_dim + 4
    cases = {("auto", "auto"): ("float32", LAYOUT.head_dim * 4, False),
             ("int8", "auto"): ("uint8", slot, False),
             ("auto", "int8"): ("uint8", slot, True),
             ("int8", "int8"): ("uint8", slot, False),
             ("fp8_e4m3", "auto"): ("uint8", LAYOUT.head_dim, False),
             ("fp8_e5m2", "auto"): ("uint8", LAYOUT.head_dim, False)}
    cache_dtypes = {"auto": "float32", "int8": "uint8", "fp8_e4m3": "float8_e4m3fn",
                    "fp8_e5m2": "float8_e5m2"}
    for (cache, transfer), (wire, row_slot_bytes, quantized) in cases.items():
        layout = dataclasses.replace(LAYOUT, kv_cache_dtype=cache, kv_transfer_dtype=transfer)
        assert (layout.wire_dtype, layout.wire_quantized) == (wire, quantized), (cache, transfer)
        assert layout.row_bytes(3) == LAYOUT.block_size * 3 * row_slot_bytes
        assert layout.cache_dtype == cache_dtypes[cache]
    with pytest.raises(ValueError, match="kv_cache_dtype"):
        dataclasses.replace(LAYOUT, kv_cache_dtype="fp8")  # the engine's name, kept canonical
    with pytest.raises(ValueError, match="kv_transfer_dtype"):
        dataclasses.replace(LAYOUT, kv_transfer_dtype="fp4")


def test_from_engine_config() -> None:
    model = ModelConfig(model_dir="/m", architecture="LlamaForCausalLM", hidden_size=64,
                        intermediate_size=128, num_layers=3, num_heads=4, num_kv_heads=2,
                        head_dim=16, vocab_size=100, max_position_embeddings=128,
                        rms_norm_eps=1e-6, rope_theta=10000.0)
    config = EngineConfig(model=model, cache=CacheConfig(block_size=8, hash_seed=5))
    layout = KVLayout.from_engine_config(config, "fp")
    assert (layout.num_layers, layout.num_kv_heads, layout.head_dim) == model.kv_layout
    assert (layout.block_size, layout.hash_seed, layout.hash_algorithm) == (8, 5, "xxh3_128")
