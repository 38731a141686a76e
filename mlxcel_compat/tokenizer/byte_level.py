"""Byte-level BPE pieces back to bytes: GPT-2's bytes-to-unicode table, inverted.

A byte-level BPE vocabulary (GPT-2, Llama 3, Qwen) spells every byte as one printable character,
so a token's text is not its bytes. The streaming detokenizer (``engine/textstream.py``) reads a
token's raw bytes through this table, and the model factory (``testing/tokenizer.py``) checks
that the pieces it grows are whole UTF-8 text; both sit above this room, so the table lives here.
"""

from __future__ import annotations


def _gpt2_byte_decoder() -> dict[str, int]:
    """Inverse of GPT-2's bytes-to-unicode table used by byte-level BPE vocabularies."""
    printable = (
        list(range(ord("!"), ord("~") + 1))
        + list(range(ord("\u00a1"), ord("\u00ac") + 1))
        + list(range(ord("\u00ae"), ord("\u00ff") + 1))
    )
    mapping: dict[str, int] = {chr(b): b for b in printable}
    extra = 0
    for b in range(256):
        if b not in printable:
            mapping[chr(256 + extra)] = b
            extra += 1
    return mapping


_BYTE_DECODER = _gpt2_byte_decoder()


def byte_level_bytes(piece: str) -> bytes:
    """The bytes a byte-level BPE piece stands for (``"Ġhi"`` -> ``b" hi"``)."""
    out = bytearray()
    for ch in piece:
        b = _BYTE_DECODER.get(ch)
        if b is None:
            out.extend(ch.encode("utf-8"))
        else:
            out.append(b)
    return bytes(out)
