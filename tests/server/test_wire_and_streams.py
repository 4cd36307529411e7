"""The engine-process wire format and per-request output streams, without a model."""

from __future__ import annotations

import asyncio

import msgspec
import numpy as np
import pytest

from pagoda import wire
from pagoda.engine.request_stream import OutputKind, RequestStream
from pagoda.outputs import CompletionOutput, Logprob, RequestOutput
from pagoda.request import Request
from pagoda.sampling_params import SamplingParams
from pagoda.step import EngineCoreOutput, LogprobsArrays


def test_add_request_round_trips_with_resolved_params_as_plain_msgpack() -> None:
    params = SamplingParams(max_tokens=5, stop=["x"], logit_bias={3: 1.5}, seed=9, n=1)
    params.all_stop_token_ids = {2, 7}  # derived by resolve(); __post_init__ would drop 2
    params.bad_words_token_ids = [[4, 5]]
    request = Request("r1", [1, 2, 3], params, eos_token_id=2, priority=4, cache_salt="s")
    data = wire.Encoder().encode(wire.AddRequest.from_request(request))
    # Plain msgpack that any msgpack reader decodes (no pickle anywhere).
    assert msgspec.msgpack.decode(data)["request"]["request_id"] == "r1"
    back = wire.client_decoder().decode(data).to_request()
    assert back.sampling_params == params
    assert back.sampling_params.all_stop_token_ids == {2, 7}
    assert back.sampling_params.logit_bias == {3: 1.5}
    for name in ("request_id", "prompt_token_ids", "eos_token_id", "priority", "cache_salt"):
        assert getattr(back, name) == getattr(request, name)
    assert back.arrival_time == request.arrival_time


def test_engine_outputs_carry_logprob_arrays_and_stats() -> None:
    arrays = LogprobsArrays(
        np.array([[5, 5, 6]]), np.array([[-0.1, -0.1, -2.0]], np.float32), np.array([1])
    )
    msg = wire.EngineOutputs(
        outputs=[EngineCoreOutput("r", [5], "length", None, 3, new_logprobs=arrays)],
        stats=wire.SchedulerStats(1, 2, 0.25, 16, 8, 0, [0.5]),
        errors=[wire.RequestError("bad", "refused")],
    )
    back = wire.engine_decoder().decode(wire.Encoder().encode(msg))
    out = back.outputs[0]
    assert (out.request_id, out.new_token_ids, out.finish_reason) == ("r", [5], "length")
    np.testing.assert_array_equal(out.new_logprobs.logprobs, arrays.logprobs)
    assert out.new_logprobs.token_ids.dtype == arrays.token_ids.dtype
    assert back.stats == msg.stats and back.errors == msg.errors


def test_unknown_sampling_fields_from_a_client_are_refused() -> None:
    with pytest.raises(ValueError, match="unknown SamplingParams fields"):
        wire.params_from_wire({"temperature": 1.0, "warp_speed": 9})


def _output(text: str, ids: list[int], finish: str | None = None) -> RequestOutput:
    lps = [{t: Logprob(-1.0, 1)} for t in ids]
    c = CompletionOutput(0, text, ids, finish, logprobs=lps)
    return RequestOutput("r", "p", [1], [c], finished=finish is not None)


def _take(stream: RequestStream) -> RequestOutput:
    return asyncio.run(stream.get())


def test_delta_stream_merges_what_the_consumer_has_not_taken() -> None:
    stream = RequestStream(OutputKind.DELTA)
    stream.put(_output("Hel", [1]))
    assert _take(stream).outputs[0].text == "Hel"
    stream.put(_output("Hello", [1, 2]))
    stream.put(_output("Hello wor", [1, 2, 3]))  # not taken in between: merged
    second = _take(stream).outputs[0]
    assert (second.text, second.token_ids, len(second.logprobs)) == ("lo wor", [2, 3], 2)
    stream.put(_output("Hello world", [1, 2, 3, 4], "length"))
    last = _take(stream)
    assert last.finished and last.outputs[0].text == "ld" and stream.finished


def test_stream_holds_back_text_that_may_begin_a_stop_string() -> None:
    stream = RequestStream(OutputKind.DELTA, holdback=2)  # longest stop string: 3 characters
    stream.put(_output("abcde", [1]))
    assert _take(stream).outputs[0].text == "abc"
    stream.put(_output("abcde", [1, 2], "stop"))  # "de" turned out not to start "def"
    assert _take(stream).outputs[0].text == "de"


def test_final_only_stream_skips_partial_outputs_and_errors_reach_the_consumer() -> None:
    stream = RequestStream(OutputKind.FINAL_ONLY)
    stream.put(_output("a", [1]))
    stream.put(_output("ab", [1, 2], "stop"))
    assert _take(stream).outputs[0].text == "ab"
    failing = RequestStream(OutputKind.CUMULATIVE)
    failing.fail(RuntimeError("engine gone"))
    with pytest.raises(RuntimeError, match="engine gone"):
        _take(failing)


def test_admission_waits_for_every_sequence_or_the_refusal() -> None:
    from pagoda.plugins import RequestRejectedError

    async def admitted_after(stream: RequestStream, events) -> bool:
        waiter = asyncio.ensure_future(stream.admitted())
        for event in events:
            await asyncio.sleep(0)
            assert not waiter.done()
            event()
        await asyncio.wait_for(waiter, 1)
        return True

    two = RequestStream(OutputKind.DELTA)
    two.unadmitted = 2  # n = 2: two core sequences
    assert asyncio.run(admitted_after(two, [two.admit, two.admit]))
    shed = RequestStream(OutputKind.DELTA)
    shed.unadmitted = 2
    with pytest.raises(RequestRejectedError):
        asyncio.run(
            admitted_after(shed, [shed.admit, lambda: shed.fail(RequestRejectedError("x"))])
        )
    # An output implies admission, even one a final-only stream does not pass on.
    final = RequestStream(OutputKind.FINAL_ONLY)
    assert asyncio.run(admitted_after(final, [lambda: final.put(_output("a", [1]))]))
