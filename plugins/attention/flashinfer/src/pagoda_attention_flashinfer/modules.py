"""FlashInfer's just-in-time modules: which ones a run loads, and whether each is built.

FlashInfer builds a module (one shared library per kernel family and template parameters: dtypes,
head size, positional encoding, window, soft cap, FA2 or FA3) with ninja when a wrapper's ``plan``
first asks for it, into its cache (``~/.cache/flashinfer/<version>/<arch>/cached_ops/<name>/``),
and on every later load runs ninja again, which rebuilds whatever it finds out of date. FlashInfer
logs none of it. Every module passes through ``flashinfer.jit.core.JitSpec.build_and_load``; this
module wraps that method once per process to record which modules are loaded, how long each took
and whether it was built, and checks a recorded module the way its next load will: its library is
there and ``ninja -n`` finds nothing to do.
"""

from __future__ import annotations

import logging
import shutil
import subprocess
import time
from collections.abc import Callable, Iterable, Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

logger = logging.getLogger("pagoda.attention.flashinfer")


@dataclass(frozen=True)
class Module:
    """One FlashInfer module as a run loaded it."""

    name: str
    library: str  # the shared library FlashInfer loads
    build_file: str | None  # its ninja file; None for a prebuilt (AOT) module
    seconds: float = 0.0  # how long loading it took, its build included
    built: bool = False  # whether the load built (or rebuilt) the library


class Discovered(BaseException):  # NOTE: not an Exception, so no ``except Exception`` eats it.
    """Raised where FlashInfer asks for a module while :func:`discovering` is on."""


_original: Callable[[Any], Any] | None = None
_listeners: list[Callable[[Module], None]] = []
_asked: list[Any] | None = None  # while discovering: the specs asked for, in order
_recordings = 0
_engine_log = False


def _library(spec: Any) -> Path:
    return Path(spec.get_library_path())


def _build_file(spec: Any) -> str | None:
    if getattr(spec, "is_aot", False) or not hasattr(spec, "ninja_path"):
        return None
    return str(spec.ninja_path)


def _mtime(path: Path) -> float | None:
    try:
        return path.stat().st_mtime
    except OSError:
        return None


def install() -> bool:
    """Wrap FlashInfer's module loading in this process (once); False when this FlashInfer has
    no ``JitSpec.build_and_load`` (its modules then go unrecorded)."""
    global _original
    if _original is not None:
        return True
    try:
        from flashinfer.jit.core import JitSpec
    except ImportError:
        return False
    original = getattr(JitSpec, "build_and_load", None)
    if original is None:
        return False

    def build_and_load(self: Any) -> Any:
        if _asked is not None and _build_file(self) is not None:
            _asked.append(self)
            raise Discovered(self.name)
        library = _library(self)
        before = _mtime(library)
        start = time.perf_counter()
        loaded = original(self)
        module = Module(
            name=self.name,
            library=str(library),
            build_file=_build_file(self),
            seconds=round(time.perf_counter() - start, 2),
            built=_mtime(library) != before,
        )
        for listener in list(_listeners):
            listener(module)
        return loaded

    JitSpec.build_and_load = build_and_load
    _original = original
    return True


@contextmanager
def recording() -> Iterator[list[Module]]:
    """Collect every module FlashInfer loads in the block, in order."""
    global _recordings
    install()
    loaded: list[Module] = []
    _listeners.append(loaded.append)
    _recordings += 1
    try:
        yield loaded
    finally:
        _recordings -= 1
        _listeners.remove(loaded.append)


@contextmanager
def discovering() -> Iterator[list[Any]]:
    """In the block, a module FlashInfer asks for that is not prebuilt is noted and not built:
    :class:`Discovered` is raised where it was asked for. Yields the specs asked for."""
    global _asked
    install()
    _asked = []
    try:
        yield _asked
    finally:
        _asked = None


def build_all(specs: Iterable[Any], say: Callable[[str], None]) -> list[Module]:
    """Build ``specs`` at once, each in its own build folder with its own ninja file, as its
    load does (so that the load finds nothing to do); ``say`` gets one line per module."""
    unique = list({spec.name: spec for spec in specs}.values())

    def build(spec: Any) -> Module:
        library = _library(spec)
        before = _mtime(library)
        start = time.perf_counter()
        spec.build(need_lock=True)
        took = time.perf_counter() - start
        built = _mtime(library) != before
        say(f"flashinfer: {'compiled' if built else 'up to date:'} {spec.name} in {took:.1f} s")
        return Module(spec.name, str(library), _build_file(spec), round(took, 2), built)

    if not unique:
        return []
    with ThreadPoolExecutor(max_workers=len(unique)) as pool:
        return list(pool.map(build, unique))


def why_stale(module: Module) -> str | None:
    """None when loading ``module`` would build nothing; otherwise why it would build."""
    library = Path(module.library)
    if not library.exists():
        return f"{module.name}: {library} is missing"
    if module.build_file is None:
        return None
    ninja = shutil.which("ninja")
    if ninja is None:
        return f"{module.name}: ninja is not on PATH (FlashInfer loads its modules through it)"
    build_file = Path(module.build_file)
    argv = [ninja, "-n", "-d", "explain", "-C", str(build_file.parent), "-f", str(build_file)]
    try:
        done = subprocess.run(argv, capture_output=True, text=True, timeout=60)
    except (OSError, subprocess.TimeoutExpired) as e:
        return f"{module.name}: ninja -n failed ({e})"
    if done.returncode == 0 and "no work to do" in done.stdout:
        return None
    said = [ln for ln in (done.stderr + done.stdout).splitlines() if ln.strip()]
    reason = next((ln for ln in said if "explain" in ln), said[-1] if said else "")
    return f"{module.name}: ninja would build ({reason.strip()})"


def log_engine_builds() -> None:
    """From now on, a module this process loads outside :func:`recording` is logged: a build
    (the engine waiting for a compile) as a warning with its time, a load as debug."""
    global _engine_log
    if _engine_log or not install():
        return
    _engine_log = True

    def log(module: Module) -> None:
        if _recordings:
            return
        if module.built:
            logger.warning(
                "attention: flashinfer compiled %s in %.1f s at first use (it was not built ahead)",
                module.name,
                module.seconds,
            )
        else:
            logger.debug("attention: flashinfer loaded %s in %.2f s", module.name, module.seconds)

    _listeners.append(log)
