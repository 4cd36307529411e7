"""The fused stand-ins are chosen the same way whatever device tensors default to: the worker
builds the model under ``torch.device(cuda)``, and a probe drawn from a CPU generator there
raised, so that no norm, MLP or rotary was fused on a GPU (a decode step of Qwen3-0.6B ran 300
kernels more). A ``meta`` default stands in for the GPU's here: a probe made under it is not
computed, and every stand-in is dropped unless the probes are made on the CPU."""

from __future__ import annotations

import copy

import torch
from pagoda_models_transformers.fuse import fuse
from tf_parity import hf_model


def test_fuse_substitutes_under_another_default_device() -> None:
    model = hf_model("qwen3").model
    alone = fuse(copy.deepcopy(model))
    layers = model.config.num_hidden_layers
    # Each layer: input, post-attention, q and k norms, and its MLP; the final norm; one file.
    assert alone == {"rms_norm": 4 * layers + 1, "gated_mlp": layers, "rotary": 1}
    with torch.device("meta"):
        under = fuse(copy.deepcopy(model))
    assert under == alone


def test_a_module_that_computes_otherwise_keeps_its_own_forward() -> None:
    # Gemma's RMSNorm scales by 1 + weight: the stand-in disagrees and is not used.
    done = fuse(hf_model("gemma").model)
    assert done["rms_norm"] == 0
    assert done["gated_mlp"] == 0  # its MLP's activation is GELU, not SiLU
