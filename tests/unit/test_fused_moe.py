"""The fused MoE operator on a CPU: routing, the alignment of pairs to experts, the torch
reference against a per-token loop, and the grouped-GEMM Triton kernels (interpreted, tiny
shapes) against the reference, with experts of no token and pairs of no expert (-1)."""

from __future__ import annotations

import os
from importlib.util import find_spec

import pytest
import torch
import torch.nn.functional as F

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")  # before the kernels are defined

from pagoda.ops import batch_invariant  # noqa: E402
from pagoda.ops.fused_moe import align_tokens, fused_experts_reference, route  # noqa: E402

needs_triton = pytest.mark.skipif(find_spec("triton") is None, reason="needs triton")


def _experts(e: int, h: int, i: int, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    w13 = torch.randn(e, 2 * i, h, generator=g) / h**0.5
    w2 = torch.randn(e, h, i, generator=g) / i**0.5
    return w13, w2


def _per_token(x, w13, w2, weights, ids) -> torch.Tensor:
    """The definition, token by token, in float64."""
    inter = w13.shape[1] // 2
    out = torch.zeros(x.shape, dtype=torch.float64)
    for t in range(x.shape[0]):
        for j in range(ids.shape[1]):
            e = int(ids[t, j])
            if e < 0:
                continue
            w = w13[e].double()
            h = F.silu(x[t].double() @ w[:inter].T) * (x[t].double() @ w[inter:].T)
            out[t] += float(weights[t, j]) * (h @ w2[e].double().T)
    return out


def test_route_softmax_renormalises_only_when_asked() -> None:
    logits = torch.tensor([[1.0, 3.0, 2.0, 0.0]])
    w, ids = route(logits, 2, "softmax", renormalize=False)
    p = logits.softmax(-1)
    assert ids.tolist() == [[1, 2]] and ids.dtype == torch.int32
    assert torch.allclose(w, p[:, [1, 2]])
    w, _ = route(logits, 2, "softmax", renormalize=True)
    assert torch.allclose(w, p[:, [1, 2]] / p[:, [1, 2]].sum())
    w, ids = route(logits, 1, "sigmoid", renormalize=False)
    assert ids.tolist() == [[1]] and torch.allclose(w, torch.sigmoid(torch.tensor([[3.0]])))


def test_route_refuses_a_top_k_beyond_the_experts() -> None:
    with pytest.raises(ValueError, match="top_k=5 must be in 1..4"):
        route(torch.zeros(2, 4), 5)


def test_alignment_puts_every_routed_pair_once_in_its_experts_padded_run() -> None:
    ids = torch.tensor([[3, 0], [3, -1], [0, 3], [3, 2]], dtype=torch.int32)  # expert 1: none
    a = align_tokens(ids, num_experts=4, block_m=4)
    pairs = ids.numel()
    rows = a.sorted_pairs.tolist()
    used = int(a.num_padded)
    assert used == 4 * 3  # experts 0, 2, 3: one block each
    assert sorted(r for r in rows if r < pairs) == [0, 1, 2, 4, 5, 6, 7]  # not pair 3 (-1)
    assert all(r == pairs for r in rows[used:])
    for b, expert in enumerate(a.block_experts.tolist()):
        block = [r for r in rows[b * 4 : (b + 1) * 4] if r < pairs]
        if b * 4 >= used:
            assert expert == -1 and not block
        else:
            assert all(int(ids.view(-1)[r]) == expert for r in block)
            assert block == sorted(block)  # stable: a token's pairs in order
    assert a.sorted_pairs.shape[0] >= pairs + 4 * 3  # capacity from shapes alone


def test_reference_matches_the_per_token_definition() -> None:
    w13, w2 = _experts(6, 16, 12)
    x = torch.randn(9, 16, generator=torch.Generator().manual_seed(1))
    weights, ids = route(torch.randn(9, 6, generator=torch.Generator().manual_seed(2)), 2)
    ids[4, 1] = -1  # an expert of another rank
    got = fused_experts_reference(x, w13, w2, weights, ids)
    assert torch.allclose(got.double(), _per_token(x, w13, w2, weights, ids), atol=1e-5)


def test_reference_refuses_mismatched_experts_in_one_line() -> None:
    w13, w2 = _experts(4, 16, 8)
    with pytest.raises(ValueError, match=r"do not fit"):
        fused_experts_reference(torch.zeros(2, 16), w13, w2[:, :, :4], torch.ones(2, 1),
                                torch.zeros(2, 1, dtype=torch.int32))  # fmt: skip


def test_reference_is_batch_invariant_in_that_mode() -> None:
    w13, w2 = _experts(4, 64, 32)
    x = torch.randn(40, 64, generator=torch.Generator().manual_seed(3))
    weights, ids = route(torch.randn(40, 4, generator=torch.Generator().manual_seed(4)), 2)
    batch_invariant.set_batch_invariant(True)
    try:
        whole = fused_experts_reference(x, w13, w2, weights, ids)
        alone = fused_experts_reference(x[7:8], w13, w2, weights[7:8], ids[7:8])
    finally:
        batch_invariant.set_batch_invariant(False)
    assert torch.equal(whole[7:8], alone)


@needs_triton
@pytest.mark.parametrize("n", [1, 3, 13])
def test_triton_kernels_match_the_reference(n: int) -> None:
    from pagoda.ops.triton_fused_moe import fused_experts_triton

    device = "cuda" if torch.cuda.is_available() else "cpu"
    w13, w2 = _experts(8, 32, 24)  # I=24: a partial column block; 8 experts > 3 tokens * 2
    x = torch.randn(n, 32, generator=torch.Generator().manual_seed(n))
    weights, ids = route(torch.randn(n, 8, generator=torch.Generator().manual_seed(9)), 2)
    ids[0, 1] = -1
    want = fused_experts_reference(x, w13, w2, weights, ids)
    cfg = {"BLOCK_M": 16, "BLOCK_N": 16, "BLOCK_K": 16, "num_warps": 4, "num_stages": 1}
    got = fused_experts_triton(*(t.to(device) for t in (x, w13, w2, weights, ids)), config=cfg)
    assert torch.allclose(got.cpu(), want, atol=1e-5, rtol=1e-5)


@needs_triton
def test_launch_config_comes_from_the_gpus_file_else_the_heuristic(tmp_path, monkeypatch) -> None:
    import json

    from pagoda.ops import triton_fused_moe as k

    w13, _ = _experts(8, 32, 24)
    key = k.config_key(8, 24, 32, 2, torch.float32)
    tuned = {"BLOCK_M": 32, "BLOCK_N": 32, "BLOCK_K": 32, "num_warps": 2, "num_stages": 2}
    by_m = {"1": tuned, "512": {**tuned, "BLOCK_M": 64}}
    (tmp_path / "cpu.json").write_text(json.dumps({key: by_m}))
    monkeypatch.setattr(k, "CONFIG_DIR", tmp_path)
    k._tuned.cache_clear()
    try:
        assert k.pick_config(3, w13, 2, torch.float32) == tuned  # the nearest token count
        assert k.pick_config(400, w13, 2, torch.float32)["BLOCK_M"] == 64
        assert k.pick_config(3, w13, 4, torch.float32) == k.heuristic_config(3, 4, 8)  # no entry
        batch_invariant.set_batch_invariant(True)
        assert k.pick_config(400, w13, 2, torch.float32) == k.INVARIANT_CONFIG
    finally:
        batch_invariant.set_batch_invariant(False)
        k._tuned.cache_clear()


def test_shipped_launch_configs_have_every_key() -> None:
    import json
    from pathlib import Path

    import pagoda.ops

    keys = {"BLOCK_M", "BLOCK_N", "BLOCK_K", "num_warps", "num_stages"}
    for path in (Path(pagoda.ops.__file__).parent / "moe_configs").glob("*.json"):
        for shape, by_m in json.loads(path.read_text()).items():
            assert shape.startswith("E=") and by_m, path
            assert all(set(c) == keys and int(m) > 0 for m, c in by_m.items()), (path, shape)


@needs_triton
@pytest.mark.parametrize("n, experts, k, block_m", [(1, 8, 2, 16), (9, 64, 8, 16), (300, 8, 2, 32)])
def test_triton_alignment_groups_the_pairs_as_the_torch_one_does(n, experts, k, block_m) -> None:
    from pagoda.ops.triton_fused_moe import align_tokens_triton

    g = torch.Generator().manual_seed(n)
    ids = torch.stack([torch.randperm(experts, generator=g)[:k] for _ in range(n)]).int()
    ids[::4, 0] = -1
    want = align_tokens(ids, experts, block_m)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    got = align_tokens_triton(ids.to(device), experts, block_m)
    assert torch.equal(got.num_padded.cpu(), want.num_padded)
    assert torch.equal(got.block_experts.cpu(), want.block_experts)

    def runs(a) -> dict[int, list[int]]:  # each expert's pairs and padding, in any order
        out: dict[int, list[int]] = {}
        rows = a.sorted_pairs.cpu().view(-1, block_m)
        for b, e in enumerate(a.block_experts.cpu().tolist()):
            out.setdefault(e, []).extend(rows[b].tolist())
        return {e: sorted(v) for e, v in out.items()}

    assert runs(got) == runs(want)


@needs_triton
def test_an_expert_count_the_kernels_cannot_group_is_refused_in_one_line() -> None:
    from pagoda.ops.triton_fused_moe import align_tokens_triton

    with pytest.raises(ValueError, match="2048 experts; the kernels group 1 to 1024"):
        align_tokens_triton(torch.zeros(2, 2, dtype=torch.int32), 2048, 16)
