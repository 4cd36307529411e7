"""The Llama family as pooling models: the body without an LM head (``Qwen3Model``: embedders
such as Qwen3-Embedding and GTE-Qwen2 as sentence-transformers saves them) and with a sequence
classification head (``Qwen3ForSequenceClassification``: a ``score`` linear layer on the last
token). Causal like the generative models, so chunked prefill and (for last-token pooling)
prefix-cache hits apply."""

from __future__ import annotations

from collections.abc import Iterable, Iterator

import torch
from torch import nn

from pagoda.attention.backend import AttentionBackend
from pagoda.loader.arch import ModelArchConfig
from pagoda.loader.sharded import WeightSlice
from pagoda.models.llama import LlamaForCausalLM, LlamaModel


class LlamaPoolingModel(LlamaForCausalLM):
    """``forward`` gives the final norm's hidden states, as the generative model's does;
    ``classify`` maps pooled hidden states to the classification head's logits."""

    #: No LM head: the engine pools this model's hidden states and never samples from it.
    pooling_only = True

    def __init__(self, cfg: ModelArchConfig, backend: type[AttentionBackend]) -> None:
        nn.Module.__init__(self)
        self.config = cfg
        self.model = LlamaModel(cfg, backend)
        self.score = (
            nn.Linear(cfg.hidden_size, cfg.num_labels, bias=False) if cfg.num_labels else None
        )

    def compute_logits(self, hidden_states: torch.Tensor) -> torch.Tensor:
        raise ValueError(f"{self.config.architecture} has no LM head: it cannot generate")

    def classify(self, pooled: torch.Tensor) -> torch.Tensor:
        if self.score is None:
            raise ValueError(f"{self.config.architecture} has no classification head")
        return self.score(pooled)

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor | WeightSlice]]) -> set[str]:
        """Hugging Face names, with the body's ``model.`` prefix or without (a bare body saved
        alone); an LM head in the checkpoint is skipped."""

        def renamed() -> Iterator[tuple[str, torch.Tensor | WeightSlice]]:
            for name, tensor in weights:
                if name.startswith("lm_head."):
                    continue
                if not name.startswith(("model.", "score.")):
                    name = "model." + name
                yield name, tensor

        return super().load_weights(renamed())
