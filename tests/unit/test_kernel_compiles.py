"""``pagoda.bench.device.KernelCompiles``: what a timed region compiled, with the pass that met
it and the variant built, through Triton's post-compile hook (called here as Triton calls it:
no GPU needed), and the hook that was there before restored and still called."""

from __future__ import annotations

import pytest

from pagoda.bench.device import KernelCompiles

knobs = pytest.importorskip("triton.knobs")


class _Fn:
    name = "_paged_attention"


def test_each_compile_is_recorded_with_its_pass_and_variant() -> None:
    seen: list[str] = []
    before = knobs.runtime.jit_post_compile_hook
    knobs.runtime.jit_post_compile_hook = lambda **kw: seen.append(kw["repr"])
    try:
        with KernelCompiles() as compiles:
            assert compiles.supported
            hook = knobs.runtime.jit_post_compile_hook
            compiles.where = "batch 1, spec"
            hook(key=None, repr="_paged_attention[num_warps=4](BLOCK_M: 16)", fn=_Fn())
            compiles.where = "batch 7, off"
            hook(key=None, repr="_paged_attention[num_warps=8](BLOCK_M: 128)", fn=_Fn())
        assert knobs.runtime.jit_post_compile_hook is not hook  # restored on exit
        assert compiles.names == ["_paged_attention", "_paged_attention"]
        assert [d["where"] for d in compiles.details] == ["batch 1, spec", "batch 7, off"]
        assert compiles.details[1]["variant"].endswith("(BLOCK_M: 128)")
        assert len(seen) == 2  # the hook in place before still ran
    finally:
        knobs.runtime.jit_post_compile_hook = before


class _Param:
    def __init__(self, name: str) -> None:
        self.name = name


class _Jit:
    params = [_Param("q_ptr"), _Param("num_seqs"), _Param("BLOCK_M"), _Param("SPLIT")]


class _FnInfo:
    name = "_paged_attention"
    jit_function = _Jit()


def test_a_compile_names_its_constexpr_values() -> None:
    """What tells two variants of one kernel apart (some Triton releases cut the repr's argument
    list short): the compile's constexprs by parameter name."""
    before = knobs.runtime.jit_post_compile_hook
    knobs.runtime.jit_post_compile_hook = None
    try:
        with KernelCompiles() as compiles:
            knobs.runtime.jit_post_compile_hook(
                key=None,
                repr="_paged_attention[num_warps=4](q_ptr: ()",
                fn=_FnInfo(),
                compile={"constants": {(2,): 64, (3,): False}},
            )
        assert compiles.details[0]["constexprs"] == {"BLOCK_M": "64", "SPLIT": "False"}
    finally:
        knobs.runtime.jit_post_compile_hook = before
