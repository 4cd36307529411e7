"""The checkpoint layouts EAGLE and EAGLE-3 heads are published in, read and written.

A head is a folder: ``config.json`` (a Llama config of one decoder layer) and its weights
(``*.safetensors`` or ``pytorch_model*.bin``).

- EAGLE (e.g. yuhuili/EAGLE-LLaMA3-Instruct-8B): ``fc.weight`` [H, 2H] (``fc.bias`` optional)
  over the concatenation of the next token's embedding and the target's last hidden state;
  ``layers.0.*`` one Llama decoder layer without ``input_layernorm``; ``embed_tokens.weight``
  optional (else the target's). The target's LM head reads the layer's output.
- EAGLE-3 (e.g. yuhuili/EAGLE3-LLaMA3.1-Instruct-8B): ``fc.weight`` [H, 3H] fuses a low, middle
  and high target layer; ``midlayer.*`` one decoder layer whose q/k/v projections take 2H (the
  normed embedding, then the normed hidden state), with ``midlayer.hidden_norm``;
  ``norm.weight``; ``lm_head.weight`` [draft_vocab, H]; ``d2t`` [draft_vocab] (target id =
  draft id + ``d2t[id]``) and ``t2d`` [vocab] bool; config ``draft_vocab_size`` and optionally
  ``eagle_config.eagle_aux_hidden_state_layer_ids``.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file, save_file

_KINDS = {"eagle": "EAGLE", "eagle3": "EAGLE-3"}


@dataclass
class HeadCheckpoint:
    kind: str  # "eagle" or "eagle3"
    path: Path
    config: dict[str, Any]
    weights: dict[str, torch.Tensor]  # layer weights under "layers.0." (midlayer renamed)
    hidden_size: int
    intermediate_size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    vocab_size: int
    draft_vocab_size: int
    rms_norm_eps: float
    rope_theta: float
    rope_scaling: dict | None
    aux_layers: tuple[int, ...] | None = None  # EAGLE-3's target layers, if the config names them
    norm_before_residual: bool = False
    extras: dict[str, Any] = field(default_factory=dict)

    @property
    def label(self) -> str:
        return f"{_KINDS[self.kind]} head {str(self.path)!r}"


def _read_weights(path: Path) -> dict[str, torch.Tensor]:
    files = sorted(path.glob("*.safetensors"))
    out: dict[str, torch.Tensor] = {}
    if files:
        for f in files:
            out.update(load_file(str(f)))
        return out
    bins = sorted(path.glob("pytorch_model*.bin"))
    for f in bins:
        out.update(torch.load(f, map_location="cpu", weights_only=True))
    if not out:
        raise ValueError(
            f"speculative.model {str(path)!r} holds no *.safetensors or pytorch_model*.bin weights"
        )
    return out


def _normalise(name: str) -> str:
    if name.startswith("model."):
        name = name[len("model.") :]
    if name.startswith("midlayer."):
        name = "layers.0." + name[len("midlayer.") :]
    return name


def read_head(path: str | Path, kind: str) -> HeadCheckpoint:
    """The head in folder ``path``, checked to be of ``kind`` (``eagle`` or ``eagle3``)."""
    path = Path(path)
    if not (path / "config.json").is_file():
        raise ValueError(f"speculative.model {str(path)!r} is not a folder with a config.json")
    cfg = json.loads((path / "config.json").read_text())
    weights = {_normalise(k): v for k, v in _read_weights(path).items()}
    if "fc.weight" not in weights:
        raise ValueError(f"{str(path)!r} is not an EAGLE or EAGLE-3 head: it has no fc.weight")
    h = int(cfg.get("hidden_size", weights["fc.weight"].shape[0]))
    fc_in = weights["fc.weight"].shape[1]
    found = "eagle3" if "d2t" in weights or fc_in != 2 * h else "eagle"
    if found != kind:
        raise ValueError(
            f"speculative.method is {kind!r} but {str(path)!r} is an {_KINDS[found]} head "
            f"(fc.weight is [{h}, {fc_in}]); use method {found!r}"
        )
    heads = int(cfg["num_attention_heads"])
    vocab = int(cfg["vocab_size"])
    eagle_cfg = cfg.get("eagle_config") or {}
    aux = eagle_cfg.get("eagle_aux_hidden_state_layer_ids")
    scaling = cfg.get("rope_scaling") or (cfg.get("rope_parameters") or None)
    if scaling and scaling.get("rope_type", scaling.get("type", "default")) == "default":
        scaling = None
    elif scaling and "rope_type" not in scaling and "type" in scaling:
        scaling = {**scaling, "rope_type": scaling["type"]}
    return HeadCheckpoint(
        kind=kind,
        path=path,
        config=cfg,
        weights=weights,
        hidden_size=h,
        intermediate_size=int(cfg["intermediate_size"]),
        num_heads=heads,
        num_kv_heads=int(cfg.get("num_key_value_heads") or heads),
        head_dim=int(cfg.get("head_dim") or h // heads),
        vocab_size=vocab,
        draft_vocab_size=int(cfg.get("draft_vocab_size") or vocab),
        rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
        rope_theta=float(cfg.get("rope_theta", (scaling or {}).get("rope_theta", 10000.0))),
        rope_scaling=scaling,
        aux_layers=tuple(int(i) for i in aux) if aux else None,
        norm_before_residual=bool(cfg.get("norm_before_residual", False)),
    )


def check_fits(ck: HeadCheckpoint, hidden_size: int, vocab_size: int) -> None:
    """Raise, naming the mismatch, when the head was not made for a target of this hidden size
    and vocabulary."""
    w = ck.weights
    target_h = int(ck.config.get("target_hidden_size") or ck.hidden_size)
    problems = []
    if target_h != hidden_size:
        problems.append(f"hidden size {target_h}, the target model's is {hidden_size}")
    if ck.vocab_size != vocab_size:
        problems.append(f"vocab_size {ck.vocab_size}, the target model's is {vocab_size}")
    # EAGLE's fc reads [embedding, hidden]; EAGLE-3's three target layers.
    want_fc = (ck.hidden_size, 3 * target_h if ck.kind == "eagle3" else 2 * ck.hidden_size)
    if tuple(w["fc.weight"].shape) != want_fc:
        problems.append(f"fc.weight is {list(w['fc.weight'].shape)}, expected {list(want_fc)}")
    emb = w.get("embed_tokens.weight")
    if emb is not None and tuple(emb.shape) != (vocab_size, ck.hidden_size):
        problems.append(
            f"embed_tokens.weight is {list(emb.shape)}, expected [{vocab_size}, {ck.hidden_size}]"
        )
    if ck.kind == "eagle3":
        dv = ck.draft_vocab_size
        head = w.get("lm_head.weight")
        if head is not None and tuple(head.shape) != (dv, ck.hidden_size):
            problems.append(
                f"lm_head.weight is {list(head.shape)}, expected [draft_vocab_size {dv}, "
                f"{ck.hidden_size}]"
            )
        d2t = w.get("d2t")
        if dv != ck.vocab_size and d2t is None:
            problems.append(f"draft_vocab_size {dv} differs from vocab_size but d2t is missing")
        if d2t is not None:
            if tuple(d2t.shape) != (dv,):
                problems.append(f"d2t is {list(d2t.shape)}, expected [draft_vocab_size {dv}]")
            elif ((torch.arange(dv) + d2t.long()) >= vocab_size).any():
                problems.append(f"d2t maps draft ids past the target vocabulary ({vocab_size})")
    if problems:
        raise ValueError(f"{ck.label} does not fit the target model: " + "; ".join(problems))


def write_head(path: str | Path, config: dict[str, Any], weights: dict[str, torch.Tensor]) -> None:
    """Write a head folder: ``config.json`` and ``model.safetensors`` (names as published)."""
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    (path / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    tensors = {k: v.detach().contiguous().cpu() for k, v in weights.items()}
    save_file(tensors, str(path / "model.safetensors"))


def llama_head_config(
    kind: str,
    hidden_size: int,
    intermediate_size: int,
    num_heads: int,
    num_kv_heads: int,
    vocab_size: int,
    *,
    head_dim: int | None = None,
    draft_vocab_size: int | None = None,
    rms_norm_eps: float = 1e-5,
    rope_theta: float = 10000.0,
    max_position_embeddings: int = 2048,
    aux_layers: tuple[int, ...] | None = None,
) -> dict[str, Any]:
    """A config.json as the public heads have it (LlamaForCausalLM-like, one layer)."""
    cfg: dict[str, Any] = {
        "architectures": ["LlamaForCausalLMEagle3" if kind == "eagle3" else "LlamaForCausalLM"],
        "model_type": "llama",
        "hidden_size": hidden_size,
        "intermediate_size": intermediate_size,
        "num_attention_heads": num_heads,
        "num_key_value_heads": num_kv_heads,
        "head_dim": head_dim or hidden_size // num_heads,
        "num_hidden_layers": 1,
        "hidden_act": "silu",
        "rms_norm_eps": rms_norm_eps,
        "rope_theta": rope_theta,
        "max_position_embeddings": max_position_embeddings,
        "vocab_size": vocab_size,
        "tie_word_embeddings": False,
        "torch_dtype": "float32",
    }
    if kind == "eagle3":
        cfg["draft_vocab_size"] = draft_vocab_size or vocab_size
        if aux_layers is not None:
            cfg["eagle_config"] = {
                "eagle_aux_hidden_state_layer_ids": list(aux_layers),
                "use_aux_hidden_state": True,
            }
    return cfg


def random_head_weights(
    cfg: dict[str, Any], seed: int = 0, d2t: torch.Tensor | None = None, std: float = 0.02
) -> dict[str, torch.Tensor]:
    """Random weights under the published names and shapes of ``cfg``'s layout."""
    eagle3 = "draft_vocab_size" in cfg
    g = torch.Generator().manual_seed(seed)
    h, inter = cfg["hidden_size"], cfg["intermediate_size"]
    hd = cfg["head_dim"]
    nh, nkv = cfg["num_attention_heads"], cfg["num_key_value_heads"]
    layer = "midlayer." if eagle3 else "layers.0."
    attn_in = 2 * h if eagle3 else h

    def rnd(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=g) * std

    w = {
        "fc.weight": rnd(h, (3 if eagle3 else 2) * h),
        layer + "self_attn.q_proj.weight": rnd(nh * hd, attn_in),
        layer + "self_attn.k_proj.weight": rnd(nkv * hd, attn_in),
        layer + "self_attn.v_proj.weight": rnd(nkv * hd, attn_in),
        layer + "self_attn.o_proj.weight": rnd(h, nh * hd),
        layer + "mlp.gate_proj.weight": rnd(inter, h),
        layer + "mlp.up_proj.weight": rnd(inter, h),
        layer + "mlp.down_proj.weight": rnd(h, inter),
        layer + "post_attention_layernorm.weight": torch.ones(h),
    }
    if eagle3:
        dv = cfg["draft_vocab_size"]
        w[layer + "input_layernorm.weight"] = torch.ones(h)
        w[layer + "hidden_norm.weight"] = torch.ones(h)
        w["norm.weight"] = torch.ones(h)
        w["lm_head.weight"] = rnd(dv, h)
        if d2t is None:
            d2t = torch.zeros(dv, dtype=torch.int64)
        w["d2t"] = d2t.to(torch.int64)
        t2d = torch.zeros(cfg["vocab_size"], dtype=torch.bool)
        targets = torch.arange(dv) + d2t
        t2d[targets[targets < cfg["vocab_size"]]] = True
        w["t2d"] = t2d
    return w
