"""Dense decoder architectures beyond the core ones: mistral3, phi3, gemma2, smollm3, olmo2, granite, glm4, exaone4, cohere2, starcoder2, seed_oss, ernie4_5, apertus.

Each row (:data:`SPECS`) names the mlx-lm model that serves the architecture; its config builder
and the undo steps for what llama.cpp's converter changed sit beside it in this module. What each
builder reads is what the converter's class writes (``convert_hf_to_gguf.py``) and llama.cpp's
loader reads (``src/models/<arch>.cpp``), including the values llama.cpp fixes in code rather than
metadata (SmolLM3's NoPE period, Cohere 2's sliding-window period).
"""

from __future__ import annotations

from typing import Any

from mlxcel_compat.gguf.arch_spec import ArchSpec, common_config
from mlxcel_compat.gguf.reader import GGUFModelFile


def _mistral3(file: GGUFModelFile) -> dict[str, Any]:
    """Ministral 3 (and Mistral Small 3.x, Devstral as the converter now writes them: ``mistral3``).

    mlx-lm's ``ministral3`` is llama plus Llama 4's attention temperature (queries scaled by
    ``1 + beta log(1 + floor(pos / original_context))``), llama.cpp's ``attention.temperature_scale``
    with the YaRN original context as the period; a file without it gets beta 0 (plain llama).
    ``rope.scaling.yarn_log_multiplier`` is the config's ``mscale_all_dim`` (llama.cpp assumes mscale 1)."""
    config = common_config(file)
    rope: dict[str, Any] = dict(config.pop("rope_scaling", None) or {"rope_type": "default"})
    rope["rope_theta"] = config.pop("rope_theta", 1000000.0)
    if (log_mul := file.arch_value("rope.scaling.yarn_log_multiplier")) is not None:
        rope.update(mscale=1.0, mscale_all_dim=float(log_mul))
    rope["llama_4_scaling_beta"] = float(file.arch_value("attention.temperature_scale", 0.0))
    rope.setdefault("original_max_position_embeddings", config["max_position_embeddings"])
    config["rope_parameters"] = rope
    return config


SPECS: tuple[ArchSpec, ...] = (
    ArchSpec("mistral3", "ministral3", "Ministral3ForCausalLM", _mistral3, permute_qk=True),
)
