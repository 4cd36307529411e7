"""The module the worker builds: a transformers causal LM whose attention layers call Pagoda's
paged attention."""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from pagoda.attention.backend import AttentionBackend
from pagoda.attention.layer import Attention
from pagoda.attention.spec import AttentionSpec
from pagoda.distributed import get_tp_rank, get_tp_size
from pagoda.loader.sharded import WeightSlice
from pagoda_models_transformers import attention
from pagoda_models_transformers.fuse import fuse, pagoda_forward
from pagoda_models_transformers.probe import build_config, build_hf_model, check_config
from pagoda_models_transformers.tensor_parallel import build_sharded
from pagoda_models_transformers.tp_plan import Shard
from pagoda_models_transformers.weights import load_hf_weights


@dataclass(frozen=True)
class TransformersModelConfig:
    """What the worker builds the model from (``ModelShape.config``)."""

    hf_config: dict[str, Any]
    architecture: str
    #: The attention modules (qualified names in the causal LM), in call order, their specs
    #: (this rank's heads) and the names of their sinks parameters.
    attention_modules: tuple[str, ...]
    specs: tuple[AttentionSpec, ...]
    sinks: tuple[str | None, ...]
    #: Ranks the model is split over by its tensor-parallel plan, and (when more than one) the
    #: attention modules' specs with every head, from which the plan's split is read.
    tensor_parallel_size: int = 1
    unsplit_specs: tuple[AttentionSpec, ...] = ()


class _HiddenOutput:
    """The base model's output as the head reads it: the hidden states, and None for anything
    else it may ask for (router logits, attentions)."""

    def __init__(self, hidden: torch.Tensor) -> None:
        self.last_hidden_state = hidden

    def __getattr__(self, name: str) -> None:
        return None

    def __getitem__(self, index: int) -> torch.Tensor:
        if index != 0:
            raise IndexError(index)
        return self.last_hidden_state


class _Hidden(nn.Module):
    """Stands in for the base model while the causal LM's head runs on given hidden states
    (passed as ``inputs_embeds``). A head that calls a part of its base model (OPT's
    ``model.decoder``) finds the stand-in there too."""

    def forward(self, *args: Any, inputs_embeds: torch.Tensor, **kwargs: Any) -> _HiddenOutput:
        return _HiddenOutput(inputs_embeds)

    def __getattr__(self, name: str) -> Any:
        try:
            return super().__getattr__(name)
        except AttributeError:
            if name.startswith("_"):
                raise
            return self


class TransformersCausalLM(nn.Module):
    """``model``: the transformers causal LM (its own parameter names); ``attn_layers``: one
    Pagoda :class:`Attention` per transformers attention module, in call order."""

    def __init__(self, cfg: TransformersModelConfig, backend: type[AttentionBackend]) -> None:
        super().__init__()
        self.config = cfg
        hf_config = build_config(cfg.hf_config)
        model_cls = check_config(hf_config, cfg.architecture)
        # NOTE: grouped experts: no per-expert loop, no host sync (transformers counts the
        # tokens per expert with histc, which CUDA graphs can capture).
        experts = "grouped_mm"
        #: The split parameters' shards (by name), from which their weights load.
        self.shards: dict[str, Shard] = {}
        size = cfg.tensor_parallel_size
        if size == 1:
            self.model = build_hf_model(
                model_cls, hf_config, attention.PAGODA, torch.get_default_dtype(), experts=experts
            )
        elif size != get_tp_size():
            raise ValueError(
                f"the model was shaped for {size} tensor-parallel ranks, the worker has "
                f"{get_tp_size()}"
            )
        else:
            self.model, self.shards = build_sharded(
                model_cls,
                hf_config,
                cfg.attention_modules,
                cfg.unsplit_specs,
                get_tp_rank(),
                size,
                experts,
            )
        self.attn_layers = nn.ModuleList()
        for i, (name, spec, sinks) in enumerate(
            zip(cfg.attention_modules, cfg.specs, cfg.sinks, strict=True)
        ):
            module = self.model.get_submodule(name)
            layer = Attention(
                backend, spec.num_heads, spec.head_size, spec.scale, spec.num_kv_heads, i, spec
            )
            if sinks is not None:  # the module's own parameter, loaded under its own name
                param = module.get_parameter(sinks)
                layer.sinks = param
                layer.impl.sinks = param
            object.__setattr__(module, attention.LAYER_ATTR, layer)
            self.attn_layers.append(layer)
        # Pagoda's fused norms, gated MLPs and rotary where they compute what transformers does.
        self.fused = fuse(self.model)
        self._prefix = self.model.base_model_prefix
        self._hidden = _Hidden()

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """Hidden states of every token of the flat batch: [num_tokens, hidden_size]."""
        with pagoda_forward():
            out = self.model.base_model(
                input_ids=input_ids[None], position_ids=positions[None], use_cache=False
            )
        return out.last_hidden_state[0]

    def compute_logits(self, hidden_states: torch.Tensor) -> torch.Tensor:
        """[rows, vocab]: the causal LM's own head on ``hidden_states`` (its LM head and what
        follows it: a final soft-cap, a logit scale), run by its own forward with the base
        model stood in for by the given hidden states."""
        modules = self.model._modules
        base = modules[self._prefix]
        modules[self._prefix] = self._hidden
        try:
            out = self.model(inputs_embeds=hidden_states[None], use_cache=False)
        finally:
            modules[self._prefix] = base
        return out.logits[0]

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor | WeightSlice]]) -> set[str]:
        """Load the checkpoint's tensors, named as on disk (``save_pretrained``'s names): of a
        split parameter, this rank's part."""
        return load_hf_weights(self.model, weights, self.shards)
