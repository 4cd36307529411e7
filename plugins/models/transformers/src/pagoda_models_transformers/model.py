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
from pagoda_models_transformers.experts import experts_implementation
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
        # NOTE: Pagoda's fused MoE operator (grouped-GEMM kernels reading only the routed
        # experts, no host sync: CUDA graphs capture it); transformers' grouped_mm where the
        # experts' layout is another (pagoda_models_transformers.experts).
        experts = experts_implementation()
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
        #: Whether compute_logits may run the output embedding alone (asked on first use).
        self._plain_head: bool | None = None
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
        if self._plain_head is None:
            self._plain_head = self._head_is_plain(hidden_states)
        if self._plain_head:  # NOTE: one matmul, none of the causal LM forward's host work
            return self.model.get_output_embeddings()(hidden_states)
        return self._own_head(hidden_states)

    def _own_head(self, hidden_states: torch.Tensor) -> torch.Tensor:
        modules = self.model._modules
        base = modules[self._prefix]
        modules[self._prefix] = self._hidden
        try:
            out = self.model(inputs_embeds=hidden_states[None], use_cache=False)
        finally:
            modules[self._prefix] = base
        return out.logits[0]

    def _head_is_plain(self, like: torch.Tensor) -> bool:
        """Whether the causal LM's head is its output embedding alone (no soft-cap, no scale):
        asked once, with the weights loaded, on hidden states scaled so that the logits reach
        50, where a soft-cap or a scale of the logits shows."""
        head = self.model.get_output_embeddings()
        if head is None or self.config.tensor_parallel_size != 1:
            return False
        gen = torch.Generator().manual_seed(0)
        h = torch.randn(3, like.shape[-1], generator=gen, device="cpu").to(like)
        with torch.inference_mode():
            plain = head(h).float()
            if not bool(torch.isfinite(plain).all()) or float(plain.abs().max()) == 0.0:
                return False
            h = h * (50.0 / float(plain.abs().max()))
            plain = head(h).float()
            own = self._own_head(h).float()
        if own.shape != plain.shape:
            return False
        return bool(torch.allclose(own, plain, rtol=1e-2, atol=1e-2 * float(plain.abs().max())))

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor | WeightSlice]]) -> set[str]:
        """Load the checkpoint's tensors, named as on disk (``save_pretrained``'s names): of a
        split parameter, this rank's part."""
        return load_hf_weights(self.model, weights, self.shards)
