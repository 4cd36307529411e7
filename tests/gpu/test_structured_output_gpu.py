"""On a GPU: the device's wait for the grammar matcher process's fill (``host_flag.wait_for``)
holds back what is enqueued after it until the host writes the flag, without blocking the host,
and gives up with its error word set when the flag never comes; and with the matchers in their
own process (the device waiting for them) every request of a mixed batch gets the tokens the
in-process matchers give."""

from __future__ import annotations

import os
import re
import sys
import threading
import time
from pathlib import Path

import pytest
import torch

# NOTE: triton is not imported here: a module-level import at collection would load it before
# the CPU tests that run its interpreter set TRITON_INTERPRET (their kernels then fail).
pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
]


def _pinned(n: int, dtype=torch.int64) -> torch.Tensor:
    return torch.zeros(n, dtype=dtype, pin_memory=True)


def test_the_device_waits_for_the_flag_and_the_host_does_not() -> None:
    from pagoda.structured_output.host_flag import wait_for

    flag, error = _pinned(1), _pinned(1)
    rows = _pinned(1 << 16, torch.int32)
    out = torch.zeros(1 << 16, dtype=torch.int32, device="cuda")
    enqueued = threading.Event()

    def fill() -> None:  # the matcher process's part: rows first, then the step's number
        enqueued.wait(10)
        time.sleep(0.05)
        rows.numpy()[:] = 7
        flag.numpy()[0] = 3

    writer = threading.Thread(target=fill)
    writer.start()
    torch.cuda.synchronize()
    wait_for(flag, error, 3, timeout_s=20)
    out.copy_(rows, non_blocking=True)
    # The host is here before the rows exist: had wait_for blocked, this would be reached only
    # after the device gave up (the error word below).
    assert flag.numpy()[0] == 0
    enqueued.set()
    torch.cuda.synchronize()
    writer.join()
    assert int(error.numpy()[0]) == 0
    assert bool((out == 7).all())  # the copy ran after the flag, so after the rows


def test_a_flag_that_never_comes_sets_the_error_word() -> None:
    from pagoda.structured_output.host_flag import wait_for

    flag, error = _pinned(1), _pinned(1)
    flag.numpy()[0] = 4
    wait_for(flag, error, 5, timeout_s=0.05)
    torch.cuda.synchronize()
    assert int(error.numpy()[0]) == 5
    error.numpy()[0] = 0
    wait_for(flag, error, 4, timeout_s=0.05)  # already there: no wait, no error
    torch.cuda.synchronize()
    assert int(error.numpy()[0]) == 0


def test_the_wait_is_bounded_by_the_device_clock() -> None:
    """A wait gives up after its ``timeout_s`` of wall time, and holds the stream until then:
    a bound counted in polls (a microsecond each, nominally) ran out far sooner on an H200."""
    from pagoda.structured_output.host_flag import wait_for

    flag, error = _pinned(1), _pinned(1)
    wait_for(flag, error, 1, timeout_s=1.0)
    done = torch.cuda.Event()
    done.record()
    start = time.perf_counter()
    while not done.query():
        time.sleep(0.005)
    assert 0.9 < time.perf_counter() - start < 3.0 and int(error.numpy()[0]) == 1
    error.numpy()[0] = 0
    wait_for(flag, error, 2, timeout_s=4.0)
    done = torch.cuda.Event()
    done.record()
    time.sleep(1.5)
    assert not done.query()  # still waiting, 1.5 s in
    flag.numpy()[0] = 2
    done.synchronize()
    assert int(error.numpy()[0]) == 0


def test_the_wait_launches_through_its_compiled_kernel() -> None:
    from pagoda.structured_output import host_flag

    flag, error = _pinned(1), _pinned(1)
    flag.numpy()[0] = 1 << 40
    # (from an empty cache: a key of an earlier test, whose pinned words had these addresses,
    # would count for less)
    host_flag._launch._runners.clear()
    host_flag._launch._tried.clear()
    before = 0
    for seq in (1, 16, 17, 1 << 33):  # the JIT would specialise on 1 and multiples of 16
        host_flag.wait_for(flag, error, seq, timeout_s=0.5)
    torch.cuda.synchronize()
    assert int(error.numpy()[0]) == 0
    flag.numpy()[0] = 20
    host_flag.wait_for(flag, error, 21, timeout_s=0.05)  # through the cached kernel: gives up
    torch.cuda.synchronize()
    assert int(error.numpy()[0]) == 21
    # one kernel for i32 numbers and the first timeout, one for i64, one for the second timeout
    assert host_flag._launch.fast and host_flag._launch.num_cached == before + 3


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_xgrammar_bitmask_through_the_compiled_kernel_matches_the_reference(dtype) -> None:
    pytest.importorskip("xgrammar")
    import pagoda_structured_xgrammar.backend as xb

    from pagoda.structured_output.backend import apply_token_bitmask

    g = torch.Generator(device="cuda").manual_seed(0)
    vocab = 151_936
    words = (vocab + 31) // 32
    for n in (64, 64, 3):  # the second launch of a shape goes through the cached kernel
        logits = torch.randn(n, vocab, device="cuda", generator=g).to(dtype)
        bits = torch.randint(-(2**31), 2**31 - 1, (n + 2, words), device="cuda", generator=g)
        bitmask = bits.to(torch.int32)
        want = logits.clone()
        apply_token_bitmask(want, bitmask, list(range(n)))
        xb.XGrammarBackend.apply_bitmask(logits, bitmask, list(range(n)))
        assert torch.equal(logits, want)
    assert xb._apply_launch.fast and xb._apply_launch.num_cached >= 2


def test_matchers_in_their_own_process_give_the_same_tokens_on_cuda() -> None:
    model = os.environ.get("SMOLLM2_GGUF")
    if not model or not Path(model).exists():
        pytest.skip("SMOLLM2_GGUF names no SmolLM2-135M-Instruct GGUF here")
    pytest.importorskip("xgrammar")
    sys.path.insert(0, str(Path(__file__).parents[1] / "structured_output"))
    from test_matcher_process import PHONE, PROMPTS, _params

    from pagoda import LLM

    got = {}
    for on in (False, True):
        llm = LLM(
            model=model,
            dtype="float32",
            max_model_len=256,
            kv_cache_memory_bytes=256 << 20,
            max_num_seqs=8,
            structured_output={"matcher_process": on},
        )
        outs = llm.generate(PROMPTS, _params(), use_tqdm=False)
        got[on] = [list(o.outputs[0].token_ids) for o in outs]
        if on:
            rows = llm.engine.engine_core.executor.worker.model_runner.grammar
            assert rows._device_wait  # the device, not the host, waited for the fills
            text = llm.get_tokenizer().decode(got[on][1], skip_special_tokens=True)
        llm.engine.shutdown()
    assert got[True] == got[False]
    assert re.fullmatch(PHONE, text), text
