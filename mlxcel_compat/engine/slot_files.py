"""llama-server's slot files: ``POST /slots/{id}?action=save|restore|erase``, on the engine thread.

While ``--slot-save-path`` is set, every slot keeps the state of its last task (tokens and mlx-lm
cache, ``kept_state.KeptState``), as llama-server's slots keep their KV cells:

- **save** writes it in the disk tier's file format (``cache/disk_format.py``, kind ``slot``): a
  safetensors file whose checksummed header carries the model fingerprint, the runtime, the key
  parts, the tokens and the chat template's digest;
- **restore** checks a file (format, model, runtime, chat template, checksums, context size,
  token ids) and puts its state back into the slot, and into the prompt cache, so the next request
  that starts with those tokens adopts them whichever slot it lands on; with the prompt cache off,
  a request that lands on the slot reuses the common prefix directly (``kept_state.adopt_kept``);
- **erase** forgets the slot's state (the prompt cache is cleared with ``POST /v1/cache/reset``).

The engine runs these only while the slot is idle (``Engine.call_on_slot``). Writing and reading
happen on the engine thread, as in llama-server: other slots pause for the file's duration.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

from mlxcel_compat.cache import kv, kv_io
from mlxcel_compat.cache.disk_format import DiskReject, EntryHeader, read_header
from mlxcel_compat.cache.disk_write import commit, write_temp
from mlxcel_compat.cache.key import ANON_SESSION, RAW_PROMPT_TEMPLATE_SIG, TEXT_ONLY_MM_DIGEST, Bucket
from mlxcel_compat.engine.kept_state import KeptState
from mlxcel_compat.engine.slots import Slot

if TYPE_CHECKING:
    from mlxcel_compat.engine.core import Engine

# How each rejection reads in "Unable to restore slot: ...".
_REASONS = {
    "not_a_cache_file": "not a slot save file",
    "truncated": "the file is truncated",
    "size_mismatch": "the file is damaged (longer than its header says)",
    "corrupt_header": "the file is corrupted",
    "payload_checksum": "the file is corrupted",
    "incompatible_version": "the file was written by an incompatible version",
    "kv_precision": "the file's KV cache type differs from this server's",
    "foreign_model": "the file was saved from another model",
    "bad_payload": "the file's state does not fit this model",
    "token_mismatch": "the file's state does not fit this model",
    "unreadable": "the file cannot be read",
}


class SlotFileError(Exception):
    """A slot file action that cannot be done; the message is for the client."""


class SlotHoldsMedia(SlotFileError):
    """The slot's state holds image tokens: a save is llama-server's 501 (its file format has no
    room for the images; an erase still clears the slot)."""

    def __init__(self) -> None:
        super().__init__("This feature is not supported by multimodal")


def _refuse_media(slot: Slot) -> None:
    kept = slot.kept
    if kept is not None and kept.bucket.mm_digest != TEXT_ONLY_MM_DIGEST:
        raise SlotHoldsMedia()


def save(engine: "Engine", slot: Slot, path: Path, filename: str, template_digest: str) -> dict[str, Any]:
    """Write the slot's state to ``path``; llama-server's response fields."""
    t0 = time.perf_counter()
    _refuse_media(slot)
    kept = slot.kept
    if kept is None:
        bucket = Bucket(engine.loaded.model_id, "", RAW_PROMPT_TEMPLATE_SIG, None, TEXT_ONLY_MM_DIGEST)
        kept = KeptState([], [], bucket, ANON_SESSION)
    payload = _consistent_copy(kept)
    layout, tensors = kv_io.encode(payload)
    header = EntryHeader(
        kind="slot", compat=engine.compat, bucket=kept.bucket, session_key=kept.session_key,
        tokens=tuple(kept.tokens), origin="slot", trimmable=kv.can_truncate(payload), nbytes=kv.nbytes(payload),
        layout=layout, extra={"chat_template": template_digest},
    )
    temp = write_temp(path, header, tensors)
    commit(temp, path)
    return {
        "id_slot": slot.id,
        "filename": filename,
        "n_saved": len(kept.tokens),
        "n_written": temp.size,
        "timings": {"save_ms": (time.perf_counter() - t0) * 1000.0},
    }


def restore(engine: "Engine", slot: Slot, path: Path, filename: str, template_digest: str) -> dict[str, Any]:
    """Load a slot file into the slot (and the prompt cache).

    Raises:
        SlotFileError: the file is missing, of another model, template or version, damaged, or does
            not fit the slot; the slot is left as it was.
    """
    t0 = time.perf_counter()
    try:
        header, _ = read_header(path, engine.compat, ("slot",))
        raw_prompt = header.bucket.template_sig == RAW_PROMPT_TEMPLATE_SIG
        if header.tokens and not raw_prompt and header.extra.get("chat_template") != template_digest:
            raise SlotFileError("the file was saved with another chat template (its chat prompt would not be rendered the same way)")
        if len(header.tokens) > slot.n_ctx:
            raise SlotFileError(f"Restored prompt does not fit in the slot context ({len(header.tokens)} tokens > n_ctx {slot.n_ctx})")
        vocab = _vocab_size(engine)
        if any(t < 0 or t >= vocab for t in header.tokens):
            raise SlotFileError("Invalid tokens in slot save file")
        payload = kv_io.decode(header.layout, kv_io.load_arrays(path, header)) if header.tensors else []
    except FileNotFoundError:
        raise SlotFileError(f"file {filename!r} not found") from None
    except DiskReject as exc:
        raise SlotFileError(f"{_REASONS[exc.reason]} ({exc.detail})") from None
    if header.tokens and _held(payload) not in (None, len(header.tokens)):
        raise SlotFileError(f"{_REASONS['bad_payload']} (the state does not hold {len(header.tokens)} tokens)")
    tokens = list(header.tokens)
    slot.kept = KeptState(tokens, payload, header.bucket, header.session_key) if tokens else None
    cache = engine.prefix_cache
    if tokens and cache is not None and cache.config.enabled:
        kind = "snapshot" if cache.snapshots is not None else "kv"
        cache.insert_state(kind, header.bucket, header.session_key, tokens, kv.copy_cache(payload))
    return {
        "id_slot": slot.id,
        "filename": filename,
        "n_restored": len(tokens),
        "n_read": path.stat().st_size,
        "timings": {"restore_ms": (time.perf_counter() - t0) * 1000.0},
    }


def erase(slot: Slot) -> dict[str, Any]:
    n = len(slot.kept.tokens) if slot.kept is not None else 0
    slot.kept = None
    return {"id_slot": slot.id, "n_erased": n}


def _consistent_copy(kept: KeptState) -> list[Any]:
    """An exact copy holding exactly ``kept.tokens`` (a pipelined step may have fed one more).

    Raises:
        SlotFileError: the state holds fewer tokens than recorded, or more and cannot be cut.
    """
    payload = kv.copy_cache(kept.cache, exact=True)
    held = _held(payload)
    if held is not None and held != len(kept.tokens):
        if held < len(kept.tokens) or not kv.can_truncate(payload):
            raise SlotFileError(f"the slot's state holds {held} tokens, not {len(kept.tokens)}")
        kv.truncate(payload, len(kept.tokens))
    return kv.snapshot(payload)


def _held(payload: list[Any]) -> int | None:
    """Tokens held by the token-indexed layers (None when no layer is token-indexed)."""
    counts = [kv.layer_tokens(layer) for layer in payload if hasattr(layer, "offset")]
    return max(counts) if counts else None


def _vocab_size(engine: "Engine") -> int:
    config = engine.loaded.config
    return int(config.get("vocab_size") or config.get("text_config", {}).get("vocab_size") or 0)
