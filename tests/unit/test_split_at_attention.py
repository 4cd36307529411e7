"""``pagoda.attention.layer.split_at_attention``, the seam of the runner's piecewise CUDA graphs:
inside it each attention layer hands its q, k and v to the split, in layer order, and the model
goes on from what the split returns; a split that runs the layer itself gives the eager step's
hidden states bit for bit (what a replay does between two graphs)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

import pagoda.attention.layer as attention_layer
from pagoda import LLM, SamplingParams
from pagoda.attention.layer import split_at_attention

CONFIG = Path(__file__).parents[2] / "benchmarks" / "configs" / "tiny-llama"


def test_a_split_that_attends_gives_the_eager_hidden_states() -> None:
    llm = LLM(
        model=str(CONFIG), load_format="dummy", device="cpu", dtype="float32", max_model_len=256
    )
    runner = llm.engine.engine_core.executor.worker.model_runner
    forward = runner.model.forward
    num_layers = sum(isinstance(m, attention_layer.Attention) for m in runner.model.modules())
    seen = []

    def split_again(ids, positions, **kw):
        out = forward(ids, positions, **kw)
        if ids.shape[0] == 1 or seen:
            return out  # (one prompt's step is enough)
        layers = []

        def attend(layer, q, k, v, kv_stored):
            layers.append(layer.layer_idx)
            assert q.shape[0] == k.shape[0] == v.shape[0] == ids.shape[0]
            with split_at_attention(None):  # (the keys and values written again: the same)
                return layer(q, k, v, kv_stored=kv_stored)

        def zeros(layer, q, k, v, kv_stored):
            return q.new_zeros(q.shape[0], layer.num_heads * layer.v_head_size)

        with split_at_attention(attend):
            again = forward(ids, positions, **kw)
        with split_at_attention(zeros):
            without = forward(ids, positions, **kw)
        with split_at_attention(zeros), pytest.raises(ValueError, match="keeps every row"):
            runner.model.model.layers[0].self_attn.attn(
                torch.zeros(2, 4), torch.zeros(2, 4), torch.zeros(2, 4), keep=torch.tensor([1])
            )
        seen.append((out.clone(), again, without, layers))
        return out

    runner.model.forward = split_again
    llm.generate(
        [{"prompt_token_ids": list(range(10, 50))}],
        SamplingParams(max_tokens=2, temperature=0.0),
        use_tqdm=False,
    )
    (out, again, without, layers), *_ = seen
    assert layers == list(range(num_layers)) and num_layers > 1
    assert torch.equal(again, out)
    assert not torch.allclose(without, out, atol=1e-3)  # what the split returns is read
    assert attention_layer._split is None
