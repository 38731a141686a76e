"""Context shift (``--context-shift``): a generation that fills its slot's context drops part of it
and goes on, as llama-server's does.

When a decoding sequence's next token would not fit (the cache holds ``n_ctx - 1`` tokens), the
first ``n_keep`` tokens stay (the request's ``n_keep``, ``--keep`` by default; ``-1`` the whole
prompt; plus one for the BOS token where the model adds one; at most ``n_ctx - 4``), the next
``n_discard`` go (the request's ``n_discard``, by default half of the rest), and the rest move
down. Keys hold their position's RoPE rotation, so the moved keys are rotated back by
``n_discard`` positions (llama.cpp's ``seq_rm`` then ``seq_add``): each one is what the model
computes at its new position, and new tokens continue at the positions after them.

What the shifted cache holds is no longer what a cold prefill of its tokens computes (the tokens
after ``n_keep`` attended to the discarded ones), so only the first ``n_keep`` tokens are ever
reused: a shifted sequence donates its kept prefix to the prompt cache, and nothing past it
(``Sequence.exact_tokens``).

Only plain KV tables shift: a recurrent model's state (Mamba, linear attention) or a sliding
window's ring cannot drop tokens from the middle, and a RoPE the rotation cannot undo exactly
(YaRN's magnitude scaling) is not shifted either. For those models the flag is turned off at
load with a warning, as llama-server turns it off for contexts that cannot shift, and generation
stops at the context limit.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any

import mlx.core as mx

from mlxcel_compat.cache import kv
from mlxcel_compat.runtime import kv_blocks, kv_precision

log = logging.getLogger(__name__)

MIN_ROOM = 4  # llama-server keeps at most n_ctx - 4 tokens


@dataclass(frozen=True)
class ShiftPlan:
    """How many leading tokens a shift keeps, and how many after them it drops."""

    n_keep: int
    n_discard: int


def plan_shift(n_tokens: int, n_ctx: int, n_prompt: int, n_keep: int, n_discard: int, add_bos: bool) -> ShiftPlan:
    """llama-server's arithmetic (``server-context.cpp``, ``pre_decode``) for a cache of
    ``n_tokens`` tokens: ``n_keep`` -1 keeps the prompt; the BOS token is kept on top; the rest
    (``n_left``) loses ``n_discard`` tokens, by default half of it, at least none and always
    fewer than all of it."""
    keep = n_prompt if n_keep < 0 else n_keep
    if add_bos:
        keep += 1
    keep = max(0, min(n_ctx - MIN_ROOM, keep))
    n_left = n_tokens - keep
    discard = n_discard if n_discard else n_left // 2
    discard = max(0, min(discard, max(0, n_left - 1)))
    return ShiftPlan(keep, discard)


def _sign_flip(rope: Any, head_dim: int) -> mx.array:
    """The vector that negates the second component of every rotated pair: rotating ``x * s``
    forward by d then multiplying by ``s`` again rotates ``x`` backward by d."""
    dims = int(rope.dims)
    if rope.traditional:  # pairs are (2i, 2i + 1)
        signs = [1.0, -1.0] * (dims // 2)
    else:  # pairs are (i, i + dims / 2)
        signs = [1.0] * (dims // 2) + [-1.0] * (dims // 2)
    return mx.array(signs + [1.0] * (head_dim - dims), dtype=mx.float32)


class KeyRotation:
    """Each layer's RoPE, applied to stored keys to move them by a number of positions.

    ``mx.fast.rope`` rotates row ``j`` by ``offset + j`` and takes no negative offset, so the keys
    are laid out one position a row (every key then turns by the same amount) and turned backward
    through the sign flip of :func:`_sign_flip`."""

    def __init__(self, ropes: list[Any], add_bos: bool = False, blocks: str | None = None) -> None:
        self.ropes = ropes
        self.add_bos = add_bos  # the tokenizer adds a BOS token: a shift keeps it on top of n_keep
        self.blocks = blocks  # -ctk q8_0/q4_0: keys stored as ggml's blocks (runtime/kv_blocks.py)

    def __call__(self, layer: int, keys: Any, delta: int) -> Any:
        if keys.shape[2] == 0 or delta == 0:
            return keys
        if self.blocks and keys.dtype == mx.uint8:  # as llama.cpp's K shift: dequantize, rotate, quantize
            return kv_blocks.quantize(self(layer, kv_blocks.dequantize(keys, self.blocks), delta), self.blocks)
        rope = self.ropes[layer]
        b, h, n, d = keys.shape
        rows = keys.reshape(b, h * n, 1, d)
        if delta > 0:
            turned = rope(rows, offset=delta)
        else:
            flip = _sign_flip(rope, d).astype(keys.dtype)
            turned = rope(rows * flip, offset=-delta) * flip
        return turned.reshape(b, h, n, d).astype(keys.dtype)


def _rope_of(layer: Any) -> Any:
    """The layer's rotary embedding module (mlx-lm names it ``rope`` in its attention)."""
    for name, module in layer.named_modules():
        if name == "rope" or name.endswith(".rope"):
            return module
    return None


def _undoes_exactly(rotation: KeyRotation, layer: int, head_dim: int) -> bool:
    """A key rotated to position 9 and shifted back by 4 equals the key rotated to position 5."""
    rope = rotation.ropes[layer]
    probe = mx.random.normal((1, 1, 3, head_dim), key=mx.random.key(0))
    shifted = rotation(layer, rope(probe, offset=9), -4)
    return bool(mx.allclose(shifted, rope(probe, offset=5), atol=1e-4).item())


def key_rotation(model: Any, cache: list[Any], add_bos: bool) -> tuple[KeyRotation | None, str]:
    """The model's key rotation, or None and why its cache cannot shift."""
    if not kv.can_shift(cache):
        kinds = ", ".join(sorted({type(layer).__name__ for layer in cache if type(layer) is not kv.KVCache}))
        return None, f"its cache has layers that cannot drop tokens from the middle ({kinds})"
    layers = list(getattr(model, "layers", []))
    if len(layers) != len(cache):
        return None, "its layers do not match its cache"
    ropes = [_rope_of(layer) for layer in layers]
    if any(r is None or not hasattr(r, "dims") or not hasattr(r, "traditional") for r in ropes):
        return None, "a layer has no rotary embedding this server can re-apply"
    rotation = KeyRotation(ropes, add_bos, kv_precision.of_model(model).blocks[0])  # the keys' block type
    head_dim = _head_dim(model, layers[0])
    checked: dict[int, bool] = {}
    for i, rope in enumerate(ropes):
        if id(rope) not in checked:
            checked[id(rope)] = head_dim is not None and head_dim >= int(rope.dims) and _undoes_exactly(rotation, i, head_dim)
        if not checked[id(rope)]:
            return None, "its rotary embedding is not a pure rotation (a scaled RoPE such as YaRN)"
    return rotation, ""


def rotation_for(loaded: Any) -> KeyRotation | None:
    """A loaded model's key rotation for ``--context-shift``, or None (the reason in the log):
    multimodal models (an image's tokens cannot be cut apart, as in llama-server), models whose
    cache cannot shift, RoPEs the rotation cannot undo."""
    from mlx_lm.models.cache import make_prompt_cache

    if loaded.vision is not None:
        log.warning("context shift is not supported by multimodal models; it is disabled")
        return None
    tokenizer = loaded.tokenizer
    adds_bos = tokenizer.bos_token_id is not None and tokenizer.encode("a")[:1] == [tokenizer.bos_token_id]
    rotation, reason = key_rotation(loaded.model, make_prompt_cache(loaded.model), adds_bos)
    if rotation is None:
        log.warning("context shift is not supported by this model (%s); it is disabled", reason)
    return rotation


def _head_dim(model: Any, layer: Any) -> int | None:
    attention = getattr(layer, "self_attn", None)
    for owner in (attention, getattr(model, "args", None)):
        value = getattr(owner, "head_dim", None) if owner is not None else None
        if isinstance(value, int):
            return value
    rope = _rope_of(layer)
    return int(rope.dims) if rope is not None else None


def shift_cache(cache: list[Any], rotation: KeyRotation, plan: ShiftPlan) -> None:
    """Apply ``plan`` to a sequence's own cache (``cache/kv.py: shift``)."""
    kv.shift(cache, plan.n_keep, plan.n_discard, rotation)
