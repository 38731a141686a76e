"""APC block hash chains: block-aligned verification of partial prefix reuse.

A token sequence is cut into blocks of ``block_size`` tokens and each block is
hashed together with its parent's hash (a Merkle chain)::

    h[i] = H(b"mlxcel:apc:block:v1" || h[i-1] || len(block) u64 LE
             || block tokens as i32 LE || mm_digest)
    h[-1] = 32 zero bytes

Changing one token therefore changes the hash of its block and of every later block,
so the index of the last agreeing hash of two chains tells how many leading blocks
two sequences share. ``H`` is SHA-256 (default) or BLAKE3; both give 32 bytes.

The first parent is a fixed zero hash, not a random seed: chains must be comparable
across processes and runs (the digest is part of the wire-visible stats).

Nothing here imports mlx.
"""

from __future__ import annotations

import hashlib
import struct
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import NewType, Protocol

from blake3 import blake3

from mlxcel_compat.cache.key import DIGEST_SIZE, pack_tokens

BlockHash = NewType("BlockHash", bytes)

APC_BLOCK_DOMAIN = b"mlxcel:apc:block:v1"
NONE_HASH = BlockHash(bytes(DIGEST_SIZE))
SUPPORTED_HASHES = ("sha256", "blake3")

# Default bound on tracked chain blocks per allowed entry: 64 blocks of 16 tokens
# cover about 1k tokens per entry on average (chains of LRU entries go first).
DEFAULT_BLOCKS_PER_ENTRY = 64

_U64 = struct.Struct("<Q")


class Hasher(Protocol):
    """What a block hash needs of a hash object (``hashlib.sha256()``, ``blake3()``)."""

    def update(self, data: bytes, /) -> object: ...

    def digest(self) -> bytes: ...


def hasher_factory(hash_name: str) -> Callable[[], Hasher]:
    """The constructor of the hash named ``hash_name`` ("sha256" or "blake3").

    Every block hash is made through this one function, so replacing it (a test's colliding
    hash) changes the hash of every chain.

    Raises:
        ValueError: an unknown hash name.
    """
    if hash_name == "sha256":
        return hashlib.sha256
    if hash_name == "blake3":
        return blake3
    raise ValueError(f"Unknown APC hash {hash_name!r}; expected one of {SUPPORTED_HASHES}")


@dataclass(frozen=True)
class ApcConfig:
    """APC settings (``--apc-block-size``, ``--apc-hash``, ``--apc-num-blocks``).

    Passing an ``ApcConfig`` to the store turns APC on; ``None`` turns it off.
    """

    block_size: int = 16  # tokens per block
    hash_name: str = "sha256"  # "sha256" (default) or "blake3"
    num_blocks: int | None = None  # bound on tracked chain blocks; None = derived

    def __post_init__(self) -> None:
        if self.block_size < 1:
            raise ValueError(f"APC block size must be >= 1, got {self.block_size}")
        hasher_factory(self.hash_name)  # validates the name
        if self.num_blocks is not None and self.num_blocks < 0:
            raise ValueError(f"APC num_blocks must be >= 0, got {self.num_blocks}")

    def resolve_num_blocks(self, max_entries: int) -> int:
        """The effective bound: explicit value, else ``max_entries * DEFAULT_BLOCKS_PER_ENTRY``."""
        if self.num_blocks is not None:
            return self.num_blocks
        return max_entries * DEFAULT_BLOCKS_PER_ENTRY


def _hash_packed(
    new_hasher: Callable[[], Hasher], parent: bytes, num_tokens: int, packed: bytes, mm_digest: bytes
) -> BlockHash:
    h = new_hasher()
    h.update(APC_BLOCK_DOMAIN)
    h.update(parent)
    h.update(_U64.pack(num_tokens))
    h.update(packed)
    h.update(mm_digest)
    return BlockHash(h.digest())


def hash_block(hash_name: str, parent: bytes, tokens: Sequence[int], mm_digest: bytes) -> BlockHash:
    """Hash one block given its parent's hash.

    Args:
        hash_name: "sha256" or "blake3".
        parent: the previous block's hash, ``NONE_HASH`` for the first block.
        tokens: the block's tokens (a trailing block may be shorter than block_size).
        mm_digest: the request's multimodal digest (32 bytes).

    Returns:
        The 32-byte block hash.
    """
    assert len(parent) == DIGEST_SIZE, f"{len(parent)=}"
    assert len(mm_digest) == DIGEST_SIZE, f"{len(mm_digest)=}"
    return _hash_packed(hasher_factory(hash_name), parent, len(tokens), pack_tokens(tokens), mm_digest)


def block_chain(
    tokens: Sequence[int], block_size: int, hash_name: str, mm_digest: bytes
) -> list[BlockHash]:
    """The full chain of ``tokens``, trailing partial block included.

    Args:
        tokens: the entry's token vector.
        block_size: tokens per block.
        hash_name: "sha256" or "blake3".
        mm_digest: the entry's multimodal digest.

    Returns:
        ``ceil(len(tokens) / block_size)`` hashes.
    """
    hasher = BlockHasher(tokens, block_size, hash_name, mm_digest)
    return hasher.chain(hasher.num_blocks)


class BlockHasher:
    """Computes a sequence's chain lazily, block by block, and remembers it.

    A lookup compares the request against several candidates over different ranges;
    extending one shared chain means each request block is hashed at most once.
    """

    def __init__(self, tokens: Sequence[int], block_size: int, hash_name: str, mm_digest: bytes) -> None:
        assert block_size >= 1, f"{block_size=}"
        assert len(mm_digest) == DIGEST_SIZE, f"{len(mm_digest)=}"
        self._tokens = tokens
        self._packed: bytes | None = None  # packed on first use, then sliced per block
        self._num_tokens = len(tokens)
        self._block_size = block_size
        self._new_hasher = hasher_factory(hash_name)
        self._mm_digest = mm_digest
        self._hashes: list[BlockHash] = []

    @property
    def num_blocks(self) -> int:
        """Blocks in the whole sequence, the trailing partial one included."""
        return -(-self._num_tokens // self._block_size)

    def chain(self, num_blocks: int) -> list[BlockHash]:
        """At least the first ``min(num_blocks, self.num_blocks)`` hashes (may be longer).

        The returned list is the hasher's own; do not mutate it.
        """
        target = min(num_blocks, self.num_blocks)
        hashes = self._hashes
        if len(hashes) >= target:
            return hashes
        if self._packed is None:
            self._packed = pack_tokens(self._tokens)
        bs = self._block_size
        while len(hashes) < target:
            i = len(hashes)
            start, end = i * bs, min((i + 1) * bs, self._num_tokens)
            parent = hashes[-1] if hashes else NONE_HASH
            packed = self._packed[4 * start : 4 * end]
            hashes.append(_hash_packed(self._new_hasher, parent, end - start, packed, self._mm_digest))
        return hashes


class BlockIndex:
    """Occurrence counts of the block hashes held by stored chains.

    Feeds the APC stats (``total_blocks_stored`` - ``unique_block_hashes`` = blocks
    shared between entries) and the ``--apc-num-blocks`` bound, which the store
    enforces against ``num_blocks``.
    """

    def __init__(self) -> None:
        self._counts: dict[bytes, int] = {}
        self.num_blocks = 0  # total chain length over all chains
        self.num_chains = 0

    @property
    def num_unique(self) -> int:
        """Distinct block hashes over all chains."""
        return len(self._counts)

    def add(self, chain: Sequence[bytes]) -> None:
        """Count one more stored chain."""
        for h in chain:
            self._counts[h] = self._counts.get(h, 0) + 1
        self.num_blocks += len(chain)
        self.num_chains += 1

    def discard(self, chain: Sequence[bytes]) -> None:
        """Forget a chain previously passed to ``add``."""
        for h in chain:
            left = self._counts[h] - 1
            if left:
                self._counts[h] = left
            else:
                del self._counts[h]
        self.num_blocks -= len(chain)
        self.num_chains -= 1

    def clear(self) -> None:
        self._counts.clear()
        self.num_blocks = 0
        self.num_chains = 0


def agreed_block_len(
    chain_a: Sequence[bytes], chain_b: Sequence[bytes], num_tokens_a: int, num_tokens_b: int, block_size: int
) -> int:
    """Tokens covered by the leading full blocks on which two chains agree.

    Only blocks that are full in both sequences (and present in both chains) are compared:
    a trailing partial block hashes a different length, so it can never agree with a full one.

    Args:
        chain_a: block hashes of the first sequence (a prefix of its full chain is fine).
        chain_b: block hashes of the second sequence (same).
        num_tokens_a: length of the first sequence.
        num_tokens_b: length of the second sequence.
        block_size: tokens per block used to build both chains.

    Returns:
        A multiple of ``block_size``.
    """
    num_full = min(min(num_tokens_a, num_tokens_b) // block_size, len(chain_a), len(chain_b))
    agreed = 0
    while agreed < num_full and chain_a[agreed] == chain_b[agreed]:
        agreed += 1
    return agreed * block_size


def extend_token_granular(
    tokens_a: Sequence[int], tokens_b: Sequence[int], start: int, block_size: int
) -> int:
    """Extend a block-verified length through the common tokens of the next block.

    Caches that can be cut at any token (dense KV) need not stop at the block floor:
    an exact repeat or a short new turn would otherwise give back up to
    ``block_size - 1`` tokens. The extension never goes past one block, the part that
    the hash comparison could not vouch for.
    """
    end = min(len(tokens_a), len(tokens_b), start + block_size)
    verified = start
    while verified < end and tokens_a[verified] == tokens_b[verified]:
        verified += 1
    return verified


def verified_prefix(
    chain_a: Sequence[bytes],
    chain_b: Sequence[bytes],
    tokens_a: Sequence[int],
    tokens_b: Sequence[int],
    block_size: int,
    token_granular: bool,
) -> int:
    """How many leading tokens two sequences are verified to share.

    The chains are compared side by side over the blocks that are full in both
    sequences (``agreed_block_len``); with ``token_granular`` (caches that can be cut at
    any token, i.e. dense KV) the length is then extended token by token through the
    next block (``extend_token_granular``).

    Args:
        chain_a: block hashes of ``tokens_a`` (a prefix of the full chain is fine).
        chain_b: block hashes of ``tokens_b`` (same).
        tokens_a: first token vector (e.g. the stored entry).
        tokens_b: second token vector (e.g. the request).
        block_size: tokens per block used to build both chains.
        token_granular: extend past the block floor token by token.

    Returns:
        The verified common prefix length in tokens.
    """
    verified = agreed_block_len(chain_a, chain_b, len(tokens_a), len(tokens_b), block_size)
    if token_granular:
        verified = extend_token_granular(tokens_a, tokens_b, verified, block_size)
    return verified
