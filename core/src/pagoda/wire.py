"""The messages between an engine-core client and the engine process, and their codec.

Every message is a msgspec Struct encoded as msgpack (never pickle on a socket). numpy arrays
(logprobs) travel as a msgpack extension holding dtype, shape and raw bytes.
"""

from __future__ import annotations

import dataclasses
import functools
import typing
from typing import Any

import msgspec
import numpy as np

from pagoda.request import Request
from pagoda.sampling_params import SamplingParams
from pagoda.step import EngineCoreOutput

_NDARRAY_EXT = 1


# ---- client -> engine -------------------------------------------------------------------------


class AddRequest(msgspec.Struct, tag="add"):
    """A new ``Request``: its constructor fields, and its SamplingParams field by field."""

    request: dict[str, Any]
    sampling_params: dict[str, Any]

    @classmethod
    def from_request(cls, request: Request) -> AddRequest:
        fields = {
            f.name: getattr(request, f.name)
            for f in dataclasses.fields(request)
            if f.init and f.name != "sampling_params"
        }
        return cls(fields, params_to_wire(request.sampling_params))

    def to_request(self) -> Request:
        hints = _types(Request)
        kwargs = {
            k: msgspec.convert(v, hints[k], strict=False, dec_hook=_dec_hook)
            for k, v in self.request.items()
        }
        return Request(sampling_params=params_from_wire(self.sampling_params), **kwargs)

    @property
    def request_id(self) -> str:
        return self.request["request_id"]


class AbortRequests(msgspec.Struct, tag="abort"):
    request_ids: list[str]


class UtilityCall(msgspec.Struct, tag="utility"):
    """Call one of the engine process's utility methods (``core_proc.UTILITIES``)."""

    call_id: int
    method: str
    args: list[Any] = []


class Shutdown(msgspec.Struct, tag="shutdown"):
    pass


ClientMessage = AddRequest | AbortRequests | UtilityCall | Shutdown


# ---- engine -> client -------------------------------------------------------------------------


class SchedulerStats(msgspec.Struct):
    """The scheduler's state after a step, and what happened since the previous stats."""

    num_running: int
    num_waiting: int
    kv_cache_usage: float  # fraction of usable KV blocks held by requests
    prefix_cache_queries: int = 0  # tokens looked up since the previous stats
    prefix_cache_hits: int = 0
    num_preemptions: int = 0
    queue_times: list[float] = []  # seconds from arrival to first scheduling, newly scheduled
    iteration_tokens: list[int] = []  # tokens each step since the previous stats computed
    evicted_blocks: int = 0  # prefix-cached blocks handed to other requests since then
    grammar_compile_times: list[float] = []  # seconds of each grammar compiled since then
    grammar_cache_queries: int = 0  # constrained requests since then
    grammar_cache_hits: int = 0  # of them, those whose grammar was cached or compiling
    # Speculative decoding since then: drafts verified (one per request per step), their
    # tokens, the accepted ones, and acceptances by draft position.
    spec_num_drafts: int = 0
    spec_num_draft_tokens: int = 0
    spec_num_accepted_tokens: int = 0
    spec_accepted_per_pos: list[int] = []
    # KV offload since then: blocks copied to the CPU pool and back, prompt tokens the pool
    # served (past the device's hit); and the pool's usage now (fraction of its blocks held).
    offload_stored_blocks: int = 0
    offload_loaded_blocks: int = 0
    cpu_prefix_cache_hits: int = 0
    cpu_cache_usage: float = 0.0
    # Multimodal since then: images a scheduled request looked up in the encoder cache, and
    # those whose encoder output was held (computed for another request, or earlier).
    encoder_cache_queries: int = 0
    encoder_cache_hits: int = 0
    # LoRA (0: off): the adapter slots, and the adapters of the running and waiting requests.
    max_lora: int = 0
    running_lora_adapters: list[str] = []
    waiting_lora_adapters: list[str] = []


class RequestError(msgspec.Struct):
    """The engine process refused one request (the others go on)."""

    request_id: str
    message: str
    rejected: bool = False  # by an admission rule (``admit_request``), not for bad input


class UtilityResult(msgspec.Struct):
    call_id: int
    result: Any = None
    error: str | None = None


class EngineOutputs(msgspec.Struct, tag="outputs"):
    outputs: list[EngineCoreOutput] = []
    stats: SchedulerStats | None = None
    errors: list[RequestError] = []
    utility: UtilityResult | None = None
    accepted: list[str] = []  # requests the core took in (admission passed) since the last reply


class EngineReady(msgspec.Struct, tag="ready"):
    num_blocks: int
    max_model_len: int


class EngineFailed(msgspec.Struct, tag="failed"):
    """The engine process could not start or stopped on an error; ``message`` says why."""

    message: str


EngineMessage = EngineOutputs | EngineReady | EngineFailed


# ---- codec ------------------------------------------------------------------------------------


def _enc_hook(obj: Any) -> Any:
    if isinstance(obj, np.ndarray):
        arr = np.ascontiguousarray(obj)
        header = msgspec.msgpack.encode((arr.dtype.str, arr.shape))
        return msgspec.msgpack.Ext(
            _NDARRAY_EXT, len(header).to_bytes(4, "little") + header + arr.tobytes()
        )
    if isinstance(obj, (np.integer, np.floating)):
        return obj.item()
    raise NotImplementedError(f"cannot send a {type(obj).__name__} to the engine process")


def _ext_hook(code: int, data: memoryview) -> Any:
    if code != _NDARRAY_EXT:
        raise msgspec.ValidationError(f"unknown msgpack extension {code}")
    n = int.from_bytes(data[:4], "little")
    dtype, shape = msgspec.msgpack.decode(data[4 : 4 + n])
    return np.frombuffer(data[4 + n :], dtype=dtype).reshape(shape).copy()


def _dec_hook(type_: type, obj: Any) -> Any:
    if type_ is np.ndarray and isinstance(obj, np.ndarray):
        return obj
    raise NotImplementedError(f"cannot decode a {type_!r}")


class Encoder:
    def __init__(self) -> None:
        self._encoder = msgspec.msgpack.Encoder(enc_hook=_enc_hook)

    def encode(self, msg: msgspec.Struct) -> bytes:
        return self._encoder.encode(msg)


def client_decoder() -> msgspec.msgpack.Decoder:
    """Decodes what the client sends (used in the engine process)."""
    return msgspec.msgpack.Decoder(ClientMessage, ext_hook=_ext_hook, dec_hook=_dec_hook)


def engine_decoder() -> msgspec.msgpack.Decoder:
    """Decodes what the engine process sends (used in the client)."""
    return msgspec.msgpack.Decoder(EngineMessage, ext_hook=_ext_hook, dec_hook=_dec_hook)


# ---- SamplingParams ---------------------------------------------------------------------------


def params_to_wire(params: SamplingParams) -> dict[str, Any]:
    """Every field, derived ones included (``all_stop_token_ids``, ...), as plain data."""
    return {f.name: getattr(params, f.name) for f in dataclasses.fields(params)}


def params_from_wire(data: dict[str, Any]) -> SamplingParams:
    """Rebuild the SamplingParams the client validated and resolved, field by field.

    NOTE: ``__post_init__`` is not run again: it would recompute the derived fields the client
    filled in (``resolve``). Each field is converted to its annotated type, so a set arrives as a
    set and a nested dataclass as that dataclass.
    """
    hints = _types(SamplingParams)
    unknown = set(data) - set(hints)
    if unknown:
        raise ValueError(f"unknown SamplingParams fields from the client: {sorted(unknown)}")
    params = object.__new__(SamplingParams)
    for f in dataclasses.fields(SamplingParams):
        if f.name in data:
            value = msgspec.convert(data[f.name], hints[f.name], strict=False)
        elif f.default is not dataclasses.MISSING:
            value = f.default
        else:
            value = f.default_factory()  # type: ignore[misc]
        setattr(params, f.name, value)
    return params


@functools.cache
def _types(cls: type) -> dict[str, Any]:
    return typing.get_type_hints(cls)
