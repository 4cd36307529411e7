"""Launching a Triton kernel through its compiled kernel.

``CachedLaunch``: the first launch of a key goes through the JIT, the next ones through the
compiled kernel it returned; a compiled kernel whose launcher fails sends every launch back to
the JIT, without losing the launch that failed.

``JitLaunch``: the same, with a key it works out itself and the grid of each call; the key
separates every argument the JIT specialises on, so a launch never runs a kernel compiled for
another alignment, integer class, dtype or option."""

from __future__ import annotations

import inspect

import numpy as np
import pytest
import torch

from pagoda.ops.launch import CachedLaunch, JitLaunch, _arg_key


class _Param:
    def __init__(self, name: str, constexpr: bool = False, default=inspect.Parameter.empty):
        self.name, self.is_constexpr, self.default = name, constexpr, default


class _Compiled:
    def __init__(self, log: list, fail: bool) -> None:
        self.log, self.fail, self.grids = log, fail, []

    def __getitem__(self, grid):
        self.grids.append(grid)

        def runner(*args):
            if self.fail:
                raise TypeError("launcher does not fit")
            self.log.append(("fast", grid, args))

        return runner


class _Jit:
    """A JIT kernel's stand-in; with ``params``, one that describes its parameters."""

    def __init__(self, fail: bool = False, params: list | None = None) -> None:
        self.log: list = []
        self.compiled = _Compiled(self.log, fail)
        if params is not None:
            self.params = params

    def __getitem__(self, grid):
        def launch(*args, **options):
            self.log.append(("jit", grid, args, options))
            return self.compiled

        return launch


def test_later_launches_of_a_key_go_through_the_compiled_kernel() -> None:
    fn = _Jit()
    launch = CachedLaunch(fn)
    launch("a", (4,), (1, 2), num_warps=1)
    launch("a", (4,), (3, 4), num_warps=1)
    launch("b", (2, 3), (5,), num_warps=1)
    launch("b", (2, 3), (6,), num_warps=1)
    assert [e[0] for e in fn.log] == ["jit", "fast", "jit", "fast"]
    assert fn.log[1] == ("fast", (4, 1, 1), (3, 4))  # the grid padded to three dimensions
    assert fn.log[3][2] == (6,)
    assert launch.fast and launch.num_cached == 2


def test_a_launcher_that_fails_sends_every_launch_back_to_the_jit() -> None:
    fn = _Jit(fail=True)
    launch = CachedLaunch(fn)
    for i in range(3):
        launch("a", (1,), (i,))
    assert [(e[0], e[2]) for e in fn.log] == [("jit", (0,)), ("jit", (1,)), ("jit", (2,))]
    assert not launch.fast and launch.num_cached == 0


def _kernel(fail: bool = False) -> _Jit:
    return _Jit(fail, [_Param("x"), _Param("n"), _Param("BLOCK", constexpr=True, default=16)])


def test_later_launches_of_a_key_go_through_the_compiled_kernel_at_their_own_grid() -> None:
    fn = _kernel()
    launch = JitLaunch(fn)
    x = torch.zeros(8)
    launch((4,), x, 3, num_warps=2)
    launch((7, 2), x, 5, num_warps=2)  # (another grid, the same key)
    assert [e[0] for e in fn.log] == ["jit", "fast"]
    assert fn.log[0] == ("jit", (4,), (x, 3, 16), {"num_warps": 2})  # (the default filled in)
    assert fn.log[1] == ("fast", (7, 2, 1), (x, 5, 16))
    assert launch.num_cached == 1


def test_the_key_separates_what_the_jit_specialises_on() -> None:
    fn = _kernel()
    launch = JitLaunch(fn)
    base = torch.zeros(64)
    first = [(base, 3), (base, 5)]  # the same key
    others = [
        (base[1:], 3),  # an address not 16-byte aligned
        (base.to(torch.float64), 3),  # another dtype
        (base, 1),  # an integer equal to 1
        (base, 32),  # divisible by 16
        (base, 2**40 + 3),  # 64 bits
    ]
    for x, n in first + others:
        launch((1,), x, n)
    launch((1,), base, 3, BLOCK=32)  # a constexpr's value
    launch((1,), base, 3, num_warps=8)  # a launch option
    kinds = [e[0] for e in fn.log]
    assert kinds == ["jit", "fast"] + ["jit"] * (len(others) + 2)
    assert launch.num_cached == len(others) + 3


def test_keys_of_arguments() -> None:
    t = torch.zeros(4)
    assert _arg_key(np.int64(48), False) == _arg_key(48, False)  # (numpy integers as ints)
    assert _arg_key(np.int64(48), False) != _arg_key(47, False)
    assert _arg_key(0.5, False) == _arg_key(2.0, False)  # (a float's value is not specialised)
    assert _arg_key(0.5, True) != _arg_key(2.0, True)  # (a constexpr's is)
    assert _arg_key(True, True) != _arg_key(1, True) != _arg_key(1.0, True)
    assert _arg_key(True, False) != _arg_key(False, False)
    assert _arg_key(t, False) != _arg_key(t[1:], False)
    assert _arg_key(None, False) != _arg_key(0, False)


def test_a_parameter_by_name_and_an_argument_of_no_key() -> None:
    fn = _kernel()
    launch = JitLaunch(fn)
    x = torch.zeros(4)
    launch((1,), x, n=3)
    launch((1,), x, n=4)
    assert [e[0] for e in fn.log] == ["jit", "fast"] and fn.log[1][2] == (x, 4, 16)
    launch((1,), x, [1, 2])  # (a list has no key: the JIT's launch, as given)
    assert fn.log[-1] == ("jit", (1,), (x, [1, 2]), {})


def test_a_grid_function_and_a_kernel_without_parameters_go_through_the_jit() -> None:
    fn = _kernel()
    launch = JitLaunch(fn)
    x = torch.zeros(4)

    def grid(meta):
        return (1,)

    launch(grid, x, 3)
    launch(grid, x, 3)
    assert [e[0] for e in fn.log] == ["jit", "jit"]
    bare = _kernel()
    del bare.params  # (the interpreter's kernels describe no parameters)
    launch = JitLaunch(bare)
    launch((1,), x, 3)
    launch((1,), x, 3)
    assert [e[0] for e in bare.log] == ["jit", "jit"]


def test_a_jit_launch_whose_launcher_fails_sends_every_launch_back_to_the_jit() -> None:
    fn = _kernel(fail=True)
    launch = JitLaunch(fn)
    x = torch.zeros(4)
    for n in (3, 5, 7):
        launch((1,), x, n)
    assert [(e[0], e[2][1]) for e in fn.log] == [("jit", 3), ("jit", 5), ("jit", 7)]
    assert not launch.fast and launch.num_cached == 0


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_launches_of_a_real_kernel_at_other_alignments_and_lengths_match_the_reference() -> None:
    from pagoda.ops import reference
    from pagoda.ops.triton_norm import _rms_norm_kernel_launch, rms_norm_triton

    g = torch.Generator(device="cuda").manual_seed(0)
    w = torch.randn(72, device="cuda", generator=g)
    flat = torch.randn(300 * 72 + 1, device="cuda", generator=g)
    before = _rms_norm_kernel_launch.num_cached
    for rows in (17, 40, 17, 299, 3):
        for offset in (0, 1):  # (an offset of one float: an address not 16-byte aligned)
            x = flat[offset : offset + rows * 72].view(rows, 72)
            got = rms_norm_triton(x, w, 1e-6)
            torch.testing.assert_close(got, reference.rms_norm(x, w, 1e-6), rtol=1e-5, atol=1e-5)
    assert _rms_norm_kernel_launch.fast
    assert _rms_norm_kernel_launch.num_cached > before


def test_an_argument_of_another_kind_goes_through_the_jit_every_time() -> None:
    """(A TMA descriptor, say: keyed by identity, it would add a cache entry a launch.)"""

    class Descriptor:
        pass

    fn = _kernel()
    launch = JitLaunch(fn)
    for _ in range(3):
        launch((1,), Descriptor(), 3)
    assert [e[0] for e in fn.log] == ["jit"] * 3 and launch.num_cached == 0
    assert _arg_key(torch.float16, False) != _arg_key(torch.bfloat16, False)
    with pytest.raises(TypeError):
        _arg_key(Descriptor(), False)
