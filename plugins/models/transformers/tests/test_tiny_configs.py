"""Every causal-LM type of the installed transformers gets a tiny config from
`pagoda_models_transformers.tiny` whose transformers model builds small (at most ~1M parameters)
and runs a 12-token forward on the CPU, keeping each kind of layer the full config has; or the
type is one that `tiny` declines, with its reason (shown as the skip reason, `-ra`).

The whole file runs in well under two minutes on two cores (`OMP_NUM_THREADS=1`)."""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch
from pagoda_models_transformers.tiny import (
    TINY_HIDDEN,
    build_hf_model,
    causal_lm_types,
    hf_reference,
    param_bound,
    tiny_config,
    tiny_config_or_reason,
    tiny_input_ids,
)
from transformers import CONFIG_MAPPING

TYPES = causal_lm_types()
PROMPT_LEN = 12
# Transformers 5.25 has 200 causal-LM types, 195 of which build; a drop below this means the
# generic rules broke on types they used to handle.
MIN_BUILDING = 185
# Layer-kind lists whose set of kinds the tiny config must keep (a Gemma 3 every-sixth-global
# pattern keeps a global layer, a hybrid keeps its attention layers).
KIND_LISTS = ("layer_types", "layers_block_type", "mlp_layer_types", "block_types")
# Types whose tiny config adds kinds on purpose: the class defaults to one kind where the
# released models mix several (see `_OVERRIDES` in tiny.py).
MORE_KINDS = {"cohere_compass_text", "lfm2", "lfm2_moe"}


def _declined(reason: str) -> bool:
    """A reason that `tiny` states on purpose, not a failure of its generic rules."""
    return not reason.startswith(("config does not build", "no config class"))


def _kinds(cfg) -> dict[str, set[str]]:
    text = cfg.get_text_config(decoder=True)
    out = {}
    for name in KIND_LISTS:
        try:
            value = getattr(text, name, None)
        except Exception:  # a per-layer attribute of a heterogeneous config
            continue
        if isinstance(value, (list, tuple)):
            out[name] = {repr(v) for v in value}
    return out


def test_enough_types_have_tiny_configs() -> None:
    results = {t: tiny_config_or_reason(t) for t in TYPES}
    failed = {t: why for t, (cfg, why) in results.items() if cfg is None and not _declined(why)}
    declined = {t: why for t, (cfg, why) in results.items() if cfg is None and _declined(why)}
    built = len(TYPES) - len(failed) - len(declined)
    assert not failed, f"configs that no longer build: {failed}"
    assert built >= MIN_BUILDING, f"{built}/{len(TYPES)} build; declined: {declined}"


@pytest.mark.parametrize("model_type", TYPES)
def test_tiny_model_builds_and_runs(model_type: str) -> None:
    cfg, reason = tiny_config_or_reason(model_type)
    if cfg is None:
        if _declined(reason):
            pytest.skip(f"{model_type}: {reason}")
        pytest.fail(f"{model_type}: {reason}")
    text = cfg.get_text_config(decoder=True)
    hidden = getattr(text, "hidden_size", None)
    assert hidden is None or hidden <= TINY_HIDDEN

    model = build_hf_model(cfg)
    params = sum(p.numel() for p in model.parameters())
    assert params <= param_bound(model_type), f"{params} parameters"

    ids = tiny_input_ids(cfg, length=PROMPT_LEN)
    with torch.no_grad():
        logits = model(input_ids=ids, use_cache=False).logits
    assert logits.shape[:2] == (1, PROMPT_LEN)
    assert logits.shape[-1] >= int(ids.max()) + 1
    assert torch.isfinite(logits).all()

    # Each kind of layer of the full-size default config is still there.
    try:
        full = _kinds(CONFIG_MAPPING[model_type]())
    except Exception:  # a class whose own defaults do not build: nothing to keep
        full = {}
    tiny = _kinds(cfg)
    for name, kinds in full.items():
        if name in tiny and model_type not in MORE_KINDS:
            assert tiny[name] == kinds, f"{name}: {sorted(tiny[name])} kept of {sorted(kinds)}"


def test_input_ids_avoid_special_tokens() -> None:
    """A multimodal config's image placeholder (moved into the tiny vocabulary) never appears in
    the test prompt: the model would look for an image."""
    cfg = tiny_config("gemma3")
    ids = tiny_input_ids(cfg, length=200, batch=4, seed=1)
    vocab = cfg.get_text_config().vocab_size
    specials = {cfg.image_token_id, cfg.boi_token_id, cfg.eoi_token_id}
    assert int(ids.max()) < vocab
    assert specials.isdisjoint(ids.flatten().tolist())
    assert max(specials) < vocab


def test_hf_reference_is_the_seeded_models_logits() -> None:
    cfg = tiny_config("llama")
    ids = tiny_input_ids(cfg, length=PROMPT_LEN)
    ref = hf_reference(cfg, ids[0])  # one sequence, without the batch dimension
    with torch.no_grad():
        direct = build_hf_model(cfg, seed=0)(input_ids=ids).logits
    assert ref.shape == (1, PROMPT_LEN, cfg.vocab_size)
    torch.testing.assert_close(ref, direct, rtol=0, atol=0)
    assert not torch.equal(ref, hf_reference(cfg, ids, seed=1))
    torch.testing.assert_close(ref, hf_reference(cfg, ids, attn_implementation="sdpa"))


def test_tiny_configs_keep_model_shapes() -> None:
    """Spot checks of the rules: GQA, MLA, MoE, sliding windows and layer patterns."""
    llama = tiny_config("llama")
    assert (llama.hidden_size, llama.num_attention_heads, llama.num_key_value_heads) == (64, 4, 2)
    assert llama.max_position_embeddings >= 512 and llama.vocab_size == 256

    g3 = tiny_config("gemma3_text")  # every sixth layer global
    assert g3.layer_types == ["sliding_attention"] * 5 + ["full_attention"]
    assert g3.sliding_window == 8

    oss = tiny_config("gpt_oss")  # alternating, MoE
    assert set(oss.layer_types) == {"sliding_attention", "full_attention"}
    assert (oss.num_local_experts, oss.num_experts_per_tok) == (4, 2)

    v3 = tiny_config("deepseek_v3")  # MLA: a dense layer, then MoE
    assert (v3.kv_lora_rank, v3.qk_rope_head_dim, v3.qk_head_dim) == (32, 8, 24)
    assert v3.first_k_dense_replace == 1 and v3.num_hidden_layers == 2
    assert v3.n_routed_experts % v3.n_group == 0

    g4 = tiny_config("gemma4_text")  # the global layers' wider heads stay twice as wide
    sliding, full = g4.per_layer_config[0], g4.per_layer_config[5]
    assert (sliding.head_dim, full.head_dim) == (16, 32)


def test_import_is_light() -> None:
    """Importing the module pulls in neither torch nor transformers (the engine imports it on
    paths that never build a model)."""
    code = (
        "import sys, pagoda_models_transformers.tiny; "
        "assert not {'torch', 'transformers'} & set(sys.modules), sorted(sys.modules)"
    )
    subprocess.run([sys.executable, "-c", code], check=True)
