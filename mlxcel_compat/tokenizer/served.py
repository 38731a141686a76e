"""The served model's tokenizer: a ``tokenizers.Tokenizer`` and the few facts around it.

The Rust ``tokenizers`` library does the real work (encode, decode, added tokens). Wrapping it
in transformers' ``PreTrainedTokenizerFast`` and mlx-lm's ``TokenizerWrapper`` cost the serving
process ~55 MiB and, where torch is installed, ~2 s of CPU at every start (importing
transformers imports torch), for a handful of attributes. :class:`ServedTokenizer` holds exactly
those, under the Hugging Face names the rest of the code (and its tests, which pass real HF
tokenizers) already uses: ``encode``, ``decode``, ``len()``, ``get_vocab``,
``convert_ids_to_tokens``, ``convert_tokens_to_ids``, ``backend_tokenizer``,
``added_tokens_decoder``, ``all_special_ids``, ``special_tokens_map``, ``bos_token``/``eos_token``
and their ids, ``chat_template``, a pair ``__call__`` (cross-encoders) and mlx-lm's
``eos_token_ids``.

:func:`from_files` reads a Hugging Face tokenizer directory the way transformers' fast
tokenizer loads it (``tokenizer.json``, ``tokenizer_config.json``, ``special_tokens_map.json``,
the chat template files), including what its constructor changes in the Rust object: special
tokens named in the config but missing from the vocabulary are added, and an explicit
``add_bos_token`` / ``add_eos_token`` (or no post-processor at all) rebuilds the post-processor
with transformers' template; truncation and padding are off, as transformers' ``encode`` turns
them off. ``tests/tokenizer/test_served.py`` compares every result with transformers' tokenizer
loaded from the same files.

Reading the files is exact where transformers takes ``tokenizer.json`` as it is
(``PreTrainedTokenizerFast``, ``TokenizersBackend``), not where a model-specific class rebuilds
it, so ``tokenizer/cache.py: load_directory`` serves what transformers built, once, in a child
process, and cached; GGUF vocabularies go the same way (``gguf/tokenizer.py``).
"""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterable, Mapping

from tokenizers import AddedToken, Tokenizer, processors

from mlxcel_compat.tokenizer.json_load import read_tokenizer

log = logging.getLogger(__name__)

# transformers' named special tokens (``SPECIAL_TOKENS_ATTRIBUTES``), in its order.
NAMED_SPECIALS = ("bos_token", "eos_token", "unk_token", "sep_token", "pad_token", "cls_token", "mask_token")
# Tokenizer classes whose ``model_input_names`` lack ``token_type_ids`` (RoBERTa-style pairs).
_NO_TYPE_IDS = ("RobertaTokenizer", "XLMRobertaTokenizer", "CamembertTokenizer")
# transformers' ``clean_up_tokenization``: spaces dropped before punctuation and contractions.
_CLEAN_UP = ((" .", "."), (" ?", "?"), (" !", "!"), (" ,", ","), (" ' ", "'"), (" n't", "n't"),
             (" 'm", "'m"), (" 's", "'s"), (" 've", "'ve"), (" 're", "'re"))


@dataclass
class TokenizerSpec:
    """What the tokenizer's configuration files say besides the Rust object."""

    named: dict[str, str] = field(default_factory=dict)  # "bos_token" -> "<s>", ...: the named special tokens
    extra: list[str] = field(default_factory=list)  # additional (extra) special tokens, in the config's order
    chat_template: str | dict[str, str] | None = None  # the default template, or name -> template
    clean_up_spaces: bool = False  # transformers' clean_up_tokenization_spaces (never for BPE)
    type_ids: bool = True  # pair encodings report token_type_ids (not for RoBERTa-style tokenizers)


class ServedTokenizer:
    """A ``tokenizers.Tokenizer`` with the Hugging Face and mlx-lm attributes this server reads.

    Immutable after construction except ``eos_token_ids`` (mlx-lm's setter, used when FIM end
    tokens are added at load); safe to share between the worker threads and the engine thread,
    as the Rust object is.
    """

    def __init__(self, backend: Tokenizer, spec: TokenizerSpec, eos_token_ids: Iterable[int] = ()) -> None:
        self.backend_tokenizer = backend
        self.spec = spec
        self.chat_template = spec.chat_template
        self._eos_token_ids = {int(t) for t in eos_token_ids}
        if self.eos_token_id is not None:  # as mlx-lm's wrapper: the tokenizer's own EOS always ends
            self._eos_token_ids.add(self.eos_token_id)

    # --- mlx-lm's TokenizerWrapper ---------------------------------------------------------------

    @property
    def eos_token_ids(self) -> set[int]:
        return self._eos_token_ids

    @eos_token_ids.setter
    def eos_token_ids(self, value: Iterable[int] | None) -> None:
        self._eos_token_ids = {int(t) for t in value} if value is not None else set()

    # --- encode and decode -----------------------------------------------------------------------

    # The batch calls, with one item: the Rust library releases the GIL only in its batch methods,
    # and a half-megabyte prompt takes a third of a second to tokenize. Through ``encode`` the event
    # loop (``/health``, streams) would stand still that long; a batch of one costs ~1 us more.

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return self.backend_tokenizer.encode_batch([text], add_special_tokens=add_special_tokens)[0].ids

    def decode(self, token_ids: int | Iterable[int], skip_special_tokens: bool = False) -> str:
        ids = [int(token_ids)] if isinstance(token_ids, int) else [int(t) for t in token_ids]
        text = self.backend_tokenizer.decode_batch([ids], skip_special_tokens=skip_special_tokens)[0]
        if self.spec.clean_up_spaces and type(self.backend_tokenizer.model).__name__ != "BPE":
            for old, new in _CLEAN_UP:
                text = text.replace(old, new)
        return text

    def __call__(self, text: str, text_pair: str | None = None) -> dict[str, list[int]]:
        """A text or a pair with the special tokens added, as transformers' ``tokenizer(a, b)``."""
        pair = text if text_pair is None else (text, text_pair)
        encoding = self.backend_tokenizer.encode_batch([pair], add_special_tokens=True)[0]
        out = {"input_ids": encoding.ids, "attention_mask": encoding.attention_mask}
        if self.spec.type_ids:
            out["token_type_ids"] = encoding.type_ids
        return out

    # --- vocabulary ------------------------------------------------------------------------------

    def __len__(self) -> int:
        return self.backend_tokenizer.get_vocab_size(with_added_tokens=True)

    @property
    def vocab_size(self) -> int:
        """The base vocabulary without added tokens (transformers' ``vocab_size``)."""
        return self.backend_tokenizer.get_vocab_size(with_added_tokens=False)

    def get_vocab(self) -> dict[str, int]:
        return self.backend_tokenizer.get_vocab(with_added_tokens=True)

    def convert_ids_to_tokens(self, ids: int | Iterable[int]) -> Any:
        if isinstance(ids, int):
            return self.backend_tokenizer.id_to_token(ids)
        return [self.backend_tokenizer.id_to_token(int(i)) for i in ids]

    def convert_tokens_to_ids(self, tokens: str | Iterable[str]) -> Any:
        if isinstance(tokens, str):
            return self._token_id(tokens)
        return [self._token_id(t) for t in tokens]

    def _token_id(self, token: str) -> int | None:
        found = self.backend_tokenizer.token_to_id(token)
        return found if found is not None else self.unk_token_id

    @property
    def added_tokens_decoder(self) -> dict[int, AddedToken]:
        """A new dict from the Rust object at each call (it is read once per tokenizer, by the
        stream's byte table and the infill rules): kept, Gemma 3's 6,384 added tokens held 1.4 MiB
        of Python objects for as long as the server ran."""
        return self.backend_tokenizer.get_added_tokens_decoder()

    # --- special tokens --------------------------------------------------------------------------

    @property
    def special_tokens_map(self) -> dict[str, str]:
        """The named special tokens (transformers 5: extra ones are not in this map)."""
        return {name: self.spec.named[name] for name in NAMED_SPECIALS if self.spec.named.get(name) is not None}

    @property
    def all_special_tokens(self) -> list[str]:
        return list(dict.fromkeys([*self.special_tokens_map.values(), *self.spec.extra]))

    @property
    def all_special_ids(self) -> list[int]:
        return [i for i in self.convert_tokens_to_ids(self.all_special_tokens) if i is not None]

    def _named(self, name: str) -> str | None:
        return self.spec.named.get(name)

    def _named_id(self, name: str) -> int | None:
        token = self._named(name)
        return self.backend_tokenizer.token_to_id(token) if token is not None else None

    bos_token = property(lambda self: self._named("bos_token"))
    eos_token = property(lambda self: self._named("eos_token"))
    unk_token = property(lambda self: self._named("unk_token"))
    pad_token = property(lambda self: self._named("pad_token"))
    bos_token_id = property(lambda self: self._named_id("bos_token"))
    eos_token_id = property(lambda self: self._named_id("eos_token"))
    unk_token_id = property(lambda self: self._named_id("unk_token"))
    pad_token_id = property(lambda self: self._named_id("pad_token"))


# --- loading a directory ---------------------------------------------------------------------------


def _read_json(path: Path) -> dict[str, Any]:
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        return {}
    return data if isinstance(data, dict) else {}


def _token_text(value: Any) -> str | None:
    """A special token as the config files write it: a string or an AddedToken dict."""
    if isinstance(value, Mapping):
        value = value.get("content")
    return value if isinstance(value, str) else None


def _specials(config: dict[str, Any], specials_map: dict[str, Any]) -> tuple[dict[str, str], list[str]]:
    """The named and extra special tokens; ``tokenizer_config.json`` wins over ``special_tokens_map.json``."""
    named: dict[str, str] = {}
    for name in NAMED_SPECIALS:
        text = _token_text(config.get(name, specials_map.get(name)))
        if text is not None:
            named[name] = text
    extra_raw: Any = None
    for source in (config, specials_map):
        for key in ("extra_special_tokens", "additional_special_tokens"):
            if extra_raw is None and source.get(key):
                extra_raw = source[key]
    if isinstance(extra_raw, Mapping):  # transformers 5's model-specific named extras
        extra_raw = list(extra_raw.values())
    extra = [t for t in (_token_text(v) for v in extra_raw or []) if t is not None]
    return named, extra


def _chat_template(directory: Path, config: dict[str, Any]) -> str | dict[str, str] | None:
    """The template files as transformers 5 reads them: ``chat_template.jinja`` and
    ``additional_chat_templates/*.jinja`` over ``tokenizer_config.json``'s (or the legacy
    ``chat_template.json``'s) ``chat_template``; one template is a string, several a dict."""
    raw = config.get("chat_template")
    if raw is None:
        raw = _read_json(directory / "chat_template.json").get("chat_template")
    templates: dict[str, str] = {}
    if isinstance(raw, str):
        templates["default"] = raw
    elif isinstance(raw, list):
        templates.update({str(t["name"]): t["template"] for t in raw if isinstance(t, Mapping) and "name" in t})
    elif isinstance(raw, Mapping):
        templates.update({str(k): v for k, v in raw.items() if isinstance(v, str)})
    default = directory / "chat_template.jinja"
    if default.is_file():
        templates["default"] = default.read_text(encoding="utf-8")
    extra_dir = directory / "additional_chat_templates"
    if extra_dir.is_dir():
        for file in sorted(extra_dir.glob("*.jinja")):
            templates[file.stem] = file.read_text(encoding="utf-8")
    if not templates:
        return None
    if set(templates) == {"default"}:
        return templates["default"]
    return templates


def _add_missing_specials(backend: Tokenizer, config: dict[str, Any], named: dict[str, str], extra: list[str]) -> None:
    """Add what transformers' constructor adds: the config's ``added_tokens_decoder`` entries
    and the special tokens it names that the vocabulary lacks (as special tokens)."""
    present = {t.content for t in backend.get_added_tokens_decoder().values()}
    to_add: list[AddedToken] = []
    declared = config.get("added_tokens_decoder") or {}
    for _, entry in sorted(declared.items(), key=lambda kv: int(kv[0])):
        if isinstance(entry, Mapping) and entry.get("content") not in present:
            to_add.append(AddedToken(entry["content"], single_word=bool(entry.get("single_word", False)),
                                     lstrip=bool(entry.get("lstrip", False)), rstrip=bool(entry.get("rstrip", False)),
                                     normalized=bool(entry.get("normalized", True)),
                                     special=bool(entry.get("special", False))))
            present.add(entry["content"])
    for text in [*named.values(), *extra]:
        if text not in present:  # transformers checks the added tokens only, not the vocabulary
            to_add.append(AddedToken(text, special=True))
            present.add(text)
    if to_add:
        backend.add_tokens(to_add)


def _set_post_processor(backend: Tokenizer, config: dict[str, Any], named: dict[str, str]) -> None:
    """transformers' ``update_post_processor``: when the config states ``add_bos_token`` or
    ``add_eos_token`` (or the tokenizer has no post-processor), BOS/EOS come from this template."""
    if "add_bos_token" not in config and "add_eos_token" not in config and backend.post_processor is not None:
        return
    bos, eos = named.get("bos_token"), named.get("eos_token")
    add_bos = bool(config.get("add_bos_token", False)) and bos is not None
    add_eos = bool(config.get("add_eos_token", False)) and eos is not None
    single = f"{f'{bos}:0 ' if add_bos else ''}$A:0{f' {eos}:0' if add_eos else ''}"
    pair = f"{single}{f' {bos}:1' if add_bos else ''} $B:1{f' {eos}:1' if add_eos else ''}"
    specials = ([(bos, backend.token_to_id(bos))] if add_bos else []) + ([(eos, backend.token_to_id(eos))] if add_eos else [])
    backend.post_processor = processors.TemplateProcessing(single=single, pair=pair, special_tokens=specials)


def from_files(directory: str | Path, eos_token_ids: Iterable[int] = ()) -> ServedTokenizer:
    """The tokenizer of a directory holding ``tokenizer.json`` (and its config files)."""
    directory = Path(directory)
    backend = read_tokenizer(directory / "tokenizer.json")
    config = _read_json(directory / "tokenizer_config.json")
    named, extra = _specials(config, _read_json(directory / "special_tokens_map.json"))
    _add_missing_specials(backend, config, named, extra)
    # transformers' encode and pair call neither truncate nor pad unless asked (it switches both off).
    backend.no_truncation()
    backend.no_padding()
    backend.encode_special_tokens = bool(config.get("split_special_tokens", False))
    _set_post_processor(backend, config, named)
    tokenizer_class = str(config.get("tokenizer_class") or "")
    names = config.get("model_input_names")
    type_ids = ("token_type_ids" in names if isinstance(names, list)
                else not tokenizer_class.removesuffix("Fast").endswith(_NO_TYPE_IDS))
    spec = TokenizerSpec(named=named, extra=extra, chat_template=_chat_template(directory, config),
                         clean_up_spaces=bool(config.get("clean_up_tokenization_spaces", False)), type_ids=type_ids)
    return ServedTokenizer(backend, spec, eos_token_ids)


def config_eos_ids(value: Any) -> list[int]:
    """``eos_token_id`` of a config.json: an int, a list of ints, or absent."""
    if isinstance(value, bool):
        return []
    if isinstance(value, int):
        return [value]
    if isinstance(value, list):
        return [int(v) for v in value if isinstance(v, int) and not isinstance(v, bool)]
    return []


def unwrap_tokenizer(tokenizer: Any, attribute: str = "convert_ids_to_tokens") -> Any:
    """The Hugging Face tokenizer inside an mlx-lm ``TokenizerWrapper``, else the tokenizer itself
    (the served :class:`ServedTokenizer`, an HF tokenizer in tests).

    HF fast tokenizers also have a ``_tokenizer`` (the Rust one), so the inner object is only
    taken when it has ``attribute``, the one the caller reads: the vocabulary's
    ``convert_ids_to_tokens`` by default, ``chat_template`` for the chat template.
    """
    inner = getattr(tokenizer, "_tokenizer", None)
    return inner if inner is not None and hasattr(inner, attribute) else tokenizer
