"""Random weights every engine of a benchmark loads: one safetensors folder per config and seed.

transformers builds the model from a bare config.json with its own initialisation (normal, std
``initializer_range``) under a fixed seed, in bfloat16 and directly on the GPU when there is one;
the folder (weights, config, a synthetic tokenizer) is kept in Pagoda's cache and reused by later
runs, so Pagoda, and transformers' engines, all read the same weights from the same files.
"""

from __future__ import annotations

import gc
import hashlib
import json
import logging
import os
import shutil
import tempfile
import time
from pathlib import Path
from typing import Any

logger = logging.getLogger(__name__)

MARKER = "pagoda-random-weights.json"


def config_folder(config_dir: Path, into: Path) -> Path:
    """``config_dir``'s config and a synthetic tokenizer in ``into/<its name>``, no weights: for
    an engine that draws its own (``load_format=dummy``)."""
    from pagoda.loader.synthetic import synthetic_tokenizer

    cfg = json.loads((config_dir / "config.json").read_text())
    folder = into / config_dir.name
    folder.mkdir(parents=True, exist_ok=True)
    shutil.copy(config_dir / "config.json", folder / "config.json")
    # NOTE: a vision-language config keeps its vocabulary in its text part
    vocab = cfg["vocab_size"] if "vocab_size" in cfg else cfg["text_config"]["vocab_size"]
    synthetic_tokenizer(vocab, cfg["eos_token_id"]).save_pretrained(folder)
    return folder


def random_weights_dir(config_dir: Path, seed: int) -> Path:
    # NOTE: torch and the engine load when a benchmark runs, not when the CLI builds its parser.
    from pagoda.loader import cache_dir

    return cache_dir() / "random-weights" / f"{config_dir.resolve().name}-seed{seed}"


def ensure_random_weights(config_dir: Path, seed: int, device: Any) -> tuple[Path, dict[str, Any]]:
    """The folder of random weights for ``config_dir/config.json`` and ``seed``: built on the first
    call, reused afterwards while the config is unchanged. Returns it and what happened."""
    source = config_dir / "config.json"
    if not source.is_file():
        raise ValueError(f"{config_dir} has no config.json to build random weights from")
    digest = hashlib.sha256(source.read_bytes()).hexdigest()[:16]
    target = random_weights_dir(config_dir, seed)
    want = {"config_sha256": digest, "seed": seed, "dtype": "bfloat16"}
    marker = target / MARKER
    if marker.is_file() and json.loads(marker.read_text()) == want:
        return target, {"path": str(target), "built": False, **want}
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{target.name}.tmp-", dir=target.parent))
    start = time.perf_counter()
    try:
        logger.info("building random weights for %s (seed %d) in %s", config_dir, seed, target)
        _build(source, seed, device, tmp)
        (tmp / MARKER).write_text(json.dumps(want) + "\n")
        if target.exists():  # built from another config.json, or an interrupted build
            shutil.rmtree(target)
        os.replace(tmp, target)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    info = {"path": str(target), "built": True, "build_s": round(time.perf_counter() - start, 1)}
    return target, {**info, **want}


def _build(source: Path, seed: int, device: Any, out: Path) -> None:
    # NOTE: torch is imported only where this runs, so importing this module stays light.
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    # NOTE: torch and the engine load when a benchmark runs, not when the CLI builds its parser.
    from pagoda.loader.synthetic import synthetic_tokenizer

    cfg = json.loads(source.read_text())
    config = AutoConfig.from_pretrained(source.parent)
    torch.manual_seed(seed)
    # NOTE: built where it will run, so an 8B model never sits in host memory in float32.
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16).eval()
    check_logits(model, cfg["vocab_size"])
    model.save_pretrained(out)
    del model
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()
    eos = cfg.get("eos_token_id")
    eos = eos[0] if isinstance(eos, list) else eos
    synthetic_tokenizer(cfg["vocab_size"], eos).save_pretrained(out)


def check_logits(model: Any, vocab: int) -> None:
    """Refuse weights whose logits carry no signal: not finite, or flat over the vocabulary."""
    # NOTE: torch is imported only where this runs, so importing this module stays light.
    import torch

    gen = torch.Generator().manual_seed(0)
    ids = torch.randint(2, vocab, (1, 16), generator=gen).to(model.device)
    with torch.inference_mode():
        logits = model(ids).logits[0].float()
    spread = float(logits.std(dim=-1).min())
    if not torch.isfinite(logits).all() or spread < 1e-3:
        raise RuntimeError(
            f"random weights give degenerate logits (smallest std over the vocabulary "
            f"{spread:.2g}, or not finite); check the config's initializer_range"
        )
