"""``CachedLaunch``: the first launch of a key goes through the JIT, the next ones through the
compiled kernel it returned; a compiled kernel whose launcher fails sends every launch back to
the JIT, without losing the launch that failed."""

from __future__ import annotations

from pagoda.ops.launch import CachedLaunch


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
    def __init__(self, fail: bool = False) -> None:
        self.log: list = []
        self.compiled = _Compiled(self.log, fail)

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
