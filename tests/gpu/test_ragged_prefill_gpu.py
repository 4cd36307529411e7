"""On a GPU, the Triton backend's steps of new prompts at Qwen3-0.6B's heads (bf16): a layer's
forward through the ragged kernel (the default) gives the paged kernel's output (the setting
off) and the float32 reference's, for an embedding step (32 prompts of 512 tokens) and prompts
of mixed lengths, causal and bidirectional, and leaves the same cache behind."""

from __future__ import annotations

from importlib.util import find_spec

import numpy as np
import pytest
import torch

from pagoda.attention.backend import CommonAttentionMetadata
from pagoda.attention.spec import AttentionSpec

# NOTE: triton is not imported here (no importorskip): collected on a CPU before the kernel tests,
# this module would import it without the interpreter they ask for.
pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
    pytest.mark.skipif(find_spec("triton") is None, reason="needs triton"),
]

HEADS, KV_HEADS, HEAD_DIM, PAGE = 16, 8, 128, 16
WORKLOADS = {
    "32x512": [512] * 32,
    "mixed": [1, 7, 64, 200, 513, 1024, 100, 333],
}


def _step(lens: list[int], device: torch.device) -> CommonAttentionMetadata:
    """New prompts only, each prompt's blocks scattered over the cache (block 0 left unused)."""
    gen = np.random.default_rng(0)
    qsl = np.concatenate([[0], np.cumsum(lens)])
    blocks = [-(-n // PAGE) for n in lens]
    perm = gen.permutation(sum(blocks)) + 1
    table = np.zeros((len(lens), max(blocks)), dtype=np.int32)
    at = 0
    for i, b in enumerate(blocks):
        table[i, :b] = perm[at : at + b]
        at += b
    rows = np.repeat(np.arange(len(lens)), lens)
    pos = np.concatenate([np.arange(n) for n in lens])
    slots = table[rows, pos // PAGE].astype(np.int64) * PAGE + pos % PAGE
    return CommonAttentionMetadata(
        num_reqs=len(lens),
        num_actual_tokens=int(qsl[-1]),
        max_query_len=max(lens),
        max_seq_len=max(lens),
        query_start_loc=torch.tensor(qsl, dtype=torch.int32, device=device),
        seq_lens=torch.tensor(lens, dtype=torch.int32, device=device),
        block_table=torch.tensor(table, device=device),
        slot_mapping=torch.tensor(slots, device=device),
        query_start_loc_cpu=qsl,
        seq_lens_cpu=np.array(lens),
        block_size=PAGE,
    )


@pytest.mark.parametrize("causal", [True, False], ids=["causal", "bidirectional"])
@pytest.mark.parametrize("workload", list(WORKLOADS))
def test_new_prompts_through_the_ragged_kernel_match_the_paged_kernel(
    workload: str, causal: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    from pagoda_attention_triton import kernels, ragged_prefill
    from pagoda_attention_triton.backend import TritonAttentionBackend, TritonAttentionImpl

    device = torch.device("cuda")
    lens = WORKLOADS[workload]
    common = _step(lens, device)
    n = common.num_actual_tokens
    gen = torch.Generator(device=device).manual_seed(0)
    q = torch.randn(n, HEADS, HEAD_DIM, generator=gen, device=device).bfloat16()
    # Keys and values as the model hands them: views of one fused projection's output.
    kv = torch.randn(n, 2 * KV_HEADS * HEAD_DIM, generator=gen, device=device).bfloat16()
    k = kv[:, : KV_HEADS * HEAD_DIM].view(n, KV_HEADS, HEAD_DIM)
    v = kv[:, KV_HEADS * HEAD_DIM :].view(n, KV_HEADS, HEAD_DIM)
    spec = AttentionSpec(HEADS, KV_HEADS, HEAD_DIM, HEAD_DIM**-0.5, causal=causal)
    impl = TritonAttentionImpl(HEADS, HEAD_DIM, spec.scale, KV_HEADS)
    impl.spec = spec
    used: list[str] = []

    def spy(module, name: str) -> None:
        real = getattr(module, name)

        def call(*args, **kwargs):
            used.append(name)
            return real(*args, **kwargs)

        monkeypatch.setattr(module, name, call)

    spy(ragged_prefill, "ragged_prefill_attention")
    spy(kernels, "paged_attention")

    outs, caches = [], []
    for on in (True, False):
        monkeypatch.setattr(TritonAttentionBackend, "ragged_prefill", on)
        cache = torch.zeros(2, int(common.block_table.max()) + 1, PAGE, KV_HEADS, HEAD_DIM)
        cache = cache.bfloat16().to(device)
        md = TritonAttentionBackend.build_metadata(common)
        with torch.inference_mode():
            outs.append(impl.forward(q, k, v, cache, md).float())
        caches.append(cache)
    assert used == ["ragged_prefill_attention", "paged_attention"]
    assert torch.equal(caches[0], caches[1])

    qsl = common.query_start_loc_cpu
    want = torch.cat(
        [
            torch.nn.functional.scaled_dot_product_attention(
                *(t[s:e].float().transpose(0, 1) for t in (q, k, v)),
                is_causal=causal,
                scale=spec.scale,
                enable_gqa=True,
            ).transpose(0, 1)
            for s, e in zip(qsl[:-1], qsl[1:])
        ]
    )
    for out in outs:
        torch.testing.assert_close(out, want, atol=2e-2, rtol=2e-2)
    torch.testing.assert_close(outs[0], outs[1], atol=2e-2, rtol=2e-2)
