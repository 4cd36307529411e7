"""An engine child process ends without the interpreter's teardown, where Triton's nanobind
prints a "leaked" line per live object (over a hundred when ``pagoda serve`` stops a GPU engine),
and keeps its exit status and what it printed and logged."""

from __future__ import annotations

import subprocess
import sys
import textwrap

CHILD = textwrap.dedent(
    """
    import atexit, logging, sys
    from pagoda.process import run_then_end_quietly

    # stands for nanobind's report, which the interpreter's teardown prints
    atexit.register(lambda: print("nanobind: leaked 120 instances!", file=sys.stderr))

    def main(code):
        logging.basicConfig()
        logging.getLogger("engine").warning("engine stopped")
        print("last output", end="")  # not flushed yet
        sys.exit(code)

    run_then_end_quietly(main, int(sys.argv[1]))
    """
)


def _run(code: int) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-c", CHILD, str(code)], capture_output=True, text=True, timeout=60
    )


def test_teardown_output_is_skipped_and_status_output_and_logs_kept() -> None:
    for code in (0, 3):
        done = _run(code)
        assert done.returncode == code
        assert done.stdout == "last output"
        assert "engine stopped" in done.stderr
        assert "leaked" not in done.stderr
