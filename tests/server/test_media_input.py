"""Request images (``server/media.py``): sources, limits and the multimodal digest, without a server.

The digest is over decoded pixels: the same picture as PNG and as lossless WebP, or behind a data
URI and raw base64, gives one ``mm_digest``; swapping two images changes it. Each limit is a 400
(``InvalidRequest``) that names it, found before the pixels are decoded where it can be."""

from __future__ import annotations

import base64
import io
import struct
import zlib
from typing import Any

import numpy as np
import pytest
from PIL import Image

from mlxcel_compat.cache.key import TEXT_ONLY_MM_DIGEST
from mlxcel_compat.server.errors import InvalidRequest
from mlxcel_compat.server.media import ImageInput, MediaLimits, PreparedMemo, decode_image, image_bytes
from mlxcel_compat.testing import vision


def encoded(seed: int, fmt: str = "PNG", size: tuple[int, int] = (56, 40), **save: object) -> bytes:
    pixels = np.random.default_rng(seed).integers(0, 255, (size[1], size[0], 3), dtype=np.uint8)
    out = io.BytesIO()
    Image.fromarray(pixels).save(out, format=fmt, **save)
    return out.getvalue()


def data_uri(data: bytes, mime: str = "image/png") -> str:
    return f"data:{mime};base64,{base64.b64encode(data).decode()}"


def png_header_only(width: int, height: int) -> bytes:
    """A PNG whose header claims ``width`` x ``height``, with almost no pixel data (a bomb's shape)."""
    def chunk(kind: bytes, body: bytes) -> bytes:
        return struct.pack(">I", len(body)) + kind + body + struct.pack(">I", zlib.crc32(kind + body))

    ihdr = struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0)
    return b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", ihdr) + chunk(b"IDAT", zlib.compress(b"\0" * 64)) + chunk(b"IEND", b"")


@pytest.fixture(scope="module")
def images() -> ImageInput:
    from mlxcel_compat.vision.model import vision_facts
    from tests.conftest import MODEL_CACHE

    path = vision.ensure_vision_model(MODEL_CACHE)
    import json

    return ImageInput(vision_facts(path, json.loads((path / "config.json").read_text())), MediaLimits())


def prompt_with(n: int) -> list[int]:
    pad = vision.vision_token_id("<|image_pad|>")
    start, end = vision.vision_token_id("<|vision_start|>"), vision.vision_token_id("<|vision_end|>")
    return [1, 2, 3] + [start, pad, end, 7] * n + [9]


def test_same_pixels_in_two_encodings_and_two_source_forms_give_one_digest(images: ImageInput) -> None:
    png, webp = encoded(1), encoded(1, "WEBP", lossless=True)
    assert png != webp
    sources = [data_uri(png), data_uri(webp, "image/webp"), base64.b64encode(png).decode()]
    digests = {images.prepare([src], prompt_with(1))[2] for src in sources}
    assert len(digests) == 1 and TEXT_ONLY_MM_DIGEST not in digests


def test_swapping_two_images_changes_the_digest_and_a_lossy_copy_is_another_image(images: ImageInput) -> None:
    a, b = data_uri(encoded(1)), data_uri(encoded(2))
    ab = images.prepare([a, b], prompt_with(2))[2]
    ba = images.prepare([b, a], prompt_with(2))[2]
    assert ab != ba
    jpeg = data_uri(encoded(1, "JPEG", quality=70), "image/jpeg")
    assert images.prepare([jpeg], prompt_with(1))[2] != images.prepare([a], prompt_with(1))[2]


def test_each_image_token_becomes_the_merged_patch_count_and_spans_follow(images: ImageInput) -> None:
    tokens, media, _ = images.prepare([data_uri(encoded(1)), data_uri(encoded(2, size=(28, 28)))], prompt_with(2))
    pad = vision.vision_token_id("<|image_pad|>")
    counts = [t * h * w // 4 for t, h, w in (img.grid_thw for img in media.images)]
    assert [end - start for start, end in media.spans] == counts
    for start, end in media.spans:
        assert tokens[start - 1] == vision.vision_token_id("<|vision_start|>") and set(tokens[start:end]) == {pad}
        assert tokens[end] == vision.vision_token_id("<|vision_end|>")
    assert tokens.count(pad) == sum(counts)
    assert all(img.pixel_values.shape[0] == t * h * w for img in media.images for t, h, w in [img.grid_thw])


def test_the_same_bytes_again_skip_decoding_and_give_what_a_fresh_server_gives(images: ImageInput) -> None:
    """The memo (a later turn resends the conversation's images): the same encoded bytes reuse the
    first request's processed pixels; tokens, spans, pixels and digest equal a fresh server's."""
    fresh = ImageInput(images.facts, MediaLimits())
    source = data_uri(encoded(31, size=(56, 84)))
    first = fresh.prepare([source], prompt_with(1))
    hits = fresh.memo.hits
    again = fresh.prepare([source, base64.b64encode(encoded(31, size=(56, 84))).decode()], prompt_with(2))
    assert fresh.memo.hits == hits + 2  # both: the raw base64 holds the same bytes
    assert again[1].images[0].pixel_values is first[1].images[0].pixel_values
    assert not first[1].images[0].pixel_values.flags.writeable  # shared: nobody may write it
    other = ImageInput(images.facts, MediaLimits())
    cold = other.prepare([source], prompt_with(1))
    assert cold[0] == first[0] and cold[2] == first[2] and cold[1].spans == first[1].spans
    np.testing.assert_array_equal(cold[1].images[0].pixel_values, first[1].images[0].pixel_values)
    # Other bytes of the same picture are decoded again, and get the same digest.
    lossless = data_uri(encoded(31, "WEBP", size=(56, 84), lossless=True), "image/webp")
    misses = fresh.memo.misses
    assert fresh.prepare([lossless], prompt_with(1))[2] == first[2] and fresh.memo.misses == misses + 1


def test_bad_bytes_are_refused_every_time_and_the_memo_stays_within_its_bytes(images: ImageInput) -> None:
    fresh = ImageInput(images.facts, MediaLimits())
    truncated = data_uri(encoded(1)[:200])
    for _ in range(2):
        with pytest.raises(InvalidRequest, match="failed to load image"):
            fresh.prepare([truncated], prompt_with(1))
    one = fresh.prepare([data_uri(encoded(40))], prompt_with(1))[1].images[0].pixel_values.nbytes
    memo = fresh.memo = PreparedMemo(max_bytes=2 * one)
    for seed in (40, 41, 42):  # the third pushes the first out (least recently used)
        fresh.prepare([data_uri(encoded(seed))], prompt_with(1))
    hits = memo.hits
    fresh.prepare([data_uri(encoded(42))], prompt_with(1))
    fresh.prepare([data_uri(encoded(40))], prompt_with(1))
    assert memo.hits == hits + 1 and memo._bytes <= memo.max_bytes


@pytest.mark.parametrize(
    "source, message",
    [
        (data_uri(b"hello", "text/plain"), "unsupported media type 'text/plain'"),
        ("data:image/png;base64,@@@@", "not valid base64"),
        (data_uri(encoded(1)[:200]), "failed to load image"),  # a truncated PNG
        (data_uri(b"not an image at all"), "failed to load image"),
        (data_uri(png_header_only(5000, 5000)), "over the limit of 16777216 (--media-max-pixels)"),
        (data_uri(png_header_only(20000, 20000)), "pixels"),  # 400 Mpx: refused from the header alone
        ("http://127.0.0.1:9/cat.png", "--media-fetch"),
        ("file://cat.png", "file://"),
    ],
)
def test_bad_sources_are_400s_that_say_why(source: str, message: str) -> None:
    limits = MediaLimits()
    with pytest.raises(InvalidRequest, match=message.replace("(", r"\(").replace(")", r"\)")):
        decode_image(image_bytes(source, limits), limits)


def test_count_and_byte_limits(images: ImageInput) -> None:
    with pytest.raises(InvalidRequest, match=r"1000 images in one request, over the limit of 16 \(--media-max-images\)"):
        images.prepare([data_uri(encoded(1))] * 1000, prompt_with(1000))
    small = MediaLimits(max_bytes=1000)
    with pytest.raises(InvalidRequest, match=r"--media-max-bytes"):
        image_bytes(data_uri(encoded(1, size=(200, 200))), small)


@pytest.mark.parametrize("family", ["gemma3", "llava"])
def test_fixed_size_families_expand_each_marker_between_their_own_tokens(family: str) -> None:
    """Gemma 3: ``<start_of_image>`` becomes ``\\n\\n<start_of_image>``, ``mm_tokens_per_image``
    soft tokens, ``<end_of_image>\\n\\n`` (Gemma3Processor's text); LLaVA: ``<image>`` one per
    patch. A raw prompt's media marker becomes what the template writes (one marker token)."""
    import json

    from mlx_lm.utils import load_tokenizer

    from mlxcel_compat.vision.model import vision_facts
    from mlxcel_compat.server.media import MEDIA_MARKER, marked_prompt_tokens
    from tests.conftest import MODEL_CACHE

    path = vision.ensure_vision_model(MODEL_CACHE, family)
    tokenizer = load_tokenizer(path)
    facts = vision_facts(path, json.loads((path / "config.json").read_text()), tokenizer)
    raw = marked_prompt_tokens(tokenizer, facts, f"one {MEDIA_MARKER} two {MEDIA_MARKER} end", 2)
    assert raw.count(facts.expand_token) == 2 and list(facts.marker) == [facts.expand_token]
    tokens, media, _ = ImageInput(facts, MediaLimits()).prepare([data_uri(encoded(1)), data_uri(encoded(2, size=(300, 90)))], raw)
    per_image = vision.GEMMA_TOKENS_PER_IMAGE if family == "gemma3" else (vision.IMAGE_SIZE // 14) ** 2
    assert [end - start for start, end in media.spans] == [per_image, per_image]
    for start, end in media.spans:
        assert set(tokens[start:end]) == {facts.image_token_id}
        assert tuple(tokens[start - len(facts.before) : start]) == facts.before
        assert tuple(tokens[end : end + len(facts.after)]) == facts.after
    if family == "gemma3":
        newlines = tuple(tokenizer.encode("\n\n", add_special_tokens=False))
        assert facts.before == newlines + (vision.vision_token_id("<start_of_image>", family),)
        assert facts.after == (vision.vision_token_id("<end_of_image>", family),) + newlines
    assert all(img.pixel_values.shape == (1, 3, vision.IMAGE_SIZE, vision.IMAGE_SIZE) for img in media.images)
    assert len(tokens) == len(raw) + 2 * (per_image + len(facts.before) + len(facts.after) - 1)


def test_marker_count_must_match_the_images(images: ImageInput) -> None:
    with pytest.raises(InvalidRequest, match="2 image markers for 1 images"):
        images.prepare([data_uri(encoded(1))], prompt_with(2))


@pytest.fixture(scope="module")
def image_site() -> Any:
    """A real HTTP server on loopback serving one PNG at /cat.png (404 elsewhere)."""
    import http.server
    import threading

    body = encoded(3)

    class Handler(http.server.BaseHTTPRequestHandler):
        def do_GET(self) -> None:  # noqa: N802 (http.server's name)
            if self.path != "/cat.png":
                self.send_error(404)
                return
            self.send_response(200)
            self.send_header("Content-Type", "image/png")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args: Any) -> None:
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    yield f"http://127.0.0.1:{server.server_address[1]}", body
    server.shutdown()


def test_http_images_are_fetched_only_with_media_fetch(image_site: Any, images: ImageInput) -> None:
    base, body = image_site
    with pytest.raises(InvalidRequest, match="--media-fetch"):
        image_bytes(f"{base}/cat.png", MediaLimits())
    fetching = MediaLimits(fetch=True)
    assert image_bytes(f"{base}/cat.png", fetching) == body
    # The downloaded image and the same bytes inline are one image to the cache.
    fetched = ImageInput(images.facts, fetching).prepare([f"{base}/cat.png"], prompt_with(1))[2]
    assert fetched == images.prepare([data_uri(body)], prompt_with(1))[2]
    with pytest.raises(InvalidRequest, match="HTTP 404"):
        image_bytes(f"{base}/dog.png", fetching)
    with pytest.raises(InvalidRequest, match="--media-max-bytes"):
        image_bytes(f"{base}/cat.png", MediaLimits(fetch=True, max_bytes=1000))
