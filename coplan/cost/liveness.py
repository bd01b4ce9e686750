"""The transient working set of a model part: the temporaries (activations and gradients not
kept for backward) live after each op, by liveness over the part's ops in execution order.
``profile`` prices each part's transient memory from it.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence

from coplan.cost.families import prune_dominated
from coplan.cost.parts import ZERO, Vec, vadd
from coplan.ir.types import Graph, Op, OpKind, Phase, Tensor, TensorRole


def is_temp(t: Tensor) -> bool:
    """A value that lives only through a step: an activation or a gradient of an activation."""
    return t.role in (TensorRole.ACTIVATION, TensorRole.GRADIENT) and t.grad_of is None


def liveness(
    g: Graph,
    vec: Callable[[Tensor], Vec],
    act_vec: Callable[[Tensor], Vec],
    ops: Sequence[Op],
    ids: set[int],
    skip: frozenset[int] = frozenset(),
    skip_returns: bool = True,
    kept: frozenset[int] = frozenset(),
) -> tuple[Vec, ...]:
    """Live temporaries (not kept for backward) after each op of the part, forward and backward.
    Ops in ``skip`` run as other kernels (Megatron's loss): their temporaries are left out, a
    tensor they alone read is freed once its last reader has passed, and what they produce for
    a walked op counts as an incoming temporary in the training dtype (``skip_returns``; off:
    it is storage counted elsewhere). Storages in ``kept`` are counted as saved, not here.
    ``vec`` gives a tensor's element vector as stored, ``act_vec`` in the training dtype."""
    last_use: dict[int, int] = {}
    for op in ops:
        if op.phase is Phase.OPTIMIZER:
            continue
        for tid in op.inputs:
            last_use[g.tensors[tid].storage_id] = op.id
    live: dict[int, Vec] = {}
    points: list[Vec] = []
    current: Vec = ZERO
    walked = ids - skip

    def release(sids: Iterable[int]) -> None:
        nonlocal current
        for sid in sids:
            current = tuple(a - b for a, b in zip(current, live.pop(sid), strict=True))  # type: ignore[assignment]

    for op in ops:
        if op.phase is Phase.OPTIMIZER or op.kind is OpKind.VIEW or op.id in skip:
            continue
        if skip:  # temporaries whose last reader was a skipped op are gone by now
            release([s for s in live if last_use.get(s, -1) < op.id])
        for tid in op.inputs:  # incoming temporaries from other parts (gradients) are live too
            base = g.tensors[g.tensors[tid].storage_id]
            if (
                base.id not in live
                and is_temp(base)
                and (base.producer is None or base.producer not in walked)
                and (skip_returns or base.producer not in skip)
            ):
                # a skipped (Megatron loss) kernel hands back its gradient in the training
                # dtype: the cast back from its fp32 buffer
                live[base.id] = act_vec(base) if base.producer in skip else vec(base)
                current = vadd(current, live[base.id])
        for tid in op.outputs:
            t = g.tensors[tid]
            if t.alias_of is None and is_temp(t) and not t.saved_for_backward and t.id not in kept:
                live[t.id] = vec(t)
                current = vadd(current, live[t.id])
        points.append(current)
        ended = {g.tensors[tid].storage_id for tid in (*op.inputs, *op.outputs)}
        release([sid for sid in ended if sid in live and last_use.get(sid, -1) <= op.id])
    return prune_dominated(points)
