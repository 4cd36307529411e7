"""Eager steps (prefills, chunks of prompts, steps that mix them with decodes) as CUDA graphs of
the model's parts between its attention calls, with attention run eagerly in between.

A decode step replays one graph (``pagoda.worker.cuda_graph``); a step with prompt tokens cannot,
because its attention's work depends on every request's query and context lengths. Eagerly, at
batch 1 on a small model, such a step is the host's launching of some ten kernels a layer (a
prefill of SmolLM2-135M: about 15 ms of host time for a millisecond of the device's), which is
the time to a request's first token and a fixed cost of every request.

Here the model is captured once per token-count size (``piecewise_sizes``), split at each
attention layer: graph 0 runs from the embedding to the first layer's q, k and v, graph ``i``
from the ``i``-th attention's output to the next layer's q, k and v, the last to the hidden
states. A step of ``n`` tokens replays the smallest size ``T >= n``: the graphs in turn, and
between two of them the layer's attention over the step's ``n`` real rows, eagerly, with the
step's metadata (:meth:`Attention.forward`, as an eager step runs it). Rows ``n .. T`` are
padding: token 0, KV slot 0 (block 0, never handed out), never read.

Each layer's q, k and v are copied (inside the graph before the split) into one set of buffers
that every layer and size shares, and the attention's output is copied into one more, which the
next graph reads: what crosses a split is those four buffers, so the graphs' own activations
share one memory pool (of the largest size's activations) as the decode graphs' do.

The split is the :class:`~pagoda.attention.layer.Attention` layer's
(:func:`~pagoda.attention.layer.split_at_attention`): a model whose attention goes through those
layers needs nothing else. A capture that fails (a kernel that synchronises with the host, an
attention layer not called) or that splits at other than every layer once leaves such steps
eager, with a warning.
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch

from pagoda.attention.layer import Attention, set_forward_context, split_at_attention
from pagoda.worker.step_buffers import StepBuffers

logger = logging.getLogger(__name__)

#: Token counts captured, up to the engine's limit (``model.piecewise_graph_max_tokens`` and
#: ``max_num_batched_tokens``, itself always captured): a step pads to at most a quarter more
#: past 64 tokens.
_SIZES = (16, 32, 48, 64, 80, 96, 112, 128, 160, 192, 224, 256, 320, 384, 448, 512, 640, 768, 896,
          1024, 1280, 1536, 1792, 2048)  # fmt: skip


def piecewise_sizes(max_tokens: int) -> list[int]:
    """The sizes captured for steps of at most ``max_tokens`` tokens (none for 0)."""
    if max_tokens <= 0:
        return []
    return sorted({s for s in _SIZES if s < max_tokens} | {max_tokens})


@dataclass
class _Piece:
    """One attention call between two graphs: its layer, whether the model stored the keys and
    values itself (captured: the kernel that did it is in the graph before), and the buffers'
    views it reads (q, k, v) and writes (its output)."""

    layer: Attention
    kv_stored: bool
    q: torch.Tensor
    k: torch.Tensor
    v: torch.Tensor
    out: torch.Tensor


class PiecewiseGraphs:
    """Graphs of ``model`` over ``buffers`` for steps of up to ``max_tokens`` tokens, split at
    its attention layers."""

    def __init__(self, model: torch.nn.Module, buffers: StepBuffers, max_tokens: int) -> None:
        self.model = model
        self.buffers = buffers
        self.sizes = piecewise_sizes(min(max_tokens, buffers.max_num_tokens))
        self.num_layers = sum(isinstance(m, Attention) for m in model.modules())
        self.graphs: dict[int, list[torch.cuda.CUDAGraph]] = {}
        self.pieces: dict[int, list[_Piece]] = {}
        self.outputs: dict[int, torch.Tensor] = {}
        self._shared: dict[str, torch.Tensor] = {}  # the four buffers that cross a split
        self.replays = 0

    @property
    def max_tokens(self) -> int:
        return self.sizes[-1] if self.sizes else 0

    def size_for(self, n: int) -> int | None:
        for s in self.sizes:
            if s >= n:
                return s
        return None

    def _view(self, name: str, like: torch.Tensor, row: tuple[int, ...] | None = None):
        """``like``'s rows (each of shape ``row``, default ``like``'s) in the shared buffer
        ``name``, grown (outside a capture) to the largest size's rows of the widest layer."""
        row = tuple(like.shape[1:]) if row is None else row
        width = math.prod(row)
        need = self.max_tokens * width
        buf = self._shared.get(name)
        if buf is None or buf.numel() < need or buf.dtype != like.dtype:
            if torch.cuda.is_current_stream_capturing():
                raise RuntimeError(f"shared buffer {name!r} grew during a capture")
            buf = self._shared[name] = torch.zeros(need, dtype=like.dtype, device=like.device)
        rows = like.shape[0]
        return buf[: rows * width].view(rows, *row)

    def _split(self, end: Callable[[], None] | None, pieces: list[_Piece]):
        """The split at each attention layer: its q, k and v copied into the shared buffers,
        ``end()`` (the graph so far ends, the next begins), and the shared output returned for
        the rest of the model to read."""

        def split(
            layer: Attention, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kv_stored: bool
        ) -> torch.Tensor:
            qs, ks, vs = self._view("q", q), self._view("k", k), self._view("v", v)
            qs.copy_(q)
            ks.copy_(k)
            vs.copy_(v)
            out = self._view("out", q, (layer.num_heads * layer.v_head_size,))
            if end is not None:
                end()
            pieces.append(_Piece(layer, kv_stored, qs, ks, vs, out))
            return out

        return split

    def _pad(self, n: int, size: int) -> None:
        """Padding rows ``n .. size``: token 0 (an id that embeds; a stale row may hold a
        placeholder), KV slot 0 (a stale slot may be another request's)."""
        if n < size:
            self.buffers.input_ids[n:size] = 0
            self.buffers.slot_mapping[n:size] = 0

    @torch.inference_mode()
    def capture(self) -> float:
        """Capture every size, largest first; on a failure, none (steps stay eager). Returns the
        seconds it took."""
        start = time.perf_counter()
        try:
            self._capture_all()
        except Exception as e:  # noqa: BLE001 (any failure leaves the eager path, which works)
            logger.warning("piecewise CUDA graphs not used: %s: %s", type(e).__name__, e)
            self.sizes = []
            self.graphs.clear()
            self.pieces.clear()
            self.outputs.clear()
            self._shared.clear()
            torch.cuda.synchronize()
        elapsed = time.perf_counter() - start
        if self.sizes:
            logger.info(
                "captured piecewise CUDA graphs for steps of up to %d tokens (%d sizes, %d "
                "layers) in %.1f s",
                self.max_tokens,
                len(self.sizes),
                self.num_layers,
                elapsed,
            )
        return elapsed

    def _capture_all(self) -> None:
        if not self.num_layers:
            raise RuntimeError("the model has no attention layer to split at")
        pool = torch.cuda.graph_pool_handle()
        stream = torch.cuda.Stream(device=self.buffers.device)
        for size in reversed(self.sizes):
            self._capture(size, pool, stream)
        torch.cuda.synchronize()

    def _capture(self, size: int, pool: tuple, stream: torch.cuda.Stream) -> None:
        r, model = self.buffers, self.model
        self._pad(0, size)
        ids, positions, slots = r.input_ids[:size], r.positions[:size], r.slot_mapping[:size]
        graphs = [torch.cuda.CUDAGraph()]
        pieces: list[_Piece] = []

        def end() -> None:
            graphs[-1].capture_end()
            graphs.append(torch.cuda.CUDAGraph())
            graphs[-1].capture_begin(pool=pool)

        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            # Warm-up, on the capture's stream: kernels compile and tune for this size, the
            # shared buffers grow.
            with set_forward_context(None, slots), split_at_attention(self._split(None, [])):
                model(ids, positions)
            torch.cuda.synchronize()
            graphs[0].capture_begin(pool=pool)
            try:
                with set_forward_context(None, slots), split_at_attention(self._split(end, pieces)):
                    out = model(ids, positions)
            finally:
                graphs[-1].capture_end()
        torch.cuda.current_stream().wait_stream(stream)
        if len(pieces) != self.num_layers:
            raise RuntimeError(
                f"the model called {len(pieces)} of its {self.num_layers} attention layers in a"
                f" step of {size} tokens"
            )
        self.graphs[size], self.pieces[size], self.outputs[size] = graphs, pieces, out

    def run(self, n: int, size: int) -> torch.Tensor:
        """Replay size ``size`` for a step of ``n`` tokens, whose inputs are in the buffers'
        first rows, inside the step's forward context (its attention metadata); its hidden
        states."""
        self._pad(n, size)
        graphs, pieces = self.graphs[size], self.pieces[size]
        graphs[0].replay()
        for p, graph in zip(pieces, graphs[1:]):
            p.out[:n].copy_(p.layer(p.q[:n], p.k[:n], p.v[:n], kv_stored=p.kv_stored))
            graph.replay()
        self.replays += 1
        return self.outputs[size][:n]
