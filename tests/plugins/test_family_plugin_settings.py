"""Every plugin family reads its own validated ``plugins.<name>`` section from the object the core
hands it: a proposer from its ``ProposerContext``, a grammar backend from its
``structured_output`` section, an attention backend from the ``attention`` section its
``configure`` receives, an executor from the engine configuration."""

from __future__ import annotations

import pickle
from pathlib import Path

import pytest

from pagoda.config import ConfigError, EngineConfig
from pagoda.plugins import reload_plugins
from pagoda.spec_decode.proposer import build_proposer
from pagoda.testing.spec_decode import make_context

SUFFIX = """
import numpy as np
from pydantic import BaseModel, Field

from pagoda.spec_decode import Drafts, SpeculativeProposer


class SuffixSettings(BaseModel):
    min_match: int = Field(2, ge=1)


class SuffixProposer(SpeculativeProposer):
    def __init__(self, ctx):
        super().__init__(ctx)
        self.min_match = ctx.plugin_settings("toy_lookup").min_match

    def propose(self, batch):
        k = self.ctx.num_speculative_tokens
        last = batch.token_ids[batch.rows, batch.num_tokens - 1]
        return Drafts(np.repeat(last[:, None], k, axis=1).astype(np.int64))


@hookimpl
def register_plugin_settings(register):
    register("toy_lookup", "suffix_plugin:SuffixSettings")


@hookimpl
def register_spec_proposers(register):
    register("toy_lookup", "suffix_plugin:SuffixProposer")


from pagoda.attention.torch_native import TorchNativeBackend


class ConfiguredBackend(TorchNativeBackend):
    min_match = None

    @classmethod
    def configure(cls, config):
        cls.min_match = config.plugin_settings("toy_lookup").min_match


@hookimpl
def register_attention_backends(register):
    register("configured", "suffix_plugin:ConfiguredBackend")
"""

YAML = """\
speculative:
  method: toy_lookup
  num_speculative_tokens: 2
plugins:
  toy_lookup:
    min_match: 4
"""


@pytest.fixture
def engine_yaml(fake_site, tmp_path: Path) -> Path:
    fake_site.add("pagoda-suffix", "suffix_plugin", SUFFIX)
    reload_plugins()
    path = tmp_path / "engine.yaml"
    path.write_text(YAML)
    return path


def test_a_third_party_proposer_reads_its_setting_from_the_config_file(engine_yaml) -> None:
    config = EngineConfig.load(engine_yaml)
    proposer = build_proposer(make_context(config.speculative))
    assert proposer.min_match == 4
    # the engine process gets the configuration pickled: the settings travel with each section
    again = pickle.loads(pickle.dumps(config))
    assert build_proposer(make_context(again.speculative)).min_match == 4


def test_every_family_reads_the_same_settings_from_its_section(engine_yaml) -> None:
    config = EngineConfig.load(engine_yaml)
    for section in ("speculative", "structured_output", "attention", "parallel"):
        assert getattr(config, section).plugin_settings("toy_lookup").min_match == 4, section
    assert config.plugin_settings("toy_lookup").min_match == 4  # what an executor receives
    defaults = EngineConfig.load()
    assert defaults.structured_output.plugin_settings("toy_lookup").min_match == 2


def test_a_bad_value_for_a_proposer_setting_names_the_key_and_file(engine_yaml) -> None:
    engine_yaml.write_text(YAML.replace("min_match: 4", "min_match: 0"))
    bad = r"plugins\.toy_lookup\.min_match: .*greater than or equal"
    with pytest.raises(ConfigError, match=bad):
        EngineConfig.load(engine_yaml)


def test_an_attention_backend_reads_its_setting_in_configure_when_the_engine_starts(
    engine_yaml,
) -> None:
    import suffix_plugin

    from pagoda import LLM

    engine_yaml.write_text(
        "attention:\n  backend: configured\nplugins:\n  toy_lookup:\n    min_match: 7\n"
    )
    llm = LLM(config=str(engine_yaml), max_model_len=64, max_num_seqs=2)
    assert llm.engine.engine_core is not None
    assert suffix_plugin.ConfiguredBackend.min_match == 7
