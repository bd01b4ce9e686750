"""coplan: joint planning of fusion, rematerialization, parallelism and precision for ML training."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from coplan.apply.backend import Backend
    from coplan.models.spec import ModelSpec
    from coplan.plan.types import Plan


def backend(plan: Plan, spec: ModelSpec | None = None) -> Backend:
    """``torch.compile(model, backend=coplan.backend(plan))``: apply ``plan`` (imports torch lazily)."""
    from coplan.apply.backend import backend as make

    return make(plan, spec)


# the compiler-visibility package, callable as ``coplan.inspect(module, example_inputs, ...)``
from coplan import inspect  # noqa: E402 - after backend(): the package imports no torch until called

__all__ = ["backend", "inspect"]
del Any
