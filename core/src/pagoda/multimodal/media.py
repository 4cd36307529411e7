"""Images from what users send: PIL images, arrays, bytes, data URIs, local files under an allowed
root, http(s) URLs when fetching is on. Every refusal is a ``ValueError`` of one line that names
the problem (the server answers it with a 400)."""

from __future__ import annotations

import base64
import binascii
import io
import os
from dataclasses import dataclass
from typing import Any
from urllib.parse import unquote, urlparse

import numpy as np


@dataclass(frozen=True)
class MediaLimits:
    max_image_pixels: int = 16_777_216
    max_image_bytes: int = 20_000_000


@dataclass(frozen=True)
class MediaSource:
    """Where an ``image_url`` may come from (the server's settings)."""

    allowed_local_media_path: str | None = None
    allow_remote_media: bool = False
    fetch_timeout_s: float = 10.0


def _pil() -> Any:
    # NOTE: Pillow is imported only where an image is decoded.
    from PIL import Image

    return Image


def load_image(item: Any, limits: MediaLimits) -> Any:
    """An RGB ``PIL.Image`` from a PIL image, an HWC uint8 array or encoded bytes."""
    Image = _pil()
    if isinstance(item, Image.Image):
        image = item
    elif isinstance(item, np.ndarray):
        if item.ndim != 3 or item.shape[2] not in (1, 3, 4) or item.dtype != np.uint8:
            raise ValueError(
                "an image array must be uint8 of shape (height, width, channels) with 1, 3 or 4"
                f" channels; got {item.dtype} {item.shape}"
            )
        _check_pixels(item.shape[1], item.shape[0], limits)
        image = Image.fromarray(item[..., 0] if item.shape[2] == 1 else item)
    elif isinstance(item, (bytes, bytearray, memoryview)):
        image = decode_image(bytes(item), limits)
    else:
        raise TypeError(
            "an image is a PIL image, a uint8 array (height, width, channels) or encoded bytes;"
            f" got {type(item).__name__}"
        )
    _check_pixels(image.width, image.height, limits)
    return image if image.mode == "RGB" else image.convert("RGB")


def decode_image(data: bytes, limits: MediaLimits) -> Any:
    if len(data) > limits.max_image_bytes:
        raise ValueError(
            f"the image has {len(data)} bytes, more than max_image_bytes={limits.max_image_bytes}"
        )
    Image = _pil()
    try:
        image = Image.open(io.BytesIO(data))
        _check_pixels(image.width, image.height, limits)  # before decoding the pixels
        image.load()
    except ValueError:
        raise
    except Exception as e:  # PIL raises many kinds for a broken file
        raise ValueError(f"the image cannot be decoded (corrupt or not an image): {e}") from e
    return image


def _check_pixels(width: int, height: int, limits: MediaLimits) -> None:
    if width * height > limits.max_image_pixels:
        raise ValueError(
            f"the image has {width}x{height} pixels, more than max_image_pixels="
            f"{limits.max_image_pixels}"
        )
    if width < 1 or height < 1:
        raise ValueError(f"the image is empty ({width}x{height} pixels)")


def fetch_image(url: str, source: MediaSource, limits: MediaLimits) -> Any:
    """The image an ``image_url`` names: a data URI, a file under the allowed root, or an
    http(s) URL when fetching is on."""
    if not isinstance(url, str) or not url:
        raise ValueError("image_url.url must be a non-empty string")
    scheme = url.split(":", 1)[0].lower() if ":" in url else ""
    if scheme == "data":
        return load_image(_data_uri_bytes(url, limits), limits)
    if scheme == "file":
        return load_image(_local_bytes(url, source, limits), limits)
    if scheme in ("http", "https"):
        if not source.allow_remote_media:
            raise ValueError(
                "image_url: fetching http(s) URLs is off on this server (allow_remote_media);"
                " send the image as a data URI"
            )
        return load_image(_remote_bytes(url, source, limits), limits)
    raise ValueError(
        f"image_url: unsupported URL scheme {scheme or url[:16]!r}; use data:, file: or http(s):"
    )


def _data_uri_bytes(url: str, limits: MediaLimits) -> bytes:
    head, sep, payload = url[5:].partition(",")
    if not sep or not head.endswith(";base64"):
        raise ValueError("image_url: a data URI must be data:<mime>;base64,<data>")
    if len(payload) * 3 // 4 > limits.max_image_bytes + 3:
        raise ValueError(
            f"the image has about {len(payload) * 3 // 4} bytes, more than max_image_bytes="
            f"{limits.max_image_bytes}"
        )
    try:
        return base64.b64decode(payload, validate=True)
    except (binascii.Error, ValueError) as e:
        raise ValueError(f"image_url: the data URI's base64 is invalid: {e}") from e


def _local_bytes(url: str, source: MediaSource, limits: MediaLimits) -> bytes:
    root = source.allowed_local_media_path
    if root is None:
        raise ValueError(
            "image_url: local files are off on this server (allowed_local_media_path is unset)"
        )
    path = os.path.realpath(unquote(urlparse(url).path))
    base = os.path.realpath(root)
    if os.path.commonpath([path, base]) != base:
        raise ValueError(f"image_url: {path!r} is outside allowed_local_media_path")
    try:
        size = os.path.getsize(path)
        if size > limits.max_image_bytes:
            raise ValueError(
                f"the image has {size} bytes, more than max_image_bytes={limits.max_image_bytes}"
            )
        with open(path, "rb") as f:
            return f.read()
    except OSError as e:
        raise ValueError(f"image_url: cannot read {path!r}: {e.strerror}") from e


def _remote_bytes(url: str, source: MediaSource, limits: MediaLimits) -> bytes:
    # NOTE: httpx is imported only where a URL is fetched.
    import httpx

    chunks, total = [], 0
    try:
        with httpx.stream("GET", url, timeout=source.fetch_timeout_s) as resp:
            resp.raise_for_status()
            for chunk in resp.iter_bytes():
                total += len(chunk)
                if total > limits.max_image_bytes:
                    raise ValueError(
                        f"the image at {url!r} has more than max_image_bytes="
                        f"{limits.max_image_bytes} bytes"
                    )
                chunks.append(chunk)
    except httpx.HTTPError as e:
        raise ValueError(f"image_url: cannot fetch {url!r}: {e}") from e
    return b"".join(chunks)
