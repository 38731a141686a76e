"""Build a :class:`Sequence` for a request: cache, prompt-cache adoption, sampler, grammar, text stream."""

from __future__ import annotations

import logging
from typing import Any, Protocol

from mlx_lm.models.cache import make_prompt_cache

from mlxcel_compat.engine.kept_state import adopt_kept
from mlxcel_compat.engine.request import GenerationRequest, Sink
from mlxcel_compat.engine.sampling.chain import SamplerChain
from mlxcel_compat.engine.sequence import Sequence
from mlxcel_compat.engine.slots import Slot
from mlxcel_compat.engine.speculative_sequence import SpeculativeSequence
from mlxcel_compat.engine.textstream import TextStream

log = logging.getLogger(__name__)


class SequenceHost(Protocol):
    """What building a sequence reads of the engine (``core.Engine`` is one); a protocol, so that
    this module, which the engine imports, does not import it back."""

    loaded: Any  # model.loader.LoadedModel
    n_ctx: int  # per slot
    config: Any  # core.EngineConfig: batch_size is the prefill chunk
    grammars: Any  # engine.grammar.GrammarCompiler
    speculative: Any  # engine.speculative.SpecConfig in force (None: off)
    draft: Any  # engine.speculative.DraftModel (-md) or None
    ngram_table: Any  # engine.speculative.NgramModTable or None
    lookup_files: Any  # engine.ngram_cache.LookupFiles or None
    prefix_cache: Any  # engine.prefix_cache.PrefixCache or None
    key_rotation: Any  # engine.context_shift.KeyRotation where the context shifts, else None
    slots: list[Slot]


def rows_match_chunks(loaded: Any) -> bool:
    """Whether the CPU decode runtime's decode rows compute as a prefill chunk's rows would, to
    float32 rounding: the runtime runs and every weight is float32. It decides whether a hit's
    rest off the grid may take its last token into its one chunk (``prompt_chunks.prompt_tail``):
    weights kept in ggml's blocks multiply a decode row's activations quantized to the type's
    ``vec_dot_type`` (as llama.cpp's decode does) and a chunk's by another rule or in float32, so
    the first token's log-probabilities could move by ~1e-2 against the cold run's step (a
    llama Q4_K_M: up to 1.6e-2 of the largest logit, where an activation rounds to another
    8-bit step)."""
    if loaded.decoder is None:
        return False
    known = getattr(loaded, "_rows_match_chunks", None)  # judged once per loaded model
    if known is None:
        from mlxcel_compat.runtime.block_layers import block_weight_of

        known = all(block_weight_of(m) is None for _, m in loaded.model.named_modules())
        loaded._rows_match_chunks = known
    return known


def make_sequence(engine: SequenceHost, request: GenerationRequest, sink: Sink, slot_id: int) -> Sequence:
    loaded = engine.loaded
    tokenizer = loaded.tokenizer
    vocab_size = int(loaded.config.get("vocab_size") or loaded.config.get("text_config", {}).get("vocab_size"))
    eog_ids = set(tokenizer.eos_token_ids or [])
    chain = SamplerChain(request.sampling, vocab_size=vocab_size, eog_token_ids=sorted(eog_ids), tokenizer=tokenizer, n_ctx=engine.n_ctx)
    constraint = request.constraint
    grammar = engine.grammars.new_state(constraint, tokenizer) if constraint is not None else None
    preserved = constraint.preserved_tokens if constraint is not None else ()
    # A sequence of an engine that speculates can take the draft steps (speculator_for below).
    sequence_class = SpeculativeSequence if engine.speculative is not None else Sequence
    seq = sequence_class(
        request=request,
        # A vision model gets a view bound to this request's images (vision/model.py).
        model=loaded.model.bind(request.media, request.prompt_tokens) if loaded.vision is not None else loaded.model,
        cache=make_prompt_cache(loaded.model),
        n_ctx=engine.n_ctx,
        chunk_size=engine.config.batch_size,
        chain=chain,
        text=TextStream(tokenizer, request.stop, eog_token_ids=sorted(eog_ids), preserved=preserved),
        eog_ids=eog_ids,
        emit=sink,
        slot_id=slot_id,
        grammar=grammar,
        # A request with images runs in MLX's pass (the CPU decode runtime takes token ids, not the
        # images' features: a vision model's runtime serves its requests without images).
        decoder=loaded.decoder if request.media is None or not request.media.spans else None,
    )
    seq.tail_rows = rows_match_chunks(loaded)
    if engine.speculative is not None:
        seq.speculator = speculator_for(engine, seq)
    # Context shift: not for completions sharing one prompt's KV (llama-server refuses those too)
    # nor for a sequence that drafts (its draft model's cache would have to shift with it).
    if engine.key_rotation is not None and request.share_group < 0 and seq.speculator is None:
        seq.rotation = engine.key_rotation
    cache = engine.prefix_cache
    if request.is_child:
        return seq
    if request.cache.explain:  # cache_explain: filled in below where the prompt cache is looked up
        seq.stats.cache_explain = {"tokens_reused": 0, "prompt_tokens": seq.n_prompt, "outcome": "miss", "reason": "cache_off"}
    if cache is not None and cache.config.enabled:
        if not request.cache.enabled:
            return seq
        try:
            cache.adopt(seq)  # inside: a failure after the adoption took its lease releases it below
            if request.cache.explain:
                seq.stats.cache_explain = cache.explain(seq)
            boundary = request.cache.history_boundary
            if boundary is None and cache.snapshots is not None and request.media is not None and request.media.spans:
                # Images on a snapshot family (LFM2-VL): the history boundary is not known (the image
                # tokens moved the rendered text's offsets), so the prompt's own end, less its last
                # token, is snapshotted: the next turn about the same images starts with this prompt.
                boundary = seq.n_prompt - 1
            if cache.boundary_snapshots and boundary is not None and len(seq.cache_tokens) < boundary <= seq.n_prompt - 1:
                seq.boundary = boundary
                seq.on_boundary = cache.on_boundary
            if cache.pins_enabled and request.cache.breakpoints:
                seq.pins = [(b, ttl) for b, ttl in request.cache.breakpoints if 0 < b <= seq.n_prompt - 1]
                seq.on_pin = cache.pin
                seq.pin_reached()  # breakpoints inside the adopted prefix are (re-)pinned right away
        except BaseException:
            cache.release(seq)  # the lease on shared KV blocks the adoption took
            raise
    elif request.cache.cache_prompt and engine.slots[slot_id].kept is not None:
        adopt_kept(seq, engine.slots[slot_id].kept)
    return seq


def speculator_for(engine: SequenceHost, seq: Sequence) -> Any:
    """This sequence's drafting, or None where speculation cannot verify exactly: a grammar's
    mask and a thinking budget's forced tokens depend on every accepted token (the log says so)."""
    from mlxcel_compat.engine.speculative import Speculator

    reason = "a grammar constrains it" if seq.grammar is not None else "it has a thinking budget" if seq.budget is not None else None
    if reason is not None:
        log.info("task %d: speculative decoding off for this request: %s", seq.request.task_id, reason)
        return None
    return Speculator(engine.speculative, engine.draft, engine.ngram_table, engine.lookup_files)
