"""What the engine reads of a model: :class:`ModelShape`, declared by its model impl."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from pagoda.attention.spec import AttentionSpec


@dataclass(frozen=True)
class ModelShape:
    """A model as the engine sees it on one tensor-parallel rank, before it is built.

    The model impl derives it from the model's config.json (``ModelImpl.shape``); the engine
    sizes the context, the vocabulary's buffers and the KV cache from it, the attention selector
    checks every layer's spec, and each worker builds the model from ``config``.
    """

    #: The architecture the config names (``architectures[0]``, else its ``model_type``).
    architecture: str
    #: Rows of the LM head: what a sampled token id can be.
    vocab_size: int
    #: The width of the hidden states ``forward`` returns.
    hidden_size: int
    #: Decoder layers (the hidden states a speculative proposer may ask for are numbered so).
    num_hidden_layers: int
    #: The positions the model was trained to read: the longest context it serves.
    max_position_embeddings: int
    #: One spec per layer that has a KV cache, in the order the model builds its attention
    #: layers: this rank's heads. The KV cache gives each layer its own KV heads and head size.
    attention: tuple[AttentionSpec, ...]
    #: What the impl's model class is built from (``ModelClass(config, attention_backend)``);
    #: the engine does not read it.
    config: Any
    #: The dtype the checkpoint names (``torch_dtype`` or ``dtype``), as a string.
    torch_dtype: str = "float32"
    bos_token_id: int | None = None
    #: The config's end-of-sequence id or ids (the generation config may add more).
    eos_token_id: int | list[int] | None = None

    def __post_init__(self) -> None:
        if not self.attention:
            raise ValueError(f"{self.architecture}: a model shape needs one attention spec")
        object.__setattr__(self, "attention", tuple(self.attention))

    @property
    def head_sizes(self) -> tuple[int, ...]:
        """The distinct query/key head sizes of the layers, ascending."""
        return tuple(sorted({s.head_size for s in self.attention}))

    def kv_bytes_per_token(self, itemsize: int, layers: tuple[int, int] | None = None) -> int:
        """Bytes one token takes in this rank's KV cache, every layer's keys and values (of
        the layers ``[start, end)`` only, a pipeline stage's, when given)."""
        specs = self.attention if layers is None else self.attention[layers[0] : layers[1]]
        return sum(2 * s.num_kv_heads * s.cache_head_size for s in specs) * itemsize

    @property
    def sliding_window_layers(self) -> tuple[int, ...]:
        """The layers that attend over a sliding window."""
        return tuple(i for i, s in enumerate(self.attention) if s.sliding_window is not None)
