"""Tensor parallelism by the model's own plan (``base_model_tp_plan``): two ranks, processes over
gloo as the core's CPU tests run them, give one rank's greedy tokens and log-probabilities for
Qwen3 (4 heads over 2 KV heads: split), Gemma 2 with one KV head (replicated) and an odd
vocabulary (padded halves, tied LM head), and Qwen3-MoE (each expert's intermediate size split).
Each rank reads only its slice of the checkpoint, and the slices make the checkpoint; a size that
does not divide the model names the sizes that fit; a model without a plan this impl applies is
refused by name."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from pagoda_models_transformers.impl import TransformersModelImpl
from pagoda_models_transformers.tiny import tiny_config
from tf_parity import build_ours, hf_config_dict, hf_model, save

from pagoda import LLM, SamplingParams
from pagoda.attention.torch_native import TorchNativeBackend
from pagoda.distributed import parallel_state
from pagoda.loader import iter_safetensors
from pagoda.loader.sharded import iter_safetensors_slices

#: (model type, config changes): each split a different way.
MODELS: dict[str, tuple[str, dict[str, Any]]] = {
    "qwen3": ("qwen3", {}),
    "gemma2_one_kv_head": ("gemma2", {"num_key_value_heads": 1, "vocab_size": 251}),
    "qwen3_moe": ("qwen3_moe", {}),
}


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    out = {}
    for name, (model_type, changes) in MODELS.items():
        out[name] = save(hf_model(model_type, **changes), tmp_path_factory.mktemp(name))
    return out


def _generate(folder: Path, tp: int) -> list[Any]:
    llm = LLM(
        model=str(folder),
        model_impl="transformers",
        tensor_parallel_size=tp,
        executor="multiproc" if tp > 1 else "uniproc",
        dtype="float32",
        max_model_len=128,
        kv_cache_memory_bytes=8 << 20,
    )
    try:
        vocab = hf_config_dict(folder)["vocab_size"]
        gen = torch.Generator().manual_seed(0)
        prompts = [
            {"prompt_token_ids": torch.randint(3, vocab, (n,), generator=gen).tolist()}
            for n in (5, 19, 33)
        ]
        params = SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True, logprobs=5)
        return [o.outputs[0] for o in llm.generate(prompts, params, use_tqdm=False)]
    finally:
        llm.engine.shutdown()


@pytest.mark.slow
@pytest.mark.parametrize("name", MODELS)
def test_two_ranks_give_one_ranks_greedy_tokens_and_logprobs(
    checkpoints: dict[str, Path], name: str
) -> None:
    one, two = _generate(checkpoints[name], 1), _generate(checkpoints[name], 2)
    assert [o.token_ids for o in two] == [o.token_ids for o in one]
    for a, b in zip(one, two):
        for want, got in zip(a.logprobs, b.logprobs):
            assert want.keys() == got.keys()
            for tok in want:
                assert got[tok].logprob == pytest.approx(want[tok].logprob, abs=1e-4)


def _rank_params(folder: Path, rank: int, monkeypatch: pytest.MonkeyPatch) -> dict[str, Any]:
    """Rank ``rank`` of 2's parameters, loaded from lazy slices (no process group: building and
    loading do not communicate)."""
    monkeypatch.setattr(parallel_state, "_rank", rank)
    monkeypatch.setattr(parallel_state, "_size", 2)
    shape = TransformersModelImpl.shape(hf_config_dict(folder), 2)
    model = TransformersModelImpl.model_class(shape)(shape.config, TorchNativeBackend)
    model.load_weights(iter_safetensors_slices(folder))
    return dict(model.model.named_parameters(remove_duplicate=False))


def test_each_rank_loads_its_slice_and_the_slices_make_the_checkpoint(
    checkpoints: dict[str, Path], monkeypatch: pytest.MonkeyPatch
) -> None:
    folder = checkpoints["gemma2_one_kv_head"]
    full = dict(iter_safetensors(folder))
    p = [_rank_params(folder, r, monkeypatch) for r in range(2)]
    attn = "model.layers.0.self_attn"
    for proj, dim in (("q_proj", 0), ("o_proj", 1)):
        w = f"{attn}.{proj}.weight"
        assert torch.equal(torch.cat([x[w] for x in p], dim), full[w])
    # One KV head: each rank holds all of it.
    for r in range(2):
        assert torch.equal(p[r][f"{attn}.k_proj.weight"], full[f"{attn}.k_proj.weight"])
    # 251 rows in two halves of 126, the last padded with zeros; the LM head is the embedding.
    emb = torch.cat([x["model.embed_tokens.weight"] for x in p])
    assert emb.shape[0] == 252 and not emb[251:].any()
    assert torch.equal(emb[:251], full["model.embed_tokens.weight"])
    assert p[1]["lm_head.weight"] is p[1]["model.embed_tokens.weight"]


def test_each_rank_holds_its_slice_of_every_expert(
    checkpoints: dict[str, Path], monkeypatch: pytest.MonkeyPatch
) -> None:
    folder = checkpoints["qwen3_moe"]
    full = dict(iter_safetensors(folder))  # per-expert tensors, as save_pretrained writes them
    p = [_rank_params(folder, r, monkeypatch) for r in range(2)]
    experts = "model.layers.0.mlp.experts"
    gate_up = [x[f"{experts}.gate_up_proj"] for x in p]
    down = [x[f"{experts}.down_proj"] for x in p]
    inter = gate_up[0].shape[1] // 2
    for e in (0, 3):
        for half, proj in enumerate(("gate_proj", "up_proj")):
            rows = torch.cat([g[e, half * inter : (half + 1) * inter] for g in gate_up])
            assert torch.equal(rows, full[f"{experts}.{e}.{proj}.weight"])
        assert torch.equal(
            torch.cat([d[e] for d in down], 1), full[f"{experts}.{e}.down_proj.weight"]
        )


@pytest.mark.parametrize(
    ("model_type", "param"),
    [
        ("sarvam_moe", "model.layers.0.self_attn.q_proj.weight"),  # a fused qkv in the file
        ("apertus", "model.layers.0.mlp.up_proj.weight"),  # scalar weights (its activation's)
    ],
)
def test_checkpoints_that_conversions_reshape_load_each_ranks_slice(
    model_type: str, param: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    folder = save(hf_model(model_type), tmp_path)
    whole = dict(build_ours(folder).model.named_parameters())[param]
    p = [_rank_params(folder, r, monkeypatch) for r in range(2)]
    assert torch.equal(torch.cat([x[param] for x in p]), whole)


def test_a_size_that_does_not_divide_names_what_and_the_sizes_that_fit() -> None:
    with pytest.raises(ValueError) as info:
        TransformersModelImpl.shape(tiny_config("qwen3").to_dict(), 3)
    msg = str(info.value)
    assert msg.startswith("tensor_parallel_size=3 does not divide Qwen3ForCausalLM's")
    assert "4 attention heads" in msg and "2 KV heads" in msg
    assert "128 features (mlp.gate_proj, mlp.up_proj, mlp.down_proj)" in msg  # intermediate
    assert msg.endswith("sizes that fit: 1, 2, 4")


def test_an_expert_size_that_does_not_divide_is_named_per_expert() -> None:
    config = {**tiny_config("qwen3_moe").to_dict(), "moe_intermediate_size": 30}
    with pytest.raises(ValueError) as info:
        TransformersModelImpl.shape(config, 4)
    assert str(info.value).endswith(
        "60 features per expert, in two packed halves (experts.gate_up_proj) nor 30 features "
        "per expert (experts.down_proj); sizes that fit: 1, 2"
    )


@pytest.mark.parametrize(
    ("model_type", "reason"),
    [
        ("stablelm", "StableLmForCausalLM has no tensor-parallel plan"),
        ("gpt_oss", "GptOssForCausalLM's tensor-parallel plan splits only its embedding and LM"),
        ("gemma3n_text", "Gemma3nForCausalLM uses activation sparsity \\(statistics over the"),
    ],
)
def test_a_model_without_a_plan_it_can_apply_is_refused_by_name(
    model_type: str, reason: str
) -> None:
    config = tiny_config(model_type).to_dict()
    assert TransformersModelImpl.supports(config, "") is None  # served at one rank
    with pytest.raises(ValueError, match=reason):
        TransformersModelImpl.shape(config, 2)
