from __future__ import annotations

import os
import subprocess
import sys

import pytest

from engine.kvcache import (
    HASH_ALGORITHM,
    compute_block_hashes,
    extend_block_hashes,
    hash_block_tokens,
    root_hash,
)
from engine.kvcache.block_hash import LOSSY_WIRE_SALT

TOKENS = list(range(1000, 1010))  # 2 full blocks of 4 + a partial block of 2


def test_only_full_blocks_are_hashed() -> None:
    assert len(compute_block_hashes(TOKENS, 4)) == 2
    assert len(compute_block_hashes(TOKENS[:3], 4)) == 0
    assert compute_block_hashes(TOKENS, 4) == compute_block_hashes(TOKENS[:8], 4)
    assert all(len(h) == 16 for h in compute_block_hashes(TOKENS, 4))
    assert HASH_ALGORITHM == "xxh3_128"


def test_hashes_chain_over_the_prefix() -> None:
    first, second = compute_block_hashes(TOKENS[:8], 4)
    assert first == hash_block_tokens(root_hash(0), TOKENS[:4])
    assert second == hash_block_tokens(first, TOKENS[4:8])
    # Same second block after a different first block: a different key.
    other = compute_block_hashes([7, 7, 7, 7, *TOKENS[4:8]], 4)
    assert other[1] != second


def test_seed_changes_every_hash() -> None:
    seeded = compute_block_hashes(TOKENS, 4, seed=1)
    assert set(seeded).isdisjoint(compute_block_hashes(TOKENS, 4, seed=0))
    assert root_hash(-1) != root_hash(2**64 - 1) != root_hash(0)


def test_a_salt_gives_a_key_space_of_its_own_within_the_seed() -> None:
    """``root_hash(seed, salt)``: no salt is the plain root (what the router computes);
    a salt (``LOSSY_WIRE_SALT``) changes the root and so every chained key after it."""
    assert root_hash(3, "") == root_hash(3)
    salted = root_hash(3, LOSSY_WIRE_SALT)
    assert len({salted, root_hash(3), root_hash(4, LOSSY_WIRE_SALT), root_hash(3, "x")}) == 4
    plain, lossy = [], []
    extend_block_hashes(plain, TOKENS, 4, seed=3)
    parent = salted
    for i in range(2):
        parent = hash_block_tokens(parent, TOKENS[4 * i : 4 * i + 4])
        lossy.append(parent)
    assert set(lossy).isdisjoint(plain)


def test_extra_keys_change_hashes_unambiguously() -> None:
    plain = hash_block_tokens(root_hash(), TOKENS[:4])
    extras: list[tuple[int | str, ...]] = [
        (1,),
        ("1",),
        ("\x01",),
        ("ab",),
        ("a", "b"),
        ("lora-a",),
        ("lora-a", 0),
    ]
    keyed = [hash_block_tokens(root_hash(), TOKENS[:4], extra) for extra in extras]
    assert len({plain, *keyed}) == 1 + len(keyed)
    assert compute_block_hashes(TOKENS, 4, extra_keys=("x",)) != compute_block_hashes(TOKENS, 4)


def test_extra_keys_reject_other_types() -> None:
    with pytest.raises(TypeError):
        hash_block_tokens(root_hash(), TOKENS[:4], (1.5,))  # type: ignore[arg-type]
    with pytest.raises(TypeError):
        hash_block_tokens(root_hash(), TOKENS[:4], (True,))


def test_token_ids_outside_int64_are_refused() -> None:
    with pytest.raises(OverflowError):
        hash_block_tokens(root_hash(), [2**63])


def test_extend_appends_only_newly_completed_blocks() -> None:
    block_hashes: list[bytes] = []
    tokens: list[int] = []
    for token in TOKENS:  # decode: one token at a time
        tokens.append(token)
        new = extend_block_hashes(block_hashes, tokens, 4, seed=3)
        assert len(new) == (1 if len(tokens) % 4 == 0 else 0)
    assert block_hashes == compute_block_hashes(TOKENS, 4, seed=3)


def test_extend_refuses_more_hashes_than_blocks() -> None:
    block_hashes = compute_block_hashes(TOKENS, 4)
    with pytest.raises(ValueError, match="full blocks"):
        extend_block_hashes(block_hashes, TOKENS[:4], 4)
    with pytest.raises(ValueError, match="block_size"):
        compute_block_hashes(TOKENS, 0)


def test_hashes_identical_in_another_process_with_other_hash_seed() -> None:
    code = (
        "from engine.kvcache import compute_block_hashes as c;"
        "print(','.join(h.hex() for h in c(list(range(1000, 1010)), 4, seed=5,"
        " extra_keys=('lora', 2))))"
    )
    env = {**os.environ, "PYTHONHASHSEED": "12345"}
    repo_root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(__file__))))
    result = subprocess.run(
        [sys.executable, "-c", code],
        env=env,
        cwd=repo_root,
        capture_output=True,
        text=True,
        timeout=60,
        check=True,
    )
    expected = compute_block_hashes(TOKENS, 4, seed=5, extra_keys=("lora", 2))
    assert result.stdout.strip() == ",".join(h.hex() for h in expected)
