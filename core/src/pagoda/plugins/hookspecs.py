"""Hook specifications: what a Pagoda plugin may implement.

Registration hooks are collectors: each implementation calls ``register(name, target)`` for what it
provides, where ``target`` is a lazy ``"package.module:Name"`` string or an object. Nothing is
imported until a user selects it by name, so discovery touches no kernel library and no GPU.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pluggy

PROJECT = "pagoda"
hookspec = pluggy.HookspecMarker(PROJECT)
hookimpl = pluggy.HookimplMarker(PROJECT)

Register = Callable[..., None]


@hookspec
def register_attention_backends(register: Register) -> None:
    """Register attention backends: ``register(name, "pkg.mod:BackendClass")``.

    Called once per process when plugins are loaded. The class implements
    :class:`pagoda.attention.backend.AttentionBackend`.
    """


@hookspec
def register_executors(register: Register) -> None:
    """Register executors: ``register(name, "pkg.mod:ExecutorClass")``. Called once per process."""


@hookspec
def register_models(register: Register) -> None:
    """Register model architectures by the ``architectures`` name of config.json:
    ``register("LlamaForCausalLM", "pkg.mod:ModelClass")``. Called once per process."""


@hookspec
def register_spec_proposers(register: Register) -> None:
    """Register speculative-decoding proposers by method name. Called once per process."""


@hookspec
def register_grammar_backends(register: Register) -> None:
    """Register structured-output grammar backends by name. Called once per process."""


def all_registry_hooks() -> dict[str, str]:
    """Registry name -> the hook that fills it."""
    return {
        "attention_backends": "register_attention_backends",
        "executors": "register_executors",
        "models": "register_models",
        "spec_proposers": "register_spec_proposers",
        "grammar_backends": "register_grammar_backends",
    }


_ = Any
