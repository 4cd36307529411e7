"""Tensor parallelism from the model's own plan: ``PreTrainedModel.tp_plan`` (the config's
``base_model_tp_plan``, the head's ``_tp_plan``, and the vocabulary-parallel embedding that
transformers adds), module or parameter name patterns mapped to styles.

Each style becomes, on one rank, a slice of some parameters and, on a module, a forward that
communicates through Pagoda's tensor-parallel group:

- ``colwise``: output features split (dim -2 of a weight, the only dim of a bias); the output
  stays split. A key or value projection (``k_proj``, ``v_proj``) with fewer heads than ranks is
  replicated instead: each rank holds the head its query heads read.
- ``packed_colwise``: the same for a fused gate/up projection, each half split alike.
- ``rowwise``: input features split (the last dim). A linear layer's partial products are summed
  over the ranks and its bias added once; on a parameter (an expert's 3-D weight) only the split.
- ``packed_rowwise``: the input split for a weight packed along it, each half alike.
- ``colwise_gather_output``, ``colwise_rep``: output split (in equal parts, the last padded) and
  gathered, so every rank has all of it: the LM head gives the full vocabulary.
- ``rowwise_split_input``, ``rowwise_rep``: the whole input given; each rank reads its part.
- ``embedding_rowwise``: the vocabulary split (padded); each rank looks up the ids it holds and
  the rows are summed. A tied LM head shares the slice.
- ``moe_tp_experts``, ``all_reduce``: the module's output summed over the ranks (each rank ran
  its slice of every expert).
- ``replicate``, ``replicated_with_grad_allreduce``, ``local_params``, ``mla_kv_a_proj``: the
  whole parameter on every rank (they differ from it only in training).

Any other style is refused by name. This module reads the plan (each parameter's shard, the sizes
that fit); :mod:`pagoda_models_transformers.tensor_parallel` applies it.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from pagoda.loader.sharded import WeightSlice, as_slice
from pagoda.utils import cdiv
from pagoda_models_transformers.probe import Refusal

SPLIT_OUT = frozenset({"colwise", "packed_colwise"})
GATHER_OUT = frozenset({"colwise_gather_output", "colwise_rep"})
SPLIT_IN = frozenset({"rowwise", "packed_rowwise"})
GIVEN_IN = frozenset({"rowwise_split_input", "rowwise_rep"})
REDUCE_OUT = frozenset({"moe_tp_experts", "all_reduce"})
#: Styles that keep every parameter whole and change nothing at inference.
WHOLE = frozenset({"replicate", "replicated_with_grad_allreduce", "local_params", "mla_kv_a_proj"})
EMBEDDING = "embedding_rowwise"
STYLES = SPLIT_OUT | GATHER_OUT | SPLIT_IN | GIVEN_IN | REDUCE_OUT | WHOLE | {EMBEDDING}
#: The projections whose heads are keys or values: replicated when ranks outnumber them.
KV_PROJECTIONS = frozenset({"k_proj", "v_proj"})
#: Config attributes that, set (non-zero), make a layer read all of a dim the plan splits: no
#: shape shows it, the numbers are wrong.
WHOLE_DIM_FEATURES = {
    "activation_sparsity_pattern": "activation sparsity (statistics over the whole intermediate "
    "size, which the plan splits)",
}


@dataclass(frozen=True, slots=True)
class Shard:
    """This rank's part of a checkpoint tensor along ``dim`` (of ``full``): the ``(start,
    length)`` ranges in order, then zeros up to ``local``."""

    dim: int
    full: int
    ranges: tuple[tuple[int, int], ...]
    local: int

    def take(self, w: torch.Tensor | WeightSlice, what: str) -> torch.Tensor:
        """This rank's part of ``w`` (only that part read from a lazy slice)."""
        w = as_slice(w)
        if w.shape[self.dim] != self.full:
            raise ValueError(
                f"checkpoint weight {what} has {w.shape[self.dim]} rows along dim {self.dim}, "
                f"the model splits {self.full}"
            )
        parts = [w.narrow(self.dim, start, n) for start, n in self.ranges]
        have = sum(n for _, n in self.ranges)
        if have < self.local:
            pad = list(parts[0].shape)
            pad[self.dim] = self.local - have
            parts.append(parts[0].new_zeros(pad))
        return parts[0] if len(parts) == 1 else torch.cat(parts, self.dim)


def _even(dim: int, full: int, rank: int, size: int, halves: int = 1) -> Shard:
    part = full // halves
    per = part // size
    return Shard(
        dim, full, tuple((h * part + rank * per, per) for h in range(halves)), per * halves
    )


def _padded(dim: int, full: int, rank: int, size: int) -> Shard:
    per = cdiv(full, size)
    start = rank * per
    return Shard(dim, full, ((start, min(per, full - start)),), per)


def _replicated_heads(dim: int, full: int, heads: int, rank: int, size: int) -> Shard:
    width = full // heads
    head = rank // (size // heads)
    return Shard(dim, full, ((head * width, width),), width)


def _generic(name: str) -> str:
    """``name`` with its layer numbers as ``*``, as plans write them."""
    return re.sub(r"\.\d+(?=\.|$)", ".*", name)


def _style(name: str, plan: dict[str, str], is_param: bool) -> str | None:
    generic = _generic(name)
    if generic in plan:
        return plan[generic]
    owner = generic.rpartition(".")[0]
    return plan.get(owner) if is_param and owner else None


#: Expert parameters that transformers' expert-parallel plan (``ep_plan``: ``grouped_gemm``
#: parameters of an ``ep_dispatch_experts`` module) names, and the tensor-parallel style each
#: takes when every rank holds a slice of every expert instead.
EP_AS_TP = {"gate_up_proj": "packed_colwise", "up_proj": "colwise", "down_proj": "rowwise"}


def _experts_from_ep_plan(model: Any, plan: dict[str, str]) -> dict[str, str]:
    """Tensor-parallel entries for the experts that only ``model.ep_plan`` names (transformers
    5.25 moved them there from the tensor-parallel plan): the experts module sums its ranks'
    outputs (``moe_tp_experts``) and each expert's features are split as the old plans split
    them. An experts module with any other planned parameter (a bias, a norm) is left out, and so
    refused as before."""
    ep = dict(getattr(model, "ep_plan", None) or {})
    out: dict[str, str] = {}
    for key, style in ep.items():
        if style != "ep_dispatch_experts" or any(k == key or k.startswith(key + ".") for k in plan):
            continue
        params = {k[len(key) + 1 :]: s for k, s in ep.items() if k.startswith(key + ".")}
        if params and all(s == "grouped_gemm" and p in EP_AS_TP for p, s in params.items()):
            out[key] = "moe_tp_experts"
            out.update({f"{key}.{p}": EP_AS_TP[p] for p in params})
    return out


@dataclass(frozen=True)
class Planned:
    """The plan resolved on one model: each parameter's style (own or its module's) and each
    module's."""

    params: dict[str, tuple[str, nn.Parameter, nn.Module]]
    modules: dict[str, tuple[str, nn.Module]]


def resolve(model: Any) -> Planned:
    """The model's plan, each pattern resolved to the parameters and modules it names; raises
    :class:`Refusal` for a model without a plan or with a style this impl does not implement."""
    plan = dict(getattr(model, "tp_plan", None) or {})
    plan.update(_experts_from_ep_plan(model, plan))
    name = type(model).__name__
    if not plan:
        raise Refusal(
            f"{name} has no tensor-parallel plan (its config's base_model_tp_plan): "
            "only tensor_parallel_size=1 fits"
        )
    unknown = sorted({s for s in plan.values() if s not in STYLES})
    if unknown:
        which = sorted(k for k, s in plan.items() if s in unknown)
        raise Refusal(
            f"{name}'s tensor-parallel plan uses {', '.join(unknown)} ({', '.join(which[:4])}), "
            f"which the transformers impl does not implement; only tensor_parallel_size=1 fits"
        )
    text = model.config.get_text_config()
    for attr, feature in WHOLE_DIM_FEATURES.items():
        value = getattr(text, attr, None)
        if value and any(value if isinstance(value, (list, tuple)) else [value]):
            raise Refusal(f"{name} uses {feature}: only tensor_parallel_size=1 fits")
    params: dict[str, tuple[str, nn.Parameter, nn.Module]] = {}
    modules: dict[str, tuple[str, nn.Module]] = {}
    for mname, module in model.named_modules():
        for pname, param in module.named_parameters(recurse=False):
            full = f"{mname}.{pname}" if mname else pname
            style = _style(full, plan, is_param=True)
            if style is not None:
                params[full] = (style, param, module)
        style = _style(mname, plan, is_param=False)
        if style is not None:
            modules[mname] = (style, module)
    return Planned(params, modules)


class Layout:
    """How the plan splits one model: each parameter's :class:`Shard` on a rank, and the sizes
    that do not divide it."""

    def __init__(self, planned: Planned, heads: dict[str, tuple[int, int]]) -> None:
        self.planned = planned
        splitting = [n for n, (s, _, _) in planned.params.items() if s in SPLIT_OUT]
        #: Attention module -> (query heads, KV heads), of those whose projections the plan splits.
        self.split_heads = {
            a: h for a, h in heads.items() if any(n.startswith(a + ".") for n in splitting)
        }
        #: Key and value projection parameters -> their module's KV heads.
        self.kv: dict[str, int] = {}
        for name in splitting:
            module, _, _ = name.rpartition(".")
            attn, _, leaf = module.rpartition(".")
            if leaf in KV_PROJECTIONS and attn in self.split_heads:
                self.kv[name] = self.split_heads[attn][1]
        #: Attention modules whose keys and values come from one fused projection.
        self.fused = {
            a for a in self.split_heads if not any(n.startswith(a + ".") for n in self.kv)
        }
        #: Parameters of those attention modules (their sizes follow the heads).
        self.of_heads = {
            n for n in planned.params if any(n.startswith(a + ".") for a in self.split_heads)
        }

    def problems(self, n: int) -> list[str]:
        """What ``n`` ranks do not divide, one phrase each (none: it fits)."""
        out: dict[str, None] = {}
        for attn, (heads, kv) in self.split_heads.items():
            if heads % n:
                out[f"{heads} attention heads"] = None  # dict: each phrase once, in order
            if kv % n and (attn in self.fused or n % kv):
                out[
                    f"{kv} KV heads (the size must divide them, or be a multiple of them so "
                    "that each is replicated)"
                ] = None
        features: dict[str, list[str]] = {}
        for name, (style, param, _) in self.planned.params.items():
            dim = _dim(name, style, param)
            if dim is None or style in GATHER_OUT or style == EMBEDDING:
                continue
            if name in self.of_heads:
                continue  # said by the heads
            full = param.shape[dim]
            halves = 2 if style.startswith("packed") else 1
            if full % (n * halves):
                per = " per expert" if param.ndim == 3 else ""
                packed = ", in two packed halves" if halves == 2 else ""
                where = features.setdefault(f"{full} features{per}{packed}", [])
                base = re.sub(r"\.(weight|bias)$", "", _generic(name))
                short = ".".join(base.split(".")[-2:])
                if short not in where:
                    where.append(short)
        out.update({f"{what} ({', '.join(where)})": None for what, where in features.items()})
        return list(out)

    def shard(self, name: str, rank: int, size: int) -> Shard | None:
        style, param, _ = self.planned.params[name]
        dim = _dim(name, style, param)
        if dim is None:
            return None
        full = param.shape[dim]
        if style in GATHER_OUT or style == EMBEDDING:
            return _padded(dim, full, rank, size)
        if name in self.kv and size > self.kv[name]:
            return _replicated_heads(dim, full, self.kv[name], rank, size)
        return _even(dim, full, rank, size, 2 if style.startswith("packed") else 1)


def _dim(name: str, style: str, param: nn.Parameter) -> int | None:
    """The dim ``style`` splits of a parameter: the output features (a weight's dim -2, a bias's
    last), the input features (a weight's last; a bias is added once, whole), the vocabulary."""
    bias = param.ndim == 1 or name.endswith("bias")
    if style in SPLIT_OUT | GATHER_OUT:
        return param.ndim - 1 if bias else param.ndim - 2
    if style in SPLIT_IN | GIVEN_IN:
        return None if bias else param.ndim - 1
    return 0 if style == EMBEDDING else None


def check_modules(model: Any, planned: Planned, shards: dict[str, Shard | None]) -> None:
    """Refuse what a style cannot do right: a linear style on a module that is not a linear
    layer, an input split whose partial products nothing sums, experts stored transposed or
    with a parameter the plan leaves whole."""
    name = type(model).__name__
    for mname, (style, module) in planned.modules.items():
        linear = SPLIT_OUT | GATHER_OUT | SPLIT_IN | GIVEN_IN
        if style in linear and not isinstance(module, nn.Linear):
            raise Refusal(
                f"{name}'s plan splits {mname} ({type(module).__name__}) {style}, which the "
                "transformers impl does only for linear layers"
            )
        if style == EMBEDDING and not isinstance(module, nn.Embedding):
            raise Refusal(f"{name}'s plan splits {mname} ({type(module).__name__}) as embedding")
        if style == "moe_tp_experts":
            if getattr(module, "is_transposed", False):
                raise Refusal(f"{name}'s experts ({mname}) are stored transposed")
            whole = [
                p
                for p, _ in module.named_parameters(recurse=False)
                if not shards.get(f"{mname}.{p}")
            ]
            if whole:
                raise Refusal(
                    f"{name}'s plan leaves {mname}.{whole[0]} whole, so each rank would add it "
                    "to the experts' sum"
                )
    reducing = [m for m, (s, _) in planned.modules.items() if s in REDUCE_OUT]
    for pname, (style, _, _) in planned.params.items():
        owner = pname.rpartition(".")[0]
        if style not in SPLIT_IN or planned.modules.get(owner, ("",))[0] in SPLIT_IN:
            continue
        if not any(owner == m or owner.startswith(m + ".") for m in reducing):
            raise Refusal(
                f"{name}'s plan splits {pname}'s input, but no module sums its partial products"
            )


def check_size(model: Any, planned: Planned, layout: Layout, size: int) -> None:
    """Raise ValueError, naming what does not divide and the sizes that fit, for a ``size`` the
    plan cannot split ``model`` into; :class:`Refusal` for a plan that splits nothing but the
    embedding and the LM head."""
    name = type(model).__name__
    ends = {id(model.get_input_embeddings()), id(model.get_output_embeddings())}
    if all(id(m) in ends or _dim(n, s, p) is None for n, (s, p, m) in planned.params.items()):
        raise Refusal(
            f"{name}'s tensor-parallel plan splits only its embedding and LM head (its layers "
            "are planned for expert parallelism or not at all): only tensor_parallel_size=1 fits"
        )
    problems = layout.problems(size)
    if problems:
        most = max([h for h, _ in layout.split_heads.values()] or [8])
        fits = [n for n in range(1, most + 1) if not layout.problems(n)]
        raise ValueError(
            f"tensor_parallel_size={size} does not divide {name}'s "
            + " nor ".join(problems)
            + f"; sizes that fit: {', '.join(map(str, fits))}"
        )
