"""llama-server's ``/infill`` prompt: the fill-in-the-middle layout, token for token.

llama-server (``server-context.cpp: post_infill``, ``server-common.cpp: format_prompt_infill``)
builds the prompt from the request's ``input_prefix``, ``input_suffix``, ``input_extra`` and
``prompt`` and then runs it as an ordinary completion. Its layout, with the repo-level pattern of
Qwen2.5-Coder (arXiv 2409.12186) when the vocabulary has the repo and file-separator tokens::

    [FIM_REP]myproject\\n
    [FIM_SEP]{filename}\\n{text}          one per input_extra chunk ("tmp" without a filename)
    [FIM_SEP]filename\\n
    [BOS][FIM_PRE]{prefix}{prompt}[FIM_SUF]{suffix}[FIM_MID]

Without a file separator each chunk is preceded by ``\\n\\n--- snippet ---\\n\\n`` instead, and
without a repo token the ``myproject`` line is left out. ``--spm-infill`` swaps the two halves
(``[FIM_SUF]suffix`` first, then ``[FIM_PRE]prefix prompt``). The BOS comes only when the model
adds one, and it follows the extra context.

The budget is llama-server's, set by the server options, not the request's:

- the prefix keeps its last ``3 * (n_batch / 4)`` tokens;
- the suffix keeps its first ``n_batch / 4 - 2 - len(prompt)`` tokens (at least 0);
- the extra context keeps its last ``n_ctx - n_batch - 2 * n_predict`` tokens (at least 0), with
  ``n_predict`` the server's ``-n`` (``-1`` by default: two more tokens), and ``n_ctx`` a slot's.

The prefix, suffix, extra texts and file names are tokenized with special-token parsing off (the
text ``<|fim_prefix|>`` in a source file is not the control token), the ``prompt`` with it on; no
BOS is added to any piece. ``input_prefix`` and ``input_suffix`` may also be mixed arrays of text
and token ids, as llama-server's ``tokenize_mixed`` reads them.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Mapping

from mlxcel_compat.engine.textstream import derived
from mlxcel_compat.tokenizer.served import unwrap_tokenizer
from mlxcel_compat.tokenizer.fim import FimTokens
from mlxcel_compat.server.errors import InvalidRequest

# The separator llama-server puts before each extra chunk when there is no file-separator token.
SNIPPET_SEPARATOR = "\n\n--- snippet ---\n\n"
REPO_NAME = "myproject\n"  # llama-server's fixed project line
CURRENT_FILE = "filename\n"  # and the name of the file being edited
DEFAULT_FILENAME = "tmp"

Tokenize = Callable[[str], list[int]]


@dataclass(frozen=True)
class ExtraChunk:
    """One ``input_extra`` element: another file's text, the context an editor sends along."""

    text: str
    filename: str = DEFAULT_FILENAME


@dataclass(frozen=True)
class InfillInput:
    prefix: str | list[Any]
    suffix: str | list[Any]
    extra: list[ExtraChunk]
    prompt: str


@dataclass(frozen=True)
class InfillBudget:
    """The server options the layout depends on."""

    n_batch: int  # -b / --batch-size
    n_predict: int  # -n (the server's default, not the request's n_predict)
    n_ctx: int  # a slot's context
    spm: bool  # --spm-infill
    bos_id: int | None  # set when the model adds a BOS


def parse_infill(data: Mapping[str, Any]) -> InfillInput:
    """The infill fields, checked as llama-server checks them (same messages).

    Where llama-server answers 500 (a missing ``input_prefix`` or ``input_suffix`` throws past its
    check; so does a prefix that is neither text nor an array), the answer here is a 400 with the
    message it had prepared. A ``prompt`` that is not a string is ignored there, and here.
    """
    for name in ("input_prefix", "input_suffix"):
        if name not in data:
            raise InvalidRequest(f"\"{name}\" is required")
        _check_mixed(name, data[name])
    extra = data.get("input_extra", [])
    if "input_extra" in data and not isinstance(extra, list):
        raise InvalidRequest("\"input_extra\" must be an array of {\"filename\": string, \"text\": string}")
    chunks = []
    for chunk in extra:
        if not isinstance(chunk, dict) or not isinstance(chunk.get("text"), str):
            raise InvalidRequest("extra_context chunk must contain a \"text\" field with a string value")
        if "filename" in chunk and not isinstance(chunk["filename"], str):
            raise InvalidRequest("extra_context chunk's \"filename\" field must be a string")
        chunks.append(ExtraChunk(chunk["text"], chunk.get("filename", DEFAULT_FILENAME)))
    prompt = data.get("prompt")
    return InfillInput(data["input_prefix"], data["input_suffix"], chunks, prompt if isinstance(prompt, str) else "")


def _check_mixed(name: str, value: Any) -> None:
    if isinstance(value, str):
        return
    if isinstance(value, list) and all(isinstance(p, str) or (isinstance(p, int) and not isinstance(p, bool)) for p in value):
        return
    raise InvalidRequest(f"\"{name}\" must be a string or an array of strings and token ids")


def tokenize_mixed(value: str | list[Any], tokenize: Tokenize) -> list[int]:
    """Text, or text and token ids mixed, to tokens (llama-server's ``tokenize_mixed``, no BOS)."""
    if isinstance(value, str):
        return tokenize(value)
    tokens: list[int] = []
    for piece in value:
        tokens.extend(tokenize(piece) if isinstance(piece, str) else [piece])
    return tokens


def infill_prompt(fim: FimTokens, inp: InfillInput, budget: InfillBudget, plain: Tokenize, special: Tokenize) -> list[int]:
    """The prompt tokens llama-server builds for this request.

    ``plain`` tokenizes without parsing special tokens, ``special`` with; neither adds a BOS.
    ``fim`` must have the prefix, suffix and middle tokens (``FimTokens.missing`` is empty).
    """
    assert fim.pre is not None and fim.suf is not None and fim.mid is not None
    extra: list[int] = []
    if fim.rep is not None:
        extra += [fim.rep, *plain(REPO_NAME)]
    for chunk in inp.extra:
        extra += [fim.sep, *plain(chunk.filename + "\n")] if fim.sep is not None else plain(SNIPPET_SEPARATOR)
        extra += plain(chunk.text)
    if fim.sep is not None:
        extra += [fim.sep, *plain(CURRENT_FILE)]

    prefix = tokenize_mixed(inp.prefix, plain)
    suffix = tokenize_mixed(inp.suffix, plain)
    prompt = special(inp.prompt) if inp.prompt else []
    quarter = budget.n_batch // 4
    n_prefix = min(len(prefix), 3 * quarter)
    n_suffix = min(len(suffix), max(0, quarter - (2 + len(prompt))))
    n_extra = min(max(0, budget.n_ctx - budget.n_batch - 2 * budget.n_predict), len(extra))

    head = [fim.pre, *prefix[len(prefix) - n_prefix:], *prompt]
    tail = [fim.suf, *suffix[:n_suffix]]
    first, second = (tail, head) if budget.spm else (head, tail)
    bos = [budget.bos_id] if budget.bos_id is not None else []
    return [*extra[len(extra) - n_extra:], *bos, *first, *second, fim.mid]


# ---------------------------------------------------------------------- tokenizing without specials


def plain_tokenizer(tokenizer: Any) -> Tokenize:
    """Tokenize text with special-token parsing off, as llama.cpp's ``parse_special = false``.

    llama.cpp then leaves control tokens to the ordinary tokenizer (``<|im_end|>`` in the text
    becomes ``<``, ``|``, ...), but still matches user-defined added tokens. A Hugging Face fast
    tokenizer does the same with ``encode_special_tokens`` set. That switch belongs to the
    tokenizer object every thread shares, and a copy with it set costs a second tokenizer (~95
    MiB for Gemma 3's 262K entries and 515K merges). So the shared tokenizer encodes first: the
    switch only changes where a special token was matched, and where none of the ids it gives is
    a special token's, that is the answer. Only a text that spells a special token takes the copy,
    built then and kept per tokenizer.
    """
    hf = unwrap_tokenizer(tokenizer)
    specials = derived(tokenizer, "special token ids", _special_ids)

    def encode(text: str) -> list[int]:
        if not text:
            return []
        ids = hf.backend_tokenizer.encode_batch([text], add_special_tokens=False)[0].ids
        if specials.isdisjoint(ids):
            return ids
        backend = derived(tokenizer, "plain-text tokenizer", _plain_backend)
        return backend.encode(text, add_special_tokens=False).ids

    return encode


def _special_ids(hf: Any) -> frozenset[int]:
    """The ids of the added tokens marked special (the ones special-token parsing matches)."""
    return frozenset(i for i, t in hf.backend_tokenizer.get_added_tokens_decoder().items() if t.special)


def _plain_backend(hf: Any) -> Any:
    from tokenizers import Tokenizer

    copy = Tokenizer.from_str(hf.backend_tokenizer.to_str())
    copy.encode_special_tokens = True
    return copy
