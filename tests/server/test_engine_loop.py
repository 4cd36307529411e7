"""The engine process's loop: a request the core refuses is refused alone, with its error."""

from __future__ import annotations

import zmq

from pagoda import wire
from pagoda.engine.core_proc import EngineLoop
from pagoda.plugins import RequestRejectedError
from pagoda.request import Request
from pagoda.sampling_params import SamplingParams


class _Core:
    """Just enough of an EngineCore: refuses prompts that start with token 0 as bad input and
    those that start with token 1 as an admission rule would."""

    def __init__(self) -> None:
        self.added: list[str] = []
        self.aborted: list[str] = []

    def add_request(self, request: Request) -> None:
        if request.prompt_token_ids[0] == 0:
            raise ValueError("the prompt is bad")
        if request.prompt_token_ids[0] == 1:
            raise RequestRejectedError("too many requests wait")
        self.added.append(request.request_id)

    def abort_requests(self, ids: list[str]) -> None:
        self.aborted += ids


def test_refused_request_gets_an_error_and_the_others_are_added() -> None:
    ctx = zmq.Context()
    try:
        to_engine, engine_in = ctx.socket(zmq.PUSH), ctx.socket(zmq.PULL)
        engine_in.bind("inproc://in")
        to_engine.connect("inproc://in")
        engine_out, from_engine = ctx.socket(zmq.PUSH), ctx.socket(zmq.PULL)
        from_engine.bind("inproc://out")
        engine_out.connect("inproc://out")
        core = _Core()
        loop = EngineLoop(core, engine_in, engine_out)
        enc = wire.Encoder()
        for rid, first in (("good", 5), ("bad", 0), ("shed", 1), ("also-good", 6)):
            req = Request(rid, [first, 1], SamplingParams(max_tokens=2))
            to_engine.send(enc.encode(wire.AddRequest.from_request(req)))
        to_engine.send(enc.encode(wire.AbortRequests(["good"])))
        to_engine.send(enc.encode(wire.UtilityCall(1, "no_such_utility")))
        assert engine_in.poll(2000)
        reply = loop._handle_inputs()
        assert core.added == ["good", "also-good"] and core.aborted == ["good"]
        assert reply.accepted == ["good", "also-good"]  # admission results, for the client
        assert [(e.request_id, e.message, e.rejected) for e in reply.errors] == [
            ("bad", "the prompt is bad", False),
            ("shed", "too many requests wait", True),
        ]
        utility = wire.engine_decoder().decode(from_engine.recv()).utility
        assert utility.call_id == 1 and "unknown utility" in utility.error
    finally:
        ctx.destroy(linger=0)
