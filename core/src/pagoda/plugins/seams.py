"""How the engine calls its seam hooks: bound once, and skipped when no plugin implements them.

A component (scheduler, KV cache manager, model runner, engine core) asks for :func:`seam` when it
is built and keeps the result; ``None`` means no plugin implements the hook, so the call site is a
single ``is not None`` test and the hot path pays nothing.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from pagoda.plugins import hookspecs
from pagoda.plugins.errors import RequestRejectedError
from pagoda.plugins.hookspecs import SchedulerView
from pagoda.plugins.manager import get_plugin_manager

if TYPE_CHECKING:
    import torch

    from pagoda.config import EngineConfig
    from pagoda.request import Request


def seam(name: str) -> Any | None:
    """The hook caller of seam hook ``name``, or None when no loaded plugin implements it.

    A first-result hook with one implementation (the core's own admission rule, with no plugin
    beside it) is called directly, as pluggy would call it: pluggy's dispatch costs several
    microseconds a call, and ``admit_request`` runs for every request added."""
    if name not in hookspecs.SEAM_HOOKS:
        raise KeyError(f"{name!r} is not a seam hook; seams: {', '.join(hookspecs.SEAM_HOOKS)}")
    caller = getattr(get_plugin_manager().hook, name)
    impls = caller.get_hookimpls()
    if not impls:
        return None
    if (
        len(impls) == 1
        and caller.spec is not None
        and caller.spec.opts.get("firstresult")
        and not (impls[0].hookwrapper or impls[0].wrapper)
    ):
        function, argnames = impls[0].function, impls[0].argnames

        def direct(**kwargs: Any) -> Any:
            return function(*[kwargs[a] for a in argnames])

        return direct
    return caller


def check_admission(hook: Any, request: Request, scheduler: SchedulerView) -> None:
    """Run ``admit_request``; raise :class:`RequestRejectedError` with the plugin's reason."""
    reason = hook(request=request, scheduler=scheduler)
    if reason is not None:
        raise RequestRejectedError(f"request {request.request_id!r} rejected: {reason}")


def build_logits_processors(
    config: EngineConfig, vocab_size: int, device: torch.device
) -> list[hookspecs.LogitsProcessor]:
    """Every plugin's logits processors, built once; empty when no plugin provides any."""
    hook = seam("logits_processors")
    if hook is None:
        return []
    out: list[hookspecs.LogitsProcessor] = []
    for result in hook(config=config, vocab_size=vocab_size, device=device):
        if result is None:
            continue
        for proc in result:
            if not callable(proc):
                raise TypeError(
                    f"a logits_processors hook returned {proc!r}, which is not callable as "
                    "processor(logits, sampling_metadata)"
                )
            out.append(proc)
    return out
