"""Planning strategies over one cost model: sequential passes, iterated, hierarchical, joint,
exhaustive (see ``strategies.py`` and ``joint.py``)."""

from coplan.search import joint  # noqa: F401  (registers the joint strategy)
from coplan.search.result import Point, StrategyResult
from coplan.search.space import SearchSpace
from coplan.search.strategies import DEFAULT_STRATEGIES, STRATEGIES, Options, run_strategy

__all__ = [
    "DEFAULT_STRATEGIES",
    "STRATEGIES",
    "Options",
    "Point",
    "SearchSpace",
    "StrategyResult",
    "run_strategy",
]
