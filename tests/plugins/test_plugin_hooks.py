"""Each hook spec exercised by a plugin registered in a test, as a plugin author would use it.

The meta-test (test_plugin_meta.py) requires a ``test_hook_<name>...`` here for every hook.
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch

from pagoda import LLM, SamplingParams, hookimpl
from pagoda.config import CacheConfig, SchedulerConfig
from pagoda.kv_cache.block_pool import BlockPool
from pagoda.kv_cache.manager import KVCacheManager
from pagoda.parsers import MarkedToolParser, ToolCall, reasoning_parser_class, tool_parser_class
from pagoda.plugins import RequestRejectedError, get_registry, plugin_registered, select
from pagoda.request import Request
from pagoda.scheduler.scheduler import Scheduler


class _HookedGrammar:
    # Above any installed grammar backend, so that ``auto`` must consider hooked ones.
    priority = 10**9


class Registers:
    PAGODA_PLUGIN_API = 1

    @hookimpl
    def register_attention_backends(self, register):
        register("hooked_attn", "pagoda.attention.torch_native:TorchNativeBackend")

    @hookimpl
    def register_executors(self, register):
        register("hooked_exec", "pagoda.executor.uniproc:UniProcExecutor")

    @hookimpl
    def register_spec_proposers(self, register):
        register("hooked_ngram", dict)

    @hookimpl
    def register_grammar_backends(self, register):
        register("hooked_grammar", _HookedGrammar)

    @hookimpl
    def register_models(self, register):
        register("HookedForCausalLM", "pagoda.models.llama:LlamaForCausalLM")

    @hookimpl
    def register_offload_policies(self, register):
        register("hooked_policy", "pagoda.kv_offload.arc:ARCPolicy")

    @hookimpl
    def register_offload_mediums(self, register):
        register("hooked_medium", "pagoda.kv_offload.cpu:CPUMedium")

    @hookimpl
    def register_tool_parsers(self, register):
        register("hooked_tools", _HookedToolParser)

    @hookimpl
    def register_reasoning_parsers(self, register):
        register("hooked_think", "pagoda.parsers.reasoning:ThinkTagsParser")


class _HookedToolParser(MarkedToolParser):
    call_start = "CALL "

    def parse_block(self, block):
        name, _, args = block.partition(" ")
        return [ToolCall(name, args or "{}")]


@pytest.fixture
def registers() -> Iterator[None]:
    with plugin_registered(Registers(), "registers"):
        yield


def test_hook_register_attention_backends_makes_a_backend_selectable(registers) -> None:
    from pagoda.attention.selector import select_attention_backend
    from pagoda.attention.torch_native import TorchNativeBackend

    got = select_attention_backend("hooked_attn", torch.device("cpu"), torch.float32, 64)
    assert got is TorchNativeBackend


def test_hook_register_executors_makes_an_executor_selectable(registers) -> None:
    from pagoda.executor.uniproc import UniProcExecutor

    assert select("executors", "hooked_exec") is UniProcExecutor


def test_hook_register_spec_proposers_makes_a_proposer_selectable(registers) -> None:
    assert select("spec_proposers", "hooked_ngram") is dict


def test_hook_register_grammar_backends_makes_a_grammar_backend_selectable(registers) -> None:
    assert select("grammar_backends", "hooked_grammar") is _HookedGrammar
    assert select("grammar_backends", "auto") is _HookedGrammar


def test_hook_register_models_maps_an_architecture_to_a_class(registers) -> None:
    from pagoda.models.llama import LlamaForCausalLM

    assert get_registry("models").get("HookedForCausalLM") is LlamaForCausalLM


class _ModelImpls:
    PAGODA_PLUGIN_API = 1

    @hookimpl
    def register_model_impls(self, register):
        register("hooked_impl", "pagoda.models.native:NativeModelImpl")


def test_hook_register_model_impls_makes_an_impl_selectable_by_model_impl() -> None:
    from pagoda.models.impl import select_model_impl
    from pagoda.models.native import NativeModelImpl

    with plugin_registered(_ModelImpls(), "model_impls"):
        assert "hooked_impl" in get_registry("model_impls").names()
        chosen = select_model_impl("hooked_impl", {"architectures": ["LlamaForCausalLM"]})
        assert chosen == ("hooked_impl", NativeModelImpl)


def test_hook_register_offload_policies_makes_a_policy_selectable(registers) -> None:
    from pagoda.kv_offload import build_policy
    from pagoda.kv_offload.arc import ARCPolicy

    policy = build_policy("hooked_policy", 8)
    assert isinstance(policy, ARCPolicy) and policy.capacity == 8


def test_hook_register_offload_mediums_makes_a_medium_selectable(registers) -> None:
    from pagoda.kv_offload.cpu import CPUMedium

    assert get_registry("offload_mediums").get("hooked_medium") is CPUMedium


def test_hook_register_tool_parsers_makes_a_parser_selectable_by_name(registers) -> None:
    parsed = tool_parser_class("hooked_tools")([]).parse('Sure. CALL add {"a": 1}')
    assert parsed.content == "Sure. " and parsed.tool_calls == [ToolCall("add", '{"a": 1}')]


def test_hook_register_reasoning_parsers_makes_a_parser_selectable_by_name(registers) -> None:
    parser = reasoning_parser_class("hooked_think")()
    assert parser.parse("<think>hm</think>ok") == ("hm", "ok")


class _LoRAResolvers:
    PAGODA_PLUGIN_API = 1

    class Numbered:
        """Adapters ft-N live in resolver_dir/N."""

        def __init__(self, config):
            self.root = config.resolver_dir

        def resolve(self, base_model_name, lora_name):
            n = lora_name.removeprefix("ft-")
            return f"{self.root}/{n}" if lora_name.startswith("ft-") and n.isdigit() else None

    @hookimpl
    def register_lora_resolvers(self, register):
        register("hooked_resolver", self.Numbered)


def test_hook_register_lora_resolvers_makes_a_resolver_selectable_by_name() -> None:
    from pagoda.config.model import LoRAConfig

    with plugin_registered(_LoRAResolvers(), "lora_resolvers"):
        cls = get_registry("lora_resolvers").get("hooked_resolver")
        resolver = cls(LoRAConfig(resolvers=["hooked_resolver"], resolver_dir="/adapters"))
        assert resolver.resolve("base", "ft-7") == "/adapters/7"
        assert resolver.resolve("base", "other") is None
    assert "local" in get_registry("lora_resolvers").names()


class _Quantization:
    PAGODA_PLUGIN_API = 1

    @hookimpl
    def register_quantization_methods(self, register):
        from pagoda.quantization.fp8 import Fp8Method

        class HookedFp8(Fp8Method):
            name = "hooked_fp8"
            checkpoint_formats = ("hooked-format",)

            @classmethod
            def unsupported(cls, checkpoint_config, device, dtype):
                return None

        register("hooked_fp8", HookedFp8)


def test_hook_register_quantization_methods_makes_a_method_selectable_by_name() -> None:
    from pagoda.quantization import build_quantization, resolve_quantization

    cpu = torch.device("cpu")
    with plugin_registered(_Quantization(), "quantization"):
        assert resolve_quantization("hooked_fp8", {}, cpu, torch.float32) == "hooked_fp8"
        # a checkpoint in its format selects it
        hf = {"quantization_config": {"quant_method": "hooked-format"}}
        assert resolve_quantization(None, hf, cpu, torch.float32) == "hooked_fp8"
        method = build_quantization("hooked_fp8", {})
        assert method.name == "hooked_fp8" and method.linear_method(["a.q_proj"]) is not None
    assert "fp8" in get_registry("quantization_methods").names()
    assert "hooked_fp8" not in get_registry("quantization_methods").names()


class _Settings:
    PAGODA_PLUGIN_API = 1

    @hookimpl
    def register_plugin_settings(self, register):
        from pydantic import BaseModel

        class HookedSettings(BaseModel):
            level: int = 2

        register("hooked", HookedSettings)


def test_hook_register_plugin_settings_validates_a_plugins_section() -> None:
    from pagoda.config import ConfigError, EngineConfig

    with plugin_registered(_Settings(), "settings"):
        config = EngineConfig.load(overrides={"plugins": {"hooked": {"level": 5}}})
        assert config.plugin_settings("hooked").level == 5
        assert EngineConfig.load().plugin_settings("hooked").level == 2  # the default
        with pytest.raises(ConfigError, match=r"plugins\.hooked\.levl: unknown key"):
            EngineConfig.load(overrides={"plugins": {"hooked": {"levl": 5}}})


# ---- scheduler: admission -----------------------------------------------------------------------


def _scheduler() -> Scheduler:
    kv = KVCacheManager(num_blocks=64, block_size=4, max_model_len=64)
    return Scheduler(SchedulerConfig(), CacheConfig(block_size=4), kv, max_model_len=64)


def _request(rid: str, tokens: list[int]) -> Request:
    return Request(rid, tokens, SamplingParams(max_tokens=4))


class RejectsToken13:
    PAGODA_PLUGIN_API = 1

    @hookimpl
    def admit_request(self, request, scheduler):
        if 13 in request.prompt_token_ids:
            return f"token 13 is not allowed ({scheduler.num_waiting} waiting)"
        return None


class RejectsEverything:
    PAGODA_PLUGIN_API = 1

    @hookimpl
    def admit_request(self, request):
        return "closed"


def test_hook_admit_request_rejects_with_the_plugins_reason() -> None:
    with plugin_registered(RejectsToken13()):
        sched = _scheduler()
        sched.add_request(_request("ok", [1, 2, 3]))
        with pytest.raises(RequestRejectedError, match=r"'bad' rejected: token 13 .*\(1 waiting"):
            sched.add_request(_request("bad", [1, 13]))
    assert sched.num_waiting == 1 and "bad" not in sched.requests


def test_hook_admit_request_first_reason_wins() -> None:
    with plugin_registered(RejectsToken13()), plugin_registered(RejectsEverything()):
        sched = _scheduler()
        # pluggy calls the most recently registered implementation first.
        with pytest.raises(RequestRejectedError, match="closed"):
            sched.add_request(_request("bad", [13]))


def test_a_single_first_result_implementation_is_called_directly_as_pluggy_would() -> None:
    """With the core's own admission rule alone, the scheduler calls it without pluggy's
    dispatch, with the arguments it names; a plugin beside it brings pluggy back."""
    from pagoda.plugins.seams import seam

    hook = seam("admit_request")
    assert not hasattr(hook, "get_hookimpls")  # the function itself, not the hook caller
    sched = Scheduler(
        SchedulerConfig(max_waiting_requests=1),
        CacheConfig(block_size=4),
        KVCacheManager(num_blocks=64, block_size=4, max_model_len=64),
        max_model_len=64,
    )
    sched.add_request(_request("first", [1, 2]))
    with pytest.raises(RequestRejectedError, match=r"1 requests are already waiting"):
        sched.add_request(_request("second", [1, 2]))
    with plugin_registered(RejectsEverything()):  # (it takes ``request`` alone)
        assert hasattr(seam("admit_request"), "get_hookimpls")
        with pytest.raises(RequestRejectedError, match="closed"):
            _scheduler().add_request(_request("bad", [1]))


# ---- KV cache manager: eviction -----------------------------------------------------------------


class RecordsEvictions:
    PAGODA_PLUGIN_API = 1

    def __init__(self) -> None:
        self.calls: list[tuple[list[int], list[bytes]]] = []

    @hookimpl
    def on_blocks_evicted(self, block_ids, block_hashes):
        self.calls.append((list(block_ids), list(block_hashes)))


def _run_to_completion(kv: KVCacheManager, req: Request) -> list[int]:
    kv.allocate_slots(req, req.num_tokens)
    req.num_computed_tokens = req.num_tokens
    ids = kv.get_block_ids(req.request_id)
    kv.free(req)
    return ids


def test_hook_on_blocks_evicted_reports_the_ids_and_hashes_of_evicted_blocks() -> None:
    assert type(KVCacheManager(8, 4).block_pool) is BlockPool  # no plugin: the plain pool
    plugin = RecordsEvictions()
    with plugin_registered(plugin):
        kv = KVCacheManager(num_blocks=5, block_size=4)  # 4 usable blocks
        first = _request("a", list(range(16)))
        first_ids = _run_to_completion(kv, first)  # 4 full blocks, all cached, all free
        assert plugin.calls == []
        kv.allocate_slots(_request("b", [99] * 8), 8)  # takes 2 free blocks: evicts 2 cached
    assert len(plugin.calls) == 1
    ids, hashes = plugin.calls[0]
    assert len(ids) == 2 and set(ids) <= set(first_ids)
    assert hashes == [first.block_hashes[first_ids.index(i)] for i in ids]


# ---- model runner and engine core: logits processors, step end, admission end to end -----------

FORCED = 42


class ForcesOneToken:
    """Masks every logit but one: greedy decoding then yields only that token."""

    PAGODA_PLUGIN_API = 1

    def __init__(self) -> None:
        self.built_with: list[int] = []
        self.steps: list[tuple[int, int]] = []
        self.rows_seen: list[list[str]] = []

    @hookimpl
    def logits_processors(self, config, vocab_size, device):
        self.built_with.append(vocab_size)
        return [self._force]

    def _force(self, logits: torch.Tensor, md) -> torch.Tensor:
        self.rows_seen.append(list(md.req_ids))
        keep = logits[:, FORCED].clone()
        logits.fill_(float("-inf"))
        logits[:, FORCED] = keep
        return logits

    @hookimpl
    def on_step_end(self, scheduler_output, runner_output, outputs):
        self.steps.append((scheduler_output.total_num_scheduled_tokens, len(outputs)))


@pytest.fixture(scope="module")
def forced_llm() -> Iterator[tuple[LLM, ForcesOneToken]]:
    plugin = ForcesOneToken()
    with plugin_registered(plugin, "forces"), plugin_registered(RejectsToken13(), "rejects"):
        llm = LLM(load_format="dummy", max_model_len=64, max_num_seqs=4, block_size=16)
        yield llm, plugin
        llm.engine.shutdown()


def test_hook_logits_processors_are_built_once_and_applied_every_sampling_step(
    forced_llm,
) -> None:
    llm, plugin = forced_llm
    outs = llm.generate(
        [{"prompt_token_ids": [1, 2, 3]}, {"prompt_token_ids": [4, 5]}],
        SamplingParams(max_tokens=5, temperature=0.0, ignore_eos=True),
        use_tqdm=False,
    )
    assert [o.outputs[0].token_ids for o in outs] == [[FORCED] * 5, [FORCED] * 5]
    assert plugin.built_with == [llm.engine.info.shape.vocab_size]
    assert sorted(plugin.rows_seen[0]) == sorted(o.request_id for o in outs)


def test_hook_on_step_end_sees_every_step_and_its_outputs(forced_llm) -> None:
    llm, plugin = forced_llm
    plugin.steps.clear()
    llm.generate({"prompt_token_ids": [7, 8, 9]}, SamplingParams(max_tokens=3, ignore_eos=True))
    assert plugin.steps == [(3, 1), (1, 1), (1, 1)]  # prefill 3 tokens, then two decodes


def test_hook_admit_request_rejection_reaches_the_caller_of_generate(forced_llm) -> None:
    llm, _ = forced_llm
    with pytest.raises(RequestRejectedError, match="token 13 is not allowed"):
        llm.generate({"prompt_token_ids": [13, 14]}, SamplingParams(max_tokens=2))
    out = llm.generate({"prompt_token_ids": [1]}, SamplingParams(max_tokens=2, ignore_eos=True))
    assert out[0].outputs[0].token_ids == [FORCED, FORCED]
