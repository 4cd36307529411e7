"""Configuration tests run with no ``PAGODA_`` configuration variable from the caller's shell."""

from __future__ import annotations

import os

import pytest


@pytest.fixture(autouse=True)
def _clean_pagoda_env(monkeypatch: pytest.MonkeyPatch) -> None:
    for var in list(os.environ):
        if var.upper().startswith("PAGODA_") and "__" in var:
            monkeypatch.delenv(var)
