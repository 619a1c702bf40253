"""Images as clients send them to a conversation: data URLs (``data:image/png;base64,…``,
what OpenAI's Realtime ``input_image`` and Chat Completions ``image_url`` parts carry).

`check_data_url` validates one when the client sends it (so a bad image is the client's
error on the event that carried it, never a failed answer later) and `open_data_url`
opens it for a thinker's processor (Pillow, RGB). The server fetches nothing: an
``http(s)://`` URL is refused with a clear error, as a server without outbound access
must.
"""

from __future__ import annotations

import base64
import binascii
import io
import re
from typing import Any

FORMATS = ("png", "jpeg", "jpg", "webp", "gif")
MAX_BYTES = 20 * 1024 * 1024  # OpenAI's limit per image
MAX_PIXELS = 36_000_000  # decompression bombs: larger images are refused before decoding
_DATA_URL = re.compile(r"data:image/([a-z]+);base64,(.*)", re.S)


class ImageError(ValueError):
    """Why an image cannot be used, phrased for the client."""


def _decode(url: Any) -> bytes:
    if not isinstance(url, str) or not url:
        raise ImageError("must be a data URL string (data:image/png;base64,...)")
    m = _DATA_URL.fullmatch(url.strip())
    if m is None:
        if url.startswith(("http://", "https://")):
            raise ImageError("is a web URL; this server fetches nothing: send the image inline as a data URL (data:image/png;base64,...)")
        raise ImageError("is not a data URL of an image (data:image/<png|jpeg|webp|gif>;base64,...)")
    if m[1] not in FORMATS:
        raise ImageError(f"has media type image/{m[1]}; supported: image/png, image/jpeg, image/webp, image/gif")
    if len(m[2]) > MAX_BYTES * 4 // 3 + 4:
        raise ImageError(f"is over {MAX_BYTES // (1024 * 1024)} MB")
    try:
        return base64.b64decode(m[2], validate=True)
    except (binascii.Error, ValueError):
        raise ImageError("is not valid base64") from None


def _open(raw: bytes) -> Any:
    from PIL import Image

    try:
        img = Image.open(io.BytesIO(raw))
        w, h = img.size
    except Exception as exc:  # PIL raises many kinds for a bad file
        raise ImageError(f"cannot be read as an image ({type(exc).__name__})") from None
    if w * h > MAX_PIXELS:
        raise ImageError(f"is {w}x{h} pixels; at most {MAX_PIXELS // 1_000_000} megapixels")
    return img


def check_data_url(url: Any) -> tuple[int, int]:
    """The image's (width, height); `ImageError` when it is not a usable image (the
    whole file is decoded, so a truncated one is caught here)."""
    img = _open(_decode(url))
    try:
        img.load()
    except Exception as exc:
        raise ImageError(f"cannot be decoded ({type(exc).__name__}: {exc})") from None
    return int(img.size[0]), int(img.size[1])


def open_data_url(url: str) -> Any:
    """The image as an RGB `PIL.Image.Image` (its first frame for an animation)."""
    img = _open(_decode(url))
    return img.convert("RGB")
