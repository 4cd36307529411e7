"""Qwen2.5-VL, native: the vision tower (patches, 2-D rotary, window attention with a few full
layers, the 2x2 merger) and the Qwen2 decoder with M-RoPE over the paged KV cache.

The decoder is the core's Llama family (``LlamaForCausalLM``, Qwen2's flags) with its rotary
replaced by :class:`MRotaryEmbedding`; the runner hands ``forward`` the image rows for the
placeholder tokens (``mm_embeds``) and [3, tokens] positions where they differ per axis.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from pagoda.attention.backend import AttentionBackend
from pagoda.distributed import check_tensor_parallel
from pagoda.loader.arch import ModelArchConfig
from pagoda.loader.sharded import WeightSlice
from pagoda.models.layers import RotaryEmbedding
from pagoda.models.llama import LlamaForCausalLM, attention_specs, final_norm
from pagoda.models.shape import ModelShape
from pagoda.ops import reference
from pagoda_models_vision.processor import Qwen2_5_VLProcessor


@dataclass(frozen=True)
class VLConfig:
    """What the model is built from: the decoder's config, the vision config, M-RoPE's split."""

    text: ModelArchConfig
    vision: dict[str, Any]
    mrope_section: tuple[int, ...]
    hf: dict[str, Any]


def _text_dict(hf: dict[str, Any]) -> tuple[dict[str, Any], tuple[int, ...]]:
    """The decoder's config.json keys (transformers 5 nests them in ``text_config``) as a
    Qwen2 config, and M-RoPE's section sizes."""
    text = {**hf, **(hf.get("text_config") or {})}
    text.pop("text_config", None)
    rope = dict(text.get("rope_parameters") or text.get("rope_scaling") or {})
    section = tuple(rope.get("mrope_section") or (16, 24, 24))
    theta = rope.get("rope_theta") or text.get("rope_theta") or 1_000_000.0
    text["rope_parameters"] = {"rope_theta": theta, "rope_type": "default"}
    text.pop("rope_scaling", None)
    text["architectures"] = ["Qwen2ForCausalLM"]
    if "tie_word_embeddings" in hf:
        text["tie_word_embeddings"] = hf["tie_word_embeddings"]
    return text, section


class MRotaryEmbedding(RotaryEmbedding):
    """Qwen2-VL's multimodal rotary: the frequencies split in sections (temporal, height,
    width), each rotated by its row of [3, tokens] positions; 1-D positions rotate as usual
    (all three rows equal)."""

    def __init__(self, head_dim: int, max_position: int, base: float, section: tuple[int, ...]):
        super().__init__(head_dim, max_position, base)
        if sum(section) != head_dim // 2:
            raise ValueError(
                f"mrope_section {list(section)} must add up to head_dim / 2 = {head_dim // 2}"
            )
        rows = torch.repeat_interleave(torch.arange(len(section)), torch.tensor(section))
        self.register_buffer("rows", rows, persistent=False)
        self.register_buffer("cols", torch.arange(head_dim // 2), persistent=False)

    def forward(self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor):
        if positions.dim() == 1:
            return super().forward(positions, q, k)
        pos = positions[self.rows].T  # [tokens, head_dim / 2]: each frequency's axis
        cos, sin = self.cos[pos, self.cols], self.sin[pos, self.cols]
        index = torch.arange(pos.shape[0], device=pos.device)
        return reference.rotary_embedding(index, q, k, cos, sin)


# ---- the vision tower ----------------------------------------------------------------------


class VisionRMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * xf.to(x.dtype)


class VisionMLP(nn.Module):
    def __init__(self, dim: int, hidden: int, act: str) -> None:
        super().__init__()
        if act != "silu":
            raise ValueError(f"vision hidden_act {act!r} is not supported (only silu)")
        self.gate_proj = nn.Linear(dim, hidden)
        self.up_proj = nn.Linear(dim, hidden)
        self.down_proj = nn.Linear(hidden, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


class VisionAttention(nn.Module):
    def __init__(self, dim: int, num_heads: int) -> None:
        super().__init__()
        self.num_heads = num_heads
        self.head_dim = dim // num_heads
        self.qkv = nn.Linear(dim, 3 * dim)
        self.proj = nn.Linear(dim, dim)

    def forward(self, x: torch.Tensor, mask: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor):
        n = x.shape[0]
        q, k, v = self.qkv(x).reshape(n, 3, self.num_heads, self.head_dim).unbind(1)
        cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)
        qf, kf = q.float(), k.float()
        q = (qf * cos + _rotate_half(qf) * sin).to(x.dtype)
        k = (kf * cos + _rotate_half(kf) * sin).to(x.dtype)
        # NOTE: one block-diagonal mask: attention stays inside each window (or image).
        out = F.scaled_dot_product_attention(
            q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1), attn_mask=mask
        )
        return self.proj(out.transpose(0, 1).reshape(n, -1))


class VisionBlock(nn.Module):
    def __init__(self, dim: int, num_heads: int, hidden: int, act: str) -> None:
        super().__init__()
        self.norm1 = VisionRMSNorm(dim)
        self.norm2 = VisionRMSNorm(dim)
        self.attn = VisionAttention(dim, num_heads)
        self.mlp = VisionMLP(dim, hidden, act)

    def forward(self, x: torch.Tensor, mask: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor):
        x = x + self.attn(self.norm1(x), mask, cos, sin)
        return x + self.mlp(self.norm2(x))


class PatchMerger(nn.Module):
    def __init__(self, out_dim: int, dim: int, merge: int) -> None:
        super().__init__()
        self.hidden = dim * merge * merge
        self.ln_q = VisionRMSNorm(dim)
        self.mlp = nn.Sequential(
            nn.Linear(self.hidden, self.hidden), nn.GELU(), nn.Linear(self.hidden, out_dim)
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.mlp(self.ln_q(x).view(-1, self.hidden))


class PatchEmbed(nn.Module):
    """The patch projection (a 3-D convolution whose stride is its kernel): one matmul."""

    def __init__(self, in_dim: int, dim: int) -> None:
        super().__init__()
        self.proj = nn.Linear(in_dim, dim, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.proj(x.to(self.proj.weight.dtype))


class VisionTower(nn.Module):
    def __init__(self, v: dict[str, Any]) -> None:
        super().__init__()
        dim, heads = int(v["hidden_size"]), int(v["num_heads"])
        self.patch = int(v.get("patch_size", 14))
        self.merge = int(v.get("spatial_merge_size", 2))
        self.window = int(v.get("window_size", 112))
        self.full_layers = set(v.get("fullatt_block_indexes") or ())
        in_dim = int(v.get("in_channels", 3)) * int(v.get("temporal_patch_size", 2)) * self.patch**2
        self.patch_embed = PatchEmbed(in_dim, dim)
        self.blocks = nn.ModuleList(
            VisionBlock(dim, heads, int(v["intermediate_size"]), v.get("hidden_act", "silu"))
            for _ in range(int(v["depth"]))
        )
        self.merger = PatchMerger(int(v["out_hidden_size"]), dim, self.merge)
        head_dim = dim // heads
        theta = float((v.get("rope_parameters") or {}).get("rope_theta") or 10000.0)
        # Rows and columns rotate half of each head each: head_dim / 4 frequencies per axis.
        axis = head_dim // 2
        inv = 1.0 / (theta ** (torch.arange(0, axis, 2, dtype=torch.float) / axis))
        self.register_buffer("inv_freq", inv, persistent=False)

    def _layout(self, t: int, h: int, w: int) -> tuple[np.ndarray, ...]:
        """For one image of ``t`` x ``h`` x ``w`` patches: each patch's (row, column), patches
        in merge-block order as the processor lays them out; the window order of the merged
        tokens (windows of ``window_size`` pixels, raster order, per frame) and each reordered
        token's window."""
        m, lh, lw = self.merge, h // self.merge, w // self.merge
        bh, bw, mh, mw = np.meshgrid(
            np.arange(lh), np.arange(lw), np.arange(m), np.arange(m), indexing="ij"
        )
        rows = np.tile((bh * m + mh).reshape(-1), t)
        cols = np.tile((bw * m + mw).reshape(-1), t)
        ws = max(self.window // m // self.patch, 1)
        nwh, nww = -(-lh // ws), -(-lw // ws)
        tt, r, c = np.meshgrid(np.arange(t), np.arange(lh), np.arange(lw), indexing="ij")
        win = ((tt * nwh + r // ws) * nww + c // ws).reshape(-1)
        within = ((r % ws) * ws + c % ws).reshape(-1)
        order = np.lexsort((within, win))
        return rows, cols, win[order], order

    def forward(self, pixels: torch.Tensor, grid: torch.Tensor) -> torch.Tensor:
        """[patches, in_dim] of one or more images (``grid``: [images, 3] of t, h, w) ->
        [merged tokens, out_hidden_size]."""
        unit = self.merge**2
        rows, cols, wins, imgs, orders = [], [], [], [], []
        base = 0
        for i, (t, h, w) in enumerate(grid.tolist()):
            r, c, win, order = self._layout(t, h, w)
            rows.append(r)
            cols.append(c)
            wins.append(win + (wins[-1].max() + 1 if wins else 0))
            imgs.append(np.full(len(order), i))
            orders.append(order + base)
            base += len(order)
        order = torch.from_numpy(np.concatenate(orders)).to(pixels.device)
        x = self.patch_embed(pixels)
        n = x.shape[0]
        x = x.view(n // unit, unit, -1)[order].reshape(n, -1)
        pos = torch.from_numpy(np.stack([np.concatenate(rows), np.concatenate(cols)], 1))
        pos = pos.to(pixels.device).view(n // unit, unit, 2)[order].reshape(n, 2)
        freqs = (pos[..., None].float() * self.inv_freq).reshape(n, -1)  # [n, head_dim / 2]
        emb = torch.cat((freqs, freqs), dim=-1)
        cos, sin = emb.cos(), emb.sin()
        win_id = torch.from_numpy(np.concatenate(wins)).to(pixels.device).repeat_interleave(unit)
        img_id = torch.from_numpy(np.concatenate(imgs)).to(pixels.device)[order]
        img_id = img_id.repeat_interleave(unit)
        window_mask = win_id[:, None] == win_id[None, :]
        full_mask = img_id[:, None] == img_id[None, :]
        for i, block in enumerate(self.blocks):
            x = block(x, full_mask if i in self.full_layers else window_mask, cos, sin)
        merged = self.merger(x)
        return merged[torch.argsort(order)]


# ---- the model --------------------------------------------------------------------------------


class Qwen2_5_VLForConditionalGeneration(nn.Module):
    #: Positions are [3, tokens] where an image's tokens differ per axis (the runner reads it).
    uses_mrope = True

    @classmethod
    def model_shape(cls, hf_config: dict[str, Any], tensor_parallel_size: int) -> ModelShape:
        text, section = _text_dict(hf_config)
        arch = ModelArchConfig.from_hf_config(text)
        check_tensor_parallel(arch, tensor_parallel_size)
        vision = dict(hf_config.get("vision_config") or {})
        if not vision:
            raise ValueError("Qwen2_5_VLForConditionalGeneration: config.json has no vision_config")
        return ModelShape(
            architecture="Qwen2_5_VLForConditionalGeneration",
            vocab_size=arch.vocab_size,
            hidden_size=arch.hidden_size,
            num_hidden_layers=arch.num_hidden_layers,
            max_position_embeddings=arch.max_position_embeddings,
            attention=tuple(attention_specs(arch, tensor_parallel_size)),
            config=VLConfig(arch, vision, section, hf_config),
            torch_dtype=arch.torch_dtype,
            bos_token_id=arch.bos_token_id,
            eos_token_id=arch.eos_token_id,
        )

    @classmethod
    def multimodal_processor(cls, config: VLConfig, model_dir: str | None, tokenizer: Any) -> Any:
        proc = Qwen2_5_VLProcessor(config.hf, model_dir)
        proc.bind_tokenizer(tokenizer)
        return proc

    def __init__(self, cfg: VLConfig, backend: type[AttentionBackend]) -> None:
        super().__init__()
        self.config = cfg
        self.language = LlamaForCausalLM(cfg.text, backend)
        t = cfg.text
        rotary = MRotaryEmbedding(
            t.head_dim, t.max_position_embeddings, t.rope_theta, cfg.mrope_section
        )
        for layer in self.language.model.layers:
            layer.self_attn.rotary_emb = rotary
        self.visual = VisionTower(cfg.vision)

    def embed_multimodal(self, modality: str, data: dict[str, torch.Tensor]) -> torch.Tensor:
        """One image's encoder output: [its placeholder tokens, hidden_size]."""
        if modality != "image":
            raise ValueError(f"Qwen2.5-VL here takes images, not {modality}")
        dtype = self.visual.patch_embed.proj.weight.dtype
        return self.visual(data["pixel_values"].to(dtype), data["image_grid_thw"]).to(dtype)

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        intermediate: torch.Tensor | None = None,
        mm_embeds: tuple[torch.Tensor, torch.Tensor] | None = None,
    ) -> torch.Tensor:
        """Hidden states [tokens, hidden]; ``positions`` [tokens] or [3, tokens]; ``mm_embeds``
        (flat indices, rows): the image rows that replace those tokens' embeddings."""
        m = self.language.model
        x = m.embed_tokens(input_ids)
        if mm_embeds is not None:
            x = x.index_copy(0, mm_embeds[0], mm_embeds[1].to(x.dtype))
        residual = None
        for layer in m.layers:
            x, residual = layer(positions, x, residual)
        return final_norm(m.norm, x, residual)

    def compute_logits(self, hidden_states: torch.Tensor) -> torch.Tensor:
        return self.language.compute_logits(hidden_states)

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor | WeightSlice]]) -> set[str]:
        """transformers 5 names (``model.language_model.``, ``model.visual.``) or the original
        checkpoints' (``model.``, ``visual.``)."""
        visual = dict(self.visual.named_parameters())
        loaded: set[str] = set()

        def text() -> Iterable[tuple[str, Any]]:
            for name, tensor in weights:
                if name.startswith("model.language_model."):
                    name = "model." + name[len("model.language_model.") :]
                if name.startswith(("model.visual.", "visual.")):
                    key = name.split("visual.", 1)[1]
                    if key not in visual:
                        raise ValueError(
                            f"checkpoint weight {name!r} has no parameter in the model"
                        )
                    t = tensor.full() if isinstance(tensor, WeightSlice) else tensor
                    p = visual[key]
                    with torch.no_grad():
                        p.copy_(t.reshape(p.shape).to(p.dtype))
                    loaded.add("visual." + key)
                    continue
                yield name, tensor

        loaded |= {"language." + n for n in self.language.load_weights(text())}
        missing = set(visual) - {n.split(".", 1)[1] for n in loaded if n.startswith("visual.")}
        if missing:
            raise ValueError(f"checkpoint lacks vision weights for: {sorted(missing)[:8]}")
        return loaded
