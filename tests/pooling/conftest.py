"""Tiny random pooling models, saved once per session (no downloads)."""

from __future__ import annotations

from pathlib import Path

import pytest
from pooling_models import (
    bert_config,
    qwen3_config,
    randomize,
    save_hf,
    st_pipeline,
)


@pytest.fixture(scope="session")
def pool_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("pooling")


@pytest.fixture(scope="session")
def bert_dir(pool_dir: Path) -> Path:
    from transformers import BertModel

    return save_hf(randomize(BertModel(bert_config()), 1), pool_dir / "bert", pool_dir / "tok")


@pytest.fixture(scope="session")
def qwen3_dir(pool_dir: Path) -> Path:
    from transformers import Qwen3Model

    return save_hf(randomize(Qwen3Model(qwen3_config()), 2), pool_dir / "qwen3", pool_dir / "tok")


@pytest.fixture(scope="session")
def st_dirs(pool_dir: Path, bert_dir: Path, qwen3_dir: Path):
    """(body, pooling mode, normalize) -> a saved sentence-transformers pipeline."""
    made: dict[tuple[str, str, bool], Path] = {}

    def get(body: str, pooling: str, normalize: bool) -> Path:
        key = (body, pooling, normalize)
        if key not in made:
            src = bert_dir if body == "bert" else qwen3_dir
            made[key] = st_pipeline(src, pool_dir / f"st_{body}_{pooling}_{normalize}", *key[1:])
        return made[key]

    return get
