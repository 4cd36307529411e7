"""Meta-tests: every hook spec is documented in the plugin author's guide, says what it needs to,
and is exercised by a test; the guide's files are the example's files; the configuration
reference lists every key."""

from __future__ import annotations

import ast
import inspect
import re
from pathlib import Path

import pytest

from pagoda.plugins import hookspecs

ROOT = Path(__file__).resolve().parents[2]
GUIDE = ROOT / "docs" / "plugins.md"
SPECS = {
    name: fn
    for name, fn in vars(hookspecs).items()
    if callable(fn) and hasattr(fn, f"{hookspecs.PROJECT}_spec")
}


def test_the_hook_lists_name_every_spec_once() -> None:
    listed = [*hookspecs.REGISTRY_HOOKS.values(), *hookspecs.SEAM_HOOKS]
    assert sorted(listed) == sorted(SPECS) and len(set(listed)) == len(listed)


@pytest.mark.parametrize("name", sorted(SPECS))
def test_hook_spec_is_documented_in_the_guide(name: str) -> None:
    params = ", ".join(inspect.signature(SPECS[name]).parameters)
    assert f"### `{name}({params})`" in GUIDE.read_text(), f"docs/plugins.md lacks {name}"


@pytest.mark.parametrize("name", sorted(SPECS))
def test_hook_spec_docstring_says_parameters_timing_and_how_results_combine(name: str) -> None:
    fn = SPECS[name]
    doc = inspect.getdoc(fn) or ""
    for param in inspect.signature(fn).parameters:
        assert f":param {param}:" in doc, f"{name}: parameter {param} undocumented"
    assert "Called " in doc, f"{name}: the docstring does not say when it is called"
    if getattr(fn, f"{hookspecs.PROJECT}_spec").get("firstresult"):
        assert "The first non-None" in doc
    else:
        assert "Every implementation is called" in doc


def _test_names(path: Path) -> set[str]:
    tree = ast.parse(path.read_text())
    return {n.name for n in ast.walk(tree) if isinstance(n, ast.FunctionDef)}


@pytest.mark.parametrize("name", sorted(SPECS))
def test_hook_spec_is_exercised_by_a_test(name: str) -> None:
    tests = _test_names(Path(__file__).with_name("test_plugin_hooks.py"))
    assert any(t.startswith(f"test_hook_{name}") for t in tests), (
        f"tests/plugins/test_plugin_hooks.py has no test_hook_{name}_... test"
    )


def test_files_shown_in_the_guide_are_the_example_plugins_files() -> None:
    blocks = re.findall(r"<!-- file: (\S+) -->\n```\w*\n(.*?)```", GUIDE.read_text(), re.S)
    assert len(blocks) >= 4
    for path, text in blocks:
        assert text == (ROOT / path).read_text(), f"docs/plugins.md shows an old {path}"


def test_configuration_reference_lists_every_key_as_the_model_defines_it() -> None:
    from pagoda.config.reference import reference_table

    doc = (ROOT / "docs" / "configuration.md").read_text()
    assert reference_table() in doc, (
        "docs/configuration.md is out of date: paste `python -m pagoda.config.reference`"
    )
