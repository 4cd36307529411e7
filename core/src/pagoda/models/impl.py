"""The model implementation contract, and choosing the one that serves a model.

A model impl says, for a model's config.json, whether it can serve it (``supports``), what the
engine reads of it on a tensor-parallel rank (``shape``: sizes, context, EOS ids, every layer's
attention spec) and which module to build (``model_class``). Impls are registered
by plugins (``register_model_impls``); the core's own, ``native``, serves the Llama family.
``model.impl`` picks one by name, or ``auto``: the highest ``priority`` among those that accept.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import Any, ClassVar

from pagoda.models.shape import ModelShape
from pagoda.plugins import PluginError, get_registry

KIND = "model_impls"


class ModelImpl(ABC):
    """A family of model implementations (a class: its methods are classmethods).

    Discovery imports nothing of it: ``register("name", "pkg.mod:MyImpl")`` is resolved only when
    a model is resolved, so a module that defines an impl keeps torch and kernels out of its top
    level when it can.
    """

    #: ``model.impl=auto`` takes the highest priority among the impls that accept the model.
    priority: ClassVar[int] = 0

    @classmethod
    @abstractmethod
    def supports(cls, hf_config: dict[str, Any], architecture: str) -> str | None:
        """None when this impl can serve the model, else the reason it cannot (one line).

        :param hf_config: the model's config.json as a dict (transformers 4 or 5 key style).
        :param architecture: the architecture it names (``architectures[0]``, else its
            ``model_type``, else ``""``).
        """

    @classmethod
    @abstractmethod
    def shape(cls, hf_config: dict[str, Any], tensor_parallel_size: int) -> ModelShape:
        """What the engine reads of the model on each of ``tensor_parallel_size`` ranks (sizes,
        context, dtype, EOS ids, and one attention spec per layer with that rank's heads); called
        only after :meth:`supports` accepted ``hf_config``, in the engine's process, before any
        worker starts. Raises ValueError, naming the numbers, for a bad config or a
        tensor-parallel size the impl cannot split the model into (the impl knows what it
        splits; say which sizes fit)."""

    @classmethod
    @abstractmethod
    def model_class(cls, shape: ModelShape) -> Any:
        """The module class, built in each worker as ``ModelClass(shape.config,
        attention_backend)`` under the worker's tensor-parallel group, with its parameters
        allocated but not initialised. The module then loads its own weights
        (``load_weights(iterable of (name, tensor or lazy slice))``, raising on a weight with no
        home or a parameter left unset), maps ``forward(input_ids, positions)`` over the flat
        batch of a step (``[num_tokens]`` each) to hidden states ``[num_tokens, hidden_size]``,
        and ``compute_logits(hidden_states)`` to ``[rows, vocab_size]``. Its attention layers
        are :class:`pagoda.attention.layer.Attention` modules, built in the order and with the
        specs of ``shape.attention``. A class that splits into pipeline stages sets
        ``supports_pipeline_parallel = True`` and builds only its stage's layers
        (``pagoda.distributed.stage_layers``; ``docs/plugins.md``, "Model implementations")."""


def named_architecture(hf_config: dict[str, Any]) -> str:
    """The architecture a config.json names: ``architectures[0]``, else its ``model_type``."""
    names = hf_config.get("architectures") or []
    return str(names[0]) if names else str(hf_config.get("model_type") or "")


def verdicts(hf_config: dict[str, Any]) -> list[tuple[str, int | None, str | None]]:
    """Each registered impl's answer for ``hf_config``, in name order: (name, priority, None when
    it accepts, else its reason). An impl that cannot be imported refuses with its error."""
    registry = get_registry(KIND)
    out: list[tuple[str, int | None, str | None]] = []
    for name in registry.names():
        try:
            impl = registry.get(name)
        except PluginError as e:
            out.append((name, None, str(e).splitlines()[0]))
            continue
        out.append((name, getattr(impl, "priority", 0), _ask(impl, hf_config)))
    return out


def select_model_impl(name: str, hf_config: dict[str, Any]) -> tuple[str, type[ModelImpl]]:
    """The impl that serves ``hf_config``: (its name, its class). ``name`` is ``model.impl``:
    ``auto`` (the highest priority that accepts; ties: the first name) or a registered name.
    Raises ValueError, one line, listing every candidate's reason when none accepts."""
    registry = get_registry(KIND)
    arch = named_architecture(hf_config) or "(none named)"
    if name != "auto":
        impl = registry.get(name)  # an unknown name: an error that lists the known ones
        reason = impl.supports(hf_config, named_architecture(hf_config))
        if reason is not None:
            raise ValueError(f"model.impl={name!r} cannot serve architecture {arch}: {reason}")
        return name, impl
    # The impls asked from the highest priority down (ties: name order), the first to accept
    # chosen: the rule's answer without asking the ones below it (the transformers impl's
    # probe imports transformers' modeling code, seconds of every engine start, to lose to
    # native).
    impls: list[tuple[str, Any]] = []
    refusals: dict[str, str] = {}
    for n in registry.names():
        try:
            impls.append((n, registry.get(n)))
        except PluginError as e:
            refusals[n] = str(e).splitlines()[0]
    impls.sort(key=lambda pair: -(getattr(pair[1], "priority", 0) or 0))
    for n, impl in impls:
        reason = _ask(impl, hf_config)
        if reason is None:
            return n, impl
        refusals[n] = reason
    why = " | ".join(f"{n}: {refusals[n]}" for n in registry.names()) or "none is registered"
    raise ValueError(
        f"no model impl accepts architecture {arch} (model.impl=auto; install a plugin that "
        f"provides one): {why}"
    )


def _ask(impl: Any, hf_config: dict[str, Any]) -> str | None:
    """``impl.supports`` of ``hf_config``; an exception it raises is its refusal."""
    try:
        return impl.supports(hf_config, named_architecture(hf_config))
    except Exception as e:
        return f"supports() raised {type(e).__name__}: {e}"
