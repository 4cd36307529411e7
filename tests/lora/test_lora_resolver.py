"""Adapter resolvers: the hook's worked example in the plugin guide (docs/plugins.md), run as
written against a local HTTP server, through the server's adapter lookup; the built-in local
resolver never leaves its folder."""

from __future__ import annotations

import asyncio
import functools
import http.server
import re
import threading
from pathlib import Path
from types import SimpleNamespace

import pytest

from pagoda import hookimpl
from pagoda.config.model import LoRAConfig
from pagoda.entrypoints.openai.lora_modules import LoRAModules
from pagoda.lora.resolver import LocalFolderResolver
from pagoda.plugins import plugin_registered

GUIDE = Path(__file__).resolve().parents[2] / "docs" / "plugins.md"


def _guide_example() -> type:
    """The HTTPResolver class, exactly as the guide shows it."""
    code = re.search(r"```python\n# my_package/http_resolver.py\n(.*?)```", GUIDE.read_text(), re.S)
    assert code, "docs/plugins.md lacks the resolver's worked example"
    namespace: dict = {}
    exec(compile(code.group(1), "http_resolver.py", "exec"), namespace)  # noqa: S102
    return namespace["HTTPResolver"]


@pytest.fixture(scope="module")
def adapter_site(lora_model):
    """An HTTP server whose /NAME/ holds lora-b's files for NAME = remote-b."""
    root = lora_model["paths"]["lora-b"].parent / "site"
    (root / "remote-b").mkdir(parents=True, exist_ok=True)
    for f in lora_model["paths"]["lora-b"].iterdir():
        (root / "remote-b" / f.name).write_bytes(f.read_bytes())
    handler = functools.partial(http.server.SimpleHTTPRequestHandler, directory=str(root))
    handler.log_message = lambda *a: None  # type: ignore[attr-defined]
    httpd = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    threading.Thread(target=httpd.serve_forever, daemon=True).start()
    yield f"http://127.0.0.1:{httpd.server_address[1]}"
    httpd.shutdown()


class _Plugin:
    PAGODA_PLUGIN_API = 1

    def __init__(self, resolver: type) -> None:
        self.resolver = resolver

    @hookimpl
    def register_lora_resolvers(self, register):
        register("http", self.resolver)


def test_the_guides_http_resolver_serves_an_adapter_by_name(
    lora_model, adapter_site, tmp_path, monkeypatch
) -> None:
    from pagoda import LLM

    monkeypatch.setenv("MY_ADAPTERS_URL", adapter_site)
    llm = LLM(
        model=str(lora_model["base"]), enable_lora=True, max_lora_rank=16, max_model_len=64,
        dtype="float32", kv_cache_memory_bytes=4 << 20, resolvers=["http"],
        resolver_dir=str(tmp_path / "cache"),
    )  # fmt: skip
    with plugin_registered(_Plugin(_guide_example()), "http-resolver"):
        modules = LoRAModules(SimpleNamespace(config=llm.engine.config, engine=llm.engine), ["b"])
        lora = asyncio.run(modules.find("remote-b"))
        assert lora is not None and modules.names == ["b", "remote-b"]
        assert (Path(lora.lora_path) / "adapter_model.safetensors").is_file()
        assert asyncio.run(modules.find("remote-b")) is lora  # served from now on
        assert asyncio.run(modules.find("nobody-has-this")) is None  # a 404 upstream
    from pagoda import SamplingParams

    out = llm.generate({"prompt_token_ids": [1, 5, 9]}, SamplingParams(max_tokens=3),
                       lora_request=lora, use_tqdm=False)  # fmt: skip
    assert len(out[0].outputs[0].token_ids) == 3


def test_the_local_resolver_finds_folders_by_name_and_nothing_outside(tmp_path) -> None:
    (tmp_path / "ad" / "x").mkdir(parents=True)
    (tmp_path / "ad" / "x" / "adapter_config.json").write_text("{}")
    (tmp_path / "adapter_config.json").write_text("{}")
    resolver = LocalFolderResolver(LoRAConfig(resolver_dir=str(tmp_path / "ad")))
    assert resolver.resolve("base", "x") == str(tmp_path / "ad" / "x")
    assert resolver.resolve("base", "y") is None
    assert resolver.resolve("base", "..") is None and resolver.resolve("base", "../ad/x") is None
    with pytest.raises(ValueError, match="lora.resolver_dir"):
        LocalFolderResolver(LoRAConfig())
