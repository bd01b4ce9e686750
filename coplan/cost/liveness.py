"""The transient working set of a model part: the temporaries (activations and gradients not
kept for backward) live after each op, by liveness over the part's ops in execution order.
``profile`` prices each part's transient memory from it.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping, Sequence

from coplan.cost.families import prune_dominated
from coplan.cost.fusion import readers
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
    ids: set[int] | frozenset[int],
    skip: frozenset[int] = frozenset(),
    skip_returns: bool = True,
    kept: frozenset[int] = frozenset(),
    unwritten: frozenset[int] = frozenset(),
    narrowed: frozenset[int] = frozenset(),
    freed: Mapping[int, Vec] | None = None,
) -> tuple[Vec, ...]:
    """Live temporaries (not kept for backward) after each op of the part, forward and backward.
    Ops in ``skip`` run as other kernels (Megatron's loss): their temporaries are left out, a
    tensor they alone read is freed once its last reader has passed, and what they produce for
    a walked op counts as an incoming temporary in the training dtype (``skip_returns``; off:
    it is storage counted elsewhere). Storages in ``kept`` are counted as saved, not here;
    storages in ``unwritten`` never reach memory, those in ``narrowed`` are written in the training
    dtype (``fused_temporaries``). ``freed``: saved storage an op's backward node releases when it
    finishes (op id -> its vector), which the saved vector counts to the end of the part's backward:
    the points after that op carry it as freed.
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

    def drop(v: Vec) -> None:
        nonlocal current
        current = tuple(a - b for a, b in zip(current, v, strict=True))  # type: ignore[assignment]

    def release(sids: Iterable[int]) -> None:
        for sid in sids:
            drop(live.pop(sid))

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
            if (
                t.alias_of is None
                and is_temp(t)
                and not t.saved_for_backward
                and t.id not in kept
                and t.id not in unwritten
            ):
                live[t.id] = act_vec(t) if t.id in narrowed else vec(t)
                current = vadd(current, live[t.id])
        points.append(current)
        if freed and op.id in freed:
            drop(freed[op.id])
        ended = {g.tensors[tid].storage_id for tid in (*op.inputs, *op.outputs)}
        release([sid for sid in ended if sid in live and last_use.get(sid, -1) <= op.id])
    return prune_dominated(points)


def fused_temporaries(
    g: Graph, ops: Sequence[Op], group_of: dict[int, tuple[int, ...]], wide: Iterable[int] = ()
) -> tuple[frozenset[int], frozenset[int]]:
    """(unwritten, narrowed): storages of temporaries ``ops`` produce in multi-op kernels of
    generated code that are never written, and those written narrower than they are computed.

    Unwritten: every op reading them (through any view) runs in a kernel that computes them, so
    they live in registers. A compiler emits a kernel's output to memory only where a reader
    outside the kernel needs it (Inductor's scheduler at v2.13.0: a buffer all of whose users are
    fused into its kernel is removed, ``torch/_inductor/scheduler.py``
    ``Scheduler.remove_kernel_local_buffers``; XLA keeps a fusion's intermediates in registers the
    same way). Narrowed: an output of an op computed in fp32 (``wide``: the loss path on the
    vocabulary) whose readers all run in the training dtype is written already cast, since the
    cast autocast puts before them is fused into the producing kernel; eager PyTorch writes the
    fp32 tensor and then its cast. Tensors kept for backward are the saved vector's (their
    unwritten copies: ``cost.remat.unwritten_items``), not these."""
    f32 = frozenset(wide)
    unwritten, narrowed = set(), set()
    for op in ops:
        if op.kind is OpKind.VIEW or op.id not in group_of or len(group_of[op.id]) < 2:
            continue
        for tid in op.outputs:
            t = g.tensors[tid]
            if t.alias_of is not None or not is_temp(t) or t.saved_for_backward or tid in g.outputs:
                continue
            users = readers(g, tid)
            if users and all(op.id in group_of.get(u, ()) for u in users):
                unwritten.add(t.id)
            elif op.id in f32 and users and not users & f32:
                narrowed.add(t.id)
    return frozenset(unwritten), frozenset(narrowed)
