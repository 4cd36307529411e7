"""The model's one name: ``server.served_model_name``, else the model's own name (a GGUF file's
stem); ``/v1/models`` lists it alone, and the metrics label it the same."""

from __future__ import annotations

from types import SimpleNamespace

from pagoda.config import EngineConfig
from pagoda.engine.async_llm import AsyncLLM
from pagoda.entrypoints.openai.api_server import model_names


def _engine(served: str | None, model: str, stem: str) -> SimpleNamespace:
    config = EngineConfig.load(overrides={"model": model, "served_model_name": served})
    fake = SimpleNamespace(config=config, info=SimpleNamespace(name=stem))
    fake.served_model_name = AsyncLLM.served_model_name.fget(fake)
    return fake


def test_a_gguf_file_is_served_under_its_stem_alone() -> None:
    engine = _engine(None, "/models/smollm2.Q8_0.gguf", "smollm2.Q8_0")
    assert model_names(engine) == ["smollm2.Q8_0"]  # not also /models/smollm2.Q8_0.gguf


def test_served_model_name_replaces_the_stem_in_the_api_and_the_metrics_label() -> None:
    engine = _engine("my-model", "/models/smollm2.Q8_0.gguf", "smollm2.Q8_0")
    assert model_names(engine) == ["my-model"]
    assert engine.served_model_name == "my-model"  # what AsyncLLM hands EngineMetrics
