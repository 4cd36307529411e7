"""The LoRA tests' model and adapters (``lorakit``), built once for the package."""

from __future__ import annotations

import pytest
from lorakit import build


@pytest.fixture(scope="package")
def lora_model(tmp_path_factory) -> dict:
    """The tiny model's folder, its adapters' folders, and transformers models of the base and
    of each adapter merged (float32)."""
    return build(tmp_path_factory.mktemp("lora"))
