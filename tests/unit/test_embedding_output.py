"""``EmbeddingOutput``: the engine's array kept, vLLM's list of floats made when first read; and
a pooling step's outputs copied out of the page-locked buffer they came back in."""

import numpy as np
import pytest
import torch

from pagoda.outputs import EmbeddingOutput
from pagoda.worker.pooling import PooledStep


def test_embedding_is_the_arrays_floats_made_once() -> None:
    data = np.array([0.5, -1.25, 3.0], dtype=np.float32)
    out = EmbeddingOutput(data)
    assert out.data is data
    assert out.hidden_size == 3
    first = out.embedding
    assert first == [0.5, -1.25, 3.0] and all(type(v) is float for v in first)
    assert out.embedding is first  # (made once, then kept)


def test_an_embedding_given_as_a_list_stays_that_list() -> None:
    values = [1.0, 2.0]
    out = EmbeddingOutput(values)
    assert out.embedding is values and out.hidden_size == 2
    assert out == EmbeddingOutput(np.array(values, dtype=np.float32))
    assert out != EmbeddingOutput([1.0, 2.5])
    assert repr(out) == "EmbeddingOutput(embedding=[1.0, 2.0])"


@pytest.mark.skipif(not torch.cuda.is_available(), reason="page-locked memory needs CUDA")
def test_pooled_outputs_do_not_share_the_steps_page_locked_buffer() -> None:
    flat = torch.arange(6, dtype=torch.float32).pin_memory()
    step = PooledStep(["a", "b"], [(2,), (2, 2)], flat)
    out = step.split()
    assert out["a"].tolist() == [0.0, 1.0]
    assert out["b"].tolist() == [[2.0, 3.0], [4.0, 5.0]]
    flat.fill_(-1)  # (the buffer reused by a later step)
    assert out["a"].tolist() == [0.0, 1.0]
    assert not np.shares_memory(out["b"], flat.numpy())


def test_pooled_outputs_of_a_cpu_step_are_views_of_it() -> None:
    flat = torch.arange(4, dtype=torch.float32)  # (a CPU step's own tensor: nothing reuses it)
    out = PooledStep(["a", "b"], [(2,), (2,)], flat).split()
    assert out["b"].tolist() == [2.0, 3.0] and np.shares_memory(out["a"], flat.numpy())
