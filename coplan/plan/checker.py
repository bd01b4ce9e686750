"""The plan checker: every plan any strategy emits is validated here before it is reported.

Rules are registered by decorator and each yields one-line violations naming the field. Levels:
``structure`` rules (names exist, divisibility, legality) make a plan unusable; the ``memory`` rule
says it does not fit the budget (a valid but infeasible plan).

Fusion legality is what a real compiler could emit as one kernel: ops of one phase and one block;
at most one library anchor (GEMM or attention) per kernel with pointwise/reduction work in its
epilogue (consumers of the anchor's output) or prologue (producers feeding it, pointwise only);
pointwise and reductions chained vertically or siblings reading one input (horizontal); optimizer
updates grouped freely (multi-tensor kernels); and no cycle between kernels (a kernel cannot need
its own output through another kernel).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass

from coplan.cost import ConfigError, check_against
from coplan.cost.fusion import source_op
from coplan.cost.looped import ROW_KINDS
from coplan.cost.looped import reduces as _reduces
from coplan.ir.types import POINTWISE_KINDS, Graph, Op, OpKind, Phase
from coplan.plan.context import PlanContext, binary_bytes, policy_sets
from coplan.plan.types import FusionPlan, Plan, PlanError

#: ops that run as vendor-library kernels (cuBLAS, cuDNN/flash): one per fused kernel at most
ANCHORS = frozenset({OpKind.MATMUL, OpKind.ATTENTION})
#: ops a code generator can put into any kernel's prologue or epilogue
POINTWISE = POINTWISE_KINDS
#: reductions a generated kernel can hold (row-wise: norms, softmax, loss, sums)
REDUCTIONS = ROW_KINDS
#: ops numerics rules keep in fp32 unless a stated tolerance allows less
SENSITIVE = frozenset(
    {OpKind.SOFTMAX, OpKind.NORM, OpKind.LOSS, OpKind.REDUCTION, OpKind.OPTIMIZER, OpKind.COLLECTIVE}
)
#: relative error of lowering a sensitive op to 16 bits (bf16 keeps 8 mantissa bits: 2^-8 ~ 0.4%
#: per rounding, a row reduction accumulates it): the tolerance a plan must allow for it
SENSITIVE_16BIT_ERROR = 2.0**-8


@dataclass(frozen=True, slots=True)
class Violation:
    rule: str
    level: str  # "structure" | "memory"
    message: str

    def __str__(self) -> str:
        return f"{self.rule}: {self.message}"


Rule = Callable[[Plan, PlanContext], Iterator[str]]
_RULES: list[tuple[str, str, Rule]] = []


def rule(level: str) -> Callable[[Rule], Rule]:
    def register(fn: Rule) -> Rule:
        _RULES.append((fn.__name__, level, fn))
        return fn

    return register


@rule("structure")
def identity(plan: Plan, ctx: PlanContext) -> Iterator[str]:
    if plan.model != ctx.model_name:
        yield f"plan is for model {plan.model!r}, this job is {ctx.model_name!r}"
    if plan.graph and plan.graph != ctx.graph_fingerprint:
        yield f"plan is for graph {plan.graph}, this model's graph is {ctx.graph_fingerprint}"
    if plan.gpus != ctx.gpus:
        yield f"plan is for {plan.gpus} GPUs, this job has {ctx.gpus}"
    if plan.global_batch != ctx.global_batch or plan.seq != ctx.seq:
        yield (
            f"plan is for global batch {plan.global_batch} x seq {plan.seq}, this job is "
            f"{ctx.global_batch} x {ctx.seq}"
        )


@rule("structure")
def parallel(plan: Plan, ctx: PlanContext) -> Iterator[str]:
    try:
        # the layout rules do not depend on fusion; leaving the groups out keeps a group naming
        # unknown ops (the fusion rule's finding) from failing the expansion here
        config = ctx.config_of(plan.with_(fusion=FusionPlan()))
        m = ctx.model
        if m.spec is not None:
            check_against(
                config,
                gpus=ctx.gpus,
                n_heads=m.spec.n_heads,
                n_layers=m.spec.n_layers,
                n_kv_heads=m.spec.kv_heads,
            )
        else:
            prof = ctx.reference_profile
            check_against(config, gpus=ctx.gpus, n_heads=prof.heads, n_layers=prof.n_layers)
    except (ConfigError, PlanError) as e:
        yield e.reason
    per_stage = plan.remat.per_stage
    if per_stage is not None and len(per_stage) != plan.parallel.pp:
        yield f"remat.per_stage has {len(per_stage)} sets for {plan.parallel.pp} pipeline stages"


def _kernel_graph_ok(graph: Graph, groups: list[tuple[int, ...]]) -> str | None:
    """A cycle between kernels, if any (Kahn's algorithm on the quotient graph)."""
    group_of: dict[int, list[int]] = {}
    for gi, g in enumerate(groups):
        for i in g:
            group_of.setdefault(i, []).append(gi)
    n = len(groups)
    succ: list[set[int]] = [set() for _ in range(n)]
    for gi, g in enumerate(groups):
        for i in g:
            for t in graph.ops[i].outputs:
                for c in graph.tensors[t].consumers:
                    for gj in group_of.get(c, ()):
                        # a kernel holding its own copy of a duplicated producer reads nothing of it
                        if gj != gi and gj not in group_of[i]:
                            succ[gi].add(gj)
    indeg = [0] * n
    for s in succ:
        for j in s:
            indeg[j] += 1
    ready = [i for i in range(n) if indeg[i] == 0]
    seen = 0
    while ready:
        i = ready.pop()
        seen += 1
        for j in succ[i]:
            indeg[j] -= 1
            if indeg[j] == 0:
                ready.append(j)
    if seen < n:
        return "the fused kernels form a cycle (a kernel would need its own output through another kernel)"
    return None


def group_problem(graph: Graph, ids: tuple[int, ...]) -> str | None:
    """Why one group of op ids cannot be one kernel, or None when it can."""
    ops = [graph.ops[i] for i in ids]
    phases = {op.phase for op in ops}
    if len(phases) > 1:
        return "mixes phases " + ", ".join(sorted(p.value for p in phases))
    if Phase.OPTIMIZER in phases:
        return None  # multi-tensor optimizer kernels group any updates
    blocks = {op.block for op in ops}
    if len(blocks) > 1:
        return "spans blocks " + ", ".join(
            str(b) for b in sorted(blocks, key=lambda b: -1 if b is None else b)
        )
    anchors = [op for op in ops if op.kind in ANCHORS]
    if len(anchors) > 1:
        return f"holds {len(anchors)} library kernels ({', '.join(op.name for op in anchors)}); at most one"
    other = [op for op in ops if op.kind not in ANCHORS | POINTWISE | REDUCTIONS]
    if other:
        return f"{other[0].name} ({other[0].kind.value}) cannot be fused"
    if anchors:
        why = _executor_problem(ops, anchors[0])
        if why is not None:
            return why
    # connected: vertically (producer-consumer through views) or horizontally (shared input)
    if not _connected(graph, ids):
        return "its ops share no data (neither producer-consumer nor a common input)"
    return None


#: scheduler nodes Inductor puts in one kernel at most (``torch._inductor.config.max_fusion_size``)
INDUCTOR_MAX_FUSION = 64


def duplicable(graph: Graph, op: Op) -> bool:
    """Whether ``op`` may be computed inside each reader's kernel: a pointwise op that is not a
    row reduction, outside the optimizer, making no output of the step (XLA duplicates only ops it
    does not deem expensive: ``xla/service/instruction_fusion.cc``, ``IsExpensive``)."""
    return (
        op.kind in POINTWISE - {OpKind.VIEW}
        and not _reduces(op)
        and op.phase is not Phase.OPTIMIZER
        and bool(op.outputs)
        and not any(t in graph.outputs for t in op.outputs)
    )


def inductor_problem(graph: Graph, ids: tuple[int, ...], target: str) -> str | None:
    """Why Inductor, compiling for ``target`` ("cpu": its C++ backend; "gpu": Triton), does not
    emit the group ``ids`` as one kernel although ``group_problem`` accepts it (None: it does).

    - A loss that reads its input by an index (``nll_loss`` gathers one log-probability per row)
      and an embedding gradient (a scatter-add into the table) share no bytes Inductor can count
      with the kernels around them (``Scheduler.score_fusion_memory`` matches reads by buffer and
      index): ``InductorChoices.can_fuse`` refuses with "no shared data".
    - On a CPU a pointwise op whose output is written (saved for backward, or read outside the
      group) is a loop nest of its own, and ``CppScheduling.can_fuse_vertical`` fuses such a
      producer into a row reduction only with the same loop nest, which a flat elementwise loop
      and a (rows, columns) reduction never have. An unwritten producer is inlined into the
      reduction instead, so the rule asks only about written ones.
    - A kernel of more than ``config.max_fusion_size`` (64) scheduler nodes, the buffers Inductor
      realizes (every value written to memory, and reductions, GEMMs and attention; inlined
      pointwise ops are no nodes of their own): ``InductorChoices.can_fuse`` refuses with
      "exceeds max fusion" (``torch/_inductor/choices.py``, ``config.py`` at v2.13.0).
    The first two were read off the refusals Inductor logged compiling coplan's plans (torch 2.13,
    ``coplan.fusion_log``)."""
    members = set(ids)
    ops = [graph.ops[i] for i in ids]
    nodes = sum(
        max(
            sum(1 for o in op.outputs if _written(graph, o, members)),
            int(_reduces(op) or op.kind in ANCHORS),
        )
        for op in ops
        if op.kind is not OpKind.VIEW
    )
    if nodes > INDUCTOR_MAX_FUSION:
        return f"{nodes} buffers in one kernel exceed Inductor's max_fusion_size ({INDUCTOR_MAX_FUSION})"
    for op in ops:
        if op.target.removeprefix("aten.") == "embedding_bwd":
            return f"{op.name} (a scatter-add into the embedding table) shares no data Inductor fuses on"
        if op.kind is OpKind.LOSS and op.phase is Phase.FORWARD:
            src = source_op(graph, op.inputs[0]) if op.inputs else None
            if src in members:
                return f"{op.name} gathers its input by index: no shared data for Inductor to fuse on"
    if target != "cpu":
        return None
    for op in ops:
        if not _reduces(op):
            continue
        for t in op.inputs:
            src = source_op(graph, t)
            if src is None or src not in members or src == op.id:
                continue
            p = graph.ops[src]
            if p.kind not in POINTWISE or _reduces(p):
                continue
            for o in p.outputs:
                if _written(graph, o, members):
                    return (
                        f"{p.name} is written (read outside the kernel or saved) and feeds the "
                        f"reduction {op.name}: Inductor's C++ backend does not fuse the two"
                    )
    return None


def _written(graph: Graph, tid: int, members: set[int]) -> bool:
    """Whether a kernel holding ``members`` must write ``tid``: it (or a view of it) is saved for
    backward or a graph output, or an op outside the kernel reads it."""
    stack = [tid]
    while stack:
        t = graph.tensors[stack.pop()]
        if t.saved_for_backward or t.id in graph.outputs:
            return True
        for c in t.consumers:
            op = graph.ops[c]
            if op.kind is OpKind.VIEW:
                stack.extend(op.outputs)
            elif c not in members:
                return True
    return False


def _executor_problem(ops: list[Op], anchor: Op) -> str | None:
    """Why no executor emits a kernel of ``anchor`` with ``ops`` around it (None: one does).

    Attention runs as a library kernel that takes no other ops: FlashAttention-2/3 and cuDNN's fused
    attention have no epilogue hooks, and Inductor lowers ``scaled_dot_product_attention`` to
    those kernels as extern calls (torch/_inductor/lowering.py, the ``_scaled_dot_product_*``
    fallbacks). A GEMM takes pointwise ops only: cuBLASLt's epilogues are bias, GELU, ReLU and
    their gradients (cublasLtEpilogue_t), and Inductor fuses into its Triton GEMM templates only
    pointwise epilogues and prologues (torch/_inductor/scheduler.py ``can_fuse`` for template
    nodes), so no norm, softmax, loss or row reduction lands in a GEMM's kernel."""
    extra = [op for op in ops if op.id != anchor.id and op.kind is not OpKind.VIEW]
    if anchor.kind is OpKind.ATTENTION and extra:
        e = extra[0]
        return f"{e.name} ({e.kind.value}) fused into attention {anchor.name}: it takes no other ops"
    # a decomposed row op counts too: the IR calls log-softmax and its gradient elementwise, and
    # each reduces a whole row (the vocabulary, after the LM head's GEMM)
    reduction = next((op for op in extra if _reduces(op)), None)
    if reduction is not None:
        return (
            f"{reduction.name} ({reduction.kind.value}, a row reduction) in the kernel of GEMM "
            f"{anchor.name}: GEMM epilogues and prologues hold pointwise ops only"
        )
    return None


def pair_problem(producer: OpKind, consumer: OpKind) -> str | None:
    """Why no executor puts an op of kind ``producer`` and one of kind ``consumer`` that reads it
    into one kernel (None: one does). The rules of ``group_problem`` for a group of two, by kind
    alone: what ``coplan inspect`` holds a compiled step's kernel boundaries against."""
    kinds = (producer, consumer)
    other = next((k for k in kinds if k not in ANCHORS | POINTWISE | REDUCTIONS), None)
    if other is not None:
        return f"{other.value} ops are not fused"
    anchors = [k for k in kinds if k in ANCHORS]
    if len(anchors) > 1:
        return "two library kernels"
    if OpKind.ATTENTION in anchors:
        return "attention takes no other ops"
    if OpKind.MATMUL in anchors and any(k in REDUCTIONS for k in kinds):
        return "GEMM epilogues and prologues hold pointwise ops only"
    return None


def _connected(graph: Graph, ids: tuple[int, ...]) -> bool:
    members = set(ids)
    adj: dict[int, set[int]] = {i: set() for i in ids}
    by_input: dict[int, list[int]] = {}
    for i in ids:
        op = graph.ops[i]
        for t in op.inputs:
            src = source_op(graph, t)
            if src in members and src != i:
                adj[i].add(src)
                adj[src].add(i)
            base = graph.tensors[graph.tensors[t].storage_id].id
            by_input.setdefault(base, []).append(i)
    for users in by_input.values():
        for a in users:
            for b in users:
                if a != b:
                    adj[a].add(b)
    start = ids[0]
    stack, seen = [start], {start}
    while stack:
        for j in adj[stack.pop()]:
            if j not in seen:
                seen.add(j)
                stack.append(j)
    return seen == members


@rule("structure")
def fusion(plan: Plan, ctx: PlanContext) -> Iterator[str]:
    idx = ctx.index
    graph = idx.graph
    unknown = [n for g in plan.fusion.groups for n in g if n not in idx.op_by_name]
    if unknown:
        yield f"fusion names unknown ops: {', '.join(unknown[:3])}"
        return
    expanded: list[tuple[int, ...]] = []
    for g in plan.fusion.groups:
        ids = tuple(idx.op_by_name[n].id for n in g)
        why = group_problem(graph, ids)
        if why:
            yield f"group [{', '.join(g[:4])}{' ...' if len(g) > 4 else ''}] {why}"
        expanded.append(ids)
    if expanded:
        covered = {i for g in expanded for i in g}
        # the reference block's kernels (and outside ops) with singletons for the rest: a cycle
        # there is a cycle in every block
        scope = {i for g in expanded for i in g}
        blocks = {graph.ops[i].block for i in scope}
        singles: list[tuple[int, ...]] = [
            (op.id,) for op in graph.ops if op.block in blocks and op.id not in covered
        ]
        why = _kernel_graph_ok(graph, expanded + singles)
        if why:
            yield why
    if plan.fusion.duplicated:
        yield from _duplication(plan, ctx)
    saved = {n for names in idx.saved_names.values() for n in names}
    for n in plan.fusion.recompute_in_backward:
        op = idx.op_by_name.get(n)
        if op is None:
            yield f"fusion.recompute_in_backward names unknown op {n!r}"
        elif op.kind not in POINTWISE:
            yield f"fusion.recompute_in_backward: {n} ({op.kind.value}) is not pointwise"
        elif not any(graph.tensors[t].name in plan.remat.all_names for t in op.outputs) and not any(
            graph.tensors[t].name in saved for t in op.outputs
        ):
            yield f"fusion.recompute_in_backward: {n} produces no saved tensor"


def _duplication(plan: Plan, ctx: PlanContext) -> Iterator[str]:
    """What is wrong with ``fusion.duplicated``: each is a cheap pointwise op (not a reduction,
    outside the optimizer, not a step output) whose readers of its own phase lie in its block,
    are not duplicated themselves, and each take it into a legal kernel; and the kernels with every
    copy placed form no cycle."""
    from coplan.cost.fusion import readers

    idx = ctx.index
    graph = idx.graph
    dup = plan.fusion.duplicated
    anchors_ok = "epilogue" in ctx.stack.fusion
    for n in sorted(dup):
        op = idx.op_by_name.get(n)
        if op is None:
            yield f"fusion.duplicated names unknown op {n!r}"
            return
        if not duplicable(graph, op):
            if any(t in graph.outputs for t in op.outputs):
                yield f"fusion.duplicated: {n} makes an output of the step, which must be written"
            else:
                yield f"fusion.duplicated: {n} ({op.kind.value}) is not a pointwise op that can be copied"
            continue
        rs = [graph.ops[r] for t in op.outputs for r in readers(graph, t) if graph.ops[r].phase is op.phase]
        if not rs:
            yield f"fusion.duplicated: {n} has no reader to be copied into"
        for r in rs:
            if r.block != op.block:
                yield f"fusion.duplicated: {n} is read by {r.name} in another block"
            elif r.name in dup:
                yield f"fusion.duplicated: {n} is read by {r.name}, which is duplicated too"
            elif r.kind in ANCHORS and not anchors_ok:
                yield f"fusion.duplicated: {n} would be a prologue of library kernel {r.name}"
            else:
                continue
            break
    try:
        expanded = ctx.expand_fusion(plan.fusion)
    except PlanError:
        return  # unknown names: reported above
    for g in expanded:
        if len(g) > 1 and any(graph.ops[i].name in dup for i in g):
            why = group_problem(graph, tuple(g))
            if why:
                names = ", ".join(graph.ops[i].name for i in g[:4])
                yield f"a kernel with a duplicated op [{names}{' ...' if len(g) > 4 else ''}] {why}"
                return
    why = _kernel_graph_ok(graph, list(expanded))
    if why:
        yield why + " (with the duplicated ops' copies)"


@rule("structure")
def remat(plan: Plan, ctx: PlanContext) -> Iterator[str]:
    saved = {n for names in ctx.index.saved_names.values() for n in names}
    unknown = sorted(n for n in plan.remat.all_names if n not in saved)
    if unknown:
        yield f"remat names tensors that are not saved for backward: {', '.join(unknown[:3])}"
    r = plan.remat
    if r.layers is not None:
        full = policy_sets(ctx).get("full")
        sets = r.per_stage if r.per_stage is not None else (r.recompute,)
        if not full or not any(frozenset(x) == full for x in sets):
            yield "remat.layers counts fully recomputed blocks, but no stage recomputes the full set"


@rule("structure")
def precision(plan: Plan, ctx: PlanContext) -> Iterator[str]:
    c = plan.precision
    native = ctx.device_dtypes
    if c.compute not in native and not (c.compute == "tf32" and "fp32" in native):
        yield f"precision.compute {c.compute} is not supported by {ctx.cluster.name}'s devices"
    if c.compute == "fp16" and not c.loss_scaling:
        yield "fp16 needs loss scaling"
    idx = ctx.index
    tol = ctx.numerics.tolerance
    for name, dtype in c.ops:
        op = idx.op_by_name.get(name)
        if op is None:
            yield f"precision.ops names unknown op {name!r}"
            continue
        if dtype == "fp8" and op.kind is not OpKind.MATMUL:
            yield f"precision.ops: {name} ({op.kind.value}) cannot run in fp8 (GEMMs only)"
        if dtype == "fp8" and "fp8" not in native:
            yield f"precision.ops: {name} in fp8, but {ctx.cluster.name}'s devices have no fp8 units"
        if op.kind in SENSITIVE and dtype != "fp32" and tol < SENSITIVE_16BIT_ERROR:
            yield (
                f"precision.ops: {name} ({op.kind.value}) is numerically sensitive; {dtype} needs a "
                f"tolerance >= {SENSITIVE_16BIT_ERROR:.2g}, the job allows {tol:.2g}"
            )


@rule("structure")
def stack(plan: Plan, ctx: PlanContext) -> Iterator[str]:
    """What the plan's stack cannot execute (``plan.capabilities``)."""
    from coplan.plan.capabilities import problems  # it builds fusion options through the passes

    yield from problems(plan, ctx)


def check(plan: Plan, ctx: PlanContext, *, memory: bool = True) -> list[Violation]:
    """Every violation of ``plan`` in ``ctx`` (empty when valid and, with ``memory``, fitting)."""
    out = [Violation(name, level, msg) for name, level, fn in _RULES for msg in fn(plan, ctx)]
    if memory and not any(v.level == "structure" for v in out):
        est = ctx.price(plan)
        if not ctx.fits(est):
            out.append(
                Violation(
                    "memory",
                    "memory",
                    f"peak {binary_bytes(est.memory.peak_bytes)} on stage {est.memory.stage} exceeds the "
                    f"budget of {binary_bytes(ctx.budget)}",
                )
            )
    return out


def is_valid(plan: Plan, ctx: PlanContext) -> bool:
    return not any(v.level == "structure" for v in check(plan, ctx, memory=False))
