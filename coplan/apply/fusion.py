"""Compiling the partitioned graphs: eager kernels, or Inductor constrained to the plan's groups.

A plan without fusion groups is eager execution (one kernel per op, what ``fusion="none"`` prices):
the FX graph runs op by op. A plan with groups is compiled by Inductor, whose scheduler is asked,
for every pair of nodes it considers fusing, whether the plan allows it
(``torch._inductor.choices.InductorChoices.can_fuse``): two nodes may fuse only when every plan op
they implement lies in one plan group. Afterwards the kernels Inductor emitted are read back
(which plan ops ended in which kernel) and each planned group is *honoured* when its ops that
survive lowering share one kernel with nothing from outside the group. Ops a plan fuses but
Inductor keeps apart (GEMMs are library calls on CPU, views vanish) are reported as not honoured.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

from torch import fx

from coplan.ir.types import Graph
from coplan.plan.types import Plan


def compile_graph(
    gm: fx.GraphModule, inputs: Sequence[Any], plan: Plan, ir: Graph, phase: str
) -> tuple[Callable[..., Any], dict[str, Any] | None]:
    """(boxed callable, fusion record or None) for one half of a partitioned region."""
    from functorch.compile import make_boxed_func

    if not plan.fusion.groups:
        return make_boxed_func(gm), None
    # Inductor-constrained compilation is not wired yet: run the graph eagerly and say so
    info = {
        "phase": phase,
        "groups_planned": len(plan.fusion.groups),
        "groups_honoured": 0,
        "not_honoured": [list(g) for g in plan.fusion.groups],
        "reason": "compiled without Inductor: every op runs as its own kernel",
    }
    return make_boxed_func(gm), info
