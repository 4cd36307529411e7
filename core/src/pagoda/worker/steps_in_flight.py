"""The steps the runner launched whose output it has not read, and where the last one's sampled
ids are on the device.

With async scheduling the runner launches step N + 1 before step N's output is read: N's
sampled ids reach N + 1's input ids on the device (the host's rows hold ``-1`` placeholders for
them until N is read). At most one launched step stays unread past a launch (:meth:`settle`).
"""

from __future__ import annotations

import numpy as np
import torch

from pagoda.worker.step_buffers import StepBuffers
from pagoda.worker.step_output import StepOutput


class StepsInFlight:
    def __init__(self, max_num_reqs: int, device: torch.device) -> None:
        # Launched steps whose output was not read yet, oldest first (at most one after
        # ``settle``), and the last step launched (read or not).
        self.unread: list[StepOutput] = []
        self.last: StepOutput | None = None
        # The ids the last sampling step drew, on the device, and each runner row's index in
        # them (-1: that row did not sample there).
        self.sampled = torch.zeros(max_num_reqs, dtype=torch.int64, device=device)
        self.index = np.full(max_num_reqs, -1, dtype=np.int64)

    def launched(self, step: StepOutput) -> None:
        self.last = step
        self.unread.append(step)

    def drew(self, rows: np.ndarray, sampled: torch.Tensor) -> None:
        """A step sampled ``sampled`` [len(rows)] (on the device) for the runner's ``rows``."""
        self.sampled = sampled
        self.index[:] = -1
        self.index[rows] = np.arange(len(rows))

    def forget_row(self, row: int) -> None:
        """A new request took ``row``: nothing sampled there is its."""
        self.index[row] = -1

    def settle(self) -> None:
        """Keep at most one launched step unread, the last: the next step may take its sampled
        ids from the device, but older placeholders must be on the host by now. (The engine reads
        each output before the launch after next, so this does not wait.)"""
        *older, last = self.unread or [None]
        for step in older:
            step.get()
        self.unread = [last] if last is not None and not last.done else []

    def read_all(self) -> None:
        """Bring every launched step's sampled ids to the host rows (waits for the device)."""
        for step in self.unread:
            step.get()

    def fill_from_device(
        self, buffers: StepBuffers, positions: np.ndarray, rows: np.ndarray
    ) -> None:
        """Input ids at flat ``positions`` of ``buffers`` are the tokens the last sampling step
        drew for ``rows``, still on the device."""
        src = self.index[rows]
        if not self.unread or (src < 0).any():
            raise RuntimeError("an input token is neither on the host nor just sampled; runner bug")
        idx = buffers.as_device(np.stack([positions, src]).astype(np.int64))
        buffers.input_ids[idx[0]] = self.sampled[idx[1]]
