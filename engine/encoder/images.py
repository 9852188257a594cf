"""Decode OpenAI `image_url` content parts (base64 data URLs) into normalised pixel tensors."""

from __future__ import annotations

import base64
import binascii
import io
import re

import torch
from PIL import Image, UnidentifiedImageError

from engine.runtime.errors import TideflowError

MAX_ENCODED_BYTES = 20 * 2**20
MAX_PIXELS = 4096 * 4096
_DATA_URL = re.compile(r"^data:(?P<mime>image/[A-Za-z0-9.+-]+)?(?P<params>(;[^;,]+)*);base64,(?P<data>.*)$", re.S)
MEAN, STD = 0.5, 0.5


class ImageError(TideflowError):
    """An image content part cannot be used; the message says what is wrong and what is accepted."""


def decode_data_url(url: str) -> bytes:
    """Raw image bytes of a `data:image/...;base64,...` URL."""
    if not isinstance(url, str) or not url.startswith("data:"):
        shown = url[:40] if isinstance(url, str) else type(url).__name__
        raise ImageError(f"image_url.url must be a base64 data URL (data:image/png;base64,...), got {shown!r}; "
                         "remote image URLs are not fetched")
    match = _DATA_URL.match(url)
    if match is None:
        raise ImageError("image_url.url is a data URL but not base64-encoded: expected data:image/<type>;base64,<data>")
    data = re.sub(r"\s+", "", match["data"])
    if len(data) > MAX_ENCODED_BYTES * 4 // 3 + 4:
        raise ImageError(f"image_url.url carries more than {MAX_ENCODED_BYTES // 2**20} MiB of image data")
    try:
        return base64.b64decode(data, validate=True)
    except (binascii.Error, ValueError) as exc:
        raise ImageError(f"image_url.url has malformed base64 data ({exc})") from None


def load_pixels(raw: bytes, image_size: int) -> torch.Tensor:
    """RGB pixels [3, image_size, image_size] in [-1, 1], from PNG/JPEG/... bytes."""
    try:
        with Image.open(io.BytesIO(raw)) as img:
            if img.width * img.height > MAX_PIXELS:
                raise ImageError(f"image is {img.width}x{img.height}; at most {MAX_PIXELS} pixels are accepted")
            rgb = img.convert("RGB").resize((image_size, image_size), Image.Resampling.BICUBIC)
    except UnidentifiedImageError:
        raise ImageError(f"image_url data ({len(raw)} bytes) is not an image Pillow can read (PNG, JPEG, WebP, GIF, ...)") from None
    except (OSError, SyntaxError, ValueError) as exc:
        raise ImageError(f"image_url data is a damaged image ({exc})") from None
    pixels = torch.frombuffer(bytearray(rgb.tobytes()), dtype=torch.uint8).view(image_size, image_size, 3)
    return (pixels.permute(2, 0, 1).float() / 255.0 - MEAN) / STD


def image_url_of(part: dict) -> str:
    """The URL of an OpenAI `{"type": "image_url", "image_url": {"url": ...}}` part (or the bare-string form)."""
    value = part.get("image_url")
    url = value.get("url") if isinstance(value, dict) else value
    if not isinstance(url, str):
        raise ImageError("an image_url content part needs image_url.url (a base64 data URL)")
    return url
