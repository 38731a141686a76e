"""A SentencePiece-style tokenizer (Llama 2 / Mistral v0.1 shape) trained on the factory corpus.

Tests of SentencePiece vocabularies (the GGUF tokenizer's ``llama`` model, byte fallback, the
space prefix) need one without downloading one: :func:`write_spm_tokenizer_dir` writes it as a
Hugging Face directory, ``gguf_writer.write_spm_tokenizer_gguf`` as a tokenizer-only GGUF.
"""

from __future__ import annotations

import json
from pathlib import Path

from .corpus import generate_corpus

# A SentencePiece-style vocabulary (Llama 2 / Mistral v0.1 shape): "▁" marks a word start, byte
# fallback tokens <0x00>..<0xFF> cover what the pieces do not, and <unk> <s> </s> come first.
SPM_VOCAB_SIZE = 1024
SPM_SPECIALS = ("<unk>", "<s>", "</s>")
SPM_BYTES = tuple(f"<0x{b:02X}>" for b in range(256))
SPM_CHAT_TEMPLATE = (
    "{{ bos_token }}{% for message in messages %}"
    "{% if message['role'] == 'user' %}{{ '[INST] ' + message['content'] + ' [/INST]' }}"
    "{% elif message['role'] == 'system' %}{{ '<<SYS>>\\n' + message['content'] + '\\n<</SYS>>\\n\\n' }}"
    "{% else %}{{ ' ' + message['content'] + eos_token }}{% endif %}{% endfor %}"
)


def spm_tokenizer_json(vocab_size: int = SPM_VOCAB_SIZE) -> str:
    """A small SentencePiece-style BPE ``tokenizer.json`` in the legacy Llama 2 layout.

    Trained with the ``tokenizers`` library on the factory corpus (split at word starts, as
    SentencePiece's BPE is), then rebuilt the way Llama 2's file is written: the pieces and byte
    tokens in the model's vocabulary, only ``<unk>``, ``<s>`` and ``</s>`` as added special tokens,
    a normalizer that prefixes a space and spells spaces "▁", byte fallback, and ``<s>`` prepended.
    """
    from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers, processors
    from tokenizers import trainers

    space = "\u2581"
    trainer_tokenizer = Tokenizer(models.BPE(unk_token="<unk>", byte_fallback=True))
    trainer_tokenizer.normalizer = normalizers.Sequence([normalizers.Prepend(space), normalizers.Replace(" ", space)])
    trainer_tokenizer.pre_tokenizer = pre_tokenizers.Split(Regex(f"{space}[^{space}]*"), behavior="isolated")
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=[*SPM_SPECIALS, *SPM_BYTES],
                                  min_frequency=2, show_progress=False, max_token_length=12)
    trainer_tokenizer.train_from_iterator(generate_corpus().split("\n"), trainer=trainer)
    model = json.loads(trainer_tokenizer.to_str())["model"]
    if len(model["vocab"]) != vocab_size:
        raise RuntimeError(f"the corpus only yields {len(model['vocab'])} SentencePiece tokens")
    merges = [tuple(m) if isinstance(m, list) else tuple(m.split(" ")) for m in model["merges"]]
    tokenizer = Tokenizer(models.BPE(vocab=model["vocab"], merges=merges, unk_token="<unk>",
                                     byte_fallback=True, fuse_unk=True))
    tokenizer.normalizer = normalizers.Sequence([normalizers.Prepend(space), normalizers.Replace(" ", space)])
    tokenizer.decoder = decoders.Sequence([decoders.Replace(space, " "), decoders.ByteFallback(), decoders.Fuse(),
                                           decoders.Strip(" ", 1, 0)])
    tokenizer.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in SPM_SPECIALS])
    tokenizer.post_processor = processors.TemplateProcessing(
        single="<s> $A", pair="<s> $A <s>:1 $B:1", special_tokens=[("<s>", 1)])
    return tokenizer.to_str(pretty=True) + "\n"


def write_spm_tokenizer_dir(directory: str | Path) -> Path:
    """A Hugging Face tokenizer directory holding ``spm_tokenizer_json`` (add BOS, Llama 2 chat template)."""
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    (directory / "tokenizer.json").write_text(spm_tokenizer_json(), encoding="utf-8")
    config = {
        "add_bos_token": True, "add_eos_token": False, "bos_token": "<s>", "eos_token": "</s>",
        "unk_token": "<unk>", "chat_template": SPM_CHAT_TEMPLATE, "clean_up_tokenization_spaces": False,
        "legacy": True, "model_max_length": 4096, "tokenizer_class": "PreTrainedTokenizerFast",
    }
    (directory / "tokenizer_config.json").write_text(json.dumps(config, indent=2) + "\n", encoding="utf-8")
    specials = {"bos_token": "<s>", "eos_token": "</s>", "unk_token": "<unk>"}
    (directory / "special_tokens_map.json").write_text(json.dumps(specials, indent=2) + "\n", encoding="utf-8")
    return directory
