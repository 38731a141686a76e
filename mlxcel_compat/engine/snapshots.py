"""Session snapshots: multi-turn reuse for models whose state cannot be cut to a prefix.

Recurrent and hybrid models (SSM / linear-attention layers) and sliding-window models (rotating
caches that wrap) cannot restore "the first n tokens" of a stored state. Their reuse goes through
whole-state snapshots, looked up in the same session only (``cache/snapshot.py``):

    turn k prompt:   [ history ............................ | new user message + scaffolding ]
                                                            ^ boundary snapshot (origin "boundary")
    turn k finish:   [ prompt + generated ]                   completion snapshot (origin "completion")
    idle warm-up:    [ history + assistant reply as turn k+1 will render it ]   (origin "boundary")

so turn k+1 restores the warm-up snapshot and prefills only its new user message. Runs on the
engine thread; the prefill here uses the same absolute chunk alignment as sequences do.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Any, Callable

from mlxcel_compat.cache import kv
from mlxcel_compat.cache.key import TEXT_ONLY_MM_DIGEST, Bucket
from mlxcel_compat.cache.snapshot import ORIGIN_BOUNDARY, ORIGIN_COMPLETION, SnapshotLookup, SnapshotStore
from mlxcel_compat.engine.forward import prefill_chunk
from mlxcel_compat.engine.request import WarmupJob
from mlxcel_compat.runtime.decode_kv import OwnedCache

if TYPE_CHECKING:
    from mlxcel_compat.engine.sequence import Sequence

log = logging.getLogger(__name__)


def prefill_tokens(model: Any, decoder: Any, cache: list[Any], tokens: list[int], start: int, chunk_size: int,
                   should_stop: Callable[[], bool], lora: tuple[float, ...] = ()) -> int:
    """Prefill ``tokens[start:]`` in chunks aligned on absolute multiples of ``chunk_size``,
    under the LoRA scales ``lora`` (those of the request the state belongs to), each chunk as a
    sequence's prefill feeds it (``forward.prefill_chunk``: the CPU decode runtime where it takes
    the cache, else MLX's forward).

    Why the runtime: MLX's prompt path for a hybrid's delta-net layers loops over the tokens in
    Python; a warm-up chunk of a turn's reply took about a second on a Qwen3.5-shaped file, and a
    request arriving meanwhile waited for it (warm-ups stop between chunks only). Through the
    runtime it is one pass, and the state it leaves is the arithmetic a cold prefill of the same
    chunk does.

    Returns how far it got (``len(tokens)`` unless ``should_stop`` interrupted it).
    """
    owned = OwnedCache()
    pos = start
    while pos < len(tokens):
        if should_stop():
            return pos
        end = min(len(tokens), (pos // chunk_size + 1) * chunk_size)
        prefill_chunk(model, decoder, cache, owned, lora, tokens[pos:end])
        pos = end
    return pos


class SessionSnapshots:
    def __init__(self, store: SnapshotStore, model_id: str, boundary: bool, warmup: bool, trace: bool) -> None:
        self.store = store
        self.model_id = model_id
        self.boundary = boundary
        self.warmup = warmup
        self.trace = trace

    def bucket(self, template_sig: str, mm_digest: bytes, namespace: str, lora_id: str = "") -> Bucket:
        return Bucket(
            model_id=self.model_id, lora_id=lora_id, template_sig=template_sig, rope_regime=None,
            mm_digest=mm_digest or TEXT_ONLY_MM_DIGEST, namespace=namespace,
        )

    def _seq_bucket(self, seq: "Sequence") -> Bucket:
        ctx = seq.request.cache
        return self.bucket(ctx.template_sig, ctx.mm_digest, ctx.namespace, ctx.lora_id)

    # ------------------------------------------------------------------ requests

    def adopt(self, seq: "Sequence") -> int:
        """Restore the session's snapshot whose tokens prefix the prompt; return tokens restored."""
        result = self.store.lookup(self._seq_bucket(seq), seq.request.cache.session_key, seq.prompt)
        self._trace("lookup", seq.request.task_id, result)
        hit = result.hit
        if hit is None:
            return 0
        cache = kv.restore(hit.entry.payload)
        if hit.needs_trim:
            kv.truncate(cache, hit.matched_len)
        seq.cache = cache
        seq.adopt(hit.matched_len)
        return hit.matched_len

    def on_boundary(self, seq: "Sequence") -> None:
        """The sequence's prefill reached the end of its rendered history: snapshot it there."""
        self._insert(seq, seq.cache, list(seq.cache_tokens), ORIGIN_BOUNDARY)

    def donate(self, seq: "Sequence") -> None:
        """Completion snapshot: ``prompt + generated`` as the sequence's state holds them."""
        self._insert(seq, seq.cache, list(seq.cache_tokens), ORIGIN_COMPLETION)

    def _insert(self, seq: "Sequence", cache: list[Any], tokens: list[int], origin: str) -> None:
        if not tokens:
            return
        payload = kv.snapshot(cache)
        result = self.store.insert(
            self._seq_bucket(seq), seq.request.cache.session_key, tokens, payload, kv.nbytes(payload), kv.can_truncate(payload), origin=origin
        )
        if self.trace:
            log.info("apc-trace: snapshot insert task=%d origin=%s tokens=%d stored=%s reason=%s", seq.request.task_id, origin, len(tokens), result.inserted, result.reason)

    # ------------------------------------------------------------------ warm-up

    def run_warmup(self, job: WarmupJob, model: Any, decoder: Any, chunk_size: int, should_stop: Callable[[], bool]) -> bool:
        """Extend the session's best snapshot through ``job.tokens``; False when skipped."""
        bucket = self.bucket(job.template_sig, job.mm_digest, job.namespace, job.lora_id)
        # The job has no token left to "generate": look up as if one more token followed.
        probe = self.store.lookup(bucket, job.session_key, job.tokens + [-1], record=False)
        hit = probe.hit
        if hit is None or hit.matched_len >= len(job.tokens):
            self.store.record_warmup(False)
            self._trace("warmup-skip", -1, probe)
            return False
        cache = kv.restore(hit.entry.payload)
        if hit.needs_trim:
            kv.truncate(cache, hit.matched_len)
        reached = prefill_tokens(model, decoder, cache, job.tokens, hit.matched_len, chunk_size, should_stop, job.lora)
        if reached < len(job.tokens):
            self.store.record_warmup(False)  # a request arrived: it goes first
            return False
        payload = kv.snapshot(cache)
        self.store.insert(bucket, job.session_key, job.tokens, payload, kv.nbytes(payload), kv.can_truncate(payload), origin=ORIGIN_BOUNDARY)
        self.store.record_warmup(True)
        if self.trace:
            log.info("apc-trace: warmup extended snapshot %d -> %d tokens", hit.matched_len, len(job.tokens))
        return True

    def _trace(self, what: str, task_id: int, result: SnapshotLookup) -> None:
        if not self.trace:
            return
        hit = result.hit
        log.info(
            "apc-trace: snapshot %s task=%d %s common=%d stored=%d request=%d restored=%d",
            what,
            task_id,
            "hit" if hit is not None else f"reject={result.reason}",
            result.common_prefix,
            result.stored_len,
            result.request_len,
            hit.matched_len if hit is not None else 0,
        )
