"""The model impl conformance kit as a pytest test class: subclass it in a test module.

.. code-block:: python

    from pagoda.testing import ModelImplSuite

    class TestMyImpl(ModelImplSuite):
        impl_name = "my_impl"  # registered with register_model_impls
        configs = {"tiny": {"architectures": ["MyForCausalLM"], "vocab_size": 128, ...}}

Each config (a tiny config.json as a dict) is built once per class with random weights and run
through :mod:`pagoda.testing.model_impl`'s checks; ``reference(name)`` may return a
:class:`~pagoda.testing.model_impl.ModelReference` to compare with.
"""

from __future__ import annotations

from typing import Any, ClassVar

import pytest
from torch import nn

from pagoda.models.impl import KIND, ModelImpl, named_architecture
from pagoda.models.shape import ModelShape
from pagoda.plugins import get_registry
from pagoda.testing.model_impl import (
    SELF_TOLERANCE,
    ModelReference,
    build_impl_model,
    check_attention_specs,
    check_chunked_matches_one_step,
    check_packed_matches_alone,
    check_reference,
    check_unfit_tensor_parallel,
    impl_class,
)

UNKNOWN = {"architectures": ["NoSuchModelForCausalLM"], "model_type": "no_such_model"}


class ModelImplSuite:
    """Registration and refusals, then per config: ``supports`` accepts it, the built layers
    carry the declared specs, chunked and packed steps give one step's logits, the reference's
    logits (when given), and the refusal of an unfit tensor-parallel size."""

    #: The impl under test, by the name it is registered under.
    impl_name: ClassVar[str]
    #: Name -> config.json (a dict) of a tiny model the impl serves.
    configs: ClassVar[dict[str, dict[str, Any]]]
    #: Logits of the same tokens however the steps cut them (float32).
    tolerance: ClassVar[float] = SELF_TOLERANCE
    #: A tensor-parallel size that does not split the configs' models; None when the impl does
    #: not split models (the check is skipped).
    unfit_tensor_parallel_size: ClassVar[int | None] = 3

    def reference(self, name: str) -> ModelReference | None:
        """The outside model for config ``name``, or None (default: none)."""
        return None

    def pytest_generate_tests(self, metafunc: pytest.Metafunc) -> None:
        if "config_name" in metafunc.fixturenames:
            metafunc.parametrize("config_name", list(self.configs))

    def impl(self) -> type[ModelImpl]:
        return impl_class(self.impl_name)

    @pytest.fixture(scope="class")
    @classmethod
    def built(cls) -> dict[str, tuple[ModelShape, nn.Module]]:
        """Each config's (shape, model) with random weights, built on first use."""
        return {}

    def _build(
        self, built: dict[str, tuple[ModelShape, nn.Module]], name: str
    ) -> tuple[ModelShape, nn.Module]:
        if name not in built:
            built[name] = build_impl_model(self.impl(), self.configs[name])
        return built[name]

    def test_is_registered_under_its_name(self) -> None:
        assert self.impl_name in get_registry(KIND).names()
        cls = self.impl()
        assert isinstance(cls, type) and issubclass(cls, ModelImpl), cls

    def test_refuses_an_unknown_architecture_with_a_one_line_reason(self) -> None:
        config = {**next(iter(self.configs.values())), **UNKNOWN}
        reason = self.impl().supports(config, named_architecture(config))
        assert isinstance(reason, str) and reason.strip(), f"accepted {UNKNOWN}: {reason!r}"
        assert "\n" not in reason.strip(), f"a reason of several lines: {reason!r}"

    def test_supports_the_config(self, config_name: str) -> None:
        config = self.configs[config_name]
        assert self.impl().supports(config, named_architecture(config)) is None

    def test_attention_layers_carry_the_declared_specs(
        self, built: dict[str, tuple[ModelShape, nn.Module]], config_name: str
    ) -> None:
        check_attention_specs(*self._build(built, config_name))

    def test_chunks_and_decodes_give_the_logits_of_one_step(
        self, built: dict[str, tuple[ModelShape, nn.Module]], config_name: str
    ) -> None:
        shape, model = self._build(built, config_name)
        check_chunked_matches_one_step(shape, model, tolerance=self.tolerance)

    def test_requests_packed_in_one_batch_give_their_logits_alone(
        self, built: dict[str, tuple[ModelShape, nn.Module]], config_name: str
    ) -> None:
        shape, model = self._build(built, config_name)
        check_packed_matches_alone(shape, model, tolerance=self.tolerance)

    def test_matches_the_reference(self, config_name: str) -> None:
        reference = self.reference(config_name)
        if reference is None:
            pytest.skip(f"no reference for {config_name}")
        shape, model = build_impl_model(
            self.impl(), self.configs[config_name], weights=reference.weights
        )
        check_reference(shape, model, reference)

    def test_an_unfit_tensor_parallel_size_is_refused_naming_the_sizes_that_fit(
        self, config_name: str
    ) -> None:
        if self.unfit_tensor_parallel_size is None:
            pytest.skip("the impl does not split models (unfit_tensor_parallel_size is None)")
        check_unfit_tensor_parallel(
            self.impl(), self.configs[config_name], self.unfit_tensor_parallel_size
        )
