"""BERT-style encoders: BERT and XLM-RoBERTa (BGE-M3's layout), bare or with a sequence
classification head (cross-encoders, rerankers).

Every layer attends bidirectionally (``AttentionSpec.causal=False``), so a prompt runs whole in
one step: the engine turns chunked prefill and prefix caching off for such a model. A token's
segment (``token_type_ids``, a pair's second text) travels in the bits of its id from
``TOKEN_TYPE_SHIFT`` up (vLLM's trick), so the forward keeps the ``(input_ids, positions)``
contract of every model.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from pagoda.attention.backend import AttentionBackend
from pagoda.attention.layer import Attention
from pagoda.attention.spec import AttentionSpec
from pagoda.loader.sharded import WeightSlice
from pagoda.models.parallel_layers import copy_weight

#: A token's segment id sits in its id's bits from here up (``encode_token_types``).
TOKEN_TYPE_SHIFT = 30

#: Architecture -> the model type whose layout it has (``bert`` or ``xlm-roberta``).
ENCODER_ARCHITECTURES = {
    "BertModel": "bert",
    "BertForSequenceClassification": "bert",
    "XLMRobertaModel": "xlm-roberta",
    "XLMRobertaForSequenceClassification": "xlm-roberta",
    "RobertaModel": "xlm-roberta",
    "RobertaForSequenceClassification": "xlm-roberta",
}

_ACTS = {"gelu": F.gelu, "relu": F.relu}
_TANH_GELUS = ("gelu_new", "gelu_pytorch_tanh", "gelu_fast")


def encode_token_types(ids: list[int], token_types: list[int]) -> list[int]:
    """Token ids with each token's segment folded into its high bits."""
    return [t | (s << TOKEN_TYPE_SHIFT) for t, s in zip(ids, token_types)]


@dataclass(frozen=True)
class BertArchConfig:
    """What an encoder's config.json fixes (transformers' names)."""

    architecture: str
    layout: str  # "bert" or "xlm-roberta"
    vocab_size: int
    hidden_size: int
    num_hidden_layers: int
    num_attention_heads: int
    intermediate_size: int
    hidden_act: str
    max_position_embeddings: int
    type_vocab_size: int
    layer_norm_eps: float
    pad_token_id: int | None
    num_labels: int
    torch_dtype: str
    bos_token_id: int | None
    eos_token_id: int | list[int] | None

    @classmethod
    def from_hf_config(cls, d: dict[str, Any], architecture: str) -> BertArchConfig:
        layout = ENCODER_ARCHITECTURES[architecture]
        pos_type = d.get("position_embedding_type", "absolute")
        if pos_type != "absolute":
            raise ValueError(
                f"{architecture} with position_embedding_type={pos_type!r} is not supported "
                "(absolute is)"
            )
        act = d.get("hidden_act", "gelu")
        if act not in _ACTS and act not in _TANH_GELUS:
            raise ValueError(f"{architecture}: hidden_act {act!r} is not supported")
        labels = d.get("num_labels")
        if labels is None:
            labels = len(d.get("id2label") or {}) or 2
        needed = ("vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads")
        missing = [k for k in (*needed, "intermediate_size") if d.get(k) is None]
        if missing:
            raise ValueError(f"config.json for {architecture} lacks {', '.join(missing)}")
        return cls(
            architecture=architecture,
            layout=layout,
            vocab_size=int(d["vocab_size"]),
            hidden_size=int(d["hidden_size"]),
            num_hidden_layers=int(d["num_hidden_layers"]),
            num_attention_heads=int(d["num_attention_heads"]),
            intermediate_size=int(d["intermediate_size"]),
            hidden_act=act,
            max_position_embeddings=int(d.get("max_position_embeddings", 512)),
            type_vocab_size=int(d.get("type_vocab_size", 2)),
            layer_norm_eps=float(d.get("layer_norm_eps", 1e-12)),
            pad_token_id=d.get("pad_token_id"),
            num_labels=int(labels),
            torch_dtype=str(d.get("torch_dtype") or d.get("dtype") or "float32"),
            bos_token_id=d.get("bos_token_id"),
            eos_token_id=d.get("eos_token_id"),
        )

    @property
    def position_offset(self) -> int:
        """RoBERTa's positions start past the padding id (``padding_idx + 1``)."""
        return (self.pad_token_id or 0) + 1 if self.layout == "xlm-roberta" else 0

    @property
    def max_context(self) -> int:
        return self.max_position_embeddings - self.position_offset


def attention_specs(
    cfg: BertArchConfig, tensor_parallel_size: int | None = None
) -> list[AttentionSpec]:
    """Every layer: bidirectional over the whole prompt. Not split for tensor parallelism."""
    if tensor_parallel_size not in (None, 1):
        raise ValueError(
            f"{cfg.architecture} runs on one device: tensor_parallel_size="
            f"{tensor_parallel_size} is not supported for encoders"
        )
    head = cfg.hidden_size // cfg.num_attention_heads
    heads = cfg.num_attention_heads
    return [AttentionSpec(heads, heads, head, head**-0.5, causal=False)] * cfg.num_hidden_layers


class _Embeddings(nn.Module):
    def __init__(self, cfg: BertArchConfig) -> None:
        super().__init__()
        self.word_embeddings = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.position_embeddings = nn.Embedding(cfg.max_position_embeddings, cfg.hidden_size)
        self.token_type_embeddings = nn.Embedding(cfg.type_vocab_size, cfg.hidden_size)
        self.LayerNorm = nn.LayerNorm(cfg.hidden_size, eps=cfg.layer_norm_eps)
        self.offset = cfg.position_offset
        self.mask = (1 << TOKEN_TYPE_SHIFT) - 1

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        types = input_ids >> TOKEN_TYPE_SHIFT
        x = self.word_embeddings(input_ids & self.mask)
        x = (
            x
            + self.token_type_embeddings(types)
            + self.position_embeddings(positions + self.offset)
        )
        return self.LayerNorm(x)


class _SelfAttention(nn.Module):
    def __init__(self, cfg: BertArchConfig, backend: type[AttentionBackend], idx: int) -> None:
        super().__init__()
        h = cfg.hidden_size
        self.query, self.key, self.value = nn.Linear(h, h), nn.Linear(h, h), nn.Linear(h, h)
        spec = attention_specs(cfg)[idx]
        self.attn = Attention(
            backend, spec.num_heads, spec.head_size, spec.scale, spec.num_kv_heads, idx, spec
        )

    def forward(self, x: torch.Tensor, keep: torch.Tensor | None = None) -> torch.Tensor:
        """``keep``: the rows whose output is read (every row's keys and values are cached)."""
        if keep is not None and self.attn.attends_kept_rows(x.shape[0], x.dtype):
            # (only the kept rows' queries; every row's keys and values, which the layer writes)
            return self.attn(self.query(x[keep]), self.key(x), self.value(x), keep=keep)
        return self.attn(self.query(x), self.key(x), self.value(x), keep=keep)


class _DenseNorm(nn.Module):
    """``LayerNorm(dense(x) + residual)``: the attention's and the MLP's output."""

    def __init__(self, d_in: int, cfg: BertArchConfig) -> None:
        super().__init__()
        self.dense = nn.Linear(d_in, cfg.hidden_size)
        self.LayerNorm = nn.LayerNorm(cfg.hidden_size, eps=cfg.layer_norm_eps)

    def forward(self, x: torch.Tensor, residual: torch.Tensor) -> torch.Tensor:
        return self.LayerNorm(self.dense(x) + residual)


class _Attention(nn.Module):
    def __init__(self, cfg: BertArchConfig, backend: type[AttentionBackend], idx: int) -> None:
        super().__init__()
        self.self = _SelfAttention(cfg, backend, idx)
        self.output = _DenseNorm(cfg.hidden_size, cfg)

    def forward(self, x: torch.Tensor, keep: torch.Tensor | None = None) -> torch.Tensor:
        return self.output(self.self(x, keep), x if keep is None else x[keep])


class _Intermediate(nn.Module):
    def __init__(self, cfg: BertArchConfig) -> None:
        super().__init__()
        self.dense = nn.Linear(cfg.hidden_size, cfg.intermediate_size)
        self.tanh = cfg.hidden_act in _TANH_GELUS
        self.act = _ACTS.get(cfg.hidden_act, F.gelu)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.dense(x)
        return F.gelu(x, approximate="tanh") if self.tanh else self.act(x)


class _Layer(nn.Module):
    def __init__(self, cfg: BertArchConfig, backend: type[AttentionBackend], idx: int) -> None:
        super().__init__()
        self.attention = _Attention(cfg, backend, idx)
        self.intermediate = _Intermediate(cfg)
        self.output = _DenseNorm(cfg.intermediate_size, cfg)

    def forward(self, x: torch.Tensor, keep: torch.Tensor | None = None) -> torch.Tensor:
        x = self.attention(x, keep)
        return self.output(self.intermediate(x), x)


class _Encoder(nn.Module):
    def __init__(self, cfg: BertArchConfig, backend: type[AttentionBackend]) -> None:
        super().__init__()
        self.layer = nn.ModuleList(_Layer(cfg, backend, i) for i in range(cfg.num_hidden_layers))

    def forward(self, x: torch.Tensor, keep: torch.Tensor | None = None) -> torch.Tensor:
        last = len(self.layer) - 1
        for i, layer in enumerate(self.layer):
            x = layer(x, keep if i == last else None)
        return x


class _Pooler(nn.Module):
    def __init__(self, cfg: BertArchConfig) -> None:
        super().__init__()
        self.dense = nn.Linear(cfg.hidden_size, cfg.hidden_size)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.tanh(self.dense(x))


class _BertBody(nn.Module):
    def __init__(self, cfg: BertArchConfig, backend: type[AttentionBackend], pooler: bool) -> None:
        super().__init__()
        self.embeddings = _Embeddings(cfg)
        self.encoder = _Encoder(cfg, backend)
        self.pooler = _Pooler(cfg) if pooler else None

    def forward(
        self, input_ids: torch.Tensor, positions: torch.Tensor, keep: torch.Tensor | None = None
    ) -> torch.Tensor:
        return self.encoder(self.embeddings(input_ids, positions), keep)


class _RobertaHead(nn.Module):
    """XLM-R's classifier: ``out_proj(tanh(dense(x)))`` on the first token."""

    def __init__(self, cfg: BertArchConfig) -> None:
        super().__init__()
        self.dense = nn.Linear(cfg.hidden_size, cfg.hidden_size)
        self.out_proj = nn.Linear(cfg.hidden_size, cfg.num_labels)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out_proj(torch.tanh(self.dense(x)))


class BertEncoderModel(nn.Module):
    """BERT or XLM-R, bare (embeddings) or with a sequence classification head.

    ``forward`` gives the last layer's hidden states; ``classify`` maps a pooled hidden state
    (the first token's) to the head's logits.
    """

    attention_specs = staticmethod(attention_specs)
    #: No LM head: the engine pools this model's hidden states and never samples from it.
    pooling_only = True
    #: ``forward(..., keep=rows)`` runs the last layer for those rows alone (every layer sees
    #: the whole prompt, so a request's first row may be the one kept) and returns theirs.
    keeps_rows = True

    def __init__(self, cfg: BertArchConfig, backend: type[AttentionBackend]) -> None:
        super().__init__()
        self.config = cfg
        self.classifier_head = cfg.architecture.endswith("ForSequenceClassification")
        body_pooler = cfg.layout == "bert"  # BERT's pooler; XLM-R's heads have their own dense
        body = _BertBody(cfg, backend, pooler=body_pooler)
        if cfg.layout == "bert":
            self.bert = body
        else:
            self.roberta = body
        self.classifier: nn.Module | None = None
        if self.classifier_head:
            self.classifier = (
                nn.Linear(cfg.hidden_size, cfg.num_labels)
                if cfg.layout == "bert"
                else _RobertaHead(cfg)
            )

    @property
    def body(self) -> _BertBody:
        return self.bert if self.config.layout == "bert" else self.roberta

    def forward(
        self, input_ids: torch.Tensor, positions: torch.Tensor, keep: torch.Tensor | None = None
    ) -> torch.Tensor:
        """Hidden states of every token of the flat batch: [num_tokens, hidden_size] (with
        ``keep``, of those rows alone, in its order)."""
        return self.body(input_ids, positions, keep)

    def classify(self, pooled: torch.Tensor) -> torch.Tensor:
        """The classification head's logits of pooled hidden states: [rows, num_labels]."""
        if self.classifier is None:
            raise ValueError(f"{self.config.architecture} has no classification head")
        if self.config.layout == "bert":
            return self.classifier(self.body.pooler(pooled))
        return self.classifier(pooled)

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor | WeightSlice]]) -> set[str]:
        """Hugging Face names, with or without the body's prefix (a bare ``BertModel`` saved
        alone has none; a pretraining checkpoint's heads, ``cls.*``/``lm_head.*``, are
        skipped). Raises when a parameter stays unset or a weight has no home."""
        params = dict(self.named_parameters())
        body = "bert." if self.config.layout == "bert" else "roberta."
        loaded: set[str] = set()
        for name, tensor in weights:
            if name.startswith(("cls.", "lm_head.")) or name.endswith("position_ids"):
                continue
            key = name if name.startswith((body, "classifier.")) else body + name
            if key not in params:
                if key.startswith(body + "pooler.") and body + "pooler.dense.weight" not in params:
                    continue  # XLM-R's unused pooler
                raise ValueError(f"checkpoint weight {name!r} has no parameter in the model")
            copy_weight(params[key], name, tensor)
            loaded.add(key)
        missing = set(params) - loaded
        if not self.classifier_head:
            # A bare model saved without its pooler: embeddings do not read it.
            missing = {m for m in missing if ".pooler." not in m}
        if missing:
            raise ValueError(f"checkpoint lacks weights for: {sorted(missing)[:8]}")
        return loaded
