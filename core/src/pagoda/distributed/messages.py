"""The messages between an executor and its workers, as msgpack (never pickle on a socket).

Each step the executor sends every worker the scheduler output (:class:`Step`); rank 0 answers
with the runner output (:class:`StepDone`). Dataclasses travel field by field, so fields added to
``SchedulerOutput`` or ``ModelRunnerOutput`` travel without a change here.
"""

from __future__ import annotations

import dataclasses
import functools
import typing
from typing import Any

import msgspec

from pagoda.engine.wire import _dec_hook, _enc_hook, _ext_hook, params_from_wire
from pagoda.sampling_params import SamplingParams
from pagoda.scheduler.output import ModelRunnerOutput, NewRequestData, SchedulerOutput

# ---- executor -> worker ------------------------------------------------------------------------


class Call(msgspec.Struct, tag="call"):
    """Run ``Worker.<method>(*args)`` and reply (start-up: load, size the cache, ...)."""

    call_id: int
    method: str
    args: list[Any] = []


class Step(msgspec.Struct, tag="step"):
    seq: int
    scheduler_output: Any  # SchedulerOutput, as plain data


class Stop(msgspec.Struct, tag="stop"):
    pass


ToWorker = Call | Step | Stop


# ---- worker -> executor ------------------------------------------------------------------------


class Hello(msgspec.Struct, tag="hello"):
    rank: int
    pid: int
    host: str


class Reply(msgspec.Struct, tag="reply"):
    rank: int
    call_id: int
    result: Any = None
    error: str | None = None


class StepDone(msgspec.Struct, tag="done"):
    seq: int
    output: ModelRunnerOutput


class Heartbeat(msgspec.Struct, tag="beat"):
    rank: int


class Failed(msgspec.Struct, tag="failed"):
    """A worker stops on an error; ``message`` holds its traceback."""

    rank: int
    message: str


FromWorker = Hello | Reply | StepDone | Heartbeat | Failed


# ---- codec -------------------------------------------------------------------------------------


def encoder() -> msgspec.msgpack.Encoder:
    return msgspec.msgpack.Encoder(enc_hook=_enc_hook)


def worker_decoder() -> msgspec.msgpack.Decoder:
    """Decodes what the executor sends (in a worker)."""
    return msgspec.msgpack.Decoder(ToWorker, ext_hook=_ext_hook, dec_hook=_dec_hook)


def executor_decoder() -> msgspec.msgpack.Decoder:
    """Decodes what workers send (in the executor)."""
    return msgspec.msgpack.Decoder(FromWorker, ext_hook=_ext_hook, dec_hook=_dec_hook)


def scheduler_output_from_wire(data: dict[str, Any]) -> SchedulerOutput:
    """Rebuild the scheduler output field by field; sampling parameters as the engine resolved
    them (their ``__post_init__`` is not run again)."""
    kwargs = {}
    for name, value in data.items():
        if name == "scheduled_new_reqs":
            kwargs[name] = [_new_request(r) for r in value]
        else:
            kwargs[name] = _convert(value, _hints(SchedulerOutput)[name])
    return SchedulerOutput(**kwargs)


def _new_request(data: dict[str, Any]) -> NewRequestData:
    hints = _hints(NewRequestData)
    kwargs = {
        k: params_from_wire(v) if hints[k] is SamplingParams else _convert(v, hints[k])
        for k, v in data.items()
    }
    return NewRequestData(**kwargs)


def _convert(value: Any, type_: Any) -> Any:
    return msgspec.convert(value, type_, strict=False, dec_hook=_dec_hook)


@functools.cache
def _hints(cls: type) -> dict[str, Any]:
    if not dataclasses.is_dataclass(cls):
        raise TypeError(cls)
    return typing.get_type_hints(cls)
