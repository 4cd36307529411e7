"""The Llama family: Llama, Mistral, SmolLM2 (a Llama), Qwen2 (QKV bias), Qwen3 (q/k RMSNorm).

Written for the paged KV cache: the forward pass takes the flat batch of the step (token ids and
positions of every scheduled token of every request) and attention reads the step's metadata.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import replace

import torch
from torch import nn

from pagoda.attention.backend import AttentionBackend
from pagoda.attention.layer import Attention
from pagoda.attention.spec import AttentionSpec
from pagoda.distributed import get_tp_size, is_first_stage, is_last_stage, stage_layers, tp_shape
from pagoda.loader.arch import ModelArchConfig
from pagoda.loader.sharded import WeightSlice
from pagoda.models.layers import RMSNorm, RotaryEmbedding
from pagoda.models.parallel_layers import (
    ColumnParallelLinear,
    ParallelLMHead,
    Part,
    RowParallelLinear,
    VocabParallelEmbedding,
    copy_weight,
    split_evenly,
)
from pagoda.ops import (
    gate_up_silu,
    linear_add_,
    qk_norm_rotary,
    qkv_norm_rotary,
    rms_norm_fp8,
    silu_and_mul,
)
from pagoda.quantization import LinearMethod, QuantizationMethod, kv_scale_of


def attention_specs(
    cfg: ModelArchConfig, tensor_parallel_size: int | None = None
) -> list[AttentionSpec]:
    """Every layer's attention with the heads of a rank of ``tensor_parallel_size`` (default:
    this process's group): causal, ``head_dim ** -0.5``, over the whole context or, in the
    layers the config says slide (Mistral's every layer, Qwen's past ``max_window_layers``),
    over ``sliding_window`` keys."""
    shape = tp_shape(cfg, 0, tensor_parallel_size) if tensor_parallel_size else tp_shape(cfg)
    full = AttentionSpec(shape.num_heads, shape.num_kv_heads, cfg.head_dim, cfg.head_dim**-0.5)
    if cfg.sliding_window is None:
        return [full] * cfg.num_hidden_layers
    window = replace(full, sliding_window=cfg.sliding_window)
    kinds = cfg.layer_types or ("sliding_attention",) * cfg.num_hidden_layers
    return [window if kind == "sliding_attention" else full for kind in kinds]


def _linear_method(
    quant: QuantizationMethod | None, prefix: str, names: tuple[str, ...]
) -> LinearMethod | None:
    """The quantization method's linear method for the layer merging checkpoint projections
    ``prefix.name`` for each of ``names`` (None: full precision)."""
    return None if quant is None else quant.linear_method([f"{prefix}.{n}" for n in names])


def _plain_weight(proj: nn.Module) -> torch.Tensor | None:
    """The weight of a projection that is a plain matmul (no quantization, no bias, no LoRA
    layer in its place; a row-parallel one on one rank, with no all-reduce to follow), which
    the GEMMs with fused epilogues may take over; None otherwise."""
    kind = type(proj)
    if (
        (kind is ColumnParallelLinear or (kind is RowParallelLinear and get_tp_size() == 1))
        and proj.quant_method is None
        and proj.bias is None
    ):
        return proj.weight
    return None


def _project_into(proj: nn.Module, x: torch.Tensor, residual: torch.Tensor | None):
    """``proj(x)``; or, where ``proj`` is a plain matmul (:func:`_plain_weight`) and
    :func:`linear_add_` takes the step, ``residual`` plus it, added in place in the GEMM's
    epilogue, and None returned (the sum is in ``residual``)."""
    if residual is not None:
        weight = _plain_weight(proj)
        if weight is not None and linear_add_(residual, x, weight):
            return None
    return proj(x)


def _norm_into(norm: RMSNorm, x: torch.Tensor, residual: torch.Tensor | None, proj: nn.Module):
    """``norm(x)``, or ``norm(x, residual)``, for ``proj`` to read: where ``proj`` is a plain
    projection (no LoRA layer in its place) whose quantization takes rows quantized already
    (FP8), the norm's kernel quantizes its output (:func:`pagoda.ops.rms_norm_fp8`) and the
    projection's own quantization of the stored output is saved."""
    method = getattr(proj, "quant_method", None)
    if type(proj) is ColumnParallelLinear and method is not None and method.takes_quantized_rows:
        out = rms_norm_fp8(x, norm.weight, norm.eps, residual)
        if out is not None:
            return out
    return norm(x) if residual is None else norm(x, residual)


def final_norm(norm: RMSNorm, x: torch.Tensor | None, residual: torch.Tensor) -> torch.Tensor:
    """The model's last norm over the last layer's ``(x, residual)`` (x None: the residual holds
    the sum already, :meth:`LlamaDecoderLayer.forward`)."""
    return norm(residual) if x is None else norm(x, residual)[0]


class LlamaAttention(nn.Module):
    def __init__(
        self,
        cfg: ModelArchConfig,
        backend: type[AttentionBackend],
        rotary_emb: RotaryEmbedding,
        layer_idx: int,
        quant: QuantizationMethod | None = None,
    ) -> None:
        super().__init__()
        # This rank's heads: the query heads split, the KV heads split or (fewer than ranks)
        # replicated.
        shape = tp_shape(cfg)
        self.num_heads = shape.num_heads
        self.num_kv_heads = shape.num_kv_heads
        self.head_dim = cfg.head_dim
        self.q_size = self.num_heads * self.head_dim
        self.kv_size = self.num_kv_heads * self.head_dim
        kv_total = cfg.num_key_value_heads * self.head_dim
        kv_start = shape.kv_head_start * self.head_dim
        prefix = f"model.layers.{layer_idx}.self_attn"
        self.qkv_proj = ColumnParallelLinear(
            cfg.hidden_size,
            [
                split_evenly("q_proj", cfg.num_attention_heads * self.head_dim),
                Part("k_proj", kv_total, kv_start, self.kv_size),
                Part("v_proj", kv_total, kv_start, self.kv_size),
            ],
            bias=cfg.attention_bias,
            quant=_linear_method(quant, prefix, ("q_proj", "k_proj", "v_proj")),
        )
        self.o_proj = RowParallelLinear(
            cfg.num_attention_heads * self.head_dim,
            cfg.hidden_size,
            bias=False,
            quant=_linear_method(quant, prefix, ("o_proj",)),
        )
        self.qk_norm = cfg.qk_norm
        if cfg.qk_norm:
            self.q_norm = RMSNorm(self.head_dim, cfg.rms_norm_eps)
            self.k_norm = RMSNorm(self.head_dim, cfg.rms_norm_eps)
        self.rotary_emb = rotary_emb
        spec = attention_specs(cfg)[layer_idx]
        self.attn = Attention(
            backend,
            spec.num_heads,
            spec.head_size,
            spec.scale,
            spec.num_kv_heads,
            layer_idx,
            spec,
        )

    def forward(
        self,
        positions: torch.Tensor,
        x: torch.Tensor,
        keep: torch.Tensor | None = None,
        residual: torch.Tensor | None = None,
    ) -> torch.Tensor | None:
        """``keep``: the rows whose output is read (every row's keys and values are cached).
        ``residual`` (the caller's own, of the output's rows): where the output projection
        can add into it in place, it does and None is returned."""
        n = x.shape[0]
        qkv = store = None
        weight = _plain_weight(self.qkv_proj)
        if self.qk_norm and weight is not None:
            # Qwen3's norms and rotation in the projection's own kernel, where it runs; the
            # kernel also stores the keys and values in the cache where the layer lets it (and
            # where a step reads them: ``stores_kv``).
            store = self.attn.kv_store_target(n, x.dtype) if self.attn.stores_kv(keep) else None
            if keep is not None and store is not None and self.attn.attends_kept_rows(n, x.dtype):
                # Every row's keys and values (stored), the kept rows' queries alone.
                kv = qkv_norm_rotary(
                    x, weight[self.q_size :], 0, self.num_kv_heads, self.head_dim,
                    self.q_norm.weight, self.k_norm.weight, self.q_norm.eps, positions,
                    self.rotary_emb.cos, self.rotary_emb.sin, store,
                )  # fmt: skip
                if kv is not None:
                    k, v = kv.split([self.kv_size, self.kv_size], dim=-1)
                    q, _, _ = self._qkv(x[keep], positions[keep], None)
                    out = self.attn(q, k, v, kv_stored=True, keep=keep)
                    return _project_into(self.o_proj, out, residual)
            qkv = qkv_norm_rotary(
                x, weight, self.num_heads, self.num_kv_heads, self.head_dim, self.q_norm.weight,
                self.k_norm.weight, self.q_norm.eps, positions, self.rotary_emb.cos,
                self.rotary_emb.sin, store,
            )  # fmt: skip
        fused = qkv is not None
        q, k, v = self._qkv(x, positions, qkv)
        out = self.attn(q, k, v, kv_stored=fused and store is not None, keep=keep)
        return _project_into(self.o_proj, out, residual)

    def _qkv(
        self, x: torch.Tensor, positions: torch.Tensor, fused: torch.Tensor | None
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """q, k and v of the rows of ``x``, normalised (Qwen3) and rotated; ``fused``: the
        fused kernel's projection, which did both already."""
        n = x.shape[0]
        qkv = self.qkv_proj(x) if fused is None else fused
        q, k, v = qkv.split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        q = q.reshape(n, self.num_heads, self.head_dim)
        k = k.reshape(n, self.num_kv_heads, self.head_dim)
        if fused is None:
            rot = self.rotary_emb
            if self.qk_norm:  # Qwen3: per-head norms, then the rotation, in one kernel
                q, k = qk_norm_rotary(
                    positions, q, k, self.q_norm.weight, self.k_norm.weight, self.q_norm.eps,
                    rot.cos, rot.sin,
                )  # fmt: skip
            else:
                q, k = rot(positions, q, k)
        return q, k, v


class LlamaMLP(nn.Module):
    def __init__(
        self, cfg: ModelArchConfig, quant: QuantizationMethod | None = None, prefix: str = ""
    ) -> None:
        super().__init__()
        if cfg.hidden_act != "silu":
            raise ValueError(f"activation {cfg.hidden_act!r} is not supported (only silu)")
        self.gate_up_proj = ColumnParallelLinear(
            cfg.hidden_size,
            [split_evenly(n, cfg.intermediate_size) for n in ("gate_proj", "up_proj")],
            bias=False,
            quant=_linear_method(quant, prefix, ("gate_proj", "up_proj")),
        )
        self.down_proj = RowParallelLinear(
            cfg.intermediate_size,
            cfg.hidden_size,
            bias=False,
            quant=_linear_method(quant, prefix, ("down_proj",)),
        )

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None) -> torch.Tensor | None:
        """``residual`` (the caller's own): where the down projection can add into it in place,
        it does and None is returned."""
        # A large step's projection and activation in one kernel where it runs; else apart.
        weight = _plain_weight(self.gate_up_proj)
        h = None if weight is None else gate_up_silu(x, weight)
        h = silu_and_mul(self.gate_up_proj(x)) if h is None else h
        return _project_into(self.down_proj, h, residual)


class LlamaDecoderLayer(nn.Module):
    def __init__(
        self,
        cfg: ModelArchConfig,
        backend: type[AttentionBackend],
        rotary_emb: RotaryEmbedding,
        layer_idx: int,
        quant: QuantizationMethod | None = None,
    ) -> None:
        super().__init__()
        self.self_attn = LlamaAttention(cfg, backend, rotary_emb, layer_idx, quant)
        self.mlp = LlamaMLP(cfg, quant, f"model.layers.{layer_idx}.mlp")
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)

    def forward(
        self,
        positions: torch.Tensor,
        x: torch.Tensor | None,
        residual: torch.Tensor | None,
        keep: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor | None, torch.Tensor]:
        """``keep``: only these rows go on past attention (the model's last layer, when the
        caller reads a few rows: an embedding step's last tokens).

        Returns ``(x, residual)``, the layer's output and the residual to add to it; x is None
        where the down projection added it into the residual already (a large step on a GPU:
        :func:`pagoda.ops.linear_add_`), and takes the same None as input."""
        # (a kept step's rows are the projection's rows: none are quantized before it)
        qkv = self.self_attn.qkv_proj if keep is None else None
        if residual is None:
            # (the input is the caller's: nothing is added into it in place)
            residual, owned = x, False
            x = _norm_into(self.input_layernorm, x, None, qkv)
        elif x is None:
            x, owned = _norm_into(self.input_layernorm, residual, None, qkv), True
        else:
            (x, residual), owned = _norm_into(self.input_layernorm, x, residual, qkv), True
        if keep is not None:
            residual, owned = residual[keep], True
        x = self.self_attn(positions, x, keep, residual if owned else None)
        gate_up = getattr(self.mlp, "gate_up_proj", None)
        if x is None:
            x = _norm_into(self.post_attention_layernorm, residual, None, gate_up)
        else:
            x, residual = _norm_into(self.post_attention_layernorm, x, residual, gate_up)
        return self.mlp(x, residual), residual


class LlamaModel(nn.Module):
    """The decoder. Split into pipeline stages, it holds only its stage's layers (``start`` to
    ``end``), the embedding on the first stage and the final norm on the last; a stage that is
    not the last returns its hidden states and residual stacked, ``[2, num_tokens, hidden]``,
    which the next stage takes as ``intermediate``."""

    def __init__(
        self,
        cfg: ModelArchConfig,
        backend: type[AttentionBackend],
        quant: QuantizationMethod | None = None,
    ) -> None:
        super().__init__()
        self.hidden_size = cfg.hidden_size
        self.start, self.end = stage_layers(cfg.num_hidden_layers)
        self.first, self.last = is_first_stage(), is_last_stage()
        # NOTE: a tied LM head is the embedding: the last stage holds it too.
        if self.first or (self.last and cfg.tie_word_embeddings):
            self.embed_tokens = VocabParallelEmbedding(cfg.vocab_size, cfg.hidden_size)
        # One rotary table for all layers (it is a buffer, not a weight).
        rotary_emb = RotaryEmbedding(
            cfg.head_dim, cfg.max_position_embeddings, cfg.rope_theta, cfg.rope_scaling
        )
        # NOTE: other stages' layers are parameterless stand-ins, so that names and indices
        # stay the checkpoint's.
        self.layers = nn.ModuleList(
            LlamaDecoderLayer(cfg, backend, rotary_emb, i, quant)
            if self.start <= i < self.end
            else nn.Identity()
            for i in range(cfg.num_hidden_layers)
        )
        if self.last:
            self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        intermediate: torch.Tensor | None = None,
        keep: torch.Tensor | None = None,
    ) -> torch.Tensor:
        if self.first:
            x, residual = self.embed_tokens(input_ids), None
        else:
            if intermediate is None:  # a dry run (profiling, warm-up): zeros stand in
                # (the first parameter of a quantized stage may be an FP8 weight)
                dtype = next(p.dtype for p in self.parameters() if p.dtype.itemsize > 1)
                intermediate = torch.zeros(
                    (2, input_ids.shape[0], self.hidden_size), dtype=dtype, device=input_ids.device
                )
            x, residual = intermediate[0], intermediate[1]
        layers = self.layers[self.start : self.end]
        if keep is not None and not self.last:
            raise ValueError("only the last pipeline stage's output rows can be kept")
        for i, layer in enumerate(layers):
            x, residual = layer(positions, x, residual, keep if i == len(layers) - 1 else None)
        if not self.last:
            return torch.stack((torch.zeros_like(residual) if x is None else x, residual))
        return final_norm(self.norm, x, residual)


class LlamaForCausalLM(nn.Module):
    """Also serves Mistral, Qwen2 and Qwen3: their differences are flags in the config."""

    #: Every layer's spec, before the model is built: the runner selects the backend with them.
    attention_specs = staticmethod(attention_specs)
    #: It splits into pipeline stages (``parallel.pipeline_parallel_size``).
    supports_pipeline_parallel = True
    #: Its linears take LoRA adapters (``pagoda.lora``: q/k/v/o, gate/up/down).
    supports_lora = True
    #: ``forward(..., keep=rows)`` runs the last layer past attention for those rows alone and
    #: returns their hidden states (an embedding step reads each prompt's last token).
    keeps_rows = True
    #: It takes a quantization method (``pagoda.quantization``) as its third argument: the
    #: decoder's linears quantized, the embedding and LM head in full precision.
    supports_quantization = True

    def __init__(
        self,
        cfg: ModelArchConfig,
        backend: type[AttentionBackend],
        quant: QuantizationMethod | None = None,
    ) -> None:
        super().__init__()
        self.config = cfg
        self.model = LlamaModel(cfg, backend, quant)
        if self.model.last:
            self.lm_head = ParallelLMHead(cfg.vocab_size, cfg.hidden_size)
            if cfg.tie_word_embeddings:
                self.lm_head.weight = self.model.embed_tokens.weight

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        intermediate: torch.Tensor | None = None,
        keep: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Hidden states of every token of the flat batch: [num_tokens, hidden_size] (with
        ``keep``, of those rows alone, in its order); on a pipeline stage before the last, its
        hidden states and residual, [2, num_tokens, hidden_size], which the next stage takes
        as ``intermediate``."""
        return self.model(input_ids, positions, intermediate, keep)

    def _elsewhere(self, name: str) -> bool:
        """Whether checkpoint weight ``name`` belongs to another pipeline stage."""
        m = self.model
        if name.startswith("model.layers."):
            i = int(name.split(".")[2])
            return not m.start <= i < m.end
        if name.startswith("model.embed_tokens."):
            return not hasattr(m, "embed_tokens")
        return name.startswith(("model.norm.", "lm_head.")) and not m.last

    def compute_logits(self, hidden_states: torch.Tensor) -> torch.Tensor:
        """[num_rows, vocab] in the model's dtype: whoever needs float32 converts (the sampler's
        steps do); the one-kernel draw reads bf16 straight, with no float32 copy to write."""
        return self.lm_head(hidden_states)

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor | WeightSlice]]) -> set[str]:
        """Load Hugging Face-named weights (tensors, or lazy slices of a checkpoint of which
        each parallel layer reads its rank's part); returns the names of the parameters set.

        Raises when a parameter stays unset or a weight has no home, naming it.
        """
        params = dict(self.named_parameters())
        modules = dict(self.named_modules())
        loaded: set[str] = set()
        merged = {
            "q_proj": "qkv_proj",
            "k_proj": "qkv_proj",
            "v_proj": "qkv_proj",
            "gate_proj": "gate_up_proj",
            "up_proj": "gate_up_proj",
        }
        for name, tensor in weights:
            if "rotary_emb.inv_freq" in name:
                continue
            if name == "lm_head.weight" and self.config.tie_word_embeddings:
                continue
            if self._elsewhere(name):
                continue
            scale = kv_scale_of(name)
            if scale is not None:  # an FP8 KV cache's scale, read by the layer's attention
                self.get_submodule(scale[0]).load_kv_scale(scale[1], tensor)
                continue
            parts = name.split(".")
            shard = parts[-2] if len(parts) >= 2 else ""
            if shard in merged:
                module_name = ".".join(parts[:-2] + [merged[shard]])
                self.get_submodule(module_name).load_weight(parts[-1], tensor, shard)
                loaded.add(f"{module_name}.{parts[-1]}")
                continue
            module = modules.get(".".join(parts[:-1]))
            if getattr(module, "quant_method", None) is not None:  # it reads its own tensors
                module.load_weight(parts[-1], tensor)
                loaded.add(name)
                continue
            if name not in params:
                raise ValueError(f"checkpoint weight {name!r} has no parameter in the model")
            if hasattr(module, "load_weight"):  # a parallel layer: it reads its own slice
                module.load_weight(parts[-1], tensor)
                loaded.add(name)
                continue
            copy_weight(params[name], name, tensor)
            loaded.add(name)
        missing = set(params) - loaded
        if self.config.tie_word_embeddings:
            missing.discard("lm_head.weight")  # (on the last stage: the embedding's)
        if missing:
            raise ValueError(f"checkpoint lacks weights for: {sorted(missing)[:8]}")
        return loaded
