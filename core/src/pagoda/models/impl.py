"""The model implementation contract, and choosing the one that serves a model.

A model impl says, for a model's config.json, whether it can serve it (``supports``), how to read
that config (``arch_config``) and which module to build (``model_class``). Impls are registered
by plugins (``register_model_impls``); the core's own, ``native``, serves the Llama family.
``model.impl`` picks one by name, or ``auto``: the highest ``priority`` among those that accept.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Sequence
from typing import Any, ClassVar

from pagoda.attention.spec import AttentionSpec
from pagoda.loader.arch import ModelArchConfig
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
    def arch_config(cls, hf_config: dict[str, Any]) -> ModelArchConfig:
        """What the engine reads of the model (sizes, heads, context, dtype, EOS ids); called only
        after :meth:`supports` accepted ``hf_config``. May raise ValueError for a bad config."""

    @classmethod
    @abstractmethod
    def model_class(cls, arch: ModelArchConfig) -> Any:
        """The module class, built in each worker as ``ModelClass(arch, attention_backend)``,
        which loads its own weights (``load_weights``)."""

    @classmethod
    def attention_specs(cls, arch: ModelArchConfig) -> Sequence[AttentionSpec]:
        """One :class:`~pagoda.attention.spec.AttentionSpec` per attention layer, in order, read
        when the worker selects its attention backend (``auto`` skips a backend that lacks a
        feature some layer needs). The default asks the model class for its own
        ``attention_specs(arch)``; empty: the layers are checked one by one as they are built."""
        declared = getattr(cls.model_class(arch), "attention_specs", None)
        return () if declared is None else declared(arch)


def named_architecture(hf_config: dict[str, Any]) -> str:
    """The architecture a config.json names: ``architectures[0]``, else its ``model_type``."""
    names = hf_config.get("architectures") or []
    return str(names[0]) if names else str(hf_config.get("model_type") or "")


def verdicts(hf_config: dict[str, Any]) -> list[tuple[str, int | None, str | None]]:
    """Each registered impl's answer for ``hf_config``, in name order: (name, priority, None when
    it accepts, else its reason). An impl that cannot be imported refuses with its error."""
    registry = get_registry(KIND)
    arch = named_architecture(hf_config)
    out: list[tuple[str, int | None, str | None]] = []
    for name in registry.names():
        try:
            impl = registry.get(name)
        except PluginError as e:
            out.append((name, None, str(e).splitlines()[0]))
            continue
        try:
            reason = impl.supports(hf_config, arch)
        except Exception as e:
            reason = f"supports() raised {type(e).__name__}: {e}"
        out.append((name, getattr(impl, "priority", 0), reason))
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
    answers = verdicts(hf_config)
    accepted = [(n, p or 0) for n, p, reason in answers if reason is None]
    if not accepted:
        why = " | ".join(f"{n}: {reason}" for n, _, reason in answers) or "none is registered"
        raise ValueError(
            f"no model impl accepts architecture {arch} (model.impl=auto; install a plugin that "
            f"provides one): {why}"
        )
    best = max(accepted, key=lambda a: a[1])[0]
    return best, registry.get(best)
