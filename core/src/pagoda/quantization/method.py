"""The quantization method contract: what a method (FP8, AWQ, GPTQ, a GGUF kernel, ...) provides.

A method is a class registered by name through the ``register_quantization_methods`` hook and
selected with ``model.quantization`` (or by the checkpoint's ``quantization_config``). The engine
asks the class, before any worker starts, whether it serves the checkpoint and the device
(:meth:`QuantizationMethod.unsupported`); each worker then builds one instance
(``MethodClass(checkpoint_config)``) and hands it to the model's constructor, whose linear layers
ask it, one layer at a time, for a :class:`LinearMethod`: the object that creates the layer's
weights, loads them from the checkpoint (quantizing a full-precision checkpoint as it loads, or
reading an already quantized one), and computes the layer's product.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, ClassVar

import torch
from torch import nn

from pagoda.loader.sharded import WeightSlice


@dataclass(frozen=True, slots=True)
class LinearSlice:
    """Where one checkpoint tensor's part lands in a linear layer of this tensor-parallel rank.

    The layer's output rows ``row_offset .. row_offset + rows`` are the checkpoint tensor's rows
    ``row_start .. row_start + rows`` of ``row_total`` (a column-parallel layer's projection:
    q, k, v, gate, up); its input columns are the checkpoint's ``col_start .. col_start + cols``
    of ``col_total`` (a row-parallel layer's split input; the whole input otherwise).
    ``shard`` names the projection (``"q_proj"``; ``""`` for a layer of one)."""

    shard: str
    row_offset: int
    row_start: int
    rows: int
    row_total: int
    col_start: int
    cols: int
    col_total: int


class LinearMethod(ABC):
    """How one linear layer holds, loads and applies its quantized weight.

    The layer is the :class:`torch.nn.Module` that calls these; the method keeps its tensors on
    the layer (parameters or buffers), so that they move with it and a CUDA graph captures
    them. One instance may serve every layer of a model: it keeps nothing per layer itself.
    """

    #: Whether :meth:`apply` also takes its input already quantized a row at a time
    #: (:class:`pagoda.ops.fp8.QuantizedRows`, FP8): a model then lets the norm before such a
    #: layer quantize its output in its own kernel (:func:`pagoda.ops.rms_norm_fp8`).
    takes_quantized_rows: ClassVar[bool] = False

    @abstractmethod
    def create_weights(
        self, layer: nn.Module, in_features: int, out_features: int, dtype: torch.dtype
    ) -> None:
        """Called once per layer while the model is built (inside the worker's device and dtype
        context: a plain ``torch.empty`` lands on the engine's device). Register the layer's
        weight tensors on ``layer``, for ``out_features`` output rows and ``in_features`` input
        columns (this rank's), ``dtype`` being the model's. Values are set by
        :meth:`load_weight`; the layer's ``bias``, if any, is the layer's own."""

    @abstractmethod
    def load_weight(
        self, layer: nn.Module, name: str, weight: WeightSlice, where: LinearSlice
    ) -> None:
        """Called for each checkpoint tensor of the layer other than its bias, named by its
        last part (``weight``, ``weight_scale``, ``input_scale``, ...): read this rank's part
        (``where``; ``weight.narrow`` reads no more of the file) into the layer's tensors. A
        full-precision ``weight`` is quantized here, as it streams in. Raise ``ValueError``,
        naming the tensor, for one the method cannot read."""

    def finish_loading(self, layer: nn.Module) -> None:
        """Called once per layer after every checkpoint tensor is loaded (or random values
        filled): check that what loaded is complete, and prepare what :meth:`apply` reads.
        Default: nothing."""
        return None

    @abstractmethod
    def apply(self, layer: nn.Module, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        """The layer's product: ``x`` [tokens, in_features] in the model's dtype -> [tokens,
        out_features] in the same dtype, plus ``bias`` when given. Called every step, inside
        CUDA graphs too: no host synchronisation, no allocation that depends on values."""


class QuantizationMethod(ABC):
    """A quantization method (a class registered by name). Class-level questions come before
    any worker starts; an instance is built in each worker from the checkpoint's
    ``quantization_config`` (``{}`` for a full-precision checkpoint quantized as it loads)."""

    name: ClassVar[str]
    #: The ``quant_method`` values of a checkpoint's ``quantization_config`` it reads
    #: (``"compressed-tensors"``, ``"fbgemm_fp8"``, ...): such a checkpoint selects it when
    #: ``model.quantization`` is not set.
    checkpoint_formats: ClassVar[tuple[str, ...]] = ()
    #: Whether it quantizes a full-precision checkpoint as it loads (``quantization: NAME`` on
    #: a bf16 checkpoint).
    quantizes_online: ClassVar[bool] = False

    def __init__(self, checkpoint_config: dict[str, Any]) -> None:
        self.checkpoint_config = checkpoint_config

    @classmethod
    def unsupported(
        cls, checkpoint_config: dict[str, Any], device: torch.device, dtype: torch.dtype
    ) -> str | None:
        """Called at engine start, in the engine's process, with the checkpoint's
        ``quantization_config`` (``{}``: none), the engine's device and the model's dtype.
        Returns None when the method serves them, else what is missing, one line (a GPU without
        the tensor cores it needs, a checkpoint layout it does not read). Default: a
        full-precision checkpoint only when it quantizes online, any device."""
        if not checkpoint_config and not cls.quantizes_online:
            return f"quantization {cls.name!r} reads only checkpoints quantized for it"
        return None

    @abstractmethod
    def linear_method(self, prefixes: Sequence[str]) -> LinearMethod | None:
        """Called once per linear layer while the model is built, with the checkpoint names of
        the projections the layer merges (``["model.layers.0.self_attn.q_proj", ...k_proj,
        ...v_proj]``). Returns the :class:`LinearMethod` for the layer, or None to leave it in
        full precision (a layer the checkpoint left unquantized, the LM head)."""
