"""Each attention feature the impl reads from transformers' code is visible: with weights scaled
so that it matters, the paged parity holds with the layer's spec as read, and fails by at least
1e-2 with the feature dropped from the spec (a negative control: the parity check can fail)."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from tf_parity import build_ours, hf_model, max_logit_error, run_scenario, save

from pagoda.attention.spec import AttentionSpec


def _scale_qk(factor: float) -> Callable[[Any], None]:
    """Query and key projections scaled: large attention logits (peaked softmax)."""

    def tweak(model: Any) -> None:
        for name, p in model.named_parameters():
            if name.endswith(("q_proj.weight", "k_proj.weight")):
                p.mul_(factor)

    return tweak


def _large_sinks(model: Any) -> None:
    for name, p in model.named_parameters():
        if name.endswith("sinks"):
            p.uniform_(1.0, 3.0)


# (model type, weight tweak, config overrides, the field the spec must carry, the spec without it)
CASES: dict[str, tuple[str, Callable[[Any], None], dict[str, Any], Callable, Callable]] = {
    "sliding_window": (
        "gemma3_text",
        _scale_qk(3.0),
        {},
        lambda s: s.sliding_window == 8,
        lambda s: dataclasses.replace(s, sliding_window=None),
    ),
    "logit_softcap": (
        "gemma2",
        _scale_qk(10.0),
        {"attn_logit_softcapping": 2.0},
        lambda s: s.logit_softcap == 2.0,
        lambda s: dataclasses.replace(s, logit_softcap=None),
    ),
    "sinks": (
        "gpt_oss",
        _large_sinks,
        {},
        lambda s: s.sinks,
        lambda s: dataclasses.replace(s, sinks=False),
    ),
}


@pytest.mark.parametrize("feature", CASES)
def test_feature_is_read_from_transformers_and_dropping_it_breaks_parity(
    feature: str, tmp_path: Path
) -> None:
    model_type, tweak, overrides, carried, drop = CASES[feature]
    hf = hf_model(model_type, tweak=tweak, **overrides)
    folder = save(hf, tmp_path)
    ours = build_ours(folder)
    specs: list[AttentionSpec] = [layer.spec for layer in ours.attn_layers]
    assert any(carried(s) for s in specs), f"no layer's spec carries {feature}: {specs}"
    vocab = hf.config.vocab_size
    assert max_logit_error(hf, run_scenario(ours, vocab)) < 1e-4
    dropped = build_ours(folder, drop=drop)
    assert max_logit_error(hf, run_scenario(dropped, vocab)) >= 1e-2


def test_window_layers_follow_the_layer_types(tmp_path: Path) -> None:
    """Gemma 3's pattern: five sliding layers, then a full one, each as transformers builds it."""
    hf = hf_model("gemma3_text")
    ours = build_ours(save(hf, tmp_path))
    kinds = hf.config.layer_types
    windows = [layer.spec.sliding_window for layer in ours.attn_layers]
    assert windows == [8 if k == "sliding_attention" else None for k in kinds]
