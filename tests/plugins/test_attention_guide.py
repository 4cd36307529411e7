"""The attention section of the plugin author's guide: the from-scratch backend built from the
guide's own code blocks passes the conformance kit. And every public method of the backend
contracts (attention backends, executors, speculative proposers, grammar backends) has a
docstring with its inputs and outputs and is named in the guide."""

from __future__ import annotations

import importlib.util
import inspect
import re
import sys
from pathlib import Path

import pytest
import torch

from pagoda.attention import backend as contract
from pagoda.testing import attention_cases, check_attention_backend

ROOT = Path(__file__).resolve().parents[2]
GUIDE = ROOT / "docs" / "plugins.md"
EXAMPLE = "examples/pagoda-sdpa-attention/"


def _guide_files() -> dict[str, str]:
    blocks = re.findall(r"<!-- file: (\S+) -->\n```\w*\n(.*?)```", GUIDE.read_text(), re.S)
    return {path: text for path, text in blocks if path.startswith(EXAMPLE)}


@pytest.fixture(scope="module")
def guide_backend(tmp_path_factory: pytest.TempPathFactory) -> type:
    """The backend class, imported from files written out of the guide's code blocks only."""
    files = _guide_files()
    root = tmp_path_factory.mktemp("from-the-guide")
    for path, text in files.items():
        out = root / path
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(text)
    src = root / EXAMPLE / "src" / "pagoda_sdpa_attention" / "backend.py"
    spec = importlib.util.spec_from_file_location("guide_sdpa_backend", src)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses resolve their module by name
    spec.loader.exec_module(module)
    return module.PagedSdpaBackend


def test_the_guide_shows_every_file_of_the_example() -> None:
    shown = set(_guide_files())
    on_disk = {
        str(p.relative_to(ROOT))
        for p in (ROOT / EXAMPLE).rglob("*")
        if p.is_file() and p.suffix in (".py", ".toml") and "egg-info" not in str(p)
        and p.name != "__init__.py"
    }
    assert on_disk <= shown, f"the guide does not show {sorted(on_disk - shown)}"


# The guide's backend computes plain causal attention: the kit's feature cases are not for it.
@pytest.mark.parametrize("case", attention_cases(features=False), ids=lambda c: c.name)
def test_backend_built_from_the_guide_passes_the_conformance_kit(guide_backend, case) -> None:
    check_attention_backend(guide_backend, case, "cpu", torch.float32)


def test_backend_built_from_the_guide_is_registered_under_its_own_name(guide_backend) -> None:
    plugin = _guide_files()[EXAMPLE + "src/pagoda_sdpa_attention/plugin.py"]
    assert f'register("{guide_backend.name}", "pagoda_sdpa_attention.backend:' in plugin
    assert guide_backend.priority < 0  # never picked by `auto` over the reference backend


def _contracts() -> dict[str, type]:
    from pagoda.executor.base import Executor
    from pagoda.spec_decode.proposer import SpeculativeProposer
    from pagoda.structured_output import backend as grammar

    return {
        "AttentionBackend": contract.AttentionBackend,
        "AttentionImpl": contract.AttentionImpl,
        "Executor": Executor,
        "SpeculativeProposer": SpeculativeProposer,
        "GrammarBackend": grammar.GrammarBackend,
        "CompiledGrammar": grammar.CompiledGrammar,
        "GrammarMatcher": grammar.GrammarMatcher,
    }


def _public_methods() -> list[tuple[str, str, object]]:
    out = [("write_kv_cache", "write_kv_cache", contract.write_kv_cache)]
    for cls_name, cls in _contracts().items():
        for name, member in vars(cls).items():
            if name.startswith("_") and name != "__init__":
                continue
            fn = getattr(member, "__func__", member)
            if inspect.isfunction(fn):
                out.append((f"{cls_name}.{name}", name, fn))
    return out


@pytest.mark.parametrize(
    "qualname,name,fn", _public_methods(), ids=[m[0] for m in _public_methods()]
)
def test_contract_method_documents_inputs_and_outputs_and_is_in_the_guide(
    qualname: str, name: str, fn: object
) -> None:
    doc = inspect.getdoc(fn) or ""
    params = [p for p in inspect.signature(fn).parameters if p not in ("self", "cls")]
    for p in params:
        assert re.search(rf"``{p}\b", doc), f"{qualname}: the docstring does not name input {p!r}"
    assert re.search(r"\breturns?\b", doc, re.I) or name == "__init__", (
        f"{qualname}: the docstring does not say what it returns"
    )
    guide = GUIDE.read_text()
    cls_name = qualname.split(".")[0]
    shown = rf"`({cls_name}|__init__)\(" if name == "__init__" else rf"[`.]{name}\("
    assert re.search(shown, guide), f"docs/plugins.md does not name {qualname}"


def test_common_attention_metadata_fields_are_each_in_the_guide() -> None:
    guide = GUIDE.read_text()
    for field in contract.CommonAttentionMetadata.__dataclass_fields__:
        assert f"`{field}`" in guide, f"docs/plugins.md does not describe {field}"


def test_pydoc_of_pagoda_testing_lists_the_lazily_imported_kits() -> None:
    import pydoc

    import pagoda.testing

    text = pydoc.render_doc(pagoda.testing, renderer=pydoc.plaintext)
    assert "class AttentionBackendConformance" in text
    assert "tolerances" in text  # the class's own documentation, not just its name
