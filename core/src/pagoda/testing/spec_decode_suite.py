"""The speculative proposer conformance kit as a pytest test class: subclass it in a test module.

.. code-block:: python

    from pagoda.config import SpeculativeConfig
    from pagoda.testing import SpeculativeProposerConformance

    class TestMyProposer(SpeculativeProposerConformance):
        proposer = "my_method"  # a registered name, or the class itself
        config = SpeculativeConfig(method="my_method", num_speculative_tokens=4)
"""

from __future__ import annotations

from typing import ClassVar

import pytest

from pagoda.config import SpeculativeConfig
from pagoda.spec_decode import SpeculativeProposer
from pagoda.testing.spec_decode import ProposerCase, check_proposer_case, proposer_cases


class SpeculativeProposerConformance:
    """Every case of :func:`proposer_cases` through :func:`check_proposer_case`."""

    #: The proposer under test: its class, or its registered method name.
    proposer: ClassVar[type[SpeculativeProposer] | str]
    config: ClassVar[SpeculativeConfig]
    device: ClassVar[str] = "cpu"
    #: Whether some case must yield at least one draft (false for a proposer that may abstain).
    proposes_something: ClassVar[bool] = True

    def proposer_class(self) -> type[SpeculativeProposer]:
        if isinstance(self.proposer, str):
            from pagoda.plugins import get_registry

            return get_registry("spec_proposers").get(self.proposer)
        return self.proposer

    def test_is_a_speculative_proposer(self) -> None:
        cls = self.proposer_class()
        assert isinstance(cls, type) and issubclass(cls, SpeculativeProposer), cls

    @pytest.mark.parametrize("case", proposer_cases(), ids=lambda c: c.name)
    def test_drafts_follow_the_contract(self, case: ProposerCase) -> None:
        check_proposer_case(self.proposer_class(), self.config, case, self.device)

    def test_proposes_for_a_repeating_history(self) -> None:
        if not self.proposes_something:
            pytest.skip("this proposer may abstain")
        case = proposer_cases()[0]
        drafts = check_proposer_case(self.proposer_class(), self.config, case, self.device)
        assert (drafts.token_ids[:, :1] >= 0).any(), "no draft for a history that repeats"
