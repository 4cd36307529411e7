"""The LoRA adapters a server serves as models: ``--lora-modules``, those loaded at run time
(``/v1/load_lora_adapter``, behind ``server.allow_runtime_lora_updating``) and those an adapter
resolver finds by name (``lora.resolvers``). Each is a model name in ``/v1/models``; a request
selects it with ``model``."""

from __future__ import annotations

import asyncio
import itertools
import json
import logging

from pagoda.engine.async_llm import AsyncLLM
from pagoda.entrypoints.openai.errors import APIError
from pagoda.lora.resolver import LoRAResolver
from pagoda.lora_request import LoRARequest
from pagoda.plugins import get_registry

logger = logging.getLogger("pagoda.server")


def parse_module(item: str) -> tuple[str, str]:
    """``name=path`` or vLLM's JSON ``{"name": ..., "path": ...}``."""
    text = item.strip()
    if text.startswith("{"):
        try:
            data = json.loads(text)
            return str(data["name"]), str(data["path"])
        except (json.JSONDecodeError, KeyError, TypeError) as e:
            raise ValueError(f"a LoRA module in JSON has a name and a path; got {item!r}") from e
    name, _, path = text.partition("=")
    return name.strip(), path.strip()


class LoRAModules:
    def __init__(self, engine: AsyncLLM, names: list[str]) -> None:
        """``names``: the server's model names, the base model's first; adapters are added to
        it (and removed) in place, so every endpoint that reads it sees them."""
        self.engine = engine
        self.names = names
        self.by_name: dict[str, LoRARequest] = {}
        self._ids = itertools.count(1)
        config = engine.config
        self.resolvers: list[LoRAResolver] = [
            get_registry("lora_resolvers").get(name)(config.lora) for name in config.lora.resolvers
        ]
        if self.resolvers and not config.lora.enable_lora:
            raise ValueError("lora.resolvers needs lora.enable_lora (--enable-lora)")
        for item in config.server.lora_modules:
            self.add(*parse_module(item))

    def add(self, name: str, path: str) -> LoRARequest:
        """Serve adapter ``name`` from folder ``path``; ValueError naming it when it is taken or
        the engine cannot serve the adapter."""
        if not name:
            raise ValueError("a LoRA adapter needs a name")
        if name in self.names:
            what = "the base model's name" if name == self.names[0] else "already loaded"
            raise ValueError(f"LoRA adapter {name!r}: the name is {what}")
        lora = LoRARequest(name, next(self._ids), path)
        self.engine.engine.check_lora(lora)
        self.by_name[name] = lora
        self.names.append(name)
        logger.info("serving LoRA adapter %s from %s", name, path)
        return lora

    def remove(self, name: str) -> None:
        lora = self.by_name.pop(name, None)
        if lora is None:
            raise APIError(
                f"The LoRA adapter `{name}` is not loaded", 404, param="lora_name",
                code="model_not_found",
            )  # fmt: skip
        self.names.remove(name)
        self.engine.engine.forget_lora(lora.lora_int_id)
        logger.info("unloaded LoRA adapter %s", name)

    async def find(self, name: str | None) -> LoRARequest | None:
        """The adapter ``name`` selects: a served one, else one a resolver finds (then served
        from here on); None for the base model or a name nobody knows."""
        if name is None or name == self.names[0]:
            return None
        if name in self.by_name:
            return self.by_name[name]
        for resolver in self.resolvers:
            try:
                path = await asyncio.to_thread(resolver.resolve, self.names[0], name)
            except Exception:  # noqa: BLE001 - one resolver's failure: the next is asked
                logger.exception("LoRA resolver %s failed on %r", type(resolver).__name__, name)
                continue
            if path is not None:
                if name in self.by_name:  # found meanwhile by another request
                    return self.by_name[name]
                try:
                    return self.add(name, path)
                except ValueError as e:
                    raise APIError(str(e), param="model") from e
        return None
