"""Pagoda's fused kernels in place of transformers' element-wise chains, where they compute the
same thing.

A decode step of a small batch costs what its kernels cost to launch, even replayed from a CUDA
graph: transformers' RMSNorm is six kernels, its rotary embedding about ten, its gated MLP an
activation and a product, where Pagoda's ops take one each. Each substitution is checked when the
model is built: the module (or the modeling file's ``apply_rotary_pos_emb``) and its stand-in run
on the same random inputs, and the stand-in is kept only where they agree (a Gemma RMSNorm, which
scales by ``1 + weight``, or an interleaved rotary, keeps transformers' own). Weights are never
copied: a fused MLP's gate and up projections become views of one matrix.
"""

from __future__ import annotations

import copy
import logging
import sys
import types
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import torch
from torch import nn

from pagoda.ops import rms_norm, rotary_embedding, silu_and_mul

# NOTE: under "pagoda", whose records the engine's commands print (they leave other libraries'
# loggers at WARNING): what was fused shows at start-up.
logger = logging.getLogger("pagoda.models_transformers.fuse")

#: Whether a Pagoda forward is running: the modeling file's function is shared by every model of
#: the process, and transformers' own models (a test's reference) must keep computing their own.
_in_pagoda_forward = False


@contextmanager
def pagoda_forward() -> Iterator[None]:
    """Within this block, the rotary stand-ins compute; outside it, the original functions do."""
    global _in_pagoda_forward
    prev, _in_pagoda_forward = _in_pagoda_forward, True
    try:
        yield
    finally:
        _in_pagoda_forward = prev


def fuse(model: nn.Module) -> dict[str, int]:
    """Substitute what agrees in ``model`` (built, weights not yet loaded); returns how many of
    each kind were substituted."""
    done = {"rms_norm": 0, "gated_mlp": 0, "rotary": 0}
    probe_norms: dict[type, bool] = {}
    probe_mlps: dict[type, bool] = {}
    for module in list(model.modules()):
        kind = type(module)
        if _is_rms_norm(module):
            if kind not in probe_norms:
                probe_norms[kind] = _agrees(module, _fused_norm_forward, module.weight.shape[-1])
            if probe_norms[kind]:
                object.__setattr__(module, "_pagoda_eps", _eps(module))
                module.forward = types.MethodType(_fused_norm_forward, module)
                done["rms_norm"] += 1
        elif _is_gated_mlp(module):
            if kind not in probe_mlps:
                probe_mlps[kind] = _mlp_agrees(module)
            if probe_mlps[kind]:
                _fuse_mlp(module)
                done["gated_mlp"] += 1
    done["rotary"] = _fuse_rotary(model)
    logger.info("transformers impl: fused %s", ", ".join(f"{v} {k}" for k, v in done.items()))
    return done


# ---- RMSNorm --------------------------------------------------------------------------------


def _eps(module: nn.Module) -> float | None:
    for name in ("variance_epsilon", "eps", "epsilon"):
        value = getattr(module, name, None)
        if isinstance(value, float):
            return value
    return None


def _is_rms_norm(module: nn.Module) -> bool:
    weight = getattr(module, "weight", None)
    return (
        type(module).__name__.endswith("RMSNorm")
        and isinstance(weight, nn.Parameter)
        and weight.dim() == 1
        and getattr(module, "bias", None) is None
        and _eps(module) is not None
        and len(list(module.parameters())) == 1
    )


def _fused_norm_forward(self: nn.Module, x: torch.Tensor) -> torch.Tensor:
    """``weight * rmsnorm(x)`` over the last dimension, one kernel where it runs."""
    try:
        flat = x.view(-1, x.shape[-1])
    except RuntimeError:  # not viewable flat: the original path
        return type(self).forward(self, x)
    return rms_norm(flat, self.weight, self._pagoda_eps).view(x.shape)


def _agrees(module: nn.Module, stand_in: Callable[..., torch.Tensor], width: int) -> bool:
    """Whether ``stand_in`` computes what ``module`` does, on a copy with random weights."""
    try:
        probe = _random_copy(module)
        x = _randn(probe, 5, width)
        object.__setattr__(probe, "_pagoda_eps", _eps(probe))
        with torch.no_grad():
            want = type(probe).forward(probe, x)
            got = stand_in(probe, x)
        return _close(got, want)
    except Exception as e:  # a module that does not fit the pattern keeps its own forward
        logger.debug("no fused stand-in for %s: %s", type(module).__name__, e)
        return False


# ---- gated MLP ------------------------------------------------------------------------------


def _is_gated_mlp(module: nn.Module) -> bool:
    names = ("gate_proj", "up_proj", "down_proj")
    if not all(isinstance(getattr(module, n, None), nn.Linear) for n in names):
        return False
    gate, up = module.gate_proj, module.up_proj
    act = getattr(module, "act_fn", None)
    return (
        gate.bias is None
        and up.bias is None
        and gate.weight.shape == up.weight.shape
        and gate.weight.device.type != "meta"
        and act is not None
        and type(act).__name__ in ("SiLU", "SiLUActivation")
    )


def _fused_mlp_forward(self: nn.Module, x: torch.Tensor) -> torch.Tensor:
    """``down(silu(gate(x)) * up(x))``: one matmul of the gate and up rows together, one
    activation kernel."""
    gate_up = nn.functional.linear(x, self._pagoda_gate_up)
    return self.down_proj(silu_and_mul(gate_up))


def _fuse_mlp(module: nn.Module) -> None:
    """The gate and up weights become the two halves of one matrix (loading fills them in
    place; their names and the state dict do not change)."""
    gate, up = module.gate_proj.weight, module.up_proj.weight
    both = torch.empty((2 * gate.shape[0], gate.shape[1]), dtype=gate.dtype, device=gate.device)
    both[: gate.shape[0]].copy_(gate.detach())
    both[gate.shape[0] :].copy_(up.detach())
    module.gate_proj.weight = nn.Parameter(both[: gate.shape[0]], requires_grad=False)
    module.up_proj.weight = nn.Parameter(both[gate.shape[0] :], requires_grad=False)
    object.__setattr__(module, "_pagoda_gate_up", both)
    module.forward = types.MethodType(_fused_mlp_forward, module)


def _mlp_agrees(module: nn.Module) -> bool:
    try:
        probe = _random_copy(module)
        x = _randn(probe, 5, probe.gate_proj.weight.shape[1])
        with torch.no_grad():
            want = type(probe).forward(probe, x)
            _fuse_mlp(probe)
            got = probe(x)
        return _close(got, want)
    except Exception as e:
        logger.debug("no fused MLP for %s: %s", type(module).__name__, e)
        return False


# ---- rotary embedding -----------------------------------------------------------------------


class _Rotary:
    """Stands in for a modeling file's ``apply_rotary_pos_emb(q, k, cos, sin)``, for
    ``[1, heads, tokens, head_dim]`` queries and keys and the ``[1, tokens, head_dim]`` tables of
    neox rotation (each half repeated) that its rotary module made for this step. The tables are
    made float32 once per step and shared by every layer that reads the same ones."""

    def __init__(self, original: Callable[..., Any]) -> None:
        self.original = original
        # NOTE: the step's tables themselves, not their ids: a freed tensor's id is reused.
        self._cos: torch.Tensor | None = None
        self._sin: torch.Tensor | None = None
        self._tables: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None

    def __call__(self, q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                 *args: Any, **kwargs: Any) -> tuple[torch.Tensor, torch.Tensor]:  # fmt: skip
        if (
            not _in_pagoda_forward
            or args
            or kwargs
            or q.dim() != 4
            or q.shape[0] != 1
            or cos.shape[-1] != q.shape[-1]
        ):
            return self.original(q, k, cos, sin, *args, **kwargs)
        if cos is not self._cos or sin is not self._sin or self._tables is None:
            half = cos.shape[-1] // 2
            n = cos.shape[-2]
            self._tables = (
                cos.reshape(n, -1)[:, :half].float(),
                sin.reshape(n, -1)[:, :half].float(),
                torch.arange(n, device=cos.device),
            )
            self._cos, self._sin = cos, sin
        c, s, positions = self._tables
        qr, kr = rotary_embedding(positions, q[0].transpose(0, 1), k[0].transpose(0, 1), c, s)
        return qr.transpose(0, 1)[None], kr.transpose(0, 1)[None]


def _fuse_rotary(model: nn.Module) -> int:
    """Replace ``apply_rotary_pos_emb`` in the modeling files of ``model``'s modules where the
    stand-in agrees with it; returns how many files."""
    count = 0
    for name in sorted({type(m).__module__ for m in model.modules()}):
        modeling = sys.modules.get(name)
        original = getattr(modeling, "apply_rotary_pos_emb", None)
        if original is None:
            continue
        if isinstance(original, _Rotary):
            count += 1
            continue
        stand_in = _Rotary(original)
        if _rotary_agrees(original, stand_in, model):
            modeling.apply_rotary_pos_emb = stand_in
            count += 1
    return count


def _rotary_agrees(original: Callable[..., Any], stand_in: _Rotary, model: nn.Module) -> bool:
    try:
        param = next(model.parameters())
        gen = torch.Generator().manual_seed(0)
        d, n = 16, 7
        inv = 1.0 / (10000 ** (torch.arange(0, d, 2, dtype=torch.float64, device="cpu") / d))
        steps = torch.randint(0, 4000, (n,), generator=gen, device="cpu")
        freqs = torch.outer(steps.double(), inv)
        emb = torch.cat((freqs, freqs), dim=-1)
        dev, dt = param.device, param.dtype
        cos, sin = (t.to(device=dev, dtype=dt)[None] for t in (emb.cos(), emb.sin()))
        q = torch.randn(1, 4, n, d, generator=gen, device="cpu").to(device=dev, dtype=dt)
        k = torch.randn(1, 2, n, d, generator=gen, device="cpu").to(device=dev, dtype=dt)
        with torch.no_grad(), pagoda_forward():
            want = original(q.clone(), k.clone(), cos, sin)
            got = stand_in(q.clone(), k.clone(), cos, sin)
        return all(_close(g, w) for g, w in zip(got, want, strict=True))
    except Exception as e:
        logger.debug("no fused rotary: %s", e)
        return False


# ---- shared ---------------------------------------------------------------------------------
# NOTE: every probe tensor is made on the CPU, where its generator is, and then moved: the worker
# builds the model under ``torch.device(cuda)``, where a CPU generator's draw would raise and
# every stand-in would be dropped without a word but a debug line.


def _random_copy(module: nn.Module) -> nn.Module:
    probe = copy.deepcopy(module)
    gen = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for p in probe.parameters():
            r = torch.randn(p.shape, generator=gen, device="cpu")
            p.copy_((r * p.shape[-1] ** -0.5 + 1).to(p))
    return probe


def _randn(module: nn.Module, *shape: int) -> torch.Tensor:
    p = next(module.parameters())
    return torch.randn(*shape, generator=torch.Generator().manual_seed(1), device="cpu").to(p)


def _close(got: torch.Tensor, want: torch.Tensor) -> bool:
    if got.shape != want.shape or got.dtype != want.dtype:
        return False
    tol = 1e-5 if got.dtype == torch.float32 else 3e-2
    return bool(torch.allclose(got.float(), want.float(), atol=tol, rtol=tol))
