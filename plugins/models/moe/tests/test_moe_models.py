"""Native Mixtral, Qwen2-MoE, Qwen3-MoE and OLMoE against transformers on tiny random configs
(float32, CPU): logits within 1e-4 through the paged cache and the same greedy tokens, with
negative controls that drop the top-k renormalisation or the shared expert's gate."""

from __future__ import annotations

from functools import cache
from types import SimpleNamespace

import pytest
import torch
from moe_tiny import configs, greedy, hf_model, per_expert_checkpoint
from pagoda_models_moe import layers, parallel, plugin
from pagoda_models_moe.layers import FusedMoE, MoEBlock
from pagoda_models_moe.settings import MoESettings

from pagoda.ops import batch_invariant
from pagoda.plugins import get_registry
from pagoda.testing.model_impl import build_impl_model, run_steps

PROMPT = [5, 17, 33, 9, 101, 64, 12, 88, 7]
NEW = 8
# A prompt in two chunks (the second starts mid-block and reads the cache), then decodes.
STEPS = [(5,), (4,)] + [(1,)] * (NEW - 1)


@cache
def _family(name: str) -> SimpleNamespace:
    """A family's transformers model, its checkpoint, the native model that loaded it, the
    greedy continuation and transformers' logits (built once per test session)."""
    torch.manual_seed(0)
    hf, cfg = hf_model(name)
    arch = cfg["architectures"][0]
    weights = per_expert_checkpoint(hf, arch)
    shape, model = build_impl_model("native", cfg, weights=weights)
    tokens = greedy(hf, PROMPT, NEW)
    with torch.no_grad():
        want = hf(torch.tensor([PROMPT + tokens[:-1]])).logits[0]
    return SimpleNamespace(name=name, hf=hf, cfg=cfg, shape=shape, model=model,
                           weights=weights, tokens=tokens, want=want)  # fmt: skip


@pytest.fixture(params=list(configs()))
def family(request) -> SimpleNamespace:
    return _family(request.param)


def _logits(model: torch.nn.Module, tokens: list[int]) -> torch.Tensor:
    with torch.no_grad():
        (got,) = run_steps(model, [PROMPT + tokens[:-1]], STEPS)
    return got


def test_native_serves_every_moe_family_by_its_architecture(family) -> None:
    assert family.shape.architecture == family.cfg["architectures"][0]
    assert type(family.model).__name__ == "MoEForCausalLM"
    assert get_registry("models").get(family.shape.architecture) is type(family.model)


def test_logits_match_transformers_and_greedy_tokens_are_identical(family) -> None:
    got = _logits(family.model, family.tokens)
    assert (got - family.want).abs().max() <= 1e-4
    # Each greedy token is the argmax of the logits before it: the same continuation.
    assert got[len(PROMPT) - 1 :].argmax(-1).tolist() == family.tokens


def _blocks(model: torch.nn.Module) -> list[MoEBlock]:
    return [m for m in model.modules() if isinstance(m, MoEBlock)]


def test_dropping_the_top_k_renormalisation_changes_the_tokens(family) -> None:
    """Negative control: the routing weights matter in these configs (Mixtral and Qwen3-MoE
    renormalise; the others do not, so turning it on is the control for them)."""
    blocks = _blocks(family.model)
    before = [b.renormalize for b in blocks]
    try:
        for b in blocks:
            b.renormalize = not b.renormalize
        got = _logits(family.model, family.tokens)
    finally:
        for b, r in zip(blocks, before, strict=True):
            b.renormalize = r
    assert (got - family.want).abs().max() > 1e-2  # the parity test's 1e-4 fails by far
    if any(before):  # the families that renormalise lose their greedy tokens without it
        assert got.argmax(-1).tolist() != family.want.argmax(-1).tolist()


class _Open(torch.nn.Module):
    """A shared-expert gate that is always open: as if the model dropped it."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x.new_full((x.shape[0], 1), 40.0)


def test_dropping_the_shared_experts_gate_changes_the_tokens() -> None:
    family = _family("qwen2_moe")  # the family with a shared expert
    blocks = _blocks(family.model)
    gates = [b.shared_expert_gate for b in blocks]
    try:
        for b in blocks:
            b.shared_expert_gate = _Open()
        got = _logits(family.model, family.tokens)
    finally:
        for b, g in zip(blocks, gates, strict=True):
            b.shared_expert_gate = g
    assert (got - family.want).abs().max() > 1e-2
    assert got.argmax(-1).tolist() != family.want.argmax(-1).tolist()


def test_stacked_transformers_weights_load_as_the_per_expert_files_do() -> None:
    family = _family("qwen3_moe")  # one family: the loader's path is the same for all
    _, stacked = build_impl_model("native", family.cfg, weights=family.hf.state_dict())
    mine = dict(family.model.named_parameters())
    for name, p in stacked.named_parameters():
        assert torch.equal(p, mine[name]), name


def test_a_checkpoint_missing_an_expert_is_refused_naming_it() -> None:
    family = _family("mixtral")
    weights = {k: v for k, v in family.weights.items() if ".experts.3.w2." not in k}
    with pytest.raises(ValueError, match=r"lacks weights for: .*layers\.\d\.mlp\.experts"):
        build_impl_model("native", family.cfg, weights=weights)


def test_moe_block_is_batch_invariant_in_that_mode() -> None:
    family = _family("qwen2_moe")  # routing, experts and the shared expert
    (block,) = _blocks(family.model)
    x = torch.randn(70, 64, generator=torch.Generator().manual_seed(5))
    batch_invariant.set_batch_invariant(True)
    try:
        with torch.no_grad():
            whole = block(x)
            alone = [block(x[i : i + 1]) for i in (0, 33, 69)]
    finally:
        batch_invariant.set_batch_invariant(False)
    for i, row in zip((0, 33, 69), alone, strict=True):
        assert torch.equal(whole[i : i + 1], row)


def test_expert_parallel_refuses_experts_the_ranks_do_not_split(monkeypatch) -> None:
    monkeypatch.setattr(layers, "get_tp_size", lambda: 3)
    monkeypatch.setattr(layers, "get_tp_rank", lambda: 0)
    parallel.set_expert_parallel(True)
    try:
        with pytest.raises(ValueError, match="3 ranks do not split 8 experts evenly"):
            FusedMoE(8, 64, 32)
    finally:
        parallel.set_expert_parallel(False)
    with pytest.raises(ValueError, match="do not split the experts' intermediate size 32"):
        FusedMoE(8, 64, 32)


def test_the_plugin_setting_reaches_the_model_built_next() -> None:
    config = SimpleNamespace(plugin_settings=lambda name: MoESettings(expert_parallel=True))
    assert plugin.logits_processors(config, 160, torch.device("cpu")) is None
    try:
        assert parallel.expert_parallel_enabled()
    finally:
        parallel.set_expert_parallel(False)
