"""Fixtures the planning tests share (``test_plan.py``, ``test_passes.py``)."""

from __future__ import annotations

import pytest
from plan_contexts import make_ctx

from coplan.plan import PlanContext


@pytest.fixture(scope="module")
def gpt() -> PlanContext:
    """gpt-tiny on two H100s with the default budget (read-only: tests that change the budget
    build their own context)."""
    return make_ctx()
