"""Discovery in fresh processes: every process finds the same plugins, discovery imports no kernel
library, and it imports little beyond what an engine has imported already."""

from __future__ import annotations

import json
import multiprocessing

from pagoda.plugins import get_registry, plugin_registered, reload_plugins

GOOD = """
@hookimpl
def register_attention_backends(register):
    register("good_attn", "pagoda.attention.torch_native:TorchNativeBackend")
"""


def _attention_backends_in_this_process() -> list[str]:
    return get_registry("attention_backends").names()


def test_a_spawned_worker_process_discovers_the_same_plugins(fake_site) -> None:
    fake_site.add("pagoda-good", "good_plugin", GOOD)
    (fake_site.root / "local_plugin.py").write_text(
        "from pagoda import hookimpl\nPAGODA_PLUGIN_API = 1\n"
        "@hookimpl\ndef register_attention_backends(register):\n"
        "    register('local_attn', 'pagoda.attention.torch_native:TorchNativeBackend')\n"
    )
    fake_site.modules.append("local_plugin")
    reload_plugins()
    import local_plugin

    # A plugin registered in this process only reaches workers started afterwards through
    # PAGODA_PLUGIN_MODULES, which register_plugin sets for a module.
    with plugin_registered(local_plugin):
        here = _attention_backends_in_this_process()
        ctx = multiprocessing.get_context("spawn")
        with ctx.Pool(1) as pool:
            there = pool.apply(_attention_backends_in_this_process)
    assert {"good_attn", "local_attn", "torch_native"} <= set(here)
    assert there == here


def test_discovery_imports_no_torch_and_no_kernel_library(fake_site) -> None:
    fake_site.add("pagoda-good", "good_plugin", GOOD)
    proc = fake_site.run(
        """
        import json, sys
        from pagoda.plugins import get_registry, plugin_records
        names = get_registry("attention_backends").names()
        heavy = sorted(m for m in ("torch", "triton", "flashinfer", "xgrammar") if m in sys.modules)
        print(json.dumps({"names": names, "heavy": heavy,
                          "loaded": [r.name for r in plugin_records() if r.status == "loaded"]}))
        """
    )
    assert proc.returncode == 0, proc.stderr
    got = json.loads(proc.stdout)
    assert got["heavy"] == []
    assert "good_attn" in got["names"] and "good_plugin" in got["loaded"]
    # The example plugin is installed in the project's environment: it loaded, lazily, too.
    assert "counting" in got["loaded"]


MEASURE = """
import json, sys, time
import torch  # an engine imports it (and logging, importlib.metadata) before building anything
before = set(sys.modules)
t0 = time.perf_counter()
from pagoda.plugins import load_plugins
load_plugins()
t1 = time.perf_counter()
new = sorted(set(sys.modules) - before)
print(json.dumps({"ms": (t1 - t0) * 1e3, "plugins": len(load_plugins().records), "modules": new}))
"""

# Modules that discovering and loading every installed plugin imports after torch: pluggy and
# pagoda's own plugin machinery and the plugins' registration modules, 58 when this was written
# (15 plugins). A plugin whose registration pulls in its whole package, or a library, shows here.
MAX_DISCOVERY_MODULES = 120
HEAVY = ("transformers", "triton", "flashinfer", "xgrammar", "ray", "numpy", "safetensors")


def test_discovering_plugins_imports_little_beyond_what_an_engine_has(fake_site) -> None:
    """Measured in a fresh process, after the import an engine does anyway (torch): discovering
    and loading every installed plugin (the core's, the example, the repository's Triton and
    FlashInfer plugins, a fake one) imports the plugin machinery and each plugin's registration
    module, and no library. (Its time, about 100 ms on a 2-core CI machine and more under load,
    is printed, not asserted: timings are the benchmarks' to measure.)"""
    fake_site.add("pagoda-good", "good_plugin", GOOD)
    proc = fake_site.run(MEASURE)
    assert proc.returncode == 0, proc.stderr
    got = json.loads(proc.stdout)
    print(f"plugin discovery: {got['ms']:.1f} ms, {len(got['modules'])} modules")
    assert got["plugins"] >= 3
    heavy = [m for m in got["modules"] if m.split(".")[0] in HEAVY]
    assert heavy == [], f"discovery imported {heavy[:10]}"
    assert len(got["modules"]) < MAX_DISCOVERY_MODULES, got["modules"]
