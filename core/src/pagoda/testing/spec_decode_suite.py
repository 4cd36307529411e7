"""The speculative proposer conformance kit as a pytest test class: subclass it in a test module.

.. code-block:: python

    from pagoda.config import SpeculativeConfig
    from pagoda.testing import SpeculativeProposerConformance

    class TestMyProposer(SpeculativeProposerConformance):
        proposer = "my_method"  # a registered name, or the class itself
        config = SpeculativeConfig(method="my_method", num_speculative_tokens=4)
"""

from __future__ import annotations

from collections.abc import Callable
from typing import ClassVar

import pytest

from pagoda.config import SpeculativeConfig
from pagoda.plugins import get_registry
from pagoda.spec_decode import ProposerContext, SpeculativeProposer, TargetModel
from pagoda.testing.spec_decode import (
    ProposerCase,
    check_drafts_ahead,
    check_proposer_case,
    check_proposes_on_host,
    check_settle,
    proposer_cases,
)


class SpeculativeProposerConformance:
    """Every case of :func:`proposer_cases` through :func:`check_proposer_case`."""

    #: The proposer under test: its class, or its registered method name.
    proposer: ClassVar[type[SpeculativeProposer] | str]
    config: ClassVar[SpeculativeConfig]
    device: ClassVar[str] = "cpu"
    #: Whether some case must yield at least one draft (false for a proposer that may abstain).
    proposes_something: ClassVar[bool] = True
    #: For a proposer with a draft model: ``target(ctx)`` builds the ``TargetModel`` that
    #: ``bind_target`` receives (see :func:`check_proposer_case`); None: not called.
    target: ClassVar[Callable[[ProposerContext], TargetModel] | None] = None

    def proposer_class(self) -> type[SpeculativeProposer]:
        if isinstance(self.proposer, str):
            return get_registry("spec_proposers").get(self.proposer)
        return self.proposer

    def _target(self) -> Callable[[ProposerContext], TargetModel] | None:
        # NOTE: read from the class, so a plain function is not bound as a method.
        return getattr(type(self), "target", None)

    def test_is_a_speculative_proposer(self) -> None:
        cls = self.proposer_class()
        assert isinstance(cls, type) and issubclass(cls, SpeculativeProposer), cls

    @pytest.mark.parametrize("case", proposer_cases(), ids=lambda c: c.name)
    def test_drafts_follow_the_contract(self, case: ProposerCase) -> None:
        check_proposer_case(self.proposer_class(), self.config, case, self.device, self._target())

    def test_proposes_for_a_repeating_history(self) -> None:
        if not self.proposes_something:
            pytest.skip("this proposer may abstain")
        case = proposer_cases()[0]
        cls = self.proposer_class()
        drafts = check_proposer_case(cls, self.config, case, self.device, self._target())
        assert (drafts.token_ids[:, :1] >= 0).any(), "no draft for a history that repeats"

    def test_settle_changes_no_draft(self) -> None:
        cls = self.proposer_class()
        if cls.settle is SpeculativeProposer.settle:
            pytest.skip("this proposer defers nothing (settle not overridden)")
        check_settle(cls, self.config, self.device, self._target())

    def test_drafts_promised_ahead_are_the_drafts_proposed(self) -> None:
        cls = self.proposer_class()
        if cls.drafts_ahead is SpeculativeProposer.drafts_ahead:
            pytest.skip("this proposer promises no drafts ahead (drafts_ahead not overridden)")
        n = check_drafts_ahead(cls, self.config, self.device, self._target())
        if n is None:
            pytest.skip("this proposer does not draft behind a verification in these settings")
        assert n > 0, "drafts_ahead promised nothing for fresh requests whose drafts verified"

    def test_a_proposer_on_the_host_returns_token_ids_only(self) -> None:
        cls = self.proposer_class()
        if not getattr(cls, "proposes_on_host", False):
            pytest.skip("this proposer does not say it proposes on the host alone")
        check_proposes_on_host(cls, self.config, self.device, self._target())
