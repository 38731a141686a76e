"""Find and load the served model: a Hugging Face directory, a GGUF file, or a hub repository.

Resolution happens before MLX is touched so that a missing model fails fast with a message a user
can act on (the hub is often unreachable on servers):

- ``-m DIR``: a model directory (config.json + safetensors): weights by mlx-lm's ``load_model``,
  the tokenizer by ``tokenizer/served.py``;
- ``-m FILE.gguf`` (or the first part of a split model): loaded by ``gguf/load.py``;
- ``-m user/repo`` or ``-hf user/repo[:quant]`` (``-hff``, ``-hft``, ``$LLAMA_CACHE``): fetched by
  ``model/hub.py``, which picks a GGUF file as llama-server does or the whole directory of an
  MLX repository.

On the CPU backend the weights end up in float32, because float16 and bfloat16 matmuls (and
quantized ones) are ~40x slower there, except quantized weights: a GGUF's stay in the file's
blocks and an MLX quantized directory's affine weights are repacked into the same blocks
(``mlx_affine.py``), both multiplied by ggml's kernels.
"""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Sequence

from mlxcel_compat.model import hub
from mlxcel_compat.tokenizer.fim import FimTokens, model_fim_tokens
from mlxcel_compat.gguf.reader import is_gguf_path
from mlxcel_compat.model.load_options import LoadOptions
from mlxcel_compat.runtime import kv_precision

log = logging.getLogger(__name__)


class ModelNotFoundError(RuntimeError):
    """The model could not be found locally nor fetched; the message says what to do."""


@dataclass
class LoadedModel:
    """Everything the engine and the HTTP layer need to know about the served model."""

    model: Any  # mlx.nn.Module; owned by the engine thread
    tokenizer: Any  # model.tokenizer.ServedTokenizer (no MLX; safe to use from handlers)
    config: dict[str, Any]
    path: Path
    model_id: str  # the display id: first alias, else the directory name
    aliases: list[str] = field(default_factory=list)
    n_params: int = 0
    size_bytes: int = 0
    gguf: Any = None  # model.gguf_load.GGUFSummary for a GGUF file, else None
    fingerprint: str = ""  # model_fingerprint(...): what saved prompt-cache state must match
    decoder: Any = None  # model.cpu_decode.CpuDecoder: decode steps outside MLX (single or batched), or None
    n_adapted: int = 0  # modules carrying a LoRA adapter (lora/layers.py), served unfused
    fim: FimTokens = field(default_factory=FimTokens)  # fill-in-the-middle tokens (/infill)
    kind: str = "decoder"  # "encoder": a BERT-family model (encoders/bert.py), served for embeddings and rerank only
    vision: Any = None  # model.vision.VisionFacts of a vision-language model (mlx-vlm), else None

    @property
    def file_type(self) -> str:
        """What /props reports as ``model_ftype``: llama.cpp's name for a GGUF, else the weight dtype."""
        return self.gguf.file_type if self.gguf is not None else "F32"


def resolve_model_path(model: str, offline: bool = False, hf_file: str | None = None, token: str | None = None,
                       cache_dir: str | Path | None = None) -> Path:
    """A local model directory or GGUF file for ``model`` (a path or a hub repo), downloading if allowed."""
    path = Path(model).expanduser()
    if path.is_dir():
        if not (path / "config.json").exists():
            raise ModelNotFoundError(f"'{model}' is a directory but has no config.json: not a Hugging Face model directory")
        return path
    if path.is_file():
        if not is_gguf_path(path):
            raise ModelNotFoundError(f"'{model}' is a file but not a .gguf model; pass a GGUF file or a model directory")
        return path
    if is_gguf_path(path) or model.startswith((".", "/", "~")) or model.split(":")[0].count("/") != 1:
        raise ModelNotFoundError(f"model '{model}' not found: no such file or directory, and it is not a hub "
                                 "repository of the form 'user/name[:quant]'")
    try:
        repo, tag = hub.parse_repo(model)
        request = hub.HubRequest(repo, tag, hf_file, token, offline, Path(cache_dir).expanduser() if cache_dir else None)
        return hub.fetch(request)
    except hub.HubError as exc:
        hint = "" if offline else " Check the name, the network and the token (-hft / HF_TOKEN)."
        raise ModelNotFoundError(f"model '{model}': {exc}.{hint}") from exc


def resolve_mmproj_path(model: str, offline: bool = False, hf_file: str | None = None, token: str | None = None,
                        cache_dir: str | Path | None = None) -> Path | None:
    """The hub repository's projector for ``model`` (``-hf``: downloaded, as llama-server's
    ``--mmproj-auto``), or None for a local model or a repository without one."""
    if Path(model).expanduser().exists():
        return None
    try:
        repo, tag = hub.parse_repo(model)
        request = hub.HubRequest(repo, tag, hf_file, token, offline, Path(cache_dir).expanduser() if cache_dir else None)
        return hub.fetch_mmproj(request)
    except hub.HubError as exc:
        raise ModelNotFoundError(f"the projector of '{model}': {exc}") from exc


def model_display_id(model_arg: str, aliases: list[str]) -> str:
    """llama-server picks the alphabetically first alias; else the directory or file name, or the hub id."""
    if aliases:
        return sorted(aliases)[0]
    path = Path(model_arg.rstrip("/")).expanduser()
    if path.exists():
        return path.name or model_arg
    return model_arg


def read_config(path: Path) -> dict[str, Any]:
    with open(path / "config.json", encoding="utf-8") as f:
        return json.load(f)


def _log_gguf(summary: Any) -> None:
    """llama.cpp-style start-up lines: the file, its architecture, tensor types, precision, time."""
    log.info("loaded GGUF %s (%d file%s): arch %s, file type %s, %d parameters, %.2f GiB",
             summary.path, summary.parts, "s" if summary.parts > 1 else "", summary.architecture,
             summary.file_type, summary.n_params, summary.file_bytes / 2**30)
    for name, count in summary.type_counts.items():
        log.info("- type %5s: %4d tensors", name, count)
    kept = ", ".join(f"{count} {label}" for label, count in sorted(summary.precision.items()))
    log.info("GGUF weights kept as: %s (compute dtype %s); loaded in %.2f s", kept, summary.compute_dtype,
             summary.load_seconds)
    for label, size in sorted(summary.weight_bytes.items()):
        kernel = summary.kernels.get(label, "MLX")
        repacked, prompts = summary.repacked.get(label), summary.prompt_products.get(label)
        grouped = summary.grouped.get(label)
        log.info("- %s: %d tensors, %.1f MiB, computed by %s%s%s%s", label, summary.precision.get(label, 0), size / 2**20,
                 kernel, f"; {repacked} repacked by ggml (its GEMV/GEMM)" if repacked else "",
                 f"; prompts of {prompts} by ggml's mul_mat" if prompts else "",
                 f"; {grouped} grouped at load (16 rows' super-blocks side by side: decode rows and prompt chunks "
                 "by mlxcel's AVX-512 VNNI lanes)" if grouped else "")
    log.info("weights take %.1f MiB (the file's tensors: %.1f MiB)", sum(summary.weight_bytes.values()) / 2**20,
             summary.file_bytes / 2**20)
    if summary.blocks_unavailable:
        log.warning("quantized weights expanded to float32 (4 bytes a weight): ggml's kernels are not available: %s",
                    summary.blocks_unavailable)
    if summary.expanded_experts:
        log.warning("MoE expert stacks expanded to %s for MLX's gather matmul (correct, not fast: ggml's kernels "
                    "do not serve them here): %s", summary.compute_dtype,
                    ", ".join(f"{n} {kind}" for kind, n in sorted(summary.expanded_experts.items())))


class _ProgressLog:
    """Logs loading progress every 10% (a large GGUF takes a while on a CPU)."""

    def __init__(self, name: str) -> None:
        self.name = name
        self.next_step = 10

    def __call__(self, done: int, total: int) -> None:
        percent = 100 * done // max(total, 1)
        if percent >= self.next_step:
            log.info("loading %s: %d%% (%.0f / %.0f MiB)", self.name, percent, done / 2**20, total / 2**20)
            self.next_step = (percent // 10 + 1) * 10


_SAMPLE = 1 << 20  # bytes read from each end of a weight file's data


def model_fingerprint(path: Path, gguf: Any = None, kept: dict[str, Any] | None = None) -> str:
    """A 64-hex identity of the weights, config and tokenizer, for state saved to disk.

    KV state is only valid for the exact weights that computed it, and token ids only for the
    tokenizer that produced them; a served alias says neither. Hashing whole weight files would
    cost seconds per GB at every start, so each weight file contributes its name, size and samples:
    a ``*.safetensors`` file its tensor table and the first and last MiB of its data (a fine-tune
    with the same shapes changes those bytes), with ``config.json``, ``tokenizer.json`` and
    ``tokenizer.model`` hashed whole; each part of a GGUF model its first 16 MiB (metadata with the
    vocabulary, tensor table, first tensors) and last MiB, plus how its weights are kept in memory
    (``gguf``: the load summary's precision and compute dtype), which changes the computed KV too;
    likewise ``kept`` for a quantized directory whose weights were repacked into ggml's blocks
    (``AffineLoad.fingerprint``): KV computed by ggml's kernels is not MLX's quantized matmul's.
    """
    from blake3 import blake3

    h = blake3(b"mlxcel:model-fingerprint:v1")
    if path.is_file():
        from mlxcel_compat.gguf.reader import split_parts

        for part in split_parts(path):
            size = part.stat().st_size
            h.update(f"{part.name}\0{size}\0".encode())
            with open(part, "rb") as f:
                h.update(f.read(16 * _SAMPLE))
                f.seek(max(0, size - _SAMPLE))
                h.update(f.read(_SAMPLE))
        if gguf is not None:
            h.update(json.dumps({"precision": gguf.precision, "compute": gguf.compute_dtype}, sort_keys=True).encode())
        return h.hexdigest()
    for name in ("config.json", "tokenizer.json", "tokenizer.model"):
        file = path / name
        if file.is_file():
            data = file.read_bytes()
            h.update(f"{name}\0{len(data)}\0".encode() + data)
    for file in sorted(path.glob("*.safetensors")):
        size = file.stat().st_size
        h.update(f"{file.name}\0{size}\0".encode())
        with open(file, "rb") as f:
            head = f.read(8)
            table = int.from_bytes(head, "little") if len(head) == 8 else 0
            h.update(head + f.read(min(table, size)))
            data_start = 8 + table
            f.seek(data_start)
            h.update(f.read(_SAMPLE))
            f.seek(max(data_start, size - _SAMPLE))
            h.update(f.read(_SAMPLE))
    if kept is not None:
        h.update(json.dumps(kept, sort_keys=True).encode())
    return h.hexdigest()


def _log_affine(affine: Any, weight_bytes: int, directory_bytes: int) -> None:
    """The GGUF path's lines for a quantized directory: which kernel serves each kind of
    tensor, how many bytes it takes, and which tensors could not be kept in blocks and why."""
    for label, count in sorted(affine.precision.items()):
        log.info("- %s: %d tensors, %.1f MiB, computed by %s (from MLX %s)", label, count,
                 affine.weight_bytes[label] / 2**20, affine.kernels[label], "; ".join(sorted(affine.sources[label])))
    for why, paths in affine.expanded.items():
        log.warning("quantized weights expanded to float32 (4 bytes a weight), %d tensors: %s (%s)", len(paths), why,
                    ", ".join(paths[:4]) + (", ..." if len(paths) > 4 else ""))
    for kind, paths in affine.kept.items():
        log.warning("%d %s modules stay MLX-quantized (MLX's quantized matmul, ~40x slower than float32 here)",
                    len(paths), kind)
    if affine.inexact:
        log.info("%d Q8_0 tensors have group biases rounded once in float32 (not bit-exact)", affine.inexact)
    log.info("weights take %.1f MiB (the directory's tensors: %.1f MiB)", weight_bytes / 2**20,
             directory_bytes / 2**20)


def _block_weights(model: Any) -> list[Any]:
    """Every distinct block weight the model holds (a tied head shares the embedding's)."""
    from mlxcel_compat.runtime.block_layers import block_weight_of

    found = {id(w): w for _, m in model.named_modules() if (w := block_weight_of(m)) is not None}
    return list(found.values())


def load_model(model_arg: str, aliases: list[str], offline: bool = False, name: str | None = None,
               adapters: Sequence[Any] = (), repack: bool = True, options: LoadOptions | None = None,
               mmproj: str | None = None, image_min_tokens: int = 0, image_max_tokens: int = 0) -> LoadedModel:
    """Load weights and tokenizer. Must run on the engine thread (it creates MLX state).

    ``model_arg`` is a local directory or GGUF file (or a hub id, resolved here); ``name`` is what
    the user asked for, used for the display id when it differs from the local path (``-hf``).
    ``adapters`` (``lora.AdapterFile``) are checked against the model and installed unfused
    (``lora_layers.py``); one that does not fit raises ``lora.AdapterError`` naming the tensor.
    ``repack``: a GGUF's Q4_0/Q4_K weights also take ggml's repacked layout (``ggml_repack.py``).
    ``options``: the loading flags (``load_options.py``: RoPE/YaRN overrides on any source,
    ``--override-kv``, ``--no-mmap`` and ``--mlock`` on a GGUF).
    ``mmproj``: llama.cpp's projector GGUF served with a GGUF text model (``model/mmproj.py``);
    ``image_min_tokens`` / ``image_max_tokens`` bound its images' tokens where the projector's
    preprocessing has such bounds (0: the projector's own).
    """
    import mlx.core as mx
    from mlx.utils import tree_flatten

    path = resolve_model_path(model_arg, offline=offline)
    if mmproj and not path.is_file():
        raise ValueError(f"--mmproj is a GGUF projector for a GGUF text model; '{model_arg}' is a directory "
                         "(a vision-language directory is served with -m alone)")
    from mlxcel_compat.encoders import load as encoder_load

    if encoder_load.is_encoder_path(path):
        if adapters:
            raise ValueError("LoRA adapters apply to decoder models; this is a BERT-family encoder")
        return _load_encoder(path, model_arg, aliases, name)
    if path.is_dir():  # the vision room (and Pillow) only where a directory may need it: ~5 MiB of a text GGUF's RSS
        from mlxcel_compat.vision import model as vision

        if vision.is_vision_directory(path):
            if adapters:
                raise ValueError("LoRA adapters are not served on vision-language models yet")
            return _load_vision(path, model_arg, aliases, name)
    options = options if options is not None else LoadOptions()
    if options.rope:
        log.info("RoPE overrides: %s", options.rope.describe())
    if mmproj:
        if adapters:
            raise ValueError("LoRA adapters are not served on vision-language models yet")
        return _load_gguf_vision(path, model_arg, aliases, name, mmproj, repack, image_min_tokens, image_max_tokens,
                                 options)
    on_cpu = mx.default_device() == mx.cpu
    summary = None
    affine = None  # mlx_affine.AffineLoad for a quantized directory on the CPU
    if path.is_file():
        from mlxcel_compat.gguf.load import load_gguf

        if options.kv_overrides:
            log.info("metadata overrides: %s", ", ".join(o.spelled() for o in options.kv_overrides))
        model, tokenizer, config, summary = load_gguf(
            str(path), progress=_ProgressLog(path.name), repack=repack, kv_overrides=options.kv_overrides,
            use_mmap=options.use_mmap, mlock=options.mlock, adjust_config=options.rope.apply if options.rope else None)
        _log_gguf(summary)
    else:
        from mlxcel_compat.tokenizer.cache import load_directory
        from mlxcel_compat.tokenizer.served import config_eos_ids
        from mlxcel_compat import zoo

        raw = read_config(path)
        quantized = on_cpu and ("quantization" in raw or "quantization_config" in raw)
        if options.kv_overrides:
            log.warning("--override-kv applies to GGUF metadata; '%s' is a directory, whose config.json is "
                        "read as it is", path)
        # A quantized directory is read lazily: each layer is evaluated, repacked and dropped in
        # turn (mlx_affine.serve), so its MLX copy and its blocks are never all in memory.
        # mlx-lm loads the weights only; the tokenizer is ours (no transformers: zoo.py).
        model, config = zoo.load_model(path, lazy=quantized, model_config=options.rope.apply(raw) if options.rope else None)
        tokenizer = load_directory(path, config_eos_ids(config.get("eos_token_id")))
        if on_cpu and config.get("quantization") is not None:
            affine = _serve_affine(model)
    n_adapted = _install_adapters(model, config, summary, adapters) if adapters else 0
    text_cfg = config.get("text_config", {})
    fim = model_fim_tokens(tokenizer, int(config.get("vocab_size") or text_cfg.get("vocab_size") or 0),
                           summary.specials if summary is not None else None)
    if summary is None and fim.end_of_generation():  # a GGUF's were added with its other end tokens
        tokenizer.eos_token_ids = set(tokenizer.eos_token_ids) | set(fim.end_of_generation())
    if fim.as_dict():
        log.info("FIM tokens: %s", ", ".join(f"{k}={v}" for k, v in fim.as_dict().items()))
    if on_cpu:
        from mlxcel_compat.runtime import attention
        from mlxcel_compat.runtime import cpu_fusion

        # Block weights are not parameters; quantized (integer) weights left to MLX stay as they
        # are; only half-precision floats are widened.
        model.set_dtype(mx.float32, predicate=lambda dt: dt in (mx.float16, mx.bfloat16))
        attention.install()  # the model's module is imported now: switch its attention
        fused = cpu_fusion.install(model)
        log.debug("CPU fusion: %s", fused)
    params = tree_flatten(model.parameters())
    blocks = _block_weights(model)
    if affine is not None:
        directory_bytes = sum(f.stat().st_size for f in path.glob("*.safetensors"))
        _log_affine(affine, sum(v.nbytes for _, v in params) + sum(b.nbytes for b in blocks), directory_bytes)
    kv_precision.install(model, options.kv_types)
    decoder = _cpu_decoder(model) if on_cpu else None
    # Block weights (not MLX parameters) count as their n x k values and their bytes in memory.
    n_params = (summary.n_params if summary is not None
                else sum(v.size for _, v in params) + sum(b.n * b.k for b in blocks))
    size_bytes = (summary.file_bytes if summary is not None
                  else sum(v.nbytes for _, v in params) + sum(b.nbytes for b in blocks))
    mx.eval(model.parameters())
    return LoadedModel(
        model=model,
        tokenizer=tokenizer,
        config=config,
        path=path,
        model_id=model_display_id(name or model_arg, aliases),
        aliases=sorted(aliases),
        n_params=n_params,
        size_bytes=size_bytes,
        gguf=summary,
        fingerprint=options.mark(model_fingerprint(path, summary, affine.fingerprint if affine is not None else None)),
        decoder=decoder,
        n_adapted=n_adapted,
        fim=fim,
    )


def _load_encoder(path: Path, model_arg: str, aliases: list[str], name: str | None) -> LoadedModel:
    """A BERT-family encoder (``encoder_load.py``): float32 MLX weights, no decode runtime."""
    from mlxcel_compat.encoders import load as encoder_load

    summary = None
    if path.is_file():
        model, tokenizer, config, summary = encoder_load.load_gguf(path)
        _log_gguf(summary)
    else:
        model, tokenizer, config = encoder_load.load_directory(path)
    c = model.config
    log.info("encoder %s: %d layers, hidden %d, %d positions, %s; served for embeddings and rerank only",
             c.model_type, c.num_hidden_layers, c.hidden_size, c.n_positions,
             f"classification head ({c.num_labels} labels)" if c.num_labels else "no classification head")
    return _plain_loaded(path, model_arg, aliases, name, model, tokenizer, config, summary, kind="encoder")


def _plain_loaded(path: Path, model_arg: str, aliases: list[str], name: str | None, model: Any, tokenizer: Any,
                  config: dict[str, Any], summary: Any = None, **extra: Any) -> LoadedModel:
    """The ``LoadedModel`` of a model whose weights are all MLX parameters (no block weights)."""
    from mlx.utils import tree_flatten

    params = tree_flatten(model.parameters())
    return LoadedModel(
        model=model,
        tokenizer=tokenizer,
        config=config,
        path=path,
        model_id=model_display_id(name or model_arg, aliases),
        aliases=sorted(aliases),
        n_params=summary.n_params if summary is not None else sum(v.size for _, v in params),
        size_bytes=summary.file_bytes if summary is not None else sum(v.nbytes for _, v in params),
        gguf=summary,
        fingerprint=model_fingerprint(path, summary),
        **extra,
    )


def _load_vision(path: Path, model_arg: str, aliases: list[str], name: str | None) -> LoadedModel:
    """A vision-language directory through mlx-vlm (``vision/model.py``): float32 weights, MLX's
    own steps (no fusion or attention levers: they patch mlx-lm's modules), the CPU decode runtime
    for requests without images where the family's text model is mlx-lm's (``_vision_decoder``)."""
    import mlx.core as mx

    from mlxcel_compat.vision import model as vision

    model, tokenizer, config, facts = vision.load_vision_directory(path)
    if mx.default_device() == mx.cpu:
        model.set_dtype(mx.float32, predicate=lambda dt: dt in (mx.float16, mx.bfloat16))
    mx.eval(model.parameters())
    model.warm_up()
    if facts.images:
        log.info("vision-language model %s (mlx-vlm): image token %d, %s; images through the vision tower",
                 facts.model_type, facts.image_token_id,
                 f"{facts.tokens_per_image} tokens an image" if facts.tokens_per_image else "tokens from each image's size")
    if facts.audio is not None:
        log.info("%s (mlx-vlm): audio token %d, %d tokens a clip (at most %.2f s); audio through the audio tower",
                 facts.model_type, facts.audio.audio_token_id, facts.audio.tokens_per_clip,
                 facts.audio.max_samples / facts.audio.sampling_rate)
    return _plain_loaded(path, model_arg, aliases, name, model, tokenizer, config, vision=facts,
                         decoder=_vision_decoder(model))


def _load_gguf_vision(path: Path, model_arg: str, aliases: list[str], name: str | None, mmproj: str, repack: bool,
                      image_min_tokens: int, image_max_tokens: int, options: LoadOptions) -> LoadedModel:
    """A text GGUF with its projector GGUF (``model/mmproj.py``): the text model's weights in the
    file's blocks as alone (the loading flags too), the tower's in float32; steps as ``_load_vision``'s."""
    from mlxcel_compat.model import mmproj as projector

    if options.kv_overrides:
        log.info("metadata overrides: %s", ", ".join(o.spelled() for o in options.kv_overrides))
    model, tokenizer, config, summary, facts = projector.load_pair(
        path, mmproj, progress=_ProgressLog(path.name), repack=repack, image_min_tokens=image_min_tokens,
        image_max_tokens=image_max_tokens, options=options)
    _log_gguf(summary)
    model.warm_up()
    log.info("vision-language model %s (GGUF + projector %s): image token %d, %s", facts.model_type, mmproj,
             facts.image_token_id,
             f"{facts.tokens_per_image} tokens an image" if facts.tokens_per_image else "tokens from each image's size")
    loaded = _plain_loaded(path, model_arg, aliases, name, model, tokenizer, config, summary, vision=facts,
                           decoder=_vision_decoder(model))
    from blake3 import blake3

    both = f"{model_fingerprint(path, summary)}+mmproj:{model_fingerprint(Path(mmproj))}"
    loaded.fingerprint = options.mark(blake3(both.encode()).hexdigest())  # KV computed with the projector's features
    return loaded


def _install_adapters(model: Any, config: dict[str, Any], summary: Any, adapters: Sequence[Any]) -> int:
    """Install the LoRA adapters before the CPU levers (compiled MLPs must not hold one)."""
    from mlxcel_compat.lora import layers as lora_layers

    n = lora_layers.install(model, config, adapters, lora_layers.model_architecture(config, summary))
    for adapter in adapters:
        log.info("LoRA adapter %d: %s (%s), served unfused", adapter.id, adapter.path, adapter.kind)
    log.info("LoRA: %d adapter%s on %d modules", len(adapters), "" if len(adapters) == 1 else "s", n)
    return n


def _serve_affine(model: Any) -> Any:
    """Repack the quantized directory's MLX affine weights into ggml's blocks (``mlx_affine``);
    None, and MLX's quantized layers kept, when ggml's kernels are not available."""
    from mlxcel_compat.runtime import block_weight
    from mlxcel_compat.runtime import mlx_affine

    lib = block_weight.library()
    if isinstance(lib, str):
        log.warning("quantized weights stay MLX-quantized (its quantized matmul, ~40x slower than float32 here): "
                    "ggml's kernels are not available: %s", lib)
        return None
    affine = mlx_affine.serve(model, lib)
    log.info("MLX quantized weights on the CPU: %d tensors repacked into ggml blocks, %d expanded to float32",
             sum(n for label, n in affine.precision.items() if label != "float32"), affine.precision.get("float32", 0))
    return affine


def _vision_decoder(model: Any) -> Any:
    """The CPU decode runtime for a vision-language model's steps on tokens without media, where
    its family's text model is mlx-lm's own (LFM2-VL: ``VisionFamily.text_model``), or None: the
    engine hands it the requests without images (``engine/factory.py``); a request with images
    stays in MLX's pass, which merges their features."""
    import mlx.core as mx

    text = model.family.text_model(model.vlm)
    return _cpu_decoder(text) if text is not None and mx.default_device() == mx.cpu else None


def _cpu_decoder(model: Any) -> Any:
    """The CPU decode runtime for this model (its KV in the types ``kv_precision.install`` gave
    it), or None; which one is active is logged."""
    from mlxcel_compat.runtime import backend
    from mlxcel_compat.runtime import cpu_decode

    built = cpu_decode.build(model, backend.matmul_shim())
    if isinstance(built, str):
        log.info("decode step: MLX (CPU decode runtime not used: %s)", built)
        return None
    log.info("decode step: CPU decode runtime (the shim's kernels; single sequences and batches)")
    return built
