"""The four production-style decision passes, one signature ``(graph, plan, ctx) -> plan``."""

from coplan.passes import fusion, parallel, precision, remat  # noqa: F401  (registers the passes)
from coplan.passes.base import DEFAULT_ORDER, PASSES, PassRecord, choose, run_passes, score

__all__ = ["DEFAULT_ORDER", "PASSES", "PassRecord", "choose", "run_passes", "score"]
