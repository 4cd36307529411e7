"""Image parts of chat messages (OpenAI's shape) for ``LLM.chat``: each part's place in the text
and the image it names."""

from __future__ import annotations

from typing import Any

from pagoda.multimodal.media import MediaLimits, MediaSource, fetch_image


def split_images(
    conversation: list[dict[str, Any]], image_text: str
) -> tuple[list[dict[str, Any]], list[Any]]:
    """The messages with list contents joined into text, each image part replaced by
    ``image_text`` (the model's placeholder); and the parts' images in order: an ``image_url``
    part's URL (``{"image_url": {"url": ...}}``), or an ``image`` part's image (``{"type":
    "image", "image": a PIL image, array or bytes}``)."""
    out: list[dict[str, Any]] = []
    images: list[Any] = []
    for message in conversation:
        content = message.get("content")
        if not isinstance(content, list):
            out.append(message)
            continue
        text = []
        for part in content:
            kind = part.get("type")
            if kind == "text":
                text.append(part["text"])
            elif kind == "image_url":
                value = part.get("image_url")
                images.append(value.get("url") if isinstance(value, dict) else value)
                text.append(image_text)
            elif kind == "image":
                images.append(part.get("image"))
                text.append(image_text)
            else:
                raise ValueError(f"content parts of type {kind!r} are not supported")
        out.append({**message, "content": "".join(text)})
    return out, images


def load_chat_images(images: list[Any], source: MediaSource, limits: MediaLimits) -> list[Any]:
    """URLs fetched (``fetch_image``); images given as such are kept for the processor."""
    return [fetch_image(i, source, limits) if isinstance(i, str) else i for i in images]
