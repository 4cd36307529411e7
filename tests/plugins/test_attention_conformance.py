"""The attention conformance kit (``pagoda.testing``) on the reference backend, and proof that the
kit fails backends with the usual bugs: a kit that passes everything would test nothing."""

from __future__ import annotations

import re
from typing import Any

import pytest
import torch

from pagoda.attention.backend import AttentionBackend, AttentionImpl, model_stored_kv
from pagoda.testing import AttentionBackendConformance, attention_cases, check_attention_backend
from pagoda.testing.attention import fresh_prompt_cases


class TestTorchNativeConformance(AttentionBackendConformance):
    backend = "torch_native"  # selected by name, through the core's own plugin


class TestTorchNativeBFloat16Conformance(AttentionBackendConformance):
    backend = "torch_native"
    dtypes = (torch.bfloat16,)


class NaiveImpl(AttentionImpl):
    """Per-request attention read back from the cache, with switches for classic bugs."""

    bug: str | None = None

    def attends_from_inputs(self, kv_cache, attn_metadata) -> bool:
        return self.bug == "claims_inputs"  # (it always reads the cache)

    def forward(self, query, key, value, kv_cache, attn_metadata) -> torch.Tensor:
        md = attn_metadata
        n, bs = md.num_actual_tokens, md.block_size
        kc, vc = kv_cache[0], kv_cache[1]
        if self.bug != "no_cache_write" and not model_stored_kv():
            kc.view(-1, self.num_kv_heads, self.head_size)[md.slot_mapping[:n]] = key[:n]
            vc.view(-1, self.num_kv_heads, self.head_size)[md.slot_mapping[:n]] = value[:n]
        out = torch.empty_like(query)
        group = self.num_heads // self.num_kv_heads
        for i in range(md.num_reqs):
            s, e = int(md.query_start_loc_cpu[i]), int(md.query_start_loc_cpu[i + 1])
            seq = int(md.seq_lens_cpu[i])
            blocks = md.block_table[i, : -(-seq // bs)].long()
            read = len(blocks) * bs if self.bug == "reads_block_tail" else seq
            k = kc[blocks].flatten(0, 1)[:read]
            v = vc[blocks].flatten(0, 1)[:read]
            heads = torch.arange(self.num_heads)
            kv_head = heads % self.num_kv_heads if self.bug == "gqa_mapping" else heads // group
            k, v = k[:, kv_head], v[:, kv_head]
            scores = torch.einsum("qhd,khd->hqk", query[s:e], k) * self.scale
            # A decode is "trivially causal", but the block's tail past seq_len is not its own.
            decode_unmasked = self.bug == "reads_block_tail" and e - s == 1
            if self.bug != "not_causal" and not decode_unmasked:
                q_pos = torch.arange(seq - (e - s), seq)[:, None]
                mask = torch.arange(read)[None, :] > q_pos
                scores = scores.masked_fill(mask, float("-inf"))
            out[s:e] = torch.einsum("hqk,khd->qhd", scores.softmax(-1), v)
        return out


def _backend(bug: str | None) -> type[AttentionBackend]:
    impl = type(f"NaiveImpl_{bug}", (NaiveImpl,), {"bug": bug})

    class Naive(AttentionBackend):
        name = f"naive_{bug}"

        @classmethod
        def supports(cls, device: Any, dtype: Any, head_size: int) -> bool:
            return True

        @classmethod
        def get_impl_cls(cls) -> type[AttentionImpl]:
            return impl

    return Naive


CASES = {c.name: c for c in attention_cases()}


@pytest.mark.parametrize(
    ("bug", "case"),
    [
        ("no_cache_write", "decode-h4kv4(g1)-d64-bs16"),
        ("not_causal", "prefill-h4kv4(g1)-d64-bs16"),
        ("gqa_mapping", "mixed-h8kv2(g4)-d128-bs32"),
        ("reads_block_tail", "decode-h6kv2(g3)-d64-bs16"),
    ],
)
def test_the_kit_fails_a_backend_with_a_classic_bug(bug: str, case: str) -> None:
    check_attention_backend(_backend(None), CASES[case])  # without the bug, the case passes
    with pytest.raises(AssertionError, match=re.escape(f"Naive on {case} ")):
        check_attention_backend(_backend(bug), CASES[case])


def test_the_kit_fails_an_impl_that_reads_the_cache_it_says_it_need_not() -> None:
    """``attends_from_inputs`` true, but the forward reads the step's keys from the cache: with
    nothing stored there, its output is not the reference's."""
    case = fresh_prompt_cases()[0]
    check_attention_backend(_backend(None), case, unread=True)  # (says false: stores, passes)
    with pytest.raises(AssertionError, match=re.escape(f"Naive on {case.name} ")):
        check_attention_backend(_backend("claims_inputs"), case, unread=True)


def test_cases_cover_the_scenarios_gqa_ratios_block_and_head_sizes() -> None:
    cases = list(CASES.values())
    assert {c.scenario for c in cases} == {"prefill", "decode", "mixed", "prefix_cached"}
    assert {c.num_heads // c.num_kv_heads for c in cases} == {1, 3, 4}
    assert {c.num_kv_heads for c in cases} >= {1}  # multi-query
    assert {c.head_size for c in cases} == {64, 128}
    assert {c.block_size for c in cases} == {16, 32}
