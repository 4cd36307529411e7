"""The quantization method kit as a pytest test class: subclass it in a test module.

.. code-block:: python

    from pagoda.testing import QuantizationMethodConformance

    class TestMyMethod(QuantizationMethodConformance):
        method = "my_method"  # registered with register_quantization_methods
        checkpoint_configs = {"online": {}}  # quantization_config -> what it loads
        tolerance = 0.02

Each checkpoint config is checked on every dtype with :func:`check_linear_method`: a merged
column-parallel linear and a row-parallel one against float64.
"""

from __future__ import annotations

from typing import Any, ClassVar

import pytest
import torch

from pagoda.quantization import LinearMethod, QuantizationMethod, method_class
from pagoda.testing.quantization import FP8_TOLERANCE, check_linear_method


class QuantizationMethodConformance:
    """Registration, the class's answers, and each linear against float64 per dtype."""

    #: The method under test: its class, or its registered name.
    method: ClassVar[type[QuantizationMethod] | str]
    device: ClassVar[str] = "cpu"
    dtypes: ClassVar[tuple[torch.dtype, ...]] = (torch.float32, torch.bfloat16)
    #: Name -> a checkpoint's ``quantization_config`` the method reads (``{}``: a full-precision
    #: checkpoint it quantizes as it loads).
    checkpoint_configs: ClassVar[dict[str, dict[str, Any]]] = {"online": {}}
    #: ``||y - ref|| / ||ref||`` allowed against the float64 product.
    tolerance: ClassVar[float] = FP8_TOLERANCE

    def method_class(self) -> type[QuantizationMethod]:
        if isinstance(self.method, str):
            return method_class(self.method)
        return self.method

    def pytest_generate_tests(self, metafunc: pytest.Metafunc) -> None:
        if "checkpoint" in metafunc.fixturenames:
            metafunc.parametrize("checkpoint", sorted(self.checkpoint_configs))
        if "dtype" in metafunc.fixturenames:
            metafunc.parametrize("dtype", self.dtypes, ids=lambda d: str(d).removeprefix("torch."))

    def test_is_a_quantization_method(self) -> None:
        cls = self.method_class()
        assert isinstance(cls, type) and issubclass(cls, QuantizationMethod), cls
        assert isinstance(cls.name, str) and cls.name, f"{cls.__name__} has no name"

    def test_unsupported_answers_none_or_one_line(self, checkpoint: str) -> None:
        cls = self.method_class()
        why = cls.unsupported(self.checkpoint_configs[checkpoint], torch.device(self.device),
                              self.dtypes[0])  # fmt: skip
        assert why is None or (isinstance(why, str) and "\n" not in why), why

    def test_linear_method_of_a_decoder_layer(self, checkpoint: str) -> None:
        method = self.method_class()(self.checkpoint_configs[checkpoint])
        lm = method.linear_method(["model.layers.0.mlp.gate_proj", "model.layers.0.mlp.up_proj"])
        assert isinstance(lm, LinearMethod), lm

    def test_linears_match_float64(self, checkpoint: str, dtype: torch.dtype) -> None:
        cls = self.method_class()
        config = self.checkpoint_configs[checkpoint]
        why = cls.unsupported(config, torch.device(self.device), dtype)
        if why is not None:
            pytest.skip(why)
        check_linear_method(cls, config, self.device, dtype, self.tolerance)
