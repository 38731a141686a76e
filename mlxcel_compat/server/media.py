"""Request images (and audio clips) for a vision-language model: fetch, decode, bound, preprocess,
digest, expand.

Runs on the request's worker thread (``server/workers.py``), never on the event loop and never on
the engine thread; it produces plain records (NumPy arrays) that the engine's vision model
(``vision/model.py``) turns into features.

- Sources (llama-server's): ``data:image/...;base64,...``, raw base64, and ``http(s)`` URLs only
  with ``--media-fetch`` (off by default; ``--media-max-bytes`` and 10 s, llama-server's download
  limits). ``file://`` needs llama-server's ``--media-path``, which this server does not serve.
- Limits, each a 400 that names it: ``--media-max-images`` per request, ``--media-max-bytes`` per
  encoded image, ``--media-max-pixels`` per image, read from the header *before* decoding (so a
  decompression bomb never allocates its pixels; Pillow's own ``MAX_IMAGE_PIXELS`` guard is an
  error too). Truncated or undecodable data and a non-image MIME type are 400s.
- Digest: ``mm_digest`` is BLAKE3 over the *decoded* RGB pixels (each image's size and pixels
  hashed, then those hashes in prompt order: ``cache.key.multimodal_digest``): the same picture
  as PNG or lossless WebP, or behind two URLs, gives one digest; swapping two images changes it.
- Memo: a chat client resends every image of the conversation with every turn, and decoding and
  preprocessing an image costs more than prefilling a turn that the prompt cache holds. So each
  image's result (its pixel digest, the processor's output, its token count) is kept by the
  BLAKE3 of its *encoded* bytes (:class:`PreparedMemo`, a byte-bounded LRU): the same bytes again
  skip decoding and preprocessing; other bytes of the same picture are decoded and get the same
  digest as before.
- Expansion: the chat template writes one image marker per image; each becomes the image's
  tokens, by its family's rule (``vision/families.py``: Qwen2-VL's merged patch count
  ``t * h * w / merge**2``, Gemma 3's fixed count between ``<start_of_image>`` and
  ``<end_of_image>``, LLaVA's one per patch), as the family's Hugging Face processor does.
- Audio (Gemma 3n): ``input_audio`` parts and audio ``multimodal_data`` items (told by their
  bytes, as llama-server does); WAV, MP3 and FLAC decoded by miniaudio, llama-server's own
  decoder (mixed to mono, resampled to the feature extractor's rate), the length checked from
  the header first (``--media-max-audio-seconds`` and the model's clip length),
  ``--media-max-audio`` clips per request. The digest covers the decoded samples, in prompt order
  with the images; each clip becomes the family's fixed count of audio tokens.
"""

from __future__ import annotations

import base64
import binascii
import io
import struct
import threading
from collections import OrderedDict
import warnings
from dataclasses import dataclass
from typing import Any

import numpy as np

from blake3 import blake3

from mlxcel_compat.cache.key import multimodal_digest
from mlxcel_compat.chat.request import AudioSource
from mlxcel_compat.vision.inputs import MediaAudio, MediaImage, MediaInput
from mlxcel_compat.server.errors import InvalidRequest

FETCH_TIMEOUT_S = 10.0  # llama-server's download timeout
# Where a raw prompt's ``multimodal_data`` items go (``/props`` ``media_marker``); llama-server's
# is random per process unless ``LLAMA_MEDIA_MARKER`` pins it, this one is fixed.
MEDIA_MARKER = "<__media__>"
# Bytes of preprocessed pixels the memo keeps (a 448x448 image is ~5 MB for Qwen2.5-VL).
PREPARED_MEMO_BYTES = 256 * 1024 * 1024


@dataclass(frozen=True)
class MediaLimits:
    """The per-request bounds on images (the ``limits`` group of ``settings.py``)."""

    max_images: int = 16
    max_pixels: int = 4096 * 4096
    max_bytes: int = 10 * 1024 * 1024
    fetch: bool = False
    max_audio: int = 16
    max_audio_seconds: float = 600.0

    @classmethod
    def from_settings(cls, s: Any) -> "MediaLimits":
        return cls(int(s.media_max_images), int(s.media_max_pixels), int(s.media_max_bytes), bool(s.media_fetch),
                   int(s.media_max_audio), float(s.media_max_audio_seconds))


@dataclass
class DecodedAudio:
    """One clip as mono float32 samples at the model's rate."""

    samples: np.ndarray
    rate: int

    def digest_item(self) -> bytes:
        """What ``mm_digest`` covers: a tag (never equal to an image's size prefix), the rate, the samples."""
        return b"audio\0" + struct.pack("<I", self.rate) + self.samples.astype("<f4").tobytes()


@dataclass
class DecodedImage:
    """One image as RGB pixels (``image``: Pillow's), its size and its digest payload."""

    image: Any
    width: int
    height: int

    def digest_item(self) -> bytes:
        """This image's part of ``mm_digest``: BLAKE3 of its size, then its decoded RGB bytes
        (32 bytes, which :class:`PreparedMemo` keeps instead of the pixels)."""
        h = blake3(struct.pack("<II", self.width, self.height))
        h.update(self.image.tobytes())
        return h.digest()


@dataclass(frozen=True)
class PreparedImage:
    """One image ready for a prompt: its digest item, the processor's output, its token count."""

    digest_item: bytes
    pixel_values: np.ndarray  # read-only: shared by every request that sends the same bytes
    count: int
    grid: tuple[int, int, int]
    spatial_shapes: tuple[tuple[int, int], ...] = ()  # NaFlex towers (LFM2-VL): each view's patch grid


class PreparedMemo:
    """Prepared images by the BLAKE3 of their encoded bytes, least recently used first out once
    their pixel arrays pass ``max_bytes`` (one image larger than that is not kept). Thread-safe:
    requests prepare their images on worker threads."""

    def __init__(self, max_bytes: int = PREPARED_MEMO_BYTES) -> None:
        self.max_bytes = max_bytes
        self._items: OrderedDict[bytes, PreparedImage] = OrderedDict()
        self._bytes = 0
        self._lock = threading.Lock()
        self.hits = self.misses = 0

    def get(self, key: bytes) -> PreparedImage | None:
        with self._lock:
            item = self._items.get(key)
            if item is None:
                self.misses += 1
                return None
            self._items.move_to_end(key)
            self.hits += 1
            return item

    def stats(self) -> dict[str, int]:
        """Counters for ``/v1/cache/stats``' ``prepared_images``: how often the same bytes came back."""
        with self._lock:
            return {"hits": self.hits, "misses": self.misses, "entries": len(self._items), "bytes": self._bytes}

    def put(self, key: bytes, item: PreparedImage) -> None:
        size = item.pixel_values.nbytes
        if size > self.max_bytes:
            return
        with self._lock:
            if key in self._items:
                return
            self._items[key] = item
            self._bytes += size
            while self._bytes > self.max_bytes:
                _, old = self._items.popitem(last=False)
                self._bytes -= old.pixel_values.nbytes


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


def _audio_kind(data: bytes) -> str | None:
    # llama-server's test (mtmd-helper's is_audio_file): a RIFF/WAVE header, an ID3 tag or an MPEG
    # frame's sync bits, or FLAC's stream marker.
    if data[:4] == b"RIFF" and data[8:12] == b"WAVE":
        return "wav"
    if data[:3] == b"ID3" or (len(data) > 1 and data[0] == 0xFF and data[1] & 0xE0 == 0xE0):
        return "mp3"
    if data[:4] == b"fLaC":
        return "flac"
    return None


def is_audio(data: bytes) -> bool:
    """llama-server tells audio from images by the bytes (RIFF/WAVE, MP3 frames or an ID3 tag, FLAC)."""
    return _audio_kind(data) is not None


def decode_audio(data: bytes, fmt: Any, limits: MediaLimits, rate: int, max_samples: int) -> DecodedAudio:
    """A WAV, MP3 or FLAC clip as mono float32 at ``rate``, by miniaudio, the decoder llama-server
    uses (mtmd-helper: ``ma_decoder`` to f32, one channel, the model's rate): channels averaged,
    resampled by its linear resampler. The duration is read from the header (MP3: by counting
    frames, without decoding them) and checked before any sample is decoded. The bytes say what
    the clip is, as in llama-server (``fmt``, the part's ``format``, is only checked to be one it
    takes)."""
    import miniaudio

    if len(data) > limits.max_bytes:
        raise InvalidRequest(f"audio is {len(data)} bytes, over the limit of {limits.max_bytes} (--media-max-bytes)")
    kind = _audio_kind(data)
    if fmt is not None and fmt not in ("wav", "mp3"):
        raise InvalidRequest(f"input_audio.format must be 'wav' or 'mp3', got {fmt!r}")
    if kind is None:
        raise InvalidRequest("failed to load audio: not a WAV, MP3 or FLAC file")
    info_of = {"wav": miniaudio.wav_get_info, "mp3": miniaudio.mp3_get_info, "flac": miniaudio.flac_get_info}[kind]
    try:
        info = info_of(data)
    except miniaudio.MiniaudioError as exc:
        raise InvalidRequest(f"failed to load audio: not a valid {kind.upper()} stream ({exc.args[0]})") from None
    if info.num_frames <= 0 or info.sample_rate <= 0:
        raise InvalidRequest(f"failed to load audio: the {kind.upper()} stream holds no samples")
    seconds = info.num_frames / info.sample_rate
    longest = min(limits.max_audio_seconds, max_samples / rate)
    if seconds > longest:
        raise InvalidRequest(f"audio is {seconds:.2f} s long, over the limit of {longest:.2f} s "
                             "(--media-max-audio-seconds, or the model's clip length)")
    try:
        decoded = miniaudio.decode(data, output_format=miniaudio.SampleFormat.FLOAT32, nchannels=1, sample_rate=rate)
    except miniaudio.MiniaudioError as exc:
        raise InvalidRequest(f"failed to load audio: {exc.args[0]}") from None
    if kind == "wav":
        _refuse_truncated_wav(data, info.num_frames)
    return DecodedAudio(np.asarray(decoded.samples, dtype=np.float32)[:max_samples], rate)


def _refuse_truncated_wav(data: bytes, frames_in_file: int) -> None:
    """A WAV header states its frame count, and a cut upload holds fewer; miniaudio decodes the
    frames that are there (llama-server then serves a shorter clip without a word), so the
    header's count is read by the standard library's ``wave`` and compared. PCM only: ``wave``
    does not open float or compressed WAVs, which are decoded as they come."""
    import wave

    try:
        with wave.open(io.BytesIO(data)) as header:
            stated = header.getnframes()
    except (wave.Error, EOFError, ValueError, struct.error):
        return
    if frames_in_file < stated:
        raise InvalidRequest(f"failed to load audio: truncated WAV data ({stated} frames in its header, "
                             f"{frames_in_file} in the data)")


class ImageInput:
    """Turns a chat's image sources (and audio sources, on a model with an audio tower) into the
    engine's ``MediaInput`` for the served model.

    ``facts`` is the model's ``model.vision_families.VisionFacts``; the family's Hugging Face image
    processor (``preprocessor_config.json``) is loaded once, off the event loop (the app does it before it
    opens the gate, so no request pays the import).
    """

    def __init__(self, facts: Any, limits: MediaLimits) -> None:
        self.facts = facts
        self.limits = limits
        self._processor: Any = None
        self._extractor: Any = None
        self._lock = threading.Lock()
        self.memo = PreparedMemo()

    def processor(self) -> Any:
        with self._lock:
            if self._processor is None:
                import importlib

                module, _, name = self.facts.processor.partition(":")
                cls = getattr(importlib.import_module(module), name)
                config = self.facts.processor_config  # a GGUF projector's settings, else the directory's file
                self._processor = cls(**config) if config is not None else cls.from_pretrained(str(self.facts.processor_dir))
            return self._processor

    def extractor(self) -> Any:
        with self._lock:
            if self._extractor is None:
                import importlib

                audio = self.facts.audio
                module, _, name = audio.extractor.partition(":")
                self._extractor = getattr(importlib.import_module(module), name).from_pretrained(str(audio.extractor_dir))
            return self._extractor

    def decode_audio_all(self, sources: list[AudioSource]) -> list[DecodedAudio]:
        audio = self.facts.audio
        if audio is None:
            raise InvalidRequest("audio input is not supported by this model")
        if len(sources) > self.limits.max_audio:
            raise InvalidRequest(f"{len(sources)} audio clips in one request, over the limit of "
                                 f"{self.limits.max_audio} (--media-max-audio)")
        clips = []
        for src in sources:
            if not isinstance(src.data, str) or not src.data:
                raise InvalidRequest("input_audio.data must be a non-empty base64 string")
            if len(src.data) * 3 // 4 > self.limits.max_bytes:
                raise InvalidRequest(f"audio is {len(src.data) * 3 // 4} bytes, over the limit of "
                                     f"{self.limits.max_bytes} (--media-max-bytes)")
            try:
                data = base64.b64decode(src.data, validate=True)
            except (binascii.Error, ValueError):
                raise InvalidRequest("audio data is not valid base64") from None
            clips.append(decode_audio(data, src.format, self.limits, audio.sampling_rate, audio.max_samples))
        return clips

    def prepare(self, sources: list[Any], tokens: list[int]) -> tuple[list[int], MediaInput, bytes]:
        """``(expanded tokens, media, mm_digest)`` for a prompt holding one marker token per source
        (image sources: ``image_url`` strings; audio: :class:`AudioSource`), in prompt order."""
        facts = self.facts
        image_sources = [s for s in sources if not isinstance(s, AudioSource)]
        audio_sources = [s for s in sources if isinstance(s, AudioSource)]
        if len(image_sources) > self.limits.max_images:
            raise InvalidRequest(f"{len(image_sources)} images in one request, over the limit of {self.limits.max_images} "
                                 "(--media-max-images)")
        audio_marker = facts.audio.expand_token if facts.audio is not None else None
        markers = [(i, t) for i, t in enumerate(tokens) if t == facts.expand_token or t == audio_marker]
        kinds = ["audio" if isinstance(s, AudioSource) else "image" for s in sources]
        found = ["audio" if t == audio_marker else "image" for _, t in markers]
        if found != kinds:
            if "audio" not in found + kinds:
                raise InvalidRequest(f"the prompt has {len(found)} image markers for {len(kinds)} images")
            raise InvalidRequest(f"the prompt has {found.count('image')} image and {found.count('audio')} audio "
                                 f"markers for {kinds.count('image')} images and {kinds.count('audio')} audio clips")
        images = iter([self.prepared(image_bytes(src, self.limits)) for src in image_sources])
        clips = iter(self.decode_audio_all(audio_sources) if audio_sources else [])
        expanded: list[int] = []
        media = MediaInput()
        items: list[bytes] = []
        last = 0
        for at, token in markers:
            expanded.extend(tokens[last:at])
            if token == audio_marker:
                clip = next(clips)
                items.append(clip.digest_item())
                media.audio.append(self._audio_record(clip, expanded))
            else:
                image = next(images)
                items.append(image.digest_item)
                expanded.extend(facts.before)
                start = len(expanded)
                expanded.extend(facts.image_tokens(image.count, image.grid))  # Idefics3: text between its tiles
                media.images.append(MediaImage(image.pixel_values, image.grid, (start, len(expanded)), image.spatial_shapes))
                expanded.extend(facts.after)
            last = at + 1
        expanded.extend(tokens[last:])
        return expanded, media, multimodal_digest(items)

    def _audio_record(self, clip: DecodedAudio, expanded: list[int]) -> MediaAudio:
        audio = self.facts.audio
        out = self.extractor()([clip.samples], return_tensors="np", max_length=audio.max_samples, truncation=True)
        expanded.extend(audio.before)
        start = len(expanded)
        expanded.extend([audio.audio_token_id] * audio.tokens_per_clip)
        expanded.extend(audio.after)
        return MediaAudio(np.asarray(out["input_features"], dtype=np.float32),
                          np.asarray(out["input_features_mask"], dtype=bool), (start, start + audio.tokens_per_clip))

    def prepared(self, data: bytes) -> PreparedImage:
        """One image's encoded bytes, decoded and preprocessed, or the memo's result for the same bytes."""
        key = blake3(data).digest()
        found = self.memo.get(key)
        if found is not None:
            return found
        decoded = decode_image(data, self.limits)
        out = self.processor()(images=[decoded.image], return_tensors="np", **self.facts.processor_kwargs)
        count, grid = self.facts.image_token_count(out)
        pixels = np.asarray(out["pixel_values"], dtype=np.float32)
        pixels.flags.writeable = False
        shapes = tuple((int(h), int(w)) for h, w in np.asarray(out["spatial_shapes"]).reshape(-1, 2)) if "spatial_shapes" in out else ()
        image = PreparedImage(decoded.digest_item(), pixels, count, grid, shapes)
        self.memo.put(key, image)
        return image


def raw_media_sources(facts: Any, items: list[str]) -> tuple[list[Any], list[bool]]:
    """A raw prompt's ``multimodal_data`` items as sources, audio told from images by the bytes
    (llama-server's rule): ``(sources, is_audio)``. Audio on a model without an audio tower: 400."""
    sources: list[Any] = []
    kinds: list[bool] = []
    for item in items:
        try:
            head = base64.b64decode(item[:64] + "=" * (-len(item[:64]) % 4), validate=False)
        except (binascii.Error, ValueError):
            head = b""  # refused as bad base64 when the image is decoded
        audio = is_audio(head)
        if audio and (facts.audio is None):
            raise InvalidRequest("audio input is not supported by this model")
        sources.append(AudioSource(item) if audio else item)
        kinds.append(audio)
    return sources, kinds


def marked_prompt_tokens(tokenizer: Any, facts: Any, prompt: str, n_items: int,
                         kinds: list[bool] | None = None) -> list[int]:
    """A raw prompt's tokens with each media marker replaced by what the model's chat template
    writes for an image (``facts.marker``: Qwen2-VL's ``<|vision_start|><|image_pad|><|vision_end|>``,
    Gemma 3's ``<start_of_image>``, LLaVA's ``<image>``), to be expanded by ``prepare``."""
    pieces = prompt.split(MEDIA_MARKER)
    if len(pieces) - 1 != n_items:
        raise InvalidRequest(f"the prompt has {len(pieces) - 1} media markers ({MEDIA_MARKER}) for {n_items} "
                             "multimodal_data items")
    tokens = list(tokenizer.encode(pieces[0], add_special_tokens=True))
    for piece, audio in zip(pieces[1:], kinds or [False] * n_items):
        marker = facts.audio.marker if audio else facts.marker
        tokens += list(marker) + list(tokenizer.encode(piece, add_special_tokens=False))
    return tokens
