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

from pagoda.step import ModelRunnerOutput, NewRequestData, SchedulerOutput
from pagoda.wire import _dec_hook, _enc_hook, _ext_hook, params_from_wire

# ---- executor -> worker ------------------------------------------------------------------------


class Call(msgspec.Struct, tag="call"):
    """Run ``Worker.<method>(*args)`` and reply (start-up: load, size the cache, ...)."""

    call_id: int
    method: str
    args: list[Any] = []


class Step(msgspec.Struct, tag="step"):
    seq: int
    scheduler_output: Any  # a SchedulerOutput; decoded as ``StepIn``'s


class Stop(msgspec.Struct, tag="stop"):
    pass


ToWorker = Call | Step | Stop


@functools.cache
def _hints(cls: type) -> dict[str, Any]:
    if not dataclasses.is_dataclass(cls):
        raise TypeError(cls)
    return typing.get_type_hints(cls)


def _mirror(cls: type, **types: Any) -> type:
    """A dataclass with ``cls``'s fields, some of them typed otherwise: msgspec decodes into it
    in one typed pass (no ``__post_init__`` of the types replaced)."""
    fields = []
    for f in dataclasses.fields(cls):
        spec: Any = dataclasses.field()
        if f.default is not dataclasses.MISSING:
            spec = dataclasses.field(default=f.default)
        elif f.default_factory is not dataclasses.MISSING:
            spec = dataclasses.field(default_factory=f.default_factory)
        fields.append((f.name, types.get(f.name, _hints(cls)[f.name]), spec))
    return dataclasses.make_dataclass(f"_{cls.__name__}Wire", fields)


_NewRequestWire = _mirror(NewRequestData, sampling_params=dict[str, Any])
_SchedulerOutputWire = _mirror(SchedulerOutput, scheduled_new_reqs=list[_NewRequestWire])


class StepIn(msgspec.Struct, tag="step"):
    """A ``Step`` as a worker decodes it."""

    seq: int
    scheduler_output: _SchedulerOutputWire  # type: ignore[valid-type]


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
    return msgspec.msgpack.Decoder(Call | StepIn | Stop, ext_hook=_ext_hook, dec_hook=_dec_hook)


def executor_decoder() -> msgspec.msgpack.Decoder:
    """Decodes what workers send (in the executor)."""
    return msgspec.msgpack.Decoder(FromWorker, ext_hook=_ext_hook, dec_hook=_dec_hook)


def scheduler_output_from_wire(wire: Any) -> SchedulerOutput:
    """The scheduler output a worker decoded; sampling parameters as the engine resolved them
    (their ``__post_init__`` is not run again)."""
    fields = {f.name: getattr(wire, f.name) for f in dataclasses.fields(SchedulerOutput)}
    fields["scheduled_new_reqs"] = [
        NewRequestData(
            **{
                f.name: params_from_wire(v) if f.name == "sampling_params" else v
                for f in dataclasses.fields(NewRequestData)
                for v in (getattr(new, f.name),)
            }
        )
        for new in wire.scheduled_new_reqs
    ]
    return SchedulerOutput(**fields)
