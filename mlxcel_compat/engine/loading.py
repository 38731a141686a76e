"""Loading a model on the engine thread, past the weights themselves (``model/loader.py``):
speculative decoding's draft model and n-gram table, and the warm-up passes that pay MLX's
one-off set-up costs at load instead of on the first request (and hand back what loading freed).

``core.Engine._load`` runs these in order and keeps what they return.
"""

from __future__ import annotations

import gc
import logging
import math
import time
from dataclasses import dataclass
from typing import Any, Callable

from mlxcel_compat.engine.batch import probe_cache
from mlxcel_compat.runtime import backend

log = logging.getLogger(__name__)


def config_value(config: dict[str, Any], key: str, default: Any) -> Any:
    """Read a model config key at top level or inside ``text_config`` (multimodal wrappers)."""
    if key in config:
        return config[key]
    return config.get("text_config", {}).get(key, default)


@dataclass
class Speculation:
    """Speculative decoding as loaded: the settings in force and what they needed loaded."""

    config: Any  # engine.speculative.SpecConfig
    draft: Any  # engine.speculative.DraftModel (-md), or None
    ngram_table: Any  # engine.speculative.NgramModTable (ngram-mod: shared by all sequences), or None
    lookup_files: Any = None  # engine.ngram_cache.LookupFiles (ngram-cache: -lcs/-lcd, read by all), or None


def load_speculation(spec: Any, loaded: Any, offline: bool, repack: bool) -> Speculation | None:
    """Speculative decoding (engine/speculative.py): load the draft model (-md) and check it
    against the target; a model whose cache cannot give back rejected positions (recurrent
    layers) decodes plainly, and the log says so. None: plain decoding."""
    from mlx_lm.models.cache import can_trim_prompt_cache, make_prompt_cache

    from mlxcel_compat.engine import ngram_cache
    from mlxcel_compat.engine.speculative import DraftModel, NgramModTable, SpecError, check_vocabularies

    if spec is None or not spec.enabled:
        return None
    if not can_trim_prompt_cache(make_prompt_cache(loaded.model)):
        log.warning("speculative decoding off: this model's cache cannot drop rejected draft tokens (recurrent layers)")
        return None
    draft = ngram_table = None
    if spec.uses_draft_model:
        from mlxcel_compat.model.loader import load_model

        t0 = time.perf_counter()
        draft_loaded = load_model(spec.draft_model, [], offline=offline, repack=repack)
        check_vocabularies(loaded.tokenizer, draft_loaded.tokenizer)
        draft = DraftModel(draft_loaded)
        log.info("draft model '%s' loaded in %.1f s (%d parameters, %s)", draft_loaded.path, time.perf_counter() - t0,
                 draft_loaded.n_params, "CPU decode runtime" if draft_loaded.decoder is not None else "MLX steps")
    if "ngram-mod" in spec.active:
        ngram_table = NgramModTable(spec.mod_n_match)
    lookup_files = None
    if "ngram-cache" in spec.active:
        try:
            lookup_files = ngram_cache.LookupFiles.read(spec.lookup_cache_static, spec.lookup_cache_dynamic)
        except (OSError, ngram_cache.LookupCacheError) as exc:
            raise SpecError(f"cannot read the lookup cache (-lcs/-lcd): {exc}") from exc
        log.info("ngram-cache: %d static and %d dynamic n-grams read", len(lookup_files.static), len(lookup_files.dynamic))
    log.info("speculative decoding: %s (draft n_max %d, n_min %d, p_min %.2f; ngram-simple n %d, m %d; "
             "ngram-mod n_match %d, n_min %d, n_max %d)", spec.type_names, spec.draft_n_max, spec.draft_n_min,
             spec.draft_p_min, spec.ngram_size_n, spec.ngram_size_m, spec.mod_n_match, spec.mod_n_min, spec.mod_n_max)
    return Speculation(spec, draft, ngram_table, lookup_files)


# The most of MLX's cache an idle hybrid keeps primed for its next snapshot hit (release_idle_memory).
IDLE_PRIMED_MAX = 24 << 20


def release_idle_memory(decoder: Any) -> None:
    """When the engine's last running sequence is done, hand back what its passes freed: the prompt
    chunks' buffers (``CpuDecoder.forget_chunk_buffers``), MLX's buffer cache and the C heap's free
    pages. Without it a 1K prompt left ~70 MiB of RSS held on Gemma 3 270M (a sliding window's
    chunk buffers, the chunk's activations, freed KV) while the server waits for the next request,
    which llama-server does not hold. A few milliseconds, once per busy spell.

    On a recurrent hybrid the cache is then primed with two sets of one sequence's recurrent state
    arrays, written once (``CpuDecoder.recurrent_state_shapes``): a session-snapshot hit makes
    the sequence's own state arrays first and then the boundary snapshot, both of those shapes,
    and fresh pages for them cost ~9 ms of page faults on a Qwen3.5-0.8B-shaped hybrid's 150 ms
    second turn. Those sets are what an idle hybrid holds beyond its model (12.8 MiB there); as
    many as fit in ``IDLE_PRIMED_MAX`` (a large hybrid's state is tens of MiB a sequence, and its
    turns take seconds: none)."""
    import mlx.core as mx

    if decoder is not None:
        decoder.forget_chunk_buffers()
    mx.clear_cache()
    shapes = getattr(decoder, "recurrent_state_shapes", [])
    state = sum(4 * math.prod(shape) for shape in shapes)
    sets = min(2, IDLE_PRIMED_MAX // state) if state else 0
    if sets:
        primed = [mx.zeros(shape, dtype=mx.float32) for _ in range(sets) for shape in shapes]
        mx.eval(primed)
        del primed  # back into MLX's cache (its limit, 32 MiB by default, is above the bound), pages in memory
    backend.release_free_memory()


def warm_up(model: Any, probe_batching: Callable[[], Any]) -> None:
    """Run one tiny forward pass: MLX's first call pays a one-off set-up cost. ``probe_batching``
    (``Engine.probe_batching``) runs while that pass's cache is still held."""
    import mlx.core as mx

    cache = probe_cache(model)
    mx.eval(model(mx.array([[0, 1]]), cache=cache))
    probe_batching()
    del cache
    # What loading and the probes freed (MLX's buffer cache, the tokenizer conversion's and the
    # header's temporaries) stays in the C heap's arenas unless handed back: ~50 MiB of RSS
    # on SmolLM2-135M.
    gc.collect()
    mx.clear_cache()
    backend.release_free_memory()


def warm_up_encoder(model: Any) -> None:
    """An encoder's first call, paid at load (MLX's one-off cost), and its memory handed back."""
    import mlx.core as mx

    mx.eval(model(mx.array([[0, 1]])))  # MLX's one-off first-call cost
    gc.collect()
    mx.clear_cache()
