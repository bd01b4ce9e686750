"""Which forward values a step keeps for backward: the ones a backward op reads."""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import replace

from coplan.ir.types import Graph, Phase


def mark_saved(graph: Graph, outputs: Iterable[int]) -> Graph:
    """Flag forward values and inputs read by a backward op, and record the step's outputs."""
    bwd_reads: set[int] = set()
    for op in graph.ops:
        if op.phase is Phase.BACKWARD:
            bwd_reads.update(op.inputs)
    tensors = []
    for t in graph.tensors:
        produced_fwd = t.producer is None or graph.ops[t.producer].phase is Phase.FORWARD
        saved = t.id in bwd_reads and produced_fwd
        tensors.append(replace(t, saved_for_backward=saved) if saved != t.saved_for_backward else t)
    return replace(graph, tensors=tuple(tensors), outputs=tuple(dict.fromkeys(outputs)))
