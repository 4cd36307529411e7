"""Everything a throughput run fixes before the first engine starts: the workload, the engine
configuration, the weights, the prompts, and what the roofline needs (bandwidth, bytes)."""

from __future__ import annotations

import argparse
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from pagoda.bench.workloads import (
    Workload,
    make_output_lens,
    make_prompts,
    nano_draws,
    resolve_workload,
)


@dataclass
class Run:
    workload: Workload
    config: Any  # EngineConfig
    info: Any  # ModelInfo
    model_label: str
    weights: dict[str, Any]
    prompts: list[list[int]]
    out_lens: list[int]
    pad_id: int
    # (n, length, seed) -> n prompts of that length, other than the workload's for any seed
    prompt_source: Callable[[int, int, int], list[list[int]]]
    peers: tuple[str, ...]
    roofline: bool
    bandwidth: float
    weight_bytes: int | None
    kv_per_token: int


def prepare(args: argparse.Namespace, config: Any) -> Run:
    # NOTE: torch is imported only where this runs, so importing this module stays light.
    import torch

    # NOTE: torch and the engine load when a benchmark runs, not when the CLI builds its parser.
    from pagoda.bench.device import copy_bandwidth
    from pagoda.bench.random_weights import ensure_random_weights
    from pagoda.bench.roofline import decode_weight_bytes
    from pagoda.loader import load_tokenizer
    from pagoda.model_info import ModelInfo

    model_given = config.source_of("model.model") != "default"
    if args.random_weights and model_given:
        raise ValueError("give either a model (--model) or --random-weights, not both")
    wl = resolve_workload(args, model_given)
    config = _with_defaults(config, wl.engine)
    weights: dict[str, Any] = {"source": "model"}
    label = None
    if wl.random_weights is not None:
        cuda = config.model.device != "cpu" and torch.cuda.is_available()
        device = torch.device("cuda" if cuda else "cpu")
        folder, weights = ensure_random_weights(wl.random_weights, wl.weights_seed, device)
        weights = {"source": "random", "config": str(wl.random_weights), **weights}
        config = config.with_overrides({"model": {"model": str(folder)}})
        label = wl.random_weights.resolve().name
    info = ModelInfo.from_config(config)
    tokenizer = load_tokenizer(info.tokenizer)
    special = set(getattr(tokenizer, "all_special_ids", []) or [])
    vocab = min(info.shape.vocab_size, len(tokenizer))

    def prompt_source(n: int, length: int, seed: int) -> list[list[int]]:
        return make_prompts(n, length, length, vocab, [wl.dataset_seed, 2, seed], special)

    n, (ilo, ihi), (olo, ohi) = wl.num_prompts, wl.input_len, wl.output_len
    if wl.draws == "nano":
        prompts, out_lens = nano_draws(n, wl.dataset_seed, ilo, ihi)
    else:
        prompts = make_prompts(n, ilo, ihi, vocab, wl.dataset_seed, special)
        out_lens = make_output_lens(n, olo, ohi, wl.dataset_seed)
    if ihi + ohi > info.max_model_len:
        raise ValueError(
            f"input up to {ihi} plus output up to {ohi} tokens exceeds max_model_len="
            f"{info.max_model_len}; raise --max-model-len or shorten the workload"
        )
    if args.skip_hf or wl.peers == "none":
        peer_names: tuple[str, ...] = ()
    else:
        peer_names = ("cb", "static") if wl.peers == "all" else (wl.peers,)
    try:
        weight_bytes = decode_weight_bytes(info.hf_dir, info.dtype.itemsize)
    except FileNotFoundError:  # random weights drawn by Pagoda itself (load_format=dummy)
        weight_bytes = None
    # NOTE: measured before any engine holds the GPU's memory.
    bandwidth = copy_bandwidth(info.device, iters=20 if info.device.type == "cuda" else 5)
    pad = tokenizer.pad_token_id
    return Run(
        workload=wl,
        config=config,
        info=info,
        model_label=label or info.name,
        weights=weights,
        prompts=prompts,
        out_lens=out_lens,
        pad_id=pad if pad is not None else 0,
        prompt_source=prompt_source,
        peers=peer_names,
        roofline=wl.roofline if wl.roofline is not None else info.device.type == "cuda",
        bandwidth=bandwidth,
        weight_bytes=weight_bytes,
        kv_per_token=info.shape.kv_bytes_per_token(info.dtype.itemsize),
    )


def _with_defaults(config: Any, engine: dict[str, Any]) -> Any:
    """``config`` with a preset's engine settings where the user left the default."""
    # NOTE: torch and the engine load when a benchmark runs, not when the CLI builds its parser.
    from pagoda.config.loader import flat_names

    names = flat_names()
    nested: dict[str, dict[str, Any]] = {}
    for flat, value in engine.items():
        section, key = names[flat]
        if config.source_of(f"{section}.{key}") == "default":
            nested.setdefault(section, {})[key] = value
    return config.with_overrides(nested) if nested else config
