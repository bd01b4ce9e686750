"""Planning strategies over one cost model: sequential passes, iterated, hierarchical, joint,
joint-exact, exhaustive (see ``strategies.py``, ``joint.py`` and ``exact.py``)."""

from coplan.search import exact, joint  # noqa: F401  (register the joint strategies)
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
