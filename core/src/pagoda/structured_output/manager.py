"""Compiling requests' constraints off the engine loop, and the cache of compiled grammars.

The engine core owns one :class:`StructuredOutputManager`. ``submit`` starts a request's compile
in a thread pool (or finds it in the cache, keyed by the constraint); the scheduler leaves the
request waiting, and schedules the others, until ``poll`` says its grammar is ready. A compile
that fails, or outlasts ``structured_output.compile_timeout_s``, fails that request alone.

The model runner finds compiled grammars through the same manager (``process_manager``): in
the engine's own process that is the core's, so a scheduled request's grammar is always there.
"""

from __future__ import annotations

import concurrent.futures as cf
import logging
import threading
import time
from collections import OrderedDict
from typing import TYPE_CHECKING, Any

from pagoda.model_info import ModelInfo, load_model_tokenizer, model_eos_ids
from pagoda.plugins import PluginLoadError, get_registry, select
from pagoda.sampling_params import StructuredOutputsParams
from pagoda.structured_output.backend import CompiledGrammar, GrammarBackend

if TYPE_CHECKING:
    from pagoda.config import EngineConfig
    from pagoda.request import Request

logger = logging.getLogger(__name__)


class GrammarCompileError(ValueError):
    """A request's constraint failed to compile, or took longer than allowed."""


def select_grammar_backend(name: str) -> type[GrammarBackend]:
    """The backend class named ``name`` (``structured_output.backend``), or ``auto``: the
    registered one with the highest ``priority``. Raises ``ValueError`` if there is none."""
    try:
        return select("grammar_backends", name, check=_check_backend)
    except (PluginLoadError, LookupError) as e:
        raise ValueError(f"structured output needs a grammar backend: {e}") from e


def _check_backend(name: str, target: Any) -> None:
    if not (isinstance(target, type) and issubclass(target, GrammarBackend)):
        plugin = get_registry("grammar_backends").registration(name).plugin
        raise PluginLoadError(
            f"grammar backend {name!r} from plugin {plugin.label} is {target!r}, not a subclass "
            "of pagoda.structured_output.backend.GrammarBackend"
        )


def validate_structured_outputs(config: EngineConfig, params: StructuredOutputsParams) -> None:
    """Check a request's constraint at admission (quick: the backend parses, not compiles);
    raises ``ValueError`` starting ``SamplingParams.structured_outputs`` with the problem."""
    try:
        backend = select_grammar_backend(config.structured_output.backend)
        backend.validate(params)
    except ValueError as e:
        raise ValueError(f"SamplingParams.structured_outputs: {e}") from e


class StructuredOutputManager:
    def __init__(self, config: EngineConfig, info: ModelInfo) -> None:
        self.config = config.structured_output
        self._engine_config = config
        self.info = info
        self._backend: GrammarBackend | None = None
        self._backend_lock = threading.Lock()
        self._pool = cf.ThreadPoolExecutor(
            self.config.compile_threads, thread_name_prefix="pagoda-grammar"
        )
        self._cache: OrderedDict[tuple[str, str], cf.Future[CompiledGrammar]] = OrderedDict()
        # Request id -> (its compile, the deadline on time.monotonic()).
        self._pending: dict[str, tuple[cf.Future[CompiledGrammar], float]] = {}
        # Statistics since the last ``take_stats`` (for /metrics).
        self.compile_times: list[float] = []
        self.cache_queries = 0
        self.cache_hits = 0

    @property
    def backend(self) -> GrammarBackend:
        """The backend, built on first use (it loads the tokenizer's vocabulary)."""
        with self._backend_lock:
            if self._backend is None:
                cls = select_grammar_backend(self.config.backend)
                tok = load_model_tokenizer(self.info, self._engine_config.model.trust_remote_code)
                stop = model_eos_ids(self.info) | ({tok.eos_token_id} - {None})
                self._backend = cls(tok, self.info.shape.vocab_size, sorted(stop), self.config)
            return self._backend

    # ---- the scheduler's side ------------------------------------------------------------------

    def submit(self, request: Request) -> None:
        """Start compiling the request's constraint (or find it compiled)."""
        params = request.sampling_params.structured_outputs
        deadline = time.monotonic() + self.config.compile_timeout_s
        self._pending[request.request_id] = (self._future(params), deadline)

    def poll(self, request: Request) -> bool:
        """Whether the request's grammar is ready. Raises :class:`GrammarCompileError` if its
        compile failed or is past its deadline (the request is forgotten here)."""
        entry = self._pending.get(request.request_id)
        if entry is None:
            return True
        future, deadline = entry
        if future.done():
            del self._pending[request.request_id]
            error = future.exception()
            if error is not None:
                raise GrammarCompileError(f"the structured output constraint failed: {error}")
            return True
        if time.monotonic() > deadline:
            del self._pending[request.request_id]
            raise GrammarCompileError(
                "compiling the structured output constraint took longer than "
                f"structured_output.compile_timeout_s={self.config.compile_timeout_s:g} s"
            )
        return False

    def forget(self, request_id: str) -> None:
        """The request ended (aborted, say) while its grammar compiled."""
        self._pending.pop(request_id, None)

    @property
    def num_pending(self) -> int:
        return len(self._pending)

    def wait(self, timeout: float) -> None:
        """Block until some pending compile ends, at most ``timeout`` seconds (an engine with
        nothing else to do waits here instead of spinning)."""
        if self._pending:
            futures = {f for f, _ in self._pending.values()}
            deadline = min(d for _, d in self._pending.values())
            cf.wait(futures, max(0.0, min(timeout, deadline - time.monotonic())), "FIRST_COMPLETED")

    # ---- the runner's side ---------------------------------------------------------------------

    def compiled(self, params: StructuredOutputsParams) -> CompiledGrammar:
        """The compiled grammar of ``params``: from the cache (waiting for a compile under way),
        or compiled now."""
        return self._future(params, count=False).result()

    # ---- the cache -----------------------------------------------------------------------------

    def _future(
        self, params: StructuredOutputsParams, count: bool = True
    ) -> cf.Future[CompiledGrammar]:
        key = params.key()
        future = self._cache.get(key)
        if count:
            self.cache_queries += 1
        if future is not None and not (future.done() and future.exception() is not None):
            self._cache.move_to_end(key)
            if count:
                self.cache_hits += 1
            return future
        future = self._pool.submit(self._compile, params)
        self._cache[key] = future
        while len(self._cache) > self.config.grammar_cache_size:
            self._cache.popitem(last=False)
        return future

    def _compile(self, params: StructuredOutputsParams) -> CompiledGrammar:
        backend = self.backend  # built on first use: not part of the compile time
        start = time.perf_counter()
        try:
            return backend.compile(params)
        finally:
            self.compile_times.append(time.perf_counter() - start)

    def take_stats(self) -> tuple[list[float], int, int]:
        """(compile seconds, cache queries, cache hits) since the previous call."""
        times, self.compile_times = self.compile_times, []
        queries, hits = self.cache_queries, self.cache_hits
        self.cache_queries = self.cache_hits = 0
        return times, queries, hits

    def shutdown(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)


# id(engine config) -> the manager of the engine built from it in this process.
_MANAGERS: dict[int, StructuredOutputManager] = {}
_MANAGERS_LOCK = threading.Lock()


def register_manager(config: EngineConfig, manager: StructuredOutputManager | None) -> None:
    """Make ``manager`` the one that model runners of the engine with ``config`` compile
    through (the core's, in its own process); None forgets it."""
    with _MANAGERS_LOCK:
        if manager is None:
            _MANAGERS.pop(id(config), None)
        else:
            _MANAGERS[id(config)] = manager


def process_manager(config: EngineConfig) -> StructuredOutputManager:
    """The manager of the engine with ``config``: the engine core's when the runner shares its
    process, else (a worker process of its own) one made here, which compiles on first use."""
    with _MANAGERS_LOCK:
        manager = _MANAGERS.get(id(config))
        if manager is None:
            manager = _MANAGERS[id(config)] = StructuredOutputManager(
                config, ModelInfo.from_config(config)
            )
        return manager
