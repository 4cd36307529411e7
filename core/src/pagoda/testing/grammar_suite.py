"""The grammar-backend conformance kit as a pytest test class: subclass it in a test module.

.. code-block:: python

    from pagoda.testing import GrammarBackendConformance

    class TestMyBackend(GrammarBackendConformance):
        backend = "my_backend"  # a registered name, or the class itself

The backend is built on the default model's tokenizer (override ``make_tokenizer``) with a
logits width a little larger than the vocabulary, as models pad it. A kind of constraint the
backend refuses through ``validate`` (``ValueError``) is skipped in every case, with its reason;
the backend must accept at least one kind.
"""

from __future__ import annotations

from typing import Any, ClassVar

import pytest
import torch

from pagoda.config import StructuredOutputConfig
from pagoda.loader import convert_gguf, default_model_path, load_tokenizer
from pagoda.plugins import get_registry
from pagoda.structured_output.backend import GrammarBackend
from pagoda.testing.grammar import (
    BAD_CONSTRAINTS,
    GrammarCase,
    check_apply,
    check_batch,
    check_concurrent_compiles,
    check_validate_and_rollback,
    check_walk,
    grammar_cases,
    refusal,
)

_CASES = grammar_cases()


class GrammarBackendConformance:
    #: The backend under test: its class, or its registered name.
    backend: ClassVar[type[GrammarBackend] | str]
    #: Devices ``apply_bitmask`` is checked on (those without a GPU here are skipped).
    devices: ClassVar[tuple[str, ...]] = ("cpu", "cuda")
    #: Logits columns beyond the tokenizer's vocabulary (padding the grammar must never allow).
    vocab_padding: ClassVar[int] = 13

    def backend_class(self) -> type[GrammarBackend]:
        if isinstance(self.backend, str):
            return get_registry("grammar_backends").get(self.backend)
        return self.backend

    def make_tokenizer(self) -> Any:
        return load_tokenizer(convert_gguf(default_model_path()))

    @pytest.fixture(scope="class")
    @classmethod
    def built(cls) -> GrammarBackend:
        self = cls()
        tok = self.make_tokenizer()
        return self.backend_class()(
            tok, len(tok) + self.vocab_padding, [tok.eos_token_id], StructuredOutputConfig()
        )

    def test_is_a_grammar_backend(self) -> None:
        cls = self.backend_class()
        assert isinstance(cls, type) and issubclass(cls, GrammarBackend), cls

    def test_init_called_the_base_initialiser(self, built: GrammarBackend) -> None:
        kept = ("tokenizer", "vocab_size", "stop_token_ids", "config")
        missing = [a for a in kept if a not in vars(built)]
        assert not missing, (
            f"{type(built).__name__}.__init__ must call super().__init__(tokenizer, vocab_size, "
            f"stop_token_ids, config); missing: {', '.join(missing)}"
        )

    def supported(self, case: GrammarCase) -> GrammarCase:
        """``case``, or a skip if the backend refuses its kind through ``validate``."""
        why = refusal(self.backend_class(), case)
        if why is not None:
            pytest.skip(why)
        return case

    def supported_cases(self) -> list[GrammarCase]:
        return [c for c in _CASES if refusal(self.backend_class(), c) is None]

    def test_accepts_at_least_one_kind_of_constraint(self) -> None:
        refused = [refusal(self.backend_class(), c) for c in _CASES]
        assert self.supported_cases(), "validate refuses every kind: " + "; ".join(refused)

    @pytest.mark.parametrize("case", _CASES, ids=[c.name for c in _CASES])
    def test_validate_accepts_a_good_constraint(self, case: GrammarCase) -> None:
        self.backend_class().validate(self.supported(case).params)

    @pytest.mark.parametrize(
        ("kind", "params"), BAD_CONSTRAINTS, ids=[k for k, _ in BAD_CONSTRAINTS]
    )
    def test_validate_refuses_a_bad_constraint_with_value_error(
        self, kind: str, params: Any
    ) -> None:
        with pytest.raises(ValueError):
            self.backend_class().validate(params)

    @pytest.mark.parametrize("case", _CASES, ids=[c.name for c in _CASES])
    def test_matcher_allows_each_token_of_a_valid_output_then_only_its_end(
        self, built: GrammarBackend, case: GrammarCase
    ) -> None:
        check_walk(built, self.supported(case), built.stop_token_ids[0])

    @pytest.mark.parametrize("case", _CASES, ids=[c.name for c in _CASES])
    def test_validate_tokens_keeps_state_and_rollback_restores_it(
        self, built: GrammarBackend, case: GrammarCase
    ) -> None:
        check_validate_and_rollback(built, self.supported(case))

    def test_batched_fill_and_accept_equal_one_by_one(self, built: GrammarBackend) -> None:
        check_batch(built, self.supported_cases())

    def test_compiles_run_concurrently(self, built: GrammarBackend) -> None:
        check_concurrent_compiles(built, self.supported_cases())

    @pytest.mark.parametrize("device", ["cpu", "cuda"])
    def test_apply_bitmask_matches_the_reference(self, device: str) -> None:
        if device not in self.devices or (device == "cuda" and not torch.cuda.is_available()):
            pytest.skip(f"no {device} here")
        check_apply(self.backend_class(), device, 1000)
