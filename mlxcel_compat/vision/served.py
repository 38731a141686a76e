"""Every served vision family and GGUF projector type: the tables of ``vision/families.py`` and
``vision/gguf_projector.py`` joined with the families big enough for a module of their own
(Qwen3-VL: ``vision/qwen3vl.py``; InternVL: ``vision/internvl.py``; Mistral 3: ``vision/pixtral.py``; LFM2-VL: ``vision/lfm2vl.py``). Those modules build on the two base modules, so the joined
tables live here, above them all; loading (``vision/model.py``, ``vision/gguf_model.py``,
``model/mmproj.py``) looks families and projector types up here."""

from __future__ import annotations

from typing import Any

from mlxcel_compat.vision import families, gguf_projector
from mlxcel_compat.vision.families import VisionFamily
from mlxcel_compat.vision.gguf_projector import ProjectorFile, ProjectorKind
from mlxcel_compat.vision.internvl import InternVL, InternVLProjector
from mlxcel_compat.vision.lfm2vl import Lfm2Vl, Lfm2VlProjector
from mlxcel_compat.vision.pixtral import Mistral3, PixtralProjector
from mlxcel_compat.vision.qwen3vl import Qwen3VL, Qwen3VLProjector

FAMILIES: dict[str, VisionFamily] = {**families.FAMILIES,
                                     **{t: f for f in (Qwen3VL(), InternVL(), Mistral3(), Lfm2Vl()) for t in f.model_types}}
SUPPORTED_MODEL_TYPES: tuple[str, ...] = tuple(FAMILIES)
KINDS: dict[str, ProjectorKind] = {**gguf_projector.KINDS,
                                   **{t: k for k in (Qwen3VLProjector(), InternVLProjector(), PixtralProjector(),
                                                     Lfm2VlProjector()) for t in k.types}}
SERVED_PROJECTOR_TYPES: tuple[str, ...] = tuple(KINDS)


def family_of(config: dict[str, Any]) -> VisionFamily:
    """The served family of ``config``'s ``model_type``; another is refused with the list."""
    return families.family_of(config, FAMILIES)


def projector_kind(projector: ProjectorFile) -> ProjectorKind:
    """The served projector type's rules; another is refused with its name and the list."""
    return gguf_projector.projector_kind(projector, KINDS)
