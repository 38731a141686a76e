"""Prompt-cache bookkeeping: key, radix trie, store, lookup and APC block chains.

Pure Python on purpose (no mlx import anywhere in this package's bookkeeping): entries
hold an opaque payload and its byte size, so everything is unit-testable with fakes.
"""

from __future__ import annotations

from mlxcel_compat.cache.block_hash import (
    APC_BLOCK_DOMAIN,
    DEFAULT_BLOCKS_PER_ENTRY,
    NONE_HASH,
    SUPPORTED_HASHES,
    ApcConfig,
    BlockHash,
    BlockHasher,
    BlockIndex,
    block_chain,
    hash_block,
    verified_prefix,
)
from mlxcel_compat.cache.key import (
    ANON_SESSION,
    DOMAIN,
    RAW_PROMPT_TEMPLATE_SIG,
    TEXT_ONLY_MM_DIGEST,
    Bucket,
    canonical_json,
    effective_tool_choice,
    multimodal_digest,
    pack_tokens,
    prompt_digest,
    resolve_session_key,
    template_signature,
    tools_digest,
)
from mlxcel_compat.cache.radix import OverlapGroup, RadixTrie, TrieNode
from mlxcel_compat.cache.store import (
    EVICTION_REASONS,
    MISS_REASONS,
    REJECTION_REASONS,
    STAGE_CROSS_SESSION,
    STAGE_SESSION,
    CacheEntry,
    CacheHit,
    EntryStore,
    InsertResult,
    LookupResult,
    PromptCacheStore,
    StoreCounters,
)

__all__ = [
    "ANON_SESSION",
    "APC_BLOCK_DOMAIN",
    "DEFAULT_BLOCKS_PER_ENTRY",
    "DOMAIN",
    "EVICTION_REASONS",
    "MISS_REASONS",
    "NONE_HASH",
    "RAW_PROMPT_TEMPLATE_SIG",
    "REJECTION_REASONS",
    "STAGE_CROSS_SESSION",
    "STAGE_SESSION",
    "SUPPORTED_HASHES",
    "TEXT_ONLY_MM_DIGEST",
    "ApcConfig",
    "BlockHash",
    "BlockHasher",
    "BlockIndex",
    "Bucket",
    "CacheEntry",
    "CacheHit",
    "EntryStore",
    "InsertResult",
    "LookupResult",
    "OverlapGroup",
    "PromptCacheStore",
    "RadixTrie",
    "StoreCounters",
    "TrieNode",
    "block_chain",
    "canonical_json",
    "effective_tool_choice",
    "hash_block",
    "multimodal_digest",
    "pack_tokens",
    "prompt_digest",
    "resolve_session_key",
    "template_signature",
    "tools_digest",
    "verified_prefix",
]
