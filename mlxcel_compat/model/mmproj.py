"""``--mmproj FILE``: a text GGUF served with llama.cpp's multimodal projector beside it.

This module reads the files (the ``gguf/`` room's reader and dequantizer); what the projector's
tensors and keys mean, and how the pair becomes one mlx-vlm model, is ``vision/gguf_projector.py``
and ``vision/gguf_model.py``. The text model loads exactly as it does alone (``gguf/load.py``:
on the CPU its quantized weights stay in the file's blocks).
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import numpy as np

log = logging.getLogger(__name__)


def read_projector(path: str | Path) -> Any:
    """The projector file as ``vision.gguf_projector.ProjectorFile``: its metadata, tensor names
    and a reader that gives one tensor's values in NumPy order: float16 for a matrix stored in 16
    bits or fewer (F16 and the block types; :func:`held_as_half`), float32 otherwise."""
    from mlxcel_compat.gguf import quants as gguf_quants
    from mlxcel_compat.gguf.reader import open_gguf, read_tensor
    from mlxcel_compat.vision.gguf_projector import ProjectorFile

    if not Path(path).expanduser().is_file():
        raise ValueError(f"--mmproj {path}: no such file")
    file = open_gguf(path)
    for info in file.tensors.values():
        gguf_quants.check_supported(info.name, info.ggml_type)

    def read(name: str) -> np.ndarray:
        info = file.tensors[name]
        dtype = np.float16 if held_as_half(info.name, info.ggml_type, info.shape) else np.float32
        values = gguf_quants.dequantize(read_tensor(info), info.ggml_type, info.n_values, dtype=dtype, name=info.name)
        return values.reshape(info.shape)

    return ProjectorFile(str(file.path), dict(file.metadata), frozenset(file.tensors), read)


def held_as_half(name: str, ggml_type: int, shape: tuple[int, ...]) -> bool:
    """Whether a projector tensor is held in float16: a matrix stored as F16 or in blocks (Q8_0,
    ...: values ``d * q`` with a float16 scale ``d``), as llama.cpp holds it, rather than doubled to
    float32 (a 400M-parameter SigLIP tower: 0.8 GiB, not 1.6). MLX promotes a float16 weight to the
    float32 activations in each product, so the tower still computes in float32. Kept float32:
    vectors, F32 and BF16 tensors (BF16's range is float32's), and the patch embedding, whose dtype
    the families cast the pixels to (the tower's activations would be float16 after it)."""
    from mlxcel_compat.gguf.quants import T

    return len(shape) >= 2 and ggml_type not in (T.F32, T.BF16) and "patch_embd" not in name


def check_projector(path: str | Path) -> str:
    """The projector's type, or ``ValueError`` (not a projector, an unknown type): start-up
    checks this before the text model loads."""
    from mlxcel_compat.vision.served import projector_kind

    projector = read_projector(path)
    projector_kind(projector)
    return projector.projector_type


def load_pair(text_path: Path, mmproj: str | Path, progress: Any = None, repack: bool = True,
              image_min_tokens: int = 0, image_max_tokens: int = 0,
              options: Any = None) -> tuple[Any, Any, dict[str, Any], Any, Any]:
    """``(model, tokenizer, config, summary, facts)`` of the pair (engine thread): the text GGUF's
    model joined with the projector's tower (``vision.gguf_model``), float32 on the CPU.

    ``options`` (``model/load_options.py``) load the text GGUF as they load it alone:
    ``--override-kv``, ``--no-mmap``/``--mlock`` and the RoPE flags. The text model's RoPE
    modules run inside mlx-vlm's model (Gemma 3's move in with its layers; SmolVLM's text model is
    the GGUF's whole) and its ``rope_theta`` configures Qwen-VL's multimodal RoPE; that one has
    no linear or YaRN scaling, so those flags on a Qwen-VL pair are refused rather than ignored."""
    import mlx.core as mx

    from mlxcel_compat.gguf.load import load_gguf
    from mlxcel_compat.vision.gguf_model import load_gguf_vision
    from mlxcel_compat.vision.served import family_of, projector_kind

    projector = read_projector(mmproj)
    kind = projector_kind(projector)  # an unknown type fails before the text model loads
    rope = getattr(options, "rope", None)
    if rope and family_of({"model_type": kind.model_type}).mrope and any(
            (rope.scaling, rope.scale, rope.freq_scale, rope.yarn_orig_ctx, rope.yarn_beta_fast, rope.yarn_beta_slow)):
        raise ValueError(f"the RoPE scaling flags do not apply to {projector.projector_type}'s multimodal RoPE "
                         "(--rope-freq-base does)")
    loading = {} if options is None else dict(kv_overrides=options.kv_overrides, use_mmap=options.use_mmap,
                                               mlock=options.mlock, adjust_config=rope.apply if rope else None)
    text_model, tokenizer, text_config, summary = load_gguf(str(text_path), progress=progress, repack=repack, **loading)
    model, config, facts = load_gguf_vision(text_model, text_config, tokenizer, projector,
                                            image_min_tokens, image_max_tokens)
    if mx.default_device() == mx.cpu:  # the text model's (the tower keeps its float16 matrices: held_as_half)
        model.vlm.language_model.set_dtype(mx.float32, predicate=lambda dt: dt in (mx.float16, mx.bfloat16))
    mx.eval(model.parameters())
    log.info("projector %s: %s (%d tensors), served through mlx-vlm's %s tower", projector.path,
             projector.projector_type, len(projector.names), config["model_type"])
    return model, tokenizer, config, summary, facts
