"""The attention conformance kit as a pytest test class: subclass it in a test module.

.. code-block:: python

    from pagoda.testing import AttentionBackendConformance

    class TestMyBackend(AttentionBackendConformance):
        backend = "my_backend"  # a registered name, or the class itself
        device = "cuda"
        dtypes = (torch.float16, torch.bfloat16)
"""

from __future__ import annotations

from typing import ClassVar

import pytest
import torch

from pagoda.attention.backend import AttentionBackend
from pagoda.ops.fp8 import FP8_DTYPE
from pagoda.plugins import get_registry
from pagoda.testing.attention import (
    AttentionCase,
    attention_cases,
    check_attention_backend,
    fp8_kv_cases,
    fresh_prompt_cases,
)


class AttentionBackendConformance:
    """Every case of :func:`attention_cases` against the float64 reference, for each dtype.

    A case whose device, dtype or head size the backend does not support (``supports``), or
    whose spec it rejects (``unsupported``: a feature case), is skipped, the reason naming the
    feature; a backend must support at least one case on ``device``.
    """

    #: The backend under test: its class, or its registered name (selected through the plugins).
    backend: ClassVar[type[AttentionBackend] | str]
    device: ClassVar[str] = "cpu"
    dtypes: ClassVar[tuple[torch.dtype, ...]] = (torch.float32,)
    #: dtype -> (atol, rtol), overriding ``pagoda.testing.attention.DEFAULT_TOLERANCES``.
    tolerances: ClassVar[dict[torch.dtype, tuple[float, float]]] = {}
    #: KV cache dtypes besides the model's to run :func:`fp8_kv_cases` with (None: each one
    #: the backend's ``supports_kv_cache_dtype`` accepts, of ``float8_e4m3fn``).
    kv_cache_dtypes: ClassVar[tuple[torch.dtype, ...] | None] = None
    #: dtype -> (atol, rtol) with such a cache, overriding ``FP8_KV_TOLERANCES``.
    kv_cache_tolerances: ClassVar[dict[torch.dtype, tuple[float, float]]] = {}

    def backend_class(self) -> type[AttentionBackend]:
        if isinstance(self.backend, str):
            return get_registry("attention_backends").get(self.backend)
        return self.backend

    def test_is_an_attention_backend(self) -> None:
        cls = self.backend_class()
        assert isinstance(cls, type) and issubclass(cls, AttentionBackend), cls

    def test_supports_some_case_on_the_device(self) -> None:
        cls = self.backend_class()
        device = torch.device(self.device)
        assert any(
            cls.supports(device, dt, c.head_size) for dt in self.dtypes for c in attention_cases()
        ), f"{cls.__name__} supports no dtype of {self.dtypes} and head size on {device}"

    @pytest.mark.parametrize("case", attention_cases(), ids=lambda c: c.name)
    def test_matches_float64_reference(self, case: AttentionCase) -> None:
        cls = self.backend_class()
        missing = cls.unsupported(case.spec)
        if missing is not None:
            pytest.skip(f"{cls.__name__} does not support {missing}")
        device = torch.device(self.device)
        ran = 0
        for dtype in self.dtypes:
            if cls.supports(device, dtype, case.head_size):
                check_attention_backend(cls, case, device, dtype, self.tolerances)
                ran += 1
        if not ran:
            pytest.skip(f"{cls.__name__} does not support head size {case.head_size} here")

    @pytest.mark.parametrize("case", attention_cases()[:3], ids=lambda c: c.name)
    def test_leaves_the_keys_and_values_the_model_stored(self, case: AttentionCase) -> None:
        """A backend that says ``accepts_model_stored_kv``: with each step's keys and values
        already in the cache in the default layout (the model's kernel stored them), its forward
        under ``kv_stored_by_model`` leaves the cache as the model stored it and matches the
        reference (a backend with a layout of its own reads other bytes and fails)."""
        cls, device, dtypes = self._takes_stored_kv(case)
        for dtype in dtypes:
            check_attention_backend(cls, case, device, dtype, self.tolerances, model_stores=True)

    @pytest.mark.parametrize(
        "case",
        [*attention_cases()[:3], *(c for c in attention_cases() if not c.spec.causal)],
        ids=lambda c: c.name,
    )
    def test_attends_one_row_a_request_alone(self, case: AttentionCase) -> None:
        """A backend that says ``accepts_model_stored_kv``: with a step's keys and values
        stored first, one row of each request attends alone through the metadata of
        ``CommonAttentionMetadata.kept_rows`` (one query a request over the same contexts, as a
        pooling model's last layer runs): its last row of the step, or in a bidirectional case
        its first (whose keys are all in the cache, not only up to it); each matches the
        reference's row."""
        cls, device, dtypes = self._takes_stored_kv(case)
        missing = cls.unsupported(case.spec)
        if missing is not None:
            pytest.skip(f"{cls.__name__} does not support {missing}")
        for dtype in dtypes:
            check_attention_backend(
                cls, case, device, dtype, self.tolerances, model_stores=True, kept_rows=True
            )

    @pytest.mark.parametrize("case", fresh_prompt_cases(), ids=lambda c: c.name)
    def test_attends_a_step_of_new_prompts_without_its_keys_stored(
        self, case: AttentionCase
    ) -> None:
        """A backend that says ``accepts_model_stored_kv``: for a step of new prompts whose keys
        and values no later step reads, where its impl says ``attends_from_inputs``, its
        forward with nothing stored (the step's slots holding other values) matches the
        reference and writes nothing; elsewhere the step runs as any other."""
        cls, device, dtypes = self._takes_stored_kv(case)
        missing = cls.unsupported(case.spec)
        if missing is not None:
            pytest.skip(f"{cls.__name__} does not support {missing}")
        for dtype in dtypes:
            check_attention_backend(cls, case, device, dtype, self.tolerances, unread=True)

    def _takes_stored_kv(
        self, case: AttentionCase
    ) -> tuple[type[AttentionBackend], torch.device, list[torch.dtype]]:
        """The backend, the device and the dtypes to run ``case`` in over keys and values the
        model stored; the test is skipped where the backend takes none or none of the dtypes."""
        cls = self.backend_class()
        if not cls.accepts_model_stored_kv:
            pytest.skip(f"{cls.__name__} does not take keys and values the model stored")
        device = torch.device(self.device)
        dtypes = [dt for dt in self.dtypes if cls.supports(device, dt, case.head_size)]
        if not dtypes:
            pytest.skip(f"{cls.__name__} does not support head size {case.head_size} here")
        return cls, device, dtypes

    @pytest.mark.parametrize("case", fp8_kv_cases(), ids=lambda c: c.name)
    def test_fp8_kv_cache_matches_float64_reference(self, case: AttentionCase) -> None:
        cls = self.backend_class()
        cache_dtypes = self.kv_cache_dtypes
        if cache_dtypes is None:
            cache_dtypes = tuple(d for d in (FP8_DTYPE,) if cls.supports_kv_cache_dtype(d))
        if not cache_dtypes:
            pytest.skip(f"no KV cache dtype besides the model's to check {cls.__name__} with here")
        missing = cls.unsupported(case.spec)
        if missing is not None:
            pytest.skip(f"{cls.__name__} does not support {missing}")
        device = torch.device(self.device)
        ran = 0
        for cache_dtype in cache_dtypes:
            for dtype in self.dtypes:
                if cls.supports(device, dtype, case.head_size):
                    check_attention_backend(
                        cls, case, device, dtype, self.kv_cache_tolerances, None, cache_dtype
                    )
                    ran += 1
        if not ran:
            pytest.skip(f"{cls.__name__} does not support head size {case.head_size} here")
