"""Per-layer attention specs: the spec, the backend's ``unsupported``, the selector and the layer
that check it, the reference backend that computes every field, and proof that each feature case
of the conformance kit fails a backend that ignores its field."""

from __future__ import annotations

import re
from dataclasses import replace

import pytest
import torch

from pagoda import hookimpl
from pagoda.attention.backend import AttentionBackend
from pagoda.attention.layer import Attention
from pagoda.attention.selector import select_attention_backend
from pagoda.attention.spec import AttentionSpec
from pagoda.attention.torch_native import TorchNativeBackend
from pagoda.plugins import PluginSelectionError, plugin_registered
from pagoda.testing import AttentionBackendConformance, attention_cases, check_attention_backend
from pagoda.testing.attention import FEATURES, run_attention_case

CPU = torch.device("cpu")
PLAIN = AttentionSpec(8, 2, 64, 0.125)
FEATURE_CASES = [c for c in attention_cases() if c.spec.features()]

# What each feature's spec falls back to when a backend ignores it.
DROPPED = {
    "causal": {"causal": True},
    "sliding_window": {"sliding_window": None},
    "logit_softcap": {"logit_softcap": None},
    "sinks": {"sinks": False},
    "chunk_size": {"chunk_size": None},
}


def test_spec_names_the_fields_set_away_from_plain_causal_attention() -> None:
    assert PLAIN.features() == ()
    assert replace(PLAIN, value_head_size=64).features() == ()  # equal to head_size: plain
    assert replace(PLAIN, causal=False, sinks=True).features() == ("causal", "sinks")
    assert replace(PLAIN, value_head_size=32).v_head_size == 32
    assert replace(PLAIN, value_head_size=128).cache_head_size == 128


@pytest.mark.parametrize(
    ("field", "value"),
    [("sliding_window", 0), ("chunk_size", -1), ("logit_softcap", 0.0), ("num_kv_heads", 3)],
)
def test_spec_rejects_values_out_of_range(field: str, value: object) -> None:
    with pytest.raises(ValueError, match=field):
        replace(PLAIN, **{field: value})


def test_default_backend_supports_plain_causal_attention_only() -> None:
    class Plain(AttentionBackend):
        pass

    assert Plain.unsupported(PLAIN) is None
    for feature, fields in FEATURES.items():
        spec = replace(PLAIN, **{k: v for k, v in fields.items() if k != "scale"})
        assert Plain.unsupported(spec) == feature
    assert all(TorchNativeBackend.unsupported(c.spec) is None for c in FEATURE_CASES)


def test_every_spec_field_has_a_case_in_every_scenario() -> None:
    by_feature = {
        f: {c.scenario for c in FEATURE_CASES if c.spec.features() == (f,)} for f in FEATURES
    }
    assert set(by_feature) == {"value_head_size", *DROPPED}
    assert all(s == {"prefill", "decode", "mixed", "prefix_cached"} for s in by_feature.values())


# A backend that ignores value_head_size returns the wrong shape: no control needed.
@pytest.mark.parametrize(
    "case", [c for c in FEATURE_CASES if c.value_head_size is None], ids=lambda c: c.name
)
def test_feature_case_fails_a_backend_that_ignores_the_feature(case) -> None:
    (feature,) = case.spec.features()
    dropped = replace(case.spec, **DROPPED[feature])
    check_attention_backend(TorchNativeBackend, case)  # the reference backend computes it
    steps = run_attention_case(TorchNativeBackend, case, reference_spec=dropped)
    assert max((out - ref).abs().max().item() for out, ref in steps) >= 1e-2
    with pytest.raises(AssertionError, match=re.escape(case.name)):
        check_attention_backend(TorchNativeBackend, case, reference_spec=dropped)


def test_conformance_kit_skips_a_case_the_backend_rejects_and_names_the_feature() -> None:
    class Suite(AttentionBackendConformance):
        backend = PlainOnlyBackend

    case = next(c for c in FEATURE_CASES if c.spec.features() == ("sinks",))
    with pytest.raises(pytest.skip.Exception, match="does not support sinks"):
        Suite().test_matches_float64_reference(case)
    with pytest.raises(ValueError, match="does not support sinks"):
        check_attention_backend(PlainOnlyBackend, case)


class PlainOnlyBackend(TorchNativeBackend):
    """The reference backend's kernels behind the default ``unsupported``: plain causal only."""

    unsupported = classmethod(AttentionBackend.unsupported.__func__)


class NoSinksBackend(TorchNativeBackend):
    name = "no_sinks"
    priority = 10

    @classmethod
    def unsupported(cls, spec: AttentionSpec) -> str | None:
        return "sinks" if spec.sinks else None


class SpecPlugin:
    PAGODA_PLUGIN_API = 1

    @hookimpl
    def register_attention_backends(self, register):
        register("no_sinks", NoSinksBackend)


@pytest.fixture
def spec_plugin():
    with plugin_registered(SpecPlugin(), "spec_plugin") as rec:
        yield rec


def _select(name: str, specs: list[AttentionSpec]) -> type[AttentionBackend]:
    return select_attention_backend(name, CPU, torch.float32, 64, 16, specs)


def test_auto_passes_over_a_backend_that_lacks_a_feature_a_layer_needs(spec_plugin) -> None:
    assert _select("auto", [PLAIN, PLAIN]) is NoSinksBackend
    assert _select("auto", [PLAIN, replace(PLAIN, sinks=True)]) is TorchNativeBackend


def test_a_named_backend_that_lacks_a_feature_is_an_error_naming_it_and_the_layer(
    spec_plugin,
) -> None:
    specs = [PLAIN, replace(PLAIN, sinks=True), PLAIN, replace(PLAIN, sinks=True)]
    with pytest.raises(PluginSelectionError, match=re.escape("sinks (layers 1, 3)")):
        _select("no_sinks", specs)


def test_auto_with_no_backend_left_names_the_feature_and_the_layer(
    spec_plugin, monkeypatch
) -> None:
    # Installed plugins (Triton, FlashInfer) keep the default: no sinks.
    monkeypatch.setattr(TorchNativeBackend, "unsupported", NoSinksBackend.unsupported)
    with pytest.raises(PluginSelectionError, match=re.escape("sinks (layer 2)")):
        _select("auto", [PLAIN, PLAIN, replace(PLAIN, sinks=True)])


def test_layer_refuses_a_spec_its_backend_lacks_and_names_the_layer() -> None:
    spec = replace(PLAIN, sliding_window=4)
    with pytest.raises(ValueError, match="does not support sliding_window, which layer 5"):
        Attention(PlainOnlyBackend, 8, 64, 0.125, 2, 5, spec)


def test_layer_hands_its_spec_and_sink_parameter_to_the_impl() -> None:
    spec = replace(PLAIN, sinks=True, value_head_size=32)
    layer = Attention(TorchNativeBackend, 8, 64, 0.125, 2, 0, spec)
    assert layer.impl.spec is spec and layer.impl.sinks is layer.sinks
    assert layer.sinks.shape == (8,)
    with pytest.raises(ValueError, match="disagrees"):
        Attention(TorchNativeBackend, 8, 64, 0.5, 2, 0, spec)
    assert Attention(TorchNativeBackend, 8, 64, 0.125, 2, 0).impl.spec == PLAIN


def test_llama_layers_are_plain_causal_attention_of_the_arch() -> None:
    from pagoda.loader.arch import ModelArchConfig
    from pagoda.models.llama import LlamaForCausalLM, attention_specs

    cfg = ModelArchConfig.from_hf_config(
        {
            "architectures": ["LlamaForCausalLM"],
            "vocab_size": 64,
            "hidden_size": 32,
            "intermediate_size": 64,
            "num_hidden_layers": 2,
            "num_attention_heads": 4,
            "num_key_value_heads": 2,
            "sliding_window": 8,  # LlamaForCausalLM ignores it (Mistral's layers slide)
        }
    )
    specs = attention_specs(cfg)
    assert specs == [AttentionSpec(4, 2, 8, 8**-0.5)] * 2
    assert LlamaForCausalLM.attention_specs(cfg) == specs  # what the runner selects with
    model = LlamaForCausalLM(cfg, PlainOnlyBackend)  # a plain-only backend builds it
    layers = [m for m in model.modules() if isinstance(m, Attention)]
    assert [layer.impl.spec for layer in layers] == specs
