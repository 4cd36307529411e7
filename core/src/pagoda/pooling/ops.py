"""The poolers' arithmetic on torch tensors: the last post-processing of pooled rows
(Matryoshka truncation, L2 normalisation, a classifier's activation) and late interaction's
MaxSim."""

from __future__ import annotations

import torch
import torch.nn.functional as F


def finish_embedding(x: torch.Tensor, dimensions: int | None, normalize: bool) -> torch.Tensor:
    """Embeddings (``[..., hidden]``) truncated to their first ``dimensions`` (Matryoshka), then
    L2-normalised over the last axis if asked; float32."""
    if dimensions is not None:
        x = x[..., :dimensions]
    x = x.float()
    return F.normalize(x, p=2, dim=-1) if normalize else x


def classifier_activation(logits: torch.Tensor) -> torch.Tensor:
    """A classifier's probabilities: softmax over its labels, or the sigmoid of a single label
    (a cross-encoder's score), as sentence-transformers and vLLM apply them."""
    logits = logits.float()
    return logits.sigmoid() if logits.shape[-1] == 1 else logits.softmax(dim=-1)


def maxsim(query: torch.Tensor, doc: torch.Tensor) -> float:
    """Late interaction (ColBERT): for each query token, its best dot product with a document
    token, summed over the query's tokens. ``query``: [q, d]; ``doc``: [n, d]."""
    return float((query.float() @ doc.float().T).max(dim=1).values.sum())


def cosine(a: torch.Tensor, b: torch.Tensor) -> float:
    """The cosine similarity of two embeddings (a bi-encoder's score)."""
    return float(F.cosine_similarity(a.float().flatten(), b.float().flatten(), dim=0))
