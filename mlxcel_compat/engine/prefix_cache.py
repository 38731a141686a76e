"""Engine glue of the prompt cache: adopt before prefill, donate after a consistent finish.

Runs on the engine thread only (it owns the store). The store is pure bookkeeping; the MLX side
(copying, truncating and measuring mlx-lm cache objects) is ``cache/kv.py``.

    request ──► adopt(seq): lookup(bucket, session, prompt) ──hit──► copy entry KV, trim to the
                match, prefill only the rest (at least one token; none when the entry keeps the
                logits of exactly this prompt, ``_final_logits``)
    finish  ──► donate(seq): snapshot the sequence's KV with exactly the tokens it holds

APC (partial reuse) is decided once, at start-up, by ``apc.apc_decision``: off when the cache is
off, by flag, for the spec's recurrent/hybrid families, or when the model's cache holds a layer
that cannot be cut at every length. ``MLXCEL_APC_TRACE=1`` logs one ``apc.trace_line`` per lookup.
The settings and budget defaults are ``prefix_cache_config.py``'s, the admin replies'
``tiers`` and reset bodies ``cache_stats.py``'s.
"""

from __future__ import annotations

import collections
import gc
import logging
import time
from dataclasses import replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

from mlx_lm.models.cache import make_prompt_cache

from mlxcel_compat.runtime.backend import release_free_memory
from mlxcel_compat.cache import kv
from mlxcel_compat.cache.block_hash import ApcConfig
from mlxcel_compat.cache.block_pool import BlockTable
from mlxcel_compat.cache.explain import explain_lookup
from mlxcel_compat.cache.key import PIN_SESSION, TEXT_ONLY_MM_DIGEST, Bucket
from mlxcel_compat.cache.media import first_media_token
from mlxcel_compat.cache.prompt_store import PromptCacheStore
from mlxcel_compat.cache.records import LookupResult
from mlxcel_compat.cache.snapshot import SnapshotStore, is_snapshot_family, snapshot_capacity_default
from mlxcel_compat.cache.store import EntryStore
from mlxcel_compat.engine.apc import apc_decision, trace_line
from mlxcel_compat.engine.cache_stats import RESET_TIERS, reset_result, tiers_stats
from mlxcel_compat.engine.disk_tier import DiskTier
from mlxcel_compat.engine.kv_blocks import SharedBlocks, donor_done
from mlxcel_compat.engine.prefix_cache_config import (PrefixCacheConfig, disk_capacity_default, kv_accounting,
                                                      model_aware_capacity, physical_memory_bytes)
from mlxcel_compat.engine.request import WarmupJob
from mlxcel_compat.engine.snapshots import SessionSnapshots

if TYPE_CHECKING:
    from mlxcel_compat.engine.core import Engine
    from mlxcel_compat.engine.sequence import Sequence

log = logging.getLogger(__name__)

FLUSH_TIMEOUT_SECONDS = 20.0  # a clean shutdown writes RAM entries to the disk tier for at most this long
# An entry keeps its donor's logits at the prompt's last position (a prompt sent again then
# needs no forward pass, ``PrefixCache._final_logits``) when they cost at most this share of its
# KV bytes (1/16 of float32 KV before f16 became the default -ctk/-ctv: the same prompts).
FINAL_LOGITS_MAX_SHARE = 1 / 8
RECENT_MISSES = 256  # misses GET /v1/cache/misses lists (reasons and sizes only)


class PrefixCache:
    """The prompt cache as the engine sees it."""

    def __init__(self, engine: "Engine", config: PrefixCacheConfig) -> None:
        loaded = engine.loaded
        self.config = config
        self.model_id = loaded.model_id
        probe = make_prompt_cache(loaded.model)
        self.n_layers = len(probe)  # an entry's first layers are the model's; a draft model's follow
        self.draft = engine.draft  # engine.speculative.DraftModel (-md) or None
        # Entries of caches without recurrent state may be cut (each entry still says whether
        # its own state can, e.g. a sliding window that has not wrapped yet).
        self.token_granular = kv.can_truncate(probe) and not kv.has_recurrent_state(probe)
        self.kv_accounting = kv_accounting(loaded)
        self.apc_disabled_reason, why = apc_decision(config, loaded.config, probe)
        capacity = config.capacity_bytes
        if capacity is None:
            capacity, entry = model_aware_capacity(loaded.config, engine.n_ctx, loaded.size_bytes, physical_memory_bytes(),
                                                   self.kv_accounting["kv_bytes_per_token"])
            log.info(
                "Applied model-aware prompt-cache capacity default: old=unset new=%d bytes (entry %d bytes at %d tokens, max_entries %d)",
                capacity,
                entry,
                min(engine.n_ctx, 8192),
                config.max_entries,
            )
        # Dense KV is stored as shared blocks (engine/kv_blocks.py); kv_block_tokens 0: whole entries.
        self.blocks = SharedBlocks(config.kv_block_tokens) if config.kv_block_tokens > 0 and self.token_granular else None
        apc = None
        if self.apc_disabled_reason is None:
            apc = ApcConfig(block_size=config.apc_block_size, hash_name=config.apc_hash, num_blocks=config.apc_num_blocks)
        self.store = PromptCacheStore(
            capacity_bytes=capacity,
            max_entries=config.max_entries,
            ttl_seconds=config.ttl_seconds,
            min_prefix=config.min_prefix,
            apc=apc,
            enabled=config.enabled,
            apc_disabled_reason=self.apc_disabled_reason,
            pin_max_entries=config.pin_max_entries,
            pin_capacity_bytes=capacity // 4 if config.pin_capacity_bytes is None else min(config.pin_capacity_bytes, capacity),
            pool=self.blocks.pool if self.blocks is not None else None,
        )
        if apc is not None:
            log.info(
                "APC enabled: block size %d, hash %s, at most %d tracked blocks",
                apc.block_size, apc.hash_name, self.store.apc_num_blocks,
            )
        else:
            log.info("APC disabled (%s): %s; whole-prefix reuse is unaffected", self.apc_disabled_reason, why)
        self.snapshot_family = is_snapshot_family(kv.layer_kinds(probe))
        self.snapshots = self._make_snapshots(engine, config) if self.snapshot_family else None
        self.disk = self._make_disk(engine, config, apc) if config.enabled and config.disk_dir else None
        if config.disk_dir and not config.enabled:
            log.warning("--prompt-cache-dir is ignored: the prompt cache is off")
        if config.disk_write_through and self.disk is None:
            log.warning("--prompt-cache-write-through is ignored: there is no disk tier (--prompt-cache-dir)")
        self.last_stats: dict[str, Any] = self.stats()
        # The latest misses, newest last: reasons and sizes, never tokens (GET /v1/cache/misses).
        self.misses: collections.deque[dict[str, Any]] = collections.deque(maxlen=RECENT_MISSES)

    def _make_disk(self, engine: "Engine", config: PrefixCacheConfig, apc: ApcConfig | None) -> DiskTier:
        """The disk tier: entries the RAM stores evict are written there and read back on a miss."""
        assert config.disk_dir is not None
        root = Path(config.disk_dir).expanduser()
        try:
            root.mkdir(parents=True, exist_ok=True)
        except OSError as exc:
            raise RuntimeError(f"--prompt-cache-dir {root}: {exc.strerror or exc}") from exc
        capacity = config.disk_capacity_bytes
        if capacity is None:
            capacity = disk_capacity_default(root)
            log.info("Applied prompt-cache disk capacity default: %d bytes (half of what %s could use, at most 16 GiB)", capacity, root)
        # engine.compat (Engine._load) is the one description of what saved state must match: the
        # model's fingerprint with the draft model's, since entries then hold the draft's layers too.
        disk = DiskTier(root, capacity, engine.compat, config.min_prefix, apc, wake=lambda: engine.call(self._refresh),
                        busy=lambda: engine.busy)
        for kind, store in self._stores.items():
            store.on_evict = lambda entry, kind=kind: disk.spill(kind, entry)
            if config.disk_write_through:
                store.on_insert = lambda entry, kind=kind: disk.spill(kind, entry)
        return disk

    @property
    def _stores(self) -> dict[str, EntryStore]:
        """The RAM stores by disk-entry kind."""
        stores: dict[str, EntryStore] = {"kv": self.store}
        if self.snapshots is not None:
            stores["snapshot"] = self.snapshots.store
        return stores

    def _make_snapshots(self, engine: "Engine", config: PrefixCacheConfig) -> SessionSnapshots:
        """Recurrent / sliding-window models: finished sequences go to the session snapshot store."""
        import mlx.core as mx

        capacity = config.snapshot_capacity_bytes
        if capacity is None:
            probe = make_prompt_cache(engine.loaded.model)
            engine.loaded.model(mx.array([[0]]), cache=probe)
            entry = kv.state_bytes_at(probe, min(engine.n_ctx, 8192))
            left = max(physical_memory_bytes() - engine.loaded.size_bytes, 0)
            capacity = snapshot_capacity_default(entry, left)
            log.info(
                "Applied model-aware prompt-cache snapshot capacity default: old=unset new=%d bytes (entry %d bytes at %d tokens, max_entries %d)",
                capacity,
                entry,
                min(engine.n_ctx, 8192),
                config.snapshot_max_entries,
            )
        store = SnapshotStore(
            capacity_bytes=capacity,
            max_entries=config.snapshot_max_entries,
            ttl_seconds=config.snapshot_ttl_seconds,
            min_prefix=config.min_prefix,
            enabled=config.enabled,
        )
        log.info(
            "session snapshots on (the model's cache cannot be cut to a prefix): boundary %s, warm-up %s",
            "on" if config.boundary_snapshots else "off",
            "on" if config.warmup else "off",
        )
        return SessionSnapshots(store, self.model_id, config.boundary_snapshots, config.warmup, config.apc_trace)

    # ------------------------------------------------------------------ engine hooks

    @property
    def boundary_snapshots(self) -> bool:
        return self.snapshots is not None and self.config.enabled and self.snapshots.boundary

    @property
    def warmups(self) -> bool:
        return self.snapshots is not None and self.config.enabled and self.snapshots.warmup

    def on_boundary(self, seq: "Sequence") -> None:
        assert self.snapshots is not None
        self.snapshots.on_boundary(seq)
        self._refresh()

    def run_warmup(self, job: WarmupJob, engine: "Engine", should_stop: Any) -> bool:
        assert self.snapshots is not None
        done = self.snapshots.run_warmup(job, engine.loaded.model, engine.loaded.decoder, engine.config.batch_size, should_stop)
        self._refresh()
        return done

    def skip_warmup(self) -> None:
        if self.snapshots is not None:
            self.snapshots.store.record_warmup(False)
            self._refresh()

    @property
    def pins_enabled(self) -> bool:
        """Explicit cache breakpoints are pinned in the KV store (dense-KV models)."""
        return self.snapshots is None and self.config.enabled and self.config.pin_max_entries > 0

    def pin(self, seq: "Sequence", position: int, ttl: float) -> None:
        """Keep the KV of ``seq.prompt[:position]`` as a pinned entry (an explicit breakpoint).

        An entry already holding exactly that prefix is re-pinned without a copy. A new one is
        cut from the sequence's cache into buffers of its own, so it outlives the longer entry
        it came from; the tokens it adds beyond what the sequence read from the cache are what
        the response reports as written to the cache.
        """
        if not seq.request.cache.enabled:
            return
        tokens = seq.prompt[:position]
        bucket = self.bucket(seq)
        if self.store.refresh_pin(bucket, PIN_SESSION, tokens, ttl):
            self._refresh()
            return
        try:
            payload = self.blocks.state(seq, seq.cache, position, bucket) if self.blocks is not None else kv.detached_prefix(seq.cache, position)
        except Exception as exc:  # a breakpoint is an optimisation: never fail the request
            log.debug("prompt cache: pinning %d tokens failed for task %d: %s", position, seq.request.task_id, exc)
            return
        try:
            result = self.store.insert(
                bucket, PIN_SESSION, tokens, payload, kv.payload_nbytes(payload), self._trimmable(payload),
                origin="breakpoint", pin_ttl=ttl,
            )
            if result.inserted and isinstance(payload, BlockTable) and self.blocks is not None:
                self.blocks.keep(seq, payload)  # the entry this sequence donates shares the pin's blocks
        finally:
            donor_done(payload)
        if result.inserted:
            seq.stats.n_cache_written = max(seq.stats.n_cache_written, position - seq.stats.n_cached)
        self._refresh()

    def bucket(self, seq: "Sequence") -> Bucket:
        ctx = seq.request.cache
        return Bucket(
            model_id=self.model_id,
            lora_id=ctx.lora_id,
            template_sig=ctx.template_sig,
            rope_regime=None,
            mm_digest=ctx.mm_digest or TEXT_ONLY_MM_DIGEST,
            namespace=ctx.namespace,
        )

    def adopt(self, seq: "Sequence") -> int:
        """Give ``seq`` the longest usable cached prefix; return the adopted token count."""
        if not self.config.enabled or not seq.request.cache.enabled:
            return 0
        if self.snapshots is not None:
            self._promote_from_disk("snapshot", seq)
            restored = self.snapshots.adopt(seq)
            self._refresh()
            return restored
        self._promote_from_disk("kv", seq)
        text_prefix = self._text_prefix(seq)
        if text_prefix is not None:  # the text before the first image may be on disk too
            self._promote_from_disk("kv", seq, *text_prefix)
        result = self._lookup(seq)
        hit = result.hit
        if hit is None:
            self.misses.append({"at": round(time.time(), 3), "task_id": seq.request.task_id, "reason": result.reason,
                                "why": result.detail, "prompt_tokens": seq.n_prompt})
            self._trace_lookup(seq, result)
            self._refresh()
            return 0
        final = self._final_logits(seq, hit)
        matched = seq.n_prompt if final is not None else hit.matched_len
        try:
            payload = hit.entry.payload
            if isinstance(payload, BlockTable) and self.blocks is not None:
                cache = self.blocks.adopt(seq, payload, matched)  # gathered; a lease on its full blocks
            else:
                cache = kv.copy_cache(payload)
                if hit.needs_trim or final is not None:
                    kv.truncate(cache, matched)
        except Exception as exc:  # a broken entry must not fail the request: prefill cold
            log.debug("prompt cache: adoption failed for task %d: %s", seq.request.task_id, exc)
            self._trace_lookup(seq, result, failed=True)
            self._refresh()
            return 0
        seq.cache = self._split_draft(seq, cache, matched)
        seq.adopt(matched, final_logits=final)
        log.debug("prompt cache hit: task=%d matched=%d/%d entry=%s stage=%s%s", seq.request.task_id, matched, seq.n_prompt,
                  hit.entry.anon_repr(), hit.stage, " (with the entry's final logits)" if final is not None else "")
        self._trace_lookup(seq, result)
        self._refresh()
        return matched

    def _final_logits(self, seq: "Sequence", hit: Any) -> Any:
        """The logits ``hit``'s entry keeps for exactly ``seq``'s prompt, when the whole prompt
        can be adopted with them; else None (the last prompt token is computed, as always).

        Why: a prompt sent again (a regenerated answer, a retried or fanned-out request) is a
        full hit whose only work is its last token's forward pass, the one a cold run ran to get
        these logits. The entry holds that token's KV too (its donor wrote it then), so the
        pair is exactly the cold run's state: the first token is sampled from the same logits,
        bit for bit, and the next step continues from the same cache. The store's lookup still
        stops one token short (its contract); this extends it by that token, only when the entry
        holds the whole prompt, vouched for (``common_len``/``verified_len``), and nothing else
        rides on the last position: no images, no draft model's cache, no sibling completions."""
        final = hit.entry.final_logits
        if final is None or self.draft is not None or seq.request.share_group >= 0:
            return None
        media = seq.request.media
        if media is not None and media.spans:
            return None
        n, logits, _ = final
        if n != seq.n_prompt or hit.matched_len != n - 1 or min(hit.common_len, hit.verified_len) < n:
            return None
        if len(hit.entry.tokens) > n and not hit.entry.trimmable:
            return None
        return logits

    def _lookup(self, seq: "Sequence") -> LookupResult:
        """The store's lookup in the request's bucket; with images, the match never ends inside
        one, and the text-only bucket may give the prefix before the first image instead (it
        does not depend on any image: ``cache/media.py``). The longer one is the recorded lookup."""
        bucket, session = self.bucket(seq), seq.request.cache.session_key
        media = seq.request.media
        if media is None or not media.spans:
            return self.store.lookup(bucket, session, seq.prompt)
        spans = media.spans
        own = self.store.lookup(bucket, session, seq.prompt, record=False, spans=spans)
        text_prefix = self._text_prefix(seq)
        if text_prefix is not None:
            text = self.store.lookup(*text_prefix, record=False)
            if text.hit is not None and (own.hit is None or text.hit.matched_len > own.hit.matched_len):
                return self.store.lookup(*text_prefix)
        return self.store.lookup(bucket, session, seq.prompt, spans=spans)

    def _text_prefix(self, seq: "Sequence") -> tuple[Bucket, str, list[int]] | None:
        """(text-only bucket, session, the prompt through its first image token) of a request with
        images: a lookup there adopts at most the tokens before that image."""
        media = seq.request.media
        first = first_media_token(media.spans) if media is not None else None
        if not first:
            return None
        return replace(self.bucket(seq), mm_digest=TEXT_ONLY_MM_DIGEST), seq.request.cache.session_key, seq.prompt[: first + 1]

    def _donate_text_prefix(self, seq: "Sequence") -> None:
        """A multimodal sequence also stores its prefix before the first image in the text-only
        bucket, so the same text with another image reuses it (``_lookup``)."""
        media = seq.request.media
        first = first_media_token(media.spans) if media is not None else None
        if first is None or first < max(1, self.config.min_prefix) or not self.token_granular:
            return
        if not kv.can_truncate(seq.cache[: self.n_layers]):
            return
        bucket = replace(self.bucket(seq), mm_digest=TEXT_ONLY_MM_DIGEST)
        if self.blocks is not None:
            payload = self.blocks.state(seq, seq.cache[: self.n_layers], first, bucket)
        else:
            payload = kv.copy_cache(seq.cache[: self.n_layers])
            kv.truncate(payload, first)
        try:
            self.store.insert(bucket, seq.request.cache.session_key, seq.cache_tokens[:first], payload, kv.payload_nbytes(payload), True)
        finally:
            donor_done(payload)

    def donate(self, seq: "Sequence") -> None:
        """Store ``seq``'s KV with exactly the tokens it holds (called after a consistent finish)."""
        if not self.config.enabled or not seq.request.cache.enabled:
            return
        if self.snapshots is not None:
            self.snapshots.donate(seq)
            self._refresh()
            return
        tokens, cache = seq.cache_tokens, seq.cache
        if seq.exact_tokens is not None:
            # A context shift happened: past its kept tokens the KV is not what a cold prefill of
            # the tokens computes (engine/context_shift.py), so only the kept prefix is stored.
            tokens, cache = tokens[:seq.exact_tokens], kv.detached_prefix(cache, seq.exact_tokens) if seq.exact_tokens else []
        held = max((kv.layer_tokens(layer) for layer in cache), default=0)
        if not tokens or (self.token_granular and held != len(tokens)):
            log.debug("prompt cache: not donating task %d: cache holds %d tokens, %d recorded", seq.request.task_id, held, len(tokens))
            return
        layers = cache + self._draft_layers(seq)
        payload = self.blocks.state(seq, layers, len(tokens), self.bucket(seq)) if self.blocks is not None else kv.snapshot(layers)
        try:
            payload_bytes = kv.payload_nbytes(payload)
            final = self._keep_final_logits(seq, tokens, payload_bytes)
            result = self.store.insert(
                self.bucket(seq),
                seq.request.cache.session_key,
                tokens,
                payload,
                payload_bytes + (final[2] if final is not None else 0),
                self._trimmable(payload),
                final_logits=final,
            )
        finally:
            donor_done(payload)
        if not result.inserted:
            log.debug("prompt cache: task %d not stored (%s)", seq.request.task_id, result.reason)
        self._donate_text_prefix(seq)
        self._refresh()

    def _trimmable(self, payload: Any) -> bool:
        """A block table is dense KV, cut at any length; a whole payload says for itself."""
        return isinstance(payload, BlockTable) or (kv.can_truncate(payload) and self.token_granular)

    def release(self, seq: "Sequence") -> None:
        """``seq`` ended (finished, cancelled, failed, or never started): its lease goes."""
        if self.blocks is not None:
            self.blocks.release(seq)

    def _keep_final_logits(self, seq: "Sequence", tokens: list[int], payload_bytes: int) -> tuple[int, Any, int] | None:
        """(n_prompt, logits, their bytes) for the entry ``seq`` donates, when it computed the
        logits at its prompt's last position (``Sequence.final_logits``) and they cost at most
        ``FINAL_LOGITS_MAX_SHARE`` of the entry's KV (a short prompt's entry of a big vocabulary
        keeps the old rule: its last token is computed again); else None."""
        logits = seq.final_logits
        if logits is None or self.draft is not None or len(tokens) < seq.n_prompt:
            return None
        nbytes = int(logits.nbytes)
        if nbytes > FINAL_LOGITS_MAX_SHARE * payload_bytes or list(tokens[: seq.n_prompt]) != list(seq.prompt):
            return None  # (the tokens differ after a context shift)
        return seq.n_prompt, logits, nbytes

    def _draft_layers(self, seq: "Sequence") -> list[Any]:
        """The draft model's cache of ``seq``, brought to exactly the tokens the entry stores, so
        the entry keeps both under one key (a hit then warms both); [] when the sequence never
        drafted (its draft state would have to prefill the whole prompt first)."""
        spec = seq.speculator
        state = spec.state if spec is not None else None
        if self.draft is None or state is None:
            return []
        self.draft.sync(state, seq.cache_tokens)
        return list(state.cache)

    def _split_draft(self, seq: "Sequence", cache: list[Any], matched: int) -> list[Any]:
        """An adopted entry's model layers; its draft-model layers, if it has them, become the
        sequence's draft state (holding the same ``matched`` tokens)."""
        if len(cache) <= self.n_layers:
            return cache
        spec = seq.speculator
        if self.draft is not None and spec is not None and spec.draft is not None and len(cache) == self.n_layers + self.draft.n_layers:
            from mlxcel_compat.engine.speculative import DraftState
            from mlxcel_compat.runtime.decode_kv import OwnedCache

            spec.state = DraftState(cache=cache[self.n_layers:], tokens=list(seq.prompt[:matched]), owned=OwnedCache())
        return cache[: self.n_layers]

    def _promote_from_disk(self, kind: str, seq: "Sequence", bucket: Bucket | None = None, session: str | None = None,
                           prompt: list[int] | None = None) -> None:
        """When the disk tier holds a longer match than RAM, load it into the RAM store.

        The normal lookup that follows then adopts it, so a disk hit obeys exactly the RAM rules
        (and counts as a hit there too; ``tiers.disk.hits`` says how many came from disk).
        """
        disk = self.disk
        if disk is None:
            return
        if bucket is None or session is None or prompt is None:  # (a text-prefix probe is not another lookup)
            disk.counters.lookups += 1
            bucket, session, prompt = self.bucket(seq), seq.request.cache.session_key, seq.prompt
        hit = disk.probe(kind, bucket, session, prompt)
        if hit is None:
            return
        store = self._stores[kind]
        ram = store.lookup(bucket, session, prompt, record=False).hit  # type: ignore[attr-defined]
        if ram is not None and ram.matched_len >= hit.matched_len:
            return
        loaded = disk.load(kind, hit, prompt)
        if loaded is None:
            return
        if self.insert_state(kind, loaded.header.bucket, loaded.header.session_key, list(loaded.header.tokens),
                             loaded.payload, loaded.header.origin):
            disk.counters.hits += 1
            disk.counters.tokens_loaded += hit.matched_len
            log.debug("prompt cache: task %d: %d tokens from the disk tier", seq.request.task_id, hit.matched_len)

    def insert_state(self, kind: str, bucket: Bucket, session_key: str, tokens: list[int], payload: list[Any], origin: str = "completion") -> bool:
        """Put a state read from a file (disk tier, slot restore) into its RAM store."""
        store = self._stores.get(kind)
        if store is None or not tokens:
            return False
        trimmable = kv.can_truncate(payload) and (self.token_granular or kind == "snapshot")
        if kind == "snapshot" and origin not in ("boundary", "completion"):
            origin = "completion"
        state = self.blocks.from_file(payload, bucket, tokens) if kind == "kv" and self.blocks is not None else payload
        try:
            return store.insert(bucket, session_key, tokens, state, kv.payload_nbytes(state), trimmable, origin).inserted
        finally:
            donor_done(state)

    def close(self) -> None:
        """Clean shutdown: write what RAM holds to the disk tier (bounded in time), stop the writer."""
        if self.disk is None:
            return
        written = self.disk.flush(self._stores, FLUSH_TIMEOUT_SECONDS)
        self.disk.close()
        log.info("prompt-cache disk tier: %d entries written at shutdown", written)

    # ------------------------------------------------------------------ admin

    def stats(self) -> dict[str, Any]:
        """KV-store fields, the ``snapshot_*`` fields (zeros when the model needs none) and ``tiers``.

        The top-level counters describe every lookup (a disk hit is promoted into RAM and adopted
        from there, so it counts as a hit); ``tiers`` splits what RAM and disk hold and served.
        """
        if not self.config.enabled:
            out = {**PromptCacheStore.disabled_stats(), **SnapshotStore.disabled_stats(), **self.kv_accounting,
                   **SharedBlocks.empty_stats()}
            out["tiers"] = tiers_stats(out, DiskTier.disabled_stats())
            return out
        self.store.sweep()
        out = {**self.store.stats(), **self.kv_accounting,
               **(self.blocks.stats() if self.blocks is not None else SharedBlocks.empty_stats())}
        if self.snapshots is not None:
            self.snapshots.store.sweep()
            out.update(self.snapshots.store.stats())
        else:
            out.update(SnapshotStore.disabled_stats())
        out["snapshot_family"] = self.snapshots is not None
        out["tiers"] = tiers_stats(out, self.disk.stats() if self.disk is not None else DiskTier.disabled_stats())
        return out

    def reset(self, tier: str = "all") -> dict[str, Any]:
        """Clear a tier: ``ram`` (both RAM stores and the APC chains), ``disk`` or ``all``; idempotent.

        Freed RAM goes back to the system (MLX would otherwise keep the buffers in its cache for
        reuse, and the C heap its free pages, and RSS would not drop)."""
        import mlx.core as mx

        if tier not in RESET_TIERS:
            raise ValueError(f"tier must be one of {', '.join(RESET_TIERS)}")
        ram = disk = (0, 0)
        if tier in ("ram", "all"):
            ram = self.store.reset()
            if self.snapshots is not None:
                more, more_bytes = self.snapshots.store.reset()
                ram = (ram[0] + more, ram[1] + more_bytes)
            if ram[0]:  # handing memory back costs ~0.1 s (a full collection); only when something was freed
                mx.clear_cache()
                gc.collect()
                release_free_memory()
        if tier in ("disk", "all") and self.disk is not None:
            disk = self.disk.clear()
        self._refresh()
        return reset_result(tier, ram, disk)

    def _refresh(self) -> None:
        # A snapshot for readers on other threads (/metrics): replaced whole, never mutated.
        self.last_stats = self.stats()

    def explain(self, seq: "Sequence") -> dict[str, Any]:
        """``cache_explain``: why ``seq`` reused what it did (``cache/explain.py``), after
        :meth:`adopt`. The lookup is asked again without counting it; the explained reason of a
        miss is added to its record in :attr:`misses`. It reads every entry of the request's
        namespace (the lookup reads one bucket's trie), which is why it is asked for, not always."""
        adopted = seq.stats.n_cached
        bucket, session = self.bucket(seq), seq.request.cache.session_key
        if self.snapshots is not None:  # session snapshots: restored by session, never across sessions
            if adopted:
                return {"outcome": "hit", "reason": "hit", "tokens_reused": adopted, "prompt_tokens": seq.n_prompt}
            snap = self.snapshots.store
            return explain_lookup(bucket, session, seq.prompt, LookupResult(hit=None, reason="no_candidate"), 0, snap.entries(),
                                  snap.departed, snap.min_prefix, sessions_shared=False)
        spans = seq.request.media.spans if seq.request.media is not None else ()
        result = self.store.lookup(bucket, session, seq.prompt, record=False, spans=spans)
        if adopted == 0:
            result.hit = None  # an adoption that failed is a miss whatever the store holds
        out = explain_lookup(bucket, session, seq.prompt, result, adopted, self.store.entries(), self.store.departed,
                             self.store.min_prefix, media_start=spans[0][0] if spans else None)
        if out["outcome"] == "miss" and self.misses and self.misses[-1]["task_id"] == seq.request.task_id:
            self.misses[-1]["explained"] = out["reason"]
        return out

    def recent_misses(self) -> dict[str, Any]:
        """``GET /v1/cache/misses``: the latest misses, newest first, and their count by reason."""
        listed = [{k: v for k, v in m.items() if k != "task_id"} for m in reversed(self.misses)]
        by_reason = collections.Counter(m.get("explained") or m["reason"] for m in self.misses)
        return {"misses": listed, "by_reason": dict(by_reason)}

    def _trace_lookup(self, seq: "Sequence", result: LookupResult, failed: bool = False) -> None:
        """``MLXCEL_APC_TRACE=1``: one INFO line per lookup decision (no tokens, no session)."""
        if self.config.apc_trace:
            log.info("apc-trace: %s", trace_line(seq.request.task_id, seq.n_prompt, result, failed))


