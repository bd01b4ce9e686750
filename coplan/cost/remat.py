"""Recomputation of an arbitrary set of saved tensors: which forward ops must re-run.

Dropping a saved tensor means re-running its producer in backward; the producer's inputs must then
exist, so any input that is neither kept for backward nor a parameter, buffer or batch input is
recomputed too (transitively), while inputs produced by another block (the residual stream) are
kept. This is the closure Checkmate-style solvers price; the planner's remat pass chooses the sets.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

from coplan.cost.config import ConfigError
from coplan.cost.fusion import readers
from coplan.cost.parts import ZERO, Part, Vec
from coplan.ir.types import POINTWISE_KINDS, Graph, OpKind, Phase, Tensor, TensorRole


def recompute_closure(graph: Graph, part: Part, names: frozenset[str]) -> tuple[frozenset[int], Vec]:
    """(ops to re-run, element vector no longer saved) for dropping the tensors named ``names``
    from block ``part``'s saved set. Unknown names are a ``ConfigError``."""
    by_name = {name: (tid, vec) for tid, name, vec in part.saved_items}
    unknown = sorted(n for n in names if n not in by_name)
    if unknown:
        known = ", ".join(n for _, n, _ in part.saved_items[:8])
        raise ConfigError(
            "recompute", f"{', '.join(unknown[:3])} not saved by {part.name} (saved tensors include: {known})"
        )
    ids = set(part.op_ids)
    dropped = {by_name[n][0] for n in names}
    kept = {tid for tid, _, _ in part.saved_items} - dropped
    rerun: set[int] = set()
    stack = list(dropped)
    seen: set[int] = set()
    while stack:
        tid = stack.pop()
        if tid in seen:
            continue
        seen.add(tid)
        t = graph.tensors[tid]
        if t.producer is None or t.producer not in ids:
            continue
        op = graph.ops[t.producer]
        rerun.add(op.id)
        for src in op.inputs:
            s = graph.tensors[src]
            base = graph.tensors[s.storage_id]
            if base.role is not TensorRole.ACTIVATION or base.id in kept:
                continue
            stack.append(base.id)
    vec = [0.0] * 6
    for tid in dropped:
        for i, x in enumerate(by_name[graph.tensors[tid].name][1]):
            vec[i] += x
    return frozenset(rerun), tuple(vec)  # type: ignore[return-value]


def inductor_recomputes(graph: Graph, part: Part) -> tuple[tuple[str, ...], Vec]:
    """(names, element vector) of the tensors block ``part`` saves that Inductor's min-cut
    partitioner recomputes by default (no memory budget): made by a pointwise, non-random forward
    op (``should_ban_recomputation`` bans random and compute-intensive ops), read in backward only
    by pointwise ops (else it is "materialized in backward" and banned), whose producer's
    activation inputs are kept for backward anyway, so that recomputing it removes its bytes from
    the cut and adds none (torch/_functorch/partitioners.py at v2.13.0,
    ``min_cut_rematerialization_partition``, ``should_ban_recomputation``,
    ``is_materialized_backwards``). SwiGLU's ``silu(x W1)`` is one: the product's backward reads
    it, and its producer's input, ``x W1``, is kept for the SiLU's own gradient. The recomputed
    op runs inside the backward kernel that reads its output: arithmetic only. Empty outside
    blocks."""
    if not part.blocks:
        return (), ZERO
    kept = {graph.tensors[tid].storage_id for tid, _, _ in part.saved_items}
    kept |= {t.storage_id for t in graph.tensors if t.saved_for_backward}
    names: list[str] = []
    vec = [0.0] * 6
    for tid, name, v in part.saved_items:
        t = graph.tensors[tid]
        if t.producer is None:
            continue
        op = graph.ops[t.producer]
        if op.block is None or op.kind not in POINTWISE_KINDS or "dropout" in op.target:
            continue
        bwd = [graph.ops[c] for c in readers(graph, tid) if graph.ops[c].phase is Phase.BACKWARD]
        if any(r.kind not in POINTWISE_KINDS for r in bwd):
            continue
        ins = [graph.tensors[graph.tensors[i].storage_id] for i in op.inputs]
        if all(x.role is not TensorRole.ACTIVATION or x.id in kept or x.producer is None for x in ins):
            names.append(name)
            for i, x in enumerate(v):
                vec[i] += x
    return tuple(names), tuple(vec)  # type: ignore[return-value]


def drops_output(graph: Graph, part: Part, names: frozenset[str]) -> bool:
    """Whether the set ``names`` drops a tensor that a forward op outside the block reads: the
    block's output, which is the next block's input (or the final norm's). The template applies to
    every block, so every block then loses its input, and re-running a block first needs all the
    blocks before it in its pipeline chunk (whose input the schedule keeps) re-run."""
    ids = set(part.op_ids)
    by_name = {name: tid for tid, name, _ in part.saved_items}
    for n in names:
        tid = by_name.get(n)
        if tid is None:
            continue
        for c in graph.tensors[tid].consumers:
            op = graph.ops[c]
            if c not in ids and op.phase is Phase.FORWARD:
                return True
    return False


def unwritten_items(
    graph: Graph, items: Sequence[tuple[int, str, Vec]], vec: Callable[[Tensor], Vec]
) -> tuple[tuple[str, int, tuple[int, ...], Vec], ...]:
    """Saved tensors a generated forward kernel may write only to keep them for backward:
    (name, producer op, its forward readers, the vector written, by ``vec``). Where the kernel
    making one also holds every forward reader, recomputing it drops the write, as Inductor's
    min-cut partitioner does: a recomputed node is not a forward output, so the fused kernel keeps
    it in registers (torch/_functorch/partitioners.py at v2.13.0,
    ``min_cut_rematerialization_partition``: only saved values leave the forward graph)."""
    out = []
    for tid, name, _ in items:
        t = graph.tensors[tid]
        if t.producer is None or tid in graph.outputs or graph.ops[t.producer].kind is OpKind.VIEW:
            continue
        fwd = tuple(sorted(c for c in readers(graph, tid) if graph.ops[c].phase is Phase.FORWARD))
        out.append((name, t.producer, fwd, vec(t)))
    return tuple(out)
