"""A tensor-parallel worker: one rank, in a process of its own (or a Ray actor).

It joins the group, builds its ``Worker`` (its slice of the model, its KV heads), then serves
its executor over ZMQ: start-up calls, then one ``Step`` per engine step. Every rank runs every
step (the collectives need all); the output rank (the first of the last pipeline stage: rank 0
without pipeline parallelism) sends the runner output back. A pipeline stage takes its input from
the previous stage's ranks and hands its output on (``pagoda.distributed``), so the stages work
on different steps at once. A thread sends heartbeats,
so that the executor notices a rank that hangs as well as one that dies.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import signal
import socket
import sys
import threading
import time
import traceback
from dataclasses import dataclass
from typing import Any

import torch
import zmq

from pagoda.config import EngineConfig
from pagoda.distributed import destroy_parallel, init_parallel, split_layers
from pagoda.executor import messages as m
from pagoda.model_info import ModelInfo
from pagoda.process import die_with_parent, run_then_end_quietly, tune_gc

logger = logging.getLogger(__name__)

#: Seconds between two heartbeats of a worker.
HEARTBEAT_S = 0.5
_SPIN_S = 1e-4  # the output rank's wait between "step done?" and "next step here?"


@dataclass
class WorkerSpec:
    """Everything a rank needs to start (handed to the process or actor at its creation)."""

    config: EngineConfig
    info: ModelInfo
    rank: int
    world_size: int
    dist_init_method: str  # tcp://host:port of rank 0, for torch.distributed
    steps_addr: str  # where this rank's steps come from (ZMQ, connect)
    results_addr: str  # where replies go (ZMQ, connect)
    device_index: int | None = None  # the CUDA device of this rank; None on a CPU

    @property
    def output_rank(self) -> int:
        """The rank that sends each step's runner output: the first of the last stage."""
        return output_rank(self.config)


def output_rank(config: EngineConfig) -> int:
    """The rank whose runner samples and answers each step: the first of the last pipeline
    stage (rank 0 without pipeline parallelism)."""
    parallel = config.parallel
    return (parallel.pipeline_parallel_size - 1) * parallel.tensor_parallel_size


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("", 0))
        return s.getsockname()[1]


class WorkerProc:
    def __init__(self, spec: WorkerSpec) -> None:
        self.spec = spec
        self.rank = spec.rank
        self.worker: Any = None
        self.ctx = zmq.Context()
        self.inbox = self.ctx.socket(zmq.PULL)
        self.inbox.connect(spec.steps_addr)
        self.outbox = self.ctx.socket(zmq.PUSH)
        self.outbox.setsockopt(zmq.LINGER, 2000)
        self.outbox.connect(spec.results_addr)
        self.encoder = m.encoder()
        self.decoder = m.worker_decoder()
        self._stop_beats = threading.Event()

    def run(self) -> None:
        """Serve until told to stop; an error is reported to the executor, then raised."""
        self._send(m.Hello(self.rank, os.getpid(), socket.gethostname()))
        beats = threading.Thread(target=self._beat, name="pagoda-heartbeat", daemon=True)
        beats.start()
        try:
            self._serve()
        except BaseException:
            self._send(m.Failed(self.rank, traceback.format_exc()))
            raise
        finally:
            self._stop_beats.set()
            beats.join(2 * HEARTBEAT_S)
            destroy_parallel()
            self.ctx.destroy(linger=2000)

    def _send(self, msg: Any) -> None:
        self.outbox.send(self.encoder.encode(msg))

    def _beat(self) -> None:
        sock = self.ctx.socket(zmq.PUSH)
        sock.setsockopt(zmq.LINGER, 0)
        sock.connect(self.spec.results_addr)
        beat = self.encoder.encode(m.Heartbeat(self.rank))
        try:
            while not self._stop_beats.wait(HEARTBEAT_S):
                try:
                    sock.send(beat, zmq.NOBLOCK)
                except zmq.Again:
                    pass
        finally:
            sock.close()

    # ---- start-up calls ------------------------------------------------------------------------

    def load_model(self) -> None:
        # NOTE: the model, its kernels and Triton load in the worker process only; the engine
        # process imports this module for WorkerSpec.
        from pagoda.worker.worker import Worker

        spec = self.spec
        info = spec.info
        if spec.device_index is not None:
            info = dataclasses.replace(info, device=torch.device("cuda", spec.device_index))
            backend = "nccl"
        else:
            # NOTE: the ranks share the machine's cores: the Worker gives each its share.
            info = dataclasses.replace(info, device=torch.device("cpu"))
            backend = "gloo"
        if info.device.type == "cuda":
            torch.cuda.set_device(info.device)
        parallel = spec.config.parallel
        tp, pp = parallel.tensor_parallel_size, parallel.pipeline_parallel_size
        stages = split_layers(info.shape.num_hidden_layers, pp, parallel.pipeline_layer_partition)
        init_parallel(
            spec.rank,
            tp,
            spec.dist_init_method,
            backend,
            info.device,
            pipeline_parallel_size=pp,
            stage_layers=stages[spec.rank // tp],
        )
        self.worker = Worker(spec.config, info)
        self.worker.load_model()

    def determine_num_blocks(self) -> int:
        return self.worker.determine_num_blocks()

    def initialize_kv_cache(self, num_blocks: int) -> None:
        self.worker.initialize_kv_cache(num_blocks)
        tune_gc()  # the last step of start-up; this process serves one engine to its end

    def startup_times(self) -> dict[str, float]:
        return dict(self.worker.model_runner.startup_times)

    # ---- the loop ------------------------------------------------------------------------------

    def _serve(self) -> None:
        # The output rank: the step whose output is not sent yet.
        pending: tuple[int, Any] | None = None
        answers = self.rank == self.spec.output_rank
        while True:
            if pending is not None:
                # Send it once the device is done, unless the next step comes first: then that
                # one is prepared and launched before (the device stays busy).
                pending[1].finish_launch()  # its sampling, if that waited for a bitmask
                while not self.inbox.poll(0):
                    event = pending[1].event
                    if event is None or event.query():
                        self._send(m.StepDone(pending[0], pending[1].get()))
                        pending = None
                        break
                    time.sleep(_SPIN_S)
            msg = self.decoder.decode(self.inbox.recv(copy=False).buffer)
            if isinstance(msg, m.StepIn):
                so = m.scheduler_output_from_wire(msg.scheduler_output)
                step = self.worker.model_runner.launch(so)
                if answers:
                    if pending is not None:
                        self._send(m.StepDone(pending[0], pending[1].get()))
                    pending = (msg.seq, step)
            elif isinstance(msg, m.Call):
                self._call(msg)
            elif isinstance(msg, m.Stop):
                if pending is not None:
                    self._send(m.StepDone(pending[0], pending[1].get()))
                return
            else:
                raise TypeError(f"unexpected message {type(msg).__name__}")

    def _call(self, msg: m.Call) -> None:
        result = getattr(self, msg.method)(*msg.args)
        self._send(m.Reply(self.rank, msg.call_id, result))


def run_worker_process(spec: WorkerSpec) -> None:
    """Entry point of a worker process (the multiprocess executor's); it ends without the
    interpreter's teardown."""
    run_then_end_quietly(_run_worker, spec)


def _run_worker(spec: WorkerSpec) -> None:
    die_with_parent()
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C reaches the engine, which stops us
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
    logging.basicConfig(
        level=logging.INFO,
        format=f"%(levelname)s %(asctime)s tp-rank-{spec.rank} %(name)s: %(message)s",
    )
    try:
        WorkerProc(spec).run()
    except Exception:
        sys.exit(1)
