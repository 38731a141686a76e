"""APC block hash chains and side-by-side verification."""

from __future__ import annotations

import hashlib
import struct

import pytest
from blake3 import blake3

from mlxcel_compat.cache.block_hash import (
    DEFAULT_BLOCKS_PER_ENTRY,
    NONE_HASH,
    ApcConfig,
    BlockHasher,
    BlockIndex,
    agreed_block_len,
    block_chain,
    extend_token_granular,
    hash_block,
    verified_prefix,
)
from mlxcel_compat.cache.key import TEXT_ONLY_MM_DIGEST, multimodal_digest

MM = TEXT_ONLY_MM_DIGEST
TOKENS = list(range(1000, 1100))  # 100 tokens = 6 full blocks of 16 + a partial of 4


def manual(new: object, parent: bytes, tokens: list[int], mm: bytes) -> bytes:
    h = new()  # type: ignore[operator]
    h.update(b"mlxcel:apc:block:v1" + parent + struct.pack("<Q", len(tokens)))
    h.update(b"".join(struct.pack("<i", t) for t in tokens) + mm)
    return h.digest()  # type: ignore[no-any-return]


@pytest.mark.parametrize("name, ctor", [("sha256", hashlib.sha256), ("blake3", blake3)])
def test_hash_block_layout(name: str, ctor: object) -> None:
    assert NONE_HASH == bytes(32)
    first = hash_block(name, NONE_HASH, TOKENS[:16], MM)
    assert first == manual(ctor, bytes(32), TOKENS[:16], MM)
    assert hash_block(name, first, TOKENS[16:32], MM) == manual(ctor, first, TOKENS[16:32], MM)
    assert len(first) == 32


def test_chain_shape_and_determinism() -> None:
    chain = block_chain(TOKENS, 16, "sha256", MM)
    assert len(chain) == 7  # trailing partial block hashed too
    assert chain == block_chain(tuple(TOKENS), 16, "sha256", MM)
    assert chain[0] == hash_block("sha256", NONE_HASH, TOKENS[:16], MM)
    assert chain[6] == hash_block("sha256", chain[5], TOKENS[96:], MM)
    assert block_chain([], 16, "sha256", MM) == []
    # A partial block never equals the full block that extends it (length is hashed).
    assert block_chain(TOKENS[:95], 16, "sha256", MM)[5] != chain[5]
    assert block_chain(TOKENS[:96], 16, "sha256", MM) == chain[:6]


@pytest.mark.parametrize("position", [0, 15, 16, 50, 99])
def test_one_token_change_invalidates_every_later_block(position: int) -> None:
    changed = list(TOKENS)
    changed[position] += 1
    a = block_chain(TOKENS, 16, "sha256", MM)
    b = block_chain(changed, 16, "sha256", MM)
    first_bad = position // 16
    assert a[:first_bad] == b[:first_bad]
    assert all(x != y for x, y in zip(a[first_bad:], b[first_bad:]))


def test_mm_digest_and_hash_name_participate() -> None:
    text = block_chain(TOKENS, 16, "sha256", MM)
    image = block_chain(TOKENS, 16, "sha256", multimodal_digest([b"img"]))
    assert all(x != y for x, y in zip(text, image))
    b3 = block_chain(TOKENS, 16, "blake3", MM)
    assert len(b3) == len(text) and all(x != y for x, y in zip(text, b3))
    assert b3[0] == manual(blake3, bytes(32), TOKENS[:16], MM)


def test_block_hasher_is_lazy_and_matches_chain() -> None:
    hasher = BlockHasher(TOKENS, 16, "sha256", MM)
    assert hasher.num_blocks == 7
    assert len(hasher.chain(2)) == 2
    assert hasher.chain(2) == block_chain(TOKENS, 16, "sha256", MM)[:2]
    assert hasher.chain(100) == block_chain(TOKENS, 16, "sha256", MM)


@pytest.mark.parametrize(
    "diverge_at, block_len, token_len",
    [
        (None, 96, 100),  # identical: every full block agrees; token-granular adds the tail
        (37, 32, 37),  # mid-block: floor to the block, then token by token
        (32, 32, 32),  # exactly at a boundary: both agree
        (5, 0, 5),  # inside the first block
    ],
)
def test_verified_prefix(diverge_at: int | None, block_len: int, token_len: int) -> None:
    other = list(TOKENS)
    if diverge_at is not None:
        other[diverge_at] = -1
    ca, cb = block_chain(TOKENS, 16, "sha256", MM), block_chain(other, 16, "sha256", MM)
    assert verified_prefix(ca, cb, TOKENS, other, 16, token_granular=False) == block_len
    assert verified_prefix(ca, cb, TOKENS, other, 16, token_granular=True) == token_len


def test_verified_prefix_shorter_sequence_and_short_chain() -> None:
    short = TOKENS[:40]
    ca, cs = block_chain(TOKENS, 16, "sha256", MM), block_chain(short, 16, "sha256", MM)
    assert verified_prefix(ca, cs, TOKENS, short, 16, token_granular=False) == 32
    assert verified_prefix(ca, cs, TOKENS, short, 16, token_granular=True) == 40
    # Only the blocks present in both chains count; tokens extend one block at most.
    assert verified_prefix(ca[:1], ca, TOKENS, TOKENS, 16, token_granular=True) == 32
    # Hashes, not tokens, decide the block part: a forged chain is not trusted.
    forged = [bytes(32)] * len(ca)
    assert verified_prefix(forged, ca, TOKENS, TOKENS, 16, token_granular=True) == 16


def test_block_part_and_token_extension_separately() -> None:
    other = list(TOKENS)
    other[37] = -1
    ca, cb = block_chain(TOKENS, 16, "sha256", MM), block_chain(other, 16, "sha256", MM)
    assert agreed_block_len(ca, cb, len(TOKENS), len(other), 16) == 32
    assert extend_token_granular(TOKENS, other, 32, 16) == 37
    # The extension stops after one block even when the tokens go on agreeing.
    assert extend_token_granular(TOKENS, TOKENS, 32, 16) == 48
    assert extend_token_granular(TOKENS, TOKENS[:40], 32, 16) == 40


def test_apc_config() -> None:
    assert ApcConfig() == ApcConfig(block_size=16, hash_name="sha256", num_blocks=None)
    assert ApcConfig().resolve_num_blocks(1024) == 1024 * DEFAULT_BLOCKS_PER_ENTRY
    assert ApcConfig(num_blocks=10).resolve_num_blocks(1024) == 10
    with pytest.raises(ValueError):
        ApcConfig(hash_name="md5")
    with pytest.raises(ValueError):
        ApcConfig(block_size=0)
    with pytest.raises(ValueError):
        ApcConfig(num_blocks=-1)


def test_block_index_counts_shared_blocks() -> None:
    index = BlockIndex()
    a = block_chain(TOKENS, 16, "sha256", MM)  # 7 blocks
    b = block_chain(TOKENS[:64] + [0] * 10, 16, "sha256", MM)  # shares the first 4, then 1 more
    index.add(a)
    index.add(b)
    assert (index.num_blocks, index.num_unique, index.num_chains) == (12, 8, 2)
    index.discard(a)
    assert (index.num_blocks, index.num_unique, index.num_chains) == (5, 5, 1)
    index.clear()
    assert (index.num_blocks, index.num_unique, index.num_chains) == (0, 0, 0)
