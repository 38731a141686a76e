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
    agreed_block_len,
    block_chain,
    extend_token_granular,
    hash_block,
    verified_prefix,
)
from mlxcel_compat.cache.families import RECURRENT_MODEL_TYPES, FamilyMatch, recurrent_family
from mlxcel_compat.cache.key import (
    ANON_SESSION,
    DOMAIN,
    RAW_PROMPT_TEMPLATE_SIG,
    TEXT_ONLY_MM_DIGEST,
    Bucket,
    canonical_json,
    multimodal_digest,
    pack_tokens,
    prompt_digest,
    resolve_session_key,
    template_signature,
    tools_digest,
)
from mlxcel_compat.cache.prompt_store import PromptCacheStore
from mlxcel_compat.cache.radix import OverlapGroup, RadixTrie, TrieNode
from mlxcel_compat.cache.records import (
    EVICTION_REASONS,
    INELIGIBLE_REASONS,
    MISS_REASONS,
    REJECTION_REASONS,
    STAGE_CROSS_SESSION,
    STAGE_SESSION,
    CacheEntry,
    CacheHit,
    InsertResult,
    LookupResult,
    StoreCounters,
)
from mlxcel_compat.cache.store import EntryStore

__all__ = [
    "ANON_SESSION",
    "APC_BLOCK_DOMAIN",
    "DEFAULT_BLOCKS_PER_ENTRY",
    "DOMAIN",
    "EVICTION_REASONS",
    "INELIGIBLE_REASONS",
    "MISS_REASONS",
    "NONE_HASH",
    "RAW_PROMPT_TEMPLATE_SIG",
    "RECURRENT_MODEL_TYPES",
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
    "FamilyMatch",
    "InsertResult",
    "LookupResult",
    "OverlapGroup",
    "PromptCacheStore",
    "RadixTrie",
    "StoreCounters",
    "TrieNode",
    "agreed_block_len",
    "block_chain",
    "canonical_json",
    "extend_token_granular",
    "hash_block",
    "multimodal_digest",
    "pack_tokens",
    "prompt_digest",
    "recurrent_family",
    "resolve_session_key",
    "template_signature",
    "tools_digest",
    "verified_prefix",
]
