"""What one attention layer computes: :class:`AttentionSpec`, read when a layer and its backend
are built, never per step."""

from __future__ import annotations

from dataclasses import dataclass, fields


@dataclass(frozen=True)
class AttentionSpec:
    """One attention layer, as its backend must compute it.

    A query at absolute position ``i`` of a request attends to the request's keys at positions
    ``j < seq_len`` that every rule below allows; its logits are ``scale * q . k``.
    """

    #: This tensor-parallel rank's query heads.
    num_heads: int
    #: This rank's KV heads; query head ``h`` reads KV head ``h // (num_heads // num_kv_heads)``.
    num_kv_heads: int
    #: The size of one query and key head.
    head_size: int
    #: The factor of ``q . k``.
    scale: float
    #: The size of one value head, and of one output head (None: ``head_size``).
    value_head_size: int | None = None
    #: True: key ``j`` is seen only if ``j <= i``. False: bidirectional (encoders).
    causal: bool = True
    #: None, or ``w``: key ``j`` is seen only if ``|i - j| < w`` (with ``causal``, ``0 <= i - j <
    #: w``).
    sliding_window: int | None = None
    #: None, or ``c``: logits become ``c * tanh(logits / c)`` before masking.
    logit_softcap: float | None = None
    #: Whether each query head has a sink logit ``s`` that joins the softmax's denominator only
    #: (``exp(s)`` is added to it; no value goes with it), as gpt-oss. The values come with the
    #: layer's weights (the layer's ``sinks`` parameter, ``[num_heads]``, handed to its impl).
    sinks: bool = False
    #: None, or ``n``: key ``j`` is seen only if ``i // n == j // n`` (Llama 4's chunks).
    chunk_size: int | None = None

    def __post_init__(self) -> None:
        if self.num_heads < 1 or self.num_kv_heads < 1 or self.num_heads % self.num_kv_heads:
            raise ValueError(
                f"num_heads ({self.num_heads}) must be a positive multiple of num_kv_heads "
                f"({self.num_kv_heads})"
            )
        for name in ("head_size", "value_head_size", "sliding_window", "chunk_size"):
            value = getattr(self, name)
            if value is not None and value < 1:
                raise ValueError(f"attention {name} must be at least 1, not {value}")
        if self.logit_softcap is not None and not self.logit_softcap > 0:
            raise ValueError(f"attention logit_softcap must be positive, not {self.logit_softcap}")
        # NOTE: kept, not a field: backends read it per layer per step.
        object.__setattr__(self, "_features", tuple(self._find_features()))

    @property
    def v_head_size(self) -> int:
        """The value (and output) head size, resolved."""
        return self.head_size if self.value_head_size is None else self.value_head_size

    @property
    def cache_head_size(self) -> int:
        """The head size the layer's KV cache is allocated with (``get_kv_cache_shape``'s): the
        larger of the key and value head sizes; each is stored in the leading part."""
        return max(self.head_size, self.v_head_size)

    def features(self) -> tuple[str, ...]:
        """The names of the fields set away from plain causal attention, in field order:
        ``value_head_size`` (when it differs from ``head_size``), ``causal`` (when false),
        ``sliding_window``, ``logit_softcap``, ``sinks``, ``chunk_size``. Empty: plain."""
        return self._features  # type: ignore[attr-defined]

    def _find_features(self) -> list[str]:
        out = []
        for f in fields(self)[4:]:  # past the sizes and the scale
            value = getattr(self, f.name)
            if f.name == "value_head_size":
                if self.v_head_size != self.head_size:
                    out.append(f.name)
            elif value != f.default:
                out.append(f.name)
        return out
