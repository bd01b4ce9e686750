"""Where a part's activations cross a parallel boundary: tensor-parallel collectives and the
activation a pipeline stage sends on."""

from __future__ import annotations

from collections.abc import Sequence

from coplan.cost.fusion import readers, source_op
from coplan.cost.parts import REPL, TP
from coplan.ir.types import Graph, Op, OpKind, Phase, TensorRole


def tp_boundaries(
    g: Graph, shard: dict[int, int], ops: Sequence[Op]
) -> tuple[tuple[float, ...], tuple[float, ...], tuple[int, ...]]:
    """Elements of the tensors crossing between replicated and sharded ops in the forward pass:
    (exits, entries, the entries' storage ids).

    An exit (a sharded op's output read by a replicated op: a reduce-scatter or all-reduce) is
    the part of the op that produced it, an entry (a replicated value read by a sharded op: an
    all-gather) the part of the op that reads it. So the vocab-parallel embedding's reduction is
    the embedding's, once per microbatch, even where the first block reads its output directly (a
    model without learned positions), and not a cost of every layer."""
    exits: dict[int, float] = {}
    entries: dict[int, float] = {}
    for op in ops:
        if op.phase is not Phase.FORWARD or op.kind is OpKind.VIEW:
            continue
        mine = shard[op.id]
        if mine == TP:
            for tid in op.outputs:
                if _read_replicated(g, shard, tid):
                    t = g.tensors[tid]
                    exits[t.storage_id] = float(t.numel)
        for tid in op.inputs:
            t = g.tensors[tid]
            src = source_op(g, tid)
            if src is None:
                if t.role is not TensorRole.ACTIVATION or mine != TP:
                    continue
                entries[t.storage_id] = float(t.numel)
                continue
            if shard[src] == REPL and mine == TP and g.ops[src].kind is not OpKind.CREATION:
                entries[t.storage_id] = float(t.numel)
    return tuple(exits.values()), tuple(entries.values()), tuple(entries)


def _read_replicated(g: Graph, shard: dict[int, int], tid: int) -> bool:
    """Whether a replicated forward op reads tensor ``tid``, directly or through views."""
    return any(g.ops[c].phase is Phase.FORWARD and shard[c] == REPL for c in readers(g, tid))


def pipeline_boundary(g: Graph, ops: Sequence[Op], ids: set[int]) -> float:
    """Elements of the activation a block hands to the next (its largest forward output read
    outside the part): what a pipeline stage sends."""
    best = 0.0
    for op in ops:
        if op.phase is not Phase.FORWARD:
            continue
        for tid in op.outputs:
            t = g.tensors[tid]
            if any(c not in ids and g.ops[c].phase is Phase.FORWARD for c in t.consumers):
                best = max(best, float(t.numel))
    return best
