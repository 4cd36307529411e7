"""The FP8 tests' tiny model, written once for the package in each checkpoint layout."""

from __future__ import annotations

from pathlib import Path

import pytest
from fp8kit import build


@pytest.fixture(scope="package")
def fp8_folders(tmp_path_factory) -> dict[str, Path]:
    return build(tmp_path_factory.mktemp("fp8"))
