"""One request's outputs on their way from the output loop to the task that awaits them."""

from __future__ import annotations

import asyncio
import dataclasses
import enum

from pagoda.outputs import CompletionOutput, RequestOutput


class OutputKind(str, enum.Enum):
    CUMULATIVE = "cumulative"  # each output holds everything so far
    DELTA = "delta"  # each output holds what is new since the previous one
    FINAL_ONLY = "final_only"  # one output, when the request finishes


class RequestStream:
    """Holds the latest output of a request until its consumer takes it.

    Outputs not yet taken merge (the output processor's are cumulative, so the latest wins): a
    slow consumer never builds a queue, and in ``DELTA`` mode it gets everything new at once.

    NOTE: while a completion runs, text that could be the start of a stop string is held back
    (``holdback`` characters), so streamed text never shows what a stop string later cuts.
    """

    def __init__(self, kind: OutputKind, holdback: int = 0) -> None:
        self.kind = kind
        self.holdback = holdback
        self._latest: RequestOutput | None = None
        self._error: BaseException | None = None
        self._ready = asyncio.Event()
        self._sent: dict[int, tuple[int, int]] = {}  # index -> (chars, tokens) already given
        self.finished = False
        self.unadmitted = 1  # core sequences (n of them) the engine has not yet taken in
        self._admitted = False

    def admit(self) -> None:
        """The engine took in one more of this request's sequences."""
        self.unadmitted -= 1
        if self.unadmitted <= 0:
            self._admitted = True
            self._ready.set()

    async def admitted(self) -> None:
        """Wait until the engine has taken in every sequence of the request (or sent an output);
        raises the error it refused the request with, such as ``RequestRejectedError``."""
        while not self._admitted and self._latest is None:
            if self._error is not None:
                raise self._error
            self._ready.clear()
            await self._ready.wait()

    def put(self, output: RequestOutput) -> None:
        self._admitted = True  # NOTE: an output implies admission
        if self.kind is OutputKind.FINAL_ONLY and not output.finished:
            self._ready.set()  # for admitted(); get() waits on
            return
        self._latest = output
        self._ready.set()

    def fail(self, error: BaseException) -> None:
        self._error = error
        self._ready.set()

    async def get(self) -> RequestOutput:
        """The next output; raises the error the request failed with, if any."""
        while self._latest is None:
            if self._error is not None:
                raise self._error
            self._ready.clear()
            await self._ready.wait()
        output, self._latest = self._latest, None
        self.finished = output.finished
        return self._shape(output)

    def _shape(self, output: RequestOutput) -> RequestOutput:
        if not isinstance(output, RequestOutput):  # a pooling request's one output
            return output
        completions = [self._shape_one(c) for c in output.outputs]
        return dataclasses.replace(output, outputs=completions)

    def _shape_one(self, c: CompletionOutput) -> CompletionOutput:
        end = len(c.text)
        if self.holdback and not c.finished():
            end = max(end - self.holdback, 0)
        chars, tokens = self._sent.get(c.index, (0, 0))
        end = max(end, chars)  # never take back what was given
        self._sent[c.index] = (end, len(c.token_ids))
        if self.kind is not OutputKind.DELTA:
            return dataclasses.replace(c, text=c.text[:end])
        return dataclasses.replace(
            c,
            text=c.text[chars:end],
            token_ids=c.token_ids[tokens:],
            logprobs=None if c.logprobs is None else c.logprobs[tokens:],
        )
