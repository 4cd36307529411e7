"""An image to a text-only model (SmolLM2) is a 400 naming it; the server serves on."""

from __future__ import annotations

import base64

import openai
import pytest

# A valid 1x1 PNG.
PNG = base64.b64decode(
    "iVBORw0KGgoAAAANSUhEUgAAAAEAAAABCAYAAAAfFcSJAAAADUlEQVR42mP8z8BQDwAEhQGAhKmMIQAAAABJRU5E"
    "rkJggg=="
)


def test_an_image_to_a_text_only_model_is_a_400_naming_it(client, model_name):
    url = "data:image/png;base64," + base64.b64encode(PNG).decode()
    parts = [{"type": "text", "text": "Hi"}, {"type": "image_url", "image_url": {"url": url}}]
    messages = [{"role": "user", "content": parts}]
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model=model_name, messages=messages, max_tokens=2)
    assert "takes text only" in str(e.value)
    ok = client.chat.completions.create(
        model=model_name, messages=[{"role": "user", "content": "Hi"}], max_tokens=2
    )
    assert ok.choices[0].message.content is not None
