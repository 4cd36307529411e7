"""Model impl conformance: an impl's model, built through its contract, run over a paged KV cache.

:func:`build_impl_model` goes the way a worker goes (``supports`` -> ``shape`` ->
``model_class``, built by :func:`pagoda.loader.construct.build_model` on the CPU in float32 over
the ``torch_native`` backend) and fills the weights: from a state dict, or random. The
:class:`PagedRunner` feeds the model steps as the model runner does: a flat batch of one or
several requests, each step's :class:`CommonAttentionMetadata`, a cache of
:data:`BLOCK_SIZE`-token blocks handed out in scattered order.

The checks raise ``AssertionError`` (``ValueError`` for a config the impl refuses):

- :func:`check_attention_specs`: the built model's attention layers carry ``shape.attention``.
- :func:`check_chunked_matches_one_step`: a prompt run in one step, and the same tokens in
  chunks then one-token decode steps through the cache, give the same logits. An impl that
  ignores the cache, mis-handles positions or keeps state between steps fails.
- :func:`check_packed_matches_alone`: requests that share steps (one flat batch, joining at
  different steps) give each the logits it gets alone. An impl that leaks across requests fails.
- :func:`check_reference`: the logits against an outside model's (:class:`ModelReference`).
- :func:`check_unfit_tensor_parallel`: ``shape`` refuses a tensor-parallel size that does not
  split the model with a ``ValueError`` that names the sizes that fit.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from torch import nn

from pagoda.attention.backend import AttentionBackend, CommonAttentionMetadata
from pagoda.attention.layer import Attention, set_forward_context
from pagoda.attention.torch_native import TorchNativeBackend
from pagoda.loader import init_dummy_
from pagoda.loader.construct import build_model
from pagoda.loader.weights import DUMMY_RANGE
from pagoda.models.impl import KIND, ModelImpl, named_architecture
from pagoda.models.shape import ModelShape
from pagoda.plugins import get_registry

BLOCK_SIZE = 4
#: Logits of the same tokens, however the steps cut them, agree this closely in float32.
SELF_TOLERANCE = 1e-5

#: One request's tokens per step: ``steps[i][r]`` tokens of request ``r`` in step ``i`` (0: not
#: scheduled). A prompt of 19 tokens in chunks that start mid-block, then three decode steps.
CHUNKED = ((5,), (6,), (5,), (1,), (1,), (1,))
#: Three requests packed: request 0 as in :data:`CHUNKED`; request 1's prompt beside it, then its
#: decodes; request 2 joins in the third step.
PACKED = ((5, 11, 0), (6, 1, 0), (5, 1, 7), (1, 1, 4), (1, 1, 1), (1, 1, 1))


@dataclass(frozen=True)
class ModelReference:
    """An outside model to compare an impl's with: ``logits(token_ids)`` gives ``[n, vocab]``
    (float32) for one sequence of a model whose weights are ``weights`` (checkpoint names, as
    the impl's ``load_weights`` reads them)."""

    weights: Mapping[str, torch.Tensor]
    logits: Callable[[list[int]], torch.Tensor]
    tolerance: float = 1e-4


def impl_class(impl: type[ModelImpl] | str) -> type[ModelImpl]:
    """The impl itself, or the one registered under the name ``impl``."""
    return get_registry(KIND).get(impl) if isinstance(impl, str) else impl


def build_impl_model(
    impl: type[ModelImpl] | str,
    hf_config: dict[str, Any],
    *,
    weights: Mapping[str, torch.Tensor] | None = None,
    seed: int = 0,
    backend: type[AttentionBackend] = TorchNativeBackend,
) -> tuple[ModelShape, nn.Module]:
    """The impl's model of ``hf_config`` (config.json as a dict) on one rank, CPU, float32, in
    eval mode, with ``weights`` loaded through its ``load_weights``, else random ones
    (:func:`random_weights_`). Raises ValueError when ``supports`` refuses the config."""
    cls = impl_class(impl)
    reason = cls.supports(hf_config, named_architecture(hf_config))
    if reason is not None:
        raise ValueError(f"{cls.__name__} refuses {named_architecture(hf_config)!r}: {reason}")
    shape = cls.shape(hf_config, 1)
    cpu = torch.device("cpu")
    model = build_model(
        cls.model_class(shape), shape.config, backend, device=cpu, dtype=torch.float32
    )
    if weights is None:
        random_weights_(model, seed)
    else:
        model.load_weights(weights.items())
    return shape, model.eval()


@torch.no_grad()
def random_weights_(model: nn.Module, seed: int = 0) -> None:
    """:func:`~pagoda.loader.init_dummy_`'s values, widened to ``±1/sqrt(fan_in)`` (the last
    dimension), ``nn.Linear``'s default range; norm weights stay 1.

    NOTE: the dummy range of ``±1e-3`` leaves attention's logits near zero, so that a model
    which ignores positions or the cache would still agree within :data:`SELF_TOLERANCE`."""
    init_dummy_(model, seed)
    for name, param in model.named_parameters():
        if not name.endswith("norm.weight") and param.ndim:
            param.mul_(param.shape[-1] ** -0.5 / DUMMY_RANGE)


def sample_token_ids(vocab_size: int, n: int, seed: int) -> list[int]:
    """``n`` token ids clear of the lowest three and the top sixteen ids of the vocabulary,
    where special tokens usually sit (a placeholder id may need inputs a text prompt lacks)."""
    low, high = (3, vocab_size - 16) if vocab_size > 64 else (0, vocab_size)
    return np.random.default_rng(seed).integers(low, high, n).tolist()


class PagedRunner:
    """Requests of one model over a fresh paged KV cache whose blocks are handed out in
    scattered order (block 0 never, as in the engine).

    ``add`` a request's tokens (teacher-forced: a decode step runs the next given token), then
    ``step`` the flat batch of (request, tokens to run) pairs; each request's logits of every
    position run collect in ``logits[request]``."""

    def __init__(
        self,
        model: nn.Module,
        num_blocks: int = 64,
        seed: int = 0,
        backend: type[AttentionBackend] = TorchNativeBackend,
    ) -> None:
        self.model = model
        self.backend = backend
        for m in model.modules():
            if isinstance(m, Attention):
                s = m.spec
                m.kv_cache = torch.zeros(
                    backend.get_kv_cache_shape(
                        num_blocks, BLOCK_SIZE, s.num_kv_heads, s.cache_head_size
                    )
                )
        order = np.random.default_rng(seed).permutation(np.arange(1, num_blocks))
        self.free = [int(b) for b in order]
        self.tokens: list[list[int]] = []
        self.blocks: list[list[int]] = []
        self.computed: list[int] = []
        self.logits: list[list[torch.Tensor]] = []

    def add(self, tokens: Sequence[int]) -> int:
        """A new request of ``tokens``; returns its index."""
        self.tokens.append(list(tokens))
        self.blocks.append([])
        self.computed.append(0)
        self.logits.append([])
        return len(self.tokens) - 1

    def step(self, work: Sequence[tuple[int, int]]) -> None:
        """One engine step: each (request, number of its next tokens) in one flat batch."""
        ids, pos, slots, starts, lens = [], [], [], [0], []
        for r, n in work:
            start, blocks = self.computed[r], self.blocks[r]
            if start + n > len(self.tokens[r]):
                raise ValueError(f"request {r} has {len(self.tokens[r])} tokens, not {start + n}")
            while len(blocks) * BLOCK_SIZE < start + n:
                blocks.append(self.free.pop())
            for p in range(start, start + n):
                ids.append(self.tokens[r][p])
                pos.append(p)
                slots.append(blocks[p // BLOCK_SIZE] * BLOCK_SIZE + p % BLOCK_SIZE)
            starts.append(starts[-1] + n)
            lens.append(start + n)
        table = np.zeros((len(work), max(len(self.blocks[r]) for r, _ in work) + 1), np.int32)
        for i, (r, _) in enumerate(work):
            table[i, : len(self.blocks[r])] = self.blocks[r]
        common = CommonAttentionMetadata(
            num_reqs=len(work),
            num_actual_tokens=len(ids),
            max_query_len=max(n for _, n in work),
            max_seq_len=max(lens),
            query_start_loc=torch.tensor(starts, dtype=torch.int32),
            seq_lens=torch.tensor(lens, dtype=torch.int32),
            block_table=torch.from_numpy(table),
            slot_mapping=torch.tensor(slots, dtype=torch.int64),
            query_start_loc_cpu=np.array(starts, dtype=np.int64),
            seq_lens_cpu=np.array(lens, dtype=np.int64),
            block_size=BLOCK_SIZE,
        )
        with torch.inference_mode(), set_forward_context(self.backend.build_metadata(common)):
            hidden = self.model(torch.tensor(ids), torch.tensor(pos))
            logits = self.model.compute_logits(hidden).float()
        for i, (r, n) in enumerate(work):
            self.logits[r].append(logits[starts[i] : starts[i] + n])
            self.computed[r] += n


def run_steps(
    model: nn.Module, token_ids: Sequence[Sequence[int]], steps: Sequence[Sequence[int]]
) -> list[torch.Tensor]:
    """Requests of ``token_ids`` through a fresh :class:`PagedRunner`, ``steps[i][r]`` tokens of
    request ``r`` in step ``i`` (0: not in that step); each request's logits ``[run, vocab]``."""
    runner = PagedRunner(model)
    for tokens in token_ids:
        runner.add(tokens)
    for step in steps:
        runner.step([(r, n) for r, n in enumerate(step) if n])
    return [torch.cat(rows) for rows in runner.logits]


def _close(got: torch.Tensor, want: torch.Tensor, tol: float, what: str) -> None:
    if got.shape != want.shape:
        raise AssertionError(
            f"{what}: logits of shape {tuple(got.shape)}, want {tuple(want.shape)}"
        )
    err = (got - want).abs().amax(dim=-1)
    if not bool((err <= tol).all()):  # NaN fails too
        bad = [int(p) for p in torch.nonzero(~(err <= tol)).flatten()]
        raise AssertionError(
            f"{what}: max logit difference {float(err.nan_to_num(float('inf')).max()):.3g} > "
            f"{tol:g}, at positions {bad[:8]}{' ...' if len(bad) > 8 else ''} of {len(err)}"
        )


def check_attention_specs(shape: ModelShape, model: nn.Module) -> None:
    """The model's :class:`Attention` layers, in module order, carry exactly ``shape.attention``
    (the KV cache and the backend are chosen from the declared specs)."""
    built = [m.spec for m in model.modules() if isinstance(m, Attention)]
    declared = list(shape.attention)
    if built == declared:
        return
    if len(built) != len(declared):
        raise AssertionError(
            f"{shape.architecture}: the model built {len(built)} attention layers, its shape "
            f"declares {len(declared)}"
        )
    i = next(i for i, (b, d) in enumerate(zip(built, declared, strict=True)) if b != d)
    raise AssertionError(
        f"{shape.architecture}: attention layer {i} is built with {built[i]}, declared "
        f"{declared[i]}"
    )


def check_chunked_matches_one_step(
    shape: ModelShape, model: nn.Module, *, seed: int = 0, tolerance: float = SELF_TOLERANCE
) -> None:
    """A 19-token sequence run in one step, and in the steps of :data:`CHUNKED` (chunks that
    start mid-block and read the cache, then decode steps), give the same logits."""
    tokens = sample_token_ids(shape.vocab_size, sum(s[0] for s in CHUNKED), seed)
    (whole,) = run_steps(model, [tokens], [(len(tokens),)])
    (chunked,) = run_steps(model, [tokens], CHUNKED)
    cuts = [s[0] for s in CHUNKED]
    _close(
        chunked, whole, tolerance, f"{shape.architecture}: chunks and decodes {cuts} vs one step"
    )


def check_packed_matches_alone(
    shape: ModelShape, model: nn.Module, *, seed: int = 0, tolerance: float = SELF_TOLERANCE
) -> None:
    """Three requests sharing the steps of :data:`PACKED` (one flat batch; prompts, chunks and
    decodes together) give each the logits it gets when it runs the same steps alone."""
    lengths = [sum(step[r] for step in PACKED) for r in range(len(PACKED[0]))]
    prompts = [sample_token_ids(shape.vocab_size, n, seed + 1 + r) for r, n in enumerate(lengths)]
    packed = run_steps(model, prompts, PACKED)
    for r, tokens in enumerate(prompts):
        (alone,) = run_steps(model, [tokens], [(s[r],) for s in PACKED if s[r]])
        what = f"{shape.architecture}: request {r} of {len(prompts)} packed in one batch vs alone"
        _close(packed[r], alone, tolerance, what)


def check_reference(
    shape: ModelShape, model: nn.Module, reference: ModelReference, *, seed: int = 0
) -> None:
    """The model (holding ``reference.weights``) run in the steps of :data:`CHUNKED` gives the
    reference's logits at every position, within ``reference.tolerance``."""
    tokens = sample_token_ids(shape.vocab_size, sum(s[0] for s in CHUNKED), seed)
    (got,) = run_steps(model, [tokens], CHUNKED)
    want = reference.logits(tokens).float()
    _close(got, want, reference.tolerance, f"{shape.architecture}: vs the reference")


def check_unfit_tensor_parallel(
    impl: type[ModelImpl] | str, hf_config: dict[str, Any], size: int
) -> None:
    """``shape(hf_config, size)`` raises ValueError, and its message names every smaller size
    that fits (those ``shape`` accepts): the user learns what to ask for instead."""
    cls = impl_class(impl)
    arch = named_architecture(hf_config)
    try:
        cls.shape(hf_config, size)
    except ValueError as e:
        message = str(e)
    else:
        raise AssertionError(
            f"{cls.__name__}.shape accepted tensor_parallel_size={size} for {arch}"
        )
    fits = []
    for n in range(1, size):
        try:
            cls.shape(hf_config, n)
        except ValueError:
            continue
        fits.append(n)
    named = {int(x) for x in re.findall(r"\d+", message)}
    missing = [n for n in fits if n not in named]
    if missing:
        raise AssertionError(
            f"{cls.__name__}.shape refused tensor_parallel_size={size} for {arch} without naming "
            f"the sizes that fit ({', '.join(map(str, fits))}): {message}"
        )


def check_model_impl(
    impl: type[ModelImpl] | str,
    hf_config: dict[str, Any],
    *,
    reference: ModelReference | None = None,
    unfit_tensor_parallel_size: int | None = None,
    seed: int = 0,
) -> None:
    """Every check above on ``hf_config``, without pytest: the reference's when one is given,
    the tensor-parallel refusal when ``unfit_tensor_parallel_size`` is."""
    shape, model = build_impl_model(impl, hf_config, seed=seed)
    check_attention_specs(shape, model)
    check_chunked_matches_one_step(shape, model, seed=seed)
    check_packed_matches_alone(shape, model, seed=seed)
    if reference is not None:
        shape, model = build_impl_model(impl, hf_config, weights=reference.weights)
        check_reference(shape, model, reference, seed=seed)
    if unfit_tensor_parallel_size is not None:
        check_unfit_tensor_parallel(impl, hf_config, unfit_tensor_parallel_size)
