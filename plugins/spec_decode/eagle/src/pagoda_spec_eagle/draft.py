"""The draft head at inference: one Llama decoder layer over the target's features, attending
through the target's attention backend over a paged KV cache of its own.

EAGLE: ``x = fc([embed(token), h])``, the layer without input norm, ``out = x + residual``; the
LM head (the target's unless the checkpoint has one) reads ``out``, and ``out`` is the next
step's ``h``.
EAGLE-3: ``h = fc([low, mid, high])`` once, from the target; the layer's attention reads
``[input_norm(embed(token)), hidden_norm(h)]`` (2H); ``norm(x + residual)`` feeds the draft
vocabulary's LM head and the sum before the norm is the next step's ``h``.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

from pagoda.attention.backend import AttentionBackend
from pagoda.attention.layer import Attention
from pagoda.models.layers import RMSNorm, RotaryEmbedding
from pagoda.ops import silu_and_mul
from pagoda_spec_eagle.checkpoint import HeadCheckpoint


class EagleHead(nn.Module):
    def __init__(
        self, ck: HeadCheckpoint, backend: type[AttentionBackend], max_positions: int
    ) -> None:
        super().__init__()
        self.eagle3 = ck.kind == "eagle3"
        w = ck.weights
        h, hd = ck.hidden_size, ck.head_dim
        self.num_heads, self.num_kv_heads, self.head_dim = ck.num_heads, ck.num_kv_heads, hd
        self.q_size, self.kv_size = ck.num_heads * hd, ck.num_kv_heads * hd
        attn_in = 2 * h if self.eagle3 else h
        bias = "layers.0.self_attn.q_proj.bias" in w
        self.fc = nn.Linear(w["fc.weight"].shape[1], h, bias="fc.bias" in w)
        self.qkv_proj = nn.Linear(attn_in, self.q_size + 2 * self.kv_size, bias=bias)
        self.o_proj = nn.Linear(self.q_size, h, bias=False)
        self.gate_up_proj = nn.Linear(h, 2 * ck.intermediate_size, bias=False)
        self.down_proj = nn.Linear(ck.intermediate_size, h, bias=False)
        eps = ck.rms_norm_eps
        self.post_attention_layernorm = RMSNorm(h, eps)
        if self.eagle3:
            self.input_layernorm = RMSNorm(h, eps)
            self.hidden_norm = RMSNorm(h, eps)
            self.norm = RMSNorm(h, eps)
        self.norm_before_residual = ck.norm_before_residual
        self.embed_tokens = (
            nn.Embedding(*w["embed_tokens.weight"].shape) if "embed_tokens.weight" in w else None
        )
        head = w.get("lm_head.weight")
        self.lm_head = None
        if head is not None:  # else the target's (EAGLE)
            self.lm_head = nn.Linear(head.shape[1], head.shape[0], bias=False)
        dv = ck.draft_vocab_size if self.eagle3 else ck.vocab_size
        self.register_buffer("draft_to_target", torch.arange(dv), persistent=False)
        self.rotary_emb = RotaryEmbedding(hd, max_positions, ck.rope_theta, ck.rope_scaling)
        self.attn = Attention(backend, ck.num_heads, hd, hd**-0.5, ck.num_kv_heads, 0)

    @torch.no_grad()
    def load(self, ck: HeadCheckpoint) -> None:
        """Copy the checkpoint's weights in (the module is already on its device and dtype)."""
        w = ck.weights
        p = "layers.0."

        def put(param: torch.Tensor, src: torch.Tensor) -> None:
            if tuple(param.shape) != tuple(src.shape):
                raise ValueError(
                    f"{ck.label}: a weight is {list(src.shape)}, expected {list(param.shape)}"
                )
            param.copy_(src)

        put(self.fc.weight, w["fc.weight"])
        if self.fc.bias is not None:
            put(self.fc.bias, w["fc.bias"])
        qkv = [w[f"{p}self_attn.{n}_proj.weight"] for n in "qkv"]
        put(self.qkv_proj.weight, torch.cat(qkv))
        if self.qkv_proj.bias is not None:
            put(self.qkv_proj.bias, torch.cat([w[f"{p}self_attn.{n}_proj.bias"] for n in "qkv"]))
        put(self.o_proj.weight, w[f"{p}self_attn.o_proj.weight"])
        gate_up = [w[f"{p}mlp.gate_proj.weight"], w[f"{p}mlp.up_proj.weight"]]
        put(self.gate_up_proj.weight, torch.cat(gate_up))
        put(self.down_proj.weight, w[f"{p}mlp.down_proj.weight"])
        put(self.post_attention_layernorm.weight, w[f"{p}post_attention_layernorm.weight"])
        if self.eagle3:
            put(self.input_layernorm.weight, w[f"{p}input_layernorm.weight"])
            put(self.hidden_norm.weight, w[f"{p}hidden_norm.weight"])
            put(self.norm.weight, w["norm.weight"])
            if "d2t" in w:
                d2t = w["d2t"].long().to(self.draft_to_target.device)
                self.draft_to_target.copy_(self.draft_to_target + d2t)
        if self.embed_tokens is not None:
            put(self.embed_tokens.weight, w["embed_tokens.weight"])
        if self.lm_head is not None:
            put(self.lm_head.weight, w["lm_head.weight"])

    def combine(self, target_hidden: torch.Tensor) -> torch.Tensor:
        """The step's feature from what the target handed over (EAGLE-3: fc of three layers)."""
        return self.fc(target_hidden) if self.eagle3 else target_hidden

    def forward(
        self,
        positions: torch.Tensor,
        embeds: torch.Tensor,
        hidden: torch.Tensor,
        attend: Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor] | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(next step's hidden, what the LM head reads), [tokens, H] each. Attention goes
        through the target's backend and the forward context the caller set, or through
        ``attend(q, k, v)`` (``pagoda_spec_eagle.chain``)."""
        if self.eagle3:
            normed_h = self.hidden_norm(hidden)
            residual = normed_h if self.norm_before_residual else hidden
            x = torch.cat([self.input_layernorm(embeds), normed_h], dim=-1)
        else:
            x = self.fc(torch.cat([embeds, hidden], dim=-1))
            residual = x
        n = x.shape[0]
        q, k, v = self.qkv_proj(x).split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        q = q.reshape(n, self.num_heads, self.head_dim)
        k = k.reshape(n, self.num_kv_heads, self.head_dim)
        q, k = self.rotary_emb(positions, q, k)
        if attend is None:
            x = self.o_proj(self.attn(q, k, v))
        else:
            x = self.o_proj(attend(q, k, v).reshape(n, self.q_size))
        x, residual = self.post_attention_layernorm(x, residual)
        x = self.down_proj(silu_and_mul(self.gate_up_proj(x)))
        if self.eagle3:
            normed, summed = self.norm(x, residual)
            return summed, normed
        out = x + residual
        return out, out
