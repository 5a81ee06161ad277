"""Paged blocks <-> contiguous payloads, and payload checksums."""

from __future__ import annotations

import random

import pytest
import torch
import xxhash
from hypothesis import given, settings
from hypothesis import strategies as st

from kvtransfer.wire.checksum import checksum
from kvtransfer.wire.packing import Segment, gather, rows_view, scatter, segments, split_rows
from kvtransfer.wire.protocol import ChecksumAlgo


def test_split_rows_covers_everything_in_bounded_parts() -> None:
    parts = split_rows(30, 4096, 16 << 10)
    assert parts[0] == (0, 4) and parts[-1] == (28, 30)
    assert [a for a, _ in parts[1:]] == [b for _, b in parts[:-1]]
    assert split_rows(3, 10 << 20, 1 << 20) == [(0, 1), (1, 2), (2, 3)]  # a row never splits


def test_segments_follow_layer_kv_block_order() -> None:
    # layers from 2, 3 blocks per plane; rows 4..11 = plane 1 (layer 2 V) blocks 1-2,
    # plane 2 (layer 3 K) blocks 0-2, plane 3 (layer 3 V) blocks 0-2
    assert list(segments(2, 3, 4, 11)) == [
        Segment(2, 1, 1, 3, 0), Segment(3, 0, 0, 3, 2), Segment(3, 1, 0, 2, 5)]


def _reference_rows(cache: torch.Tensor, ids: list[int], heads: tuple[int, int], layer_start: int,
                    rows: tuple[int, int]) -> torch.Tensor:
    out = []
    for row in range(*rows):
        plane, block = divmod(row, len(ids))
        layer, kv = layer_start + plane // 2, plane % 2
        out.append(cache[layer, kv, ids[block], :, heads[0] : heads[1]])
    return torch.stack(out)


@settings(max_examples=25, deadline=None)
@given(seed=st.integers(0, 10_000), layers=st.integers(1, 3), heads=st.sampled_from([1, 2, 4]),
       part_rows=st.integers(1, 7))
def test_gather_then_scatter_is_byte_exact(seed: int, layers: int, heads: int, part_rows: int
                                           ) -> None:
    rng = random.Random(seed)
    num_blocks, block_size, head_dim = 12, 4, 8
    src = torch.randn(layers, 2, num_blocks, block_size, heads, head_dim)
    dst = torch.zeros_like(src)
    n = rng.randint(1, 6)
    src_ids, dst_ids = rng.sample(range(num_blocks), n), rng.sample(range(num_blocks), n)
    h0 = rng.randrange(heads)
    h = (h0, rng.randint(h0 + 1, heads))
    num_rows = layers * 2 * n
    row_bytes = block_size * (h[1] - h[0]) * head_dim * 4
    for rows in split_rows(num_rows, row_bytes, part_rows * row_bytes):
        payload = torch.empty((rows[1] - rows[0]) * row_bytes, dtype=torch.uint8)
        view = rows_view(payload, torch.float32, rows[1] - rows[0], block_size, h[1] - h[0], head_dim)
        gather(src, torch.tensor(src_ids), h, 0, n, rows, view)
        assert torch.equal(view, _reference_rows(src, src_ids, h, 0, rows))
        scatter(dst, torch.tensor(dst_ids), h, 0, n, rows, view)
    assert torch.equal(dst[:, :, dst_ids, :, h[0] : h[1]], src[:, :, src_ids, :, h[0] : h[1]])
    untouched = [b for b in range(num_blocks) if b not in dst_ids]
    assert not dst[:, :, untouched].any() and not dst[..., : h[0], :].any()


@pytest.mark.parametrize("algo", list(ChecksumAlgo))
def test_checksum_detects_a_flipped_bit(algo: ChecksumAlgo) -> None:
    payload = torch.randint(0, 256, (4099,), dtype=torch.uint8)
    before = checksum(payload, algo)
    for index in (0, 2048, 4098):  # in the int64 words and in the ragged tail
        payload[index] ^= 0x04
        assert checksum(payload, algo) != before
        payload[index] ^= 0x04
    assert checksum(payload, algo) == before


def test_xxh3_checksum_is_plain_xxh3_of_the_bytes() -> None:
    payload = torch.arange(1000, dtype=torch.int32).view(torch.uint8)
    assert checksum(payload, ChecksumAlgo.XXH3_64) == xxhash.xxh3_64_intdigest(
        payload.numpy().tobytes())


def test_position_sum_catches_swapped_words() -> None:
    payload = torch.arange(64, dtype=torch.int64)
    swapped = payload.clone()
    swapped[[3, 9]] = swapped[[9, 3]]
    algo = ChecksumAlgo.TORCH_SUM64
    assert checksum(payload.view(torch.uint8), algo) != checksum(swapped.view(torch.uint8), algo)


def test_position_sum_catches_any_single_flipped_bit() -> None:
    """Every bit of every word, the top ones included (an int8 KV scale's sign bit can
    be the top bit of a word: a flip there negates a token's K or V), and the tail's."""
    algo = ChecksumAlgo.TORCH_SUM64
    payload = torch.arange(8 * 40 + 5, dtype=torch.uint8)
    clean = checksum(payload, algo)
    for byte in range(payload.numel()):
        for bit in range(8):
            flipped = payload.clone()
            flipped[byte] ^= 1 << bit
            assert checksum(flipped, algo) != clean, (byte, bit)
