"""Request images for a vision-language model: fetch, decode, bound, preprocess, digest, expand.

Runs on the request's worker thread (``server/workers.py``), never on the event loop and never on
the engine thread; it produces plain records (NumPy arrays) that the engine's vision model
(``model/vision.py``) turns into features.

- Sources (llama-server's): ``data:image/...;base64,...``, raw base64, and ``http(s)`` URLs only
  with ``--media-fetch`` (off by default; ``--media-max-bytes`` and 10 s, llama-server's download
  limits). ``file://`` needs llama-server's ``--media-path``, which this server does not serve.
- Limits, each a 400 that names it: ``--media-max-images`` per request, ``--media-max-bytes`` per
  encoded image, ``--media-max-pixels`` per image, read from the header *before* decoding (so a
  decompression bomb never allocates its pixels; Pillow's own ``MAX_IMAGE_PIXELS`` guard is an
  error too). Truncated or undecodable data and a non-image MIME type are 400s.
- Digest: ``mm_digest`` is BLAKE3 over the *decoded* RGB pixels (with each image's size), in
  prompt order (``cache.key.multimodal_digest``): the same picture as PNG or lossless WebP, or
  behind two URLs, gives one digest; swapping two images changes it.
- Expansion: the chat template writes one image marker per image; each becomes the image's
  tokens, by its family's rule (``model/vision_families.py``: Qwen2-VL's merged patch count
  ``t * h * w / merge**2``, Gemma 3's fixed count between ``<start_of_image>`` and
  ``<end_of_image>``, LLaVA's one per patch), as the family's Hugging Face processor does.
"""

from __future__ import annotations

import base64
import binascii
import io
import struct
import threading
import warnings
from dataclasses import dataclass
from typing import Any

import numpy as np

from mlxcel_compat.cache.key import multimodal_digest
from mlxcel_compat.engine.request import MediaImage, MediaInput
from mlxcel_compat.server.errors import InvalidRequest

FETCH_TIMEOUT_S = 10.0  # llama-server's download timeout
# Where a raw prompt's ``multimodal_data`` items go (``/props`` ``media_marker``); llama-server's
# is random per process unless ``LLAMA_MEDIA_MARKER`` pins it, this one is fixed.
MEDIA_MARKER = "<__media__>"


@dataclass(frozen=True)
class MediaLimits:
    """The per-request bounds on images (the ``limits`` group of ``settings.py``)."""

    max_images: int = 16
    max_pixels: int = 4096 * 4096
    max_bytes: int = 10 * 1024 * 1024
    fetch: bool = False

    @classmethod
    def from_settings(cls, s: Any) -> "MediaLimits":
        return cls(int(s.media_max_images), int(s.media_max_pixels), int(s.media_max_bytes), bool(s.media_fetch))


@dataclass
class DecodedImage:
    """One image as RGB pixels (``image``: Pillow's), its size and its digest payload."""

    image: Any
    width: int
    height: int

    def digest_item(self) -> bytes:
        """What ``mm_digest`` covers: the size, then the decoded RGB bytes."""
        return struct.pack("<II", self.width, self.height) + self.image.tobytes()


def _too_big(n: int, limit: int) -> InvalidRequest:
    return InvalidRequest(f"image is {n} bytes, over the limit of {limit} (--media-max-bytes)")


def _b64(data: str) -> bytes:
    try:
        return base64.b64decode(data, validate=True)
    except (binascii.Error, ValueError):
        raise InvalidRequest("image data is not valid base64") from None


def _fetch(url: str, limits: MediaLimits) -> bytes:
    import httpx

    try:
        with httpx.stream("GET", url, timeout=FETCH_TIMEOUT_S, follow_redirects=True) as response:
            if response.status_code != 200:
                raise InvalidRequest(f"failed to download image: HTTP {response.status_code} from {url}")
            chunks, size = [], 0
            for chunk in response.iter_bytes():
                size += len(chunk)
                if size > limits.max_bytes:
                    raise _too_big(size, limits.max_bytes)
                chunks.append(chunk)
            return b"".join(chunks)
    except httpx.HTTPError as exc:
        raise InvalidRequest(f"failed to download image from {url}: {exc}") from None


def image_bytes(url: Any, limits: MediaLimits) -> bytes:
    """The encoded bytes behind an ``image_url`` (data URI, raw base64, or http(s) when allowed)."""
    if not isinstance(url, str) or not url:
        raise InvalidRequest("image_url.url must be a non-empty string")
    if url.startswith("data:"):
        header, sep, payload = url.partition(",")
        mime = header[5:].split(";")[0].strip().lower()
        if not sep or ";base64" not in header:
            raise InvalidRequest("image data URI must be base64: data:image/<type>;base64,<data>")
        if not mime.startswith("image/"):
            raise InvalidRequest(f"unsupported media type '{mime or 'none'}' for an image: expected image/*")
        if len(payload) * 3 // 4 > limits.max_bytes:
            raise _too_big(len(payload) * 3 // 4, limits.max_bytes)
        return _b64(payload)
    if url.startswith(("http://", "https://")):
        if not limits.fetch:
            raise InvalidRequest("image URLs are not downloaded by this server (start it with --media-fetch); "
                                 "send the image as a data: URI")
        return _fetch(url, limits)
    if url.startswith("file://"):
        raise InvalidRequest("file:// images are not served (llama-server's --media-path); send a data: URI")
    if len(url) * 3 // 4 > limits.max_bytes:
        raise _too_big(len(url) * 3 // 4, limits.max_bytes)
    return _b64(url)  # llama-server also takes raw base64


def decode_image(data: bytes, limits: MediaLimits) -> DecodedImage:
    """Decode to RGB, refusing a too-large image from its header, before any pixel is decoded."""
    from PIL import Image, UnidentifiedImageError

    if len(data) > limits.max_bytes:
        raise _too_big(len(data), limits.max_bytes)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("error", Image.DecompressionBombWarning)
            image = Image.open(io.BytesIO(data))
            width, height = image.size
            if width * height > limits.max_pixels:
                raise InvalidRequest(f"image is {width}x{height} = {width * height} pixels, over the limit of "
                                     f"{limits.max_pixels} (--media-max-pixels)")
            image.load()
            rgb = image.convert("RGB")
    except InvalidRequest:
        raise
    except (UnidentifiedImageError, Image.DecompressionBombError, Image.DecompressionBombWarning) as exc:
        raise InvalidRequest(f"failed to load image: {exc}") from None
    except (OSError, ValueError, SyntaxError) as exc:  # truncated or corrupt data
        raise InvalidRequest(f"failed to load image: {exc}") from None
    return DecodedImage(rgb, width, height)


class ImageInput:
    """Turns a chat's image sources into the engine's ``MediaInput`` for the served model.

    ``facts`` is the model's ``model.vision_families.VisionFacts``; the family's Hugging Face image
    processor (``preprocessor_config.json``) is loaded once, off the event loop (the app does it before it
    opens the gate, so no request pays the import).
    """

    def __init__(self, facts: Any, limits: MediaLimits) -> None:
        self.facts = facts
        self.limits = limits
        self._processor: Any = None
        self._lock = threading.Lock()

    def processor(self) -> Any:
        with self._lock:
            if self._processor is None:
                import importlib

                module, _, name = self.facts.processor.partition(":")
                cls = getattr(importlib.import_module(module), name)
                self._processor = cls.from_pretrained(str(self.facts.processor_dir))
            return self._processor

    def decode_all(self, sources: list[Any]) -> list[DecodedImage]:
        if len(sources) > self.limits.max_images:
            raise InvalidRequest(f"{len(sources)} images in one request, over the limit of {self.limits.max_images} "
                                 "(--media-max-images)")
        return [decode_image(image_bytes(src, self.limits), self.limits) for src in sources]

    def prepare(self, sources: list[Any], tokens: list[int]) -> tuple[list[int], MediaInput, bytes]:
        """``(expanded tokens, media, mm_digest)`` for a prompt holding one image token per source."""
        images = self.decode_all(sources)
        facts = self.facts
        where = [i for i, t in enumerate(tokens) if t == facts.expand_token]
        if len(where) != len(images):
            raise InvalidRequest(f"the prompt has {len(where)} image markers for {len(images)} images")
        processor = self.processor()
        expanded: list[int] = []
        records: list[MediaImage] = []
        last = 0
        for at, decoded in zip(where, images):
            out = processor(images=[decoded.image], return_tensors="np", **facts.processor_kwargs)
            count, grid = facts.image_token_count(out)
            expanded.extend(tokens[last:at])
            expanded.extend(facts.before)
            start = len(expanded)
            expanded.extend([facts.image_token_id] * count)
            expanded.extend(facts.after)
            records.append(MediaImage(np.asarray(out["pixel_values"], dtype=np.float32), grid, (start, start + count)))
            last = at + 1
        expanded.extend(tokens[last:])
        digest = multimodal_digest([d.digest_item() for d in images])
        return expanded, MediaInput(records), digest


def marked_prompt_tokens(tokenizer: Any, facts: Any, prompt: str, n_items: int) -> list[int]:
    """A raw prompt's tokens with each media marker replaced by what the model's chat template
    writes for an image (``facts.marker``: Qwen2-VL's ``<|vision_start|><|image_pad|><|vision_end|>``,
    Gemma 3's ``<start_of_image>``, LLaVA's ``<image>``), to be expanded by ``prepare``."""
    pieces = prompt.split(MEDIA_MARKER)
    if len(pieces) - 1 != n_items:
        raise InvalidRequest(f"the prompt has {len(pieces) - 1} media markers ({MEDIA_MARKER}) for {n_items} "
                             "multimodal_data items")
    tokens = list(tokenizer.encode(pieces[0], add_special_tokens=True))
    for piece in pieces[1:]:
        tokens += list(facts.marker) + list(tokenizer.encode(piece, add_special_tokens=False))
    return tokens
