"""The exact block-level joint optimizer: fusion, recomputation and (through the outer loop)
precision of one block template, solved together by CP-SAT for a given parallel layout. The outer
loop takes every compute dtype and every per-op dtype assignment of the block template's ops whose
dtype is a choice (norms and softmaxes in fp32 or fused in the compute dtype,
``passes.precision.block_assignments``), each priced by its own block model.

For one layout and precision the step's block time is a sum over the block's kernels, and each
kernel's time depends only on the ops it holds (``cost.kernelprice``). The model:

- fusion: a 0/1 variable per legal candidate kernel of each region (``opspace``: convex groups
  only, since a group that a path leaves and re-enters is in no acyclic partition); each op in at
  most one, the others alone; a chosen set of kernels whose kernel graph has a cycle is cut off
  and the model re-solved (cycles need two kernels fused sideways, so they are rare);
- recomputation: a 0/1 variable per saved tensor of the block; the ops re-run are the closure
  ``cost.remat.recompute_closure`` walks (a dropped tensor's producer, and the producers of its
  inputs that are not kept), as implications; a re-run op's kernel re-runs whole unless every
  re-run op in it is a pointwise producer of a dropped tensor, which then re-runs inside the
  backward kernels reading it (arithmetic only), as ``estimate`` prices it; a dropped tensor whose
  kernel holds every forward reader is not written (``Part.unwritten``): the coupling that makes
  fusion save traffic only where the fused value is recomputed;
- memory: the bytes each dropped tensor frees, measured alone on the cost model, must cover what
  the plan lacks with nothing recomputed;
- objective: the block kernels' seconds, forward, backward and re-run, times the times a step
  runs them on the critical path (microbatches plus the pipeline's fill, blocks per stage).

The objective is linear in the decisions and exact per kernel; what it leaves out (collectives,
overlap, the cost model's non-additive memory) is why every answer is re-priced by the full cost
model and, when it does not fit, re-solved with the shortfall added, and the gap between the
solver's objective and the re-priced step is reported. Names whose recomputation drops the block's
output (every block would re-run its predecessors) are left to the local search afterwards.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from coplan.cost.fusion import readers
from coplan.cost.kernelprice import KernelPrices
from coplan.cost.parts import Part
from coplan.cost.remat import drops_output
from coplan.cost.stages import stage_devices
from coplan.hardware.cluster import ClusterSpec
from coplan.ir.types import OpKind, Phase, TensorRole
from coplan.passes.base import PassRecord, score
from coplan.passes.remat import saved_names, with_remat
from coplan.plan.checker import POINTWISE, _kernel_graph_ok
from coplan.plan.context import PlanContext
from coplan.plan.types import FusionPlan, Plan
from coplan.search.opspace import Region, as_fusion, regions
from coplan.search.strategies import Options, bound_search, strategy

if TYPE_CHECKING:
    from ortools.sat.python.cp_model import CpModel

#: a CP-SAT 0/1 variable or linear expression of them (or the constant 1)
Expr = Any

SCALE = 1e9  # CP-SAT works on integers: nanoseconds
MAX_RESOLVES = 6
MAX_CYCLE_CUTS = 50
#: how far below the maximally fused plan with nothing recomputed an op-level plan of the same
#: layout can price (dropped writes, partitions the greedy pass cannot reach): the bound's margin
BOUND_MARGIN = 0.01


@dataclass
class Solved:
    """One CP-SAT answer: the multi-op kernels chosen (reference op ids), the recompute set, and
    the solver's objective in step seconds."""

    kernels: list[tuple[int, ...]]
    recompute: frozenset[str]
    objective_s: float
    optimal: bool


def op_level(ctx: PlanContext, opts: Options) -> tuple[bool, bool]:
    """(whether fusion is decided per op here, whether GEMMs take prologues and epilogues): per op
    where the stack's executor compiles the plan's own groups (its fusion options include
    ``greedy``) and the space searches fusion."""
    allowed = set(ctx.stack.fusion)
    op = "greedy" in allowed and "fusion" not in opts.space.fixed
    anchors = "epilogue" in allowed and "epilogue" in opts.space.fusion
    return op, anchors


class BlockModel:
    """The CP-SAT model of one layout and precision (built once, solved for several budgets)."""

    def __init__(self, plan: Plan, ctx: PlanContext, *, anchors: bool, fusion: bool = True) -> None:
        self.ctx = ctx
        config = ctx.config_of(plan)
        model = ctx.model
        prof = model.profile(
            config.microbatch, model.seq_of(config), "none", (config.dtype, config.op_dtypes)
        )
        self.graph = prof.graph
        device = stage_devices(ctx.cluster, config)[0]
        precision = (config.dtype, config.op_dtypes)
        # (the profile, and so its graph, lives as long as the cost model: its id is a stable key)
        key = ("kernels", id(prof.graph), config.dtype if config.op_dtypes else "", config.op_dtypes)
        shared = ctx.memo.setdefault(key, {})
        self.prices = KernelPrices(prof.graph, device, config, precision, shared)  # type: ignore[arg-type]
        pp, vpp, m = config.pp, config.vpp, config.num_microbatches
        # a stage runs each of its blocks once per microbatch, plus the pipeline's fill and drain
        self.runs = (m + (pp - 1) / vpp) / pp
        self.regions = regions(ctx, anchors=anchors)
        self.fusion = fusion
        self.parts = {p.blocks[0]: p for p in prof.templates if p.blocks}
        self.names = tuple(n for n in saved_names(ctx) if not self._drops_output(n))

    def _drops_output(self, name: str) -> bool:
        for part in self.parts.values():
            if any(n == name for _, n, _ in part.saved_items):
                return drops_output(self.graph, part, frozenset({name}))
        return False

    def solve(
        self,
        freed: dict[str, float],
        need: float,
        fixed: Plan | None = None,
        held: frozenset[str] | None = None,
    ) -> Solved | None:
        """The best kernels and recompute set freeing at least ``need`` bytes (``freed``: bytes
        per name); ``fixed``: keep that plan's kernels (fusion not searched); ``held``: recompute
        exactly these (recomputation not searched). None: infeasible."""
        from ortools.sat.python import cp_model

        m = cp_model.CpModel()
        r: dict[str, Expr] = {
            n: m.new_bool_var(f"r:{n}") for n in self.names if freed.get(n, 0.0) > 0 or need <= 0
        }
        if held is not None:
            for n, v in r.items():
                m.add(v == (1 if n in held else 0))
        if need > 0 and sum(freed.get(n, 0.0) for n in r) < need:
            return None
        keep = self._fixed_kernels(fixed) if fixed is not None else None
        cands: list[tuple[int, ...]]
        terms: list[tuple[float, Expr]] = []  # (step seconds, 0/1 expression)
        chosen_vars: list[tuple[tuple[int, ...], Expr]] = []
        by_region: list[tuple[Region, dict[tuple[int, ...], Expr]]] = []
        for reg in self.regions:
            w = self.runs * reg.blocks
            if keep is not None:
                cands = [c for c in keep if set(c) <= set(reg.ops)]
            elif self.fusion:
                cands = list(reg.candidates)
            else:
                cands = []
            x = {c: m.new_bool_var(f"x:{c}") for c in cands}
            if keep is not None:
                for c in cands:
                    m.add(x[c] == 1)
            member: dict[int, list[tuple[int, ...]]] = {}
            for c in cands:
                for i in c:
                    member.setdefault(i, []).append(c)
            for cs in member.values():
                if len(cs) > 1:
                    m.add(sum(x[c] for c in cs) <= 1)
            # every kernel the region may run: (ops, 0/1 expression choosing it)
            options: list[tuple[tuple[int, ...], Expr]] = [(c, x[c]) for c in cands]
            for i in reg.ops:
                held_by = member.get(i, [])
                options.append(((i,), 1 - sum(x[c] for c in held_by) if held_by else 1))
            for k, sel in options:
                terms.append((w * self.prices.time(k), sel))
            chosen_vars.extend((c, x[c]) for c in cands)
            by_region.append((reg, x))
            if reg.name.startswith("block") and r:
                self._remat(m, reg, w, options, r, terms)
        if need > 0:
            m.add(sum(int(freed[n]) * v for n, v in r.items()) >= int(need) + 1)
        const = sum(s for s, e in terms if isinstance(e, int))
        m.minimize(sum(round(s * SCALE) * e for s, e in terms if not isinstance(e, int)))
        solver = cp_model.CpSolver()
        solver.parameters.num_workers = 1
        # a deterministic budget, not wall-clock seconds: the answer must not depend on the load
        solver.parameters.max_deterministic_time = 10.0
        # the kernel graph must be acyclic: every candidate is convex (``opspace``), so a cycle
        # needs two or more of the chosen kernels; each one found is cut off and the model
        # re-solved (a cut removes only partitions holding all of that cycle's kernels)
        for _ in range(MAX_CYCLE_CUTS):
            st = solver.solve(m)
            if st not in (cp_model.OPTIMAL, cp_model.FEASIBLE):
                return None
            cuts = 0
            for reg, x in by_region:
                mine = [c for c, v in x.items() if solver.value(v)]
                if mine and _kernel_graph_ok(self.graph, [*mine, *self._singles(reg, mine)]) is not None:
                    m.add(sum(x[c] for c in mine) <= len(mine) - 1)
                    cuts += 1
            if not cuts:
                break
        else:
            return None
        chosen = [c for c, v in chosen_vars if solver.value(v)]
        rec = frozenset(n for n, v in r.items() if solver.value(v))
        return Solved(chosen, rec, solver.objective_value / SCALE + const, st == cp_model.OPTIMAL)

    def _remat(
        self,
        m: CpModel,
        reg: Region,
        w: float,
        options: list[tuple[tuple[int, ...], Expr]],
        r: dict[str, Expr],
        terms: list[tuple[float, Expr]],
    ) -> None:
        """The recompute variables' implications and costs for one block region (module doc)."""
        g = self.graph
        part = self.parts[int(reg.name[6:-1])]
        tid_of = {n: tid for tid, n, _ in part.saved_items}
        saved = set(tid_of.values())
        fwd = [i for i in reg.ops if g.ops[i].phase is Phase.FORWARD]
        fwd_set = set(fwd)
        u = {i: m.new_bool_var(f"u:{i}") for i in fwd}
        name_of = {tid: n for n, tid in tid_of.items()}
        made_by: dict[int, list[str]] = {}
        for n in r:
            p = g.tensors[tid_of[n]].producer
            if p in u:
                m.add(u[p] >= r[n])
                made_by.setdefault(p, []).append(n)
        for i in fwd:  # the closure: a re-run op needs its inputs that are not kept
            for tin in g.ops[i].inputs:
                base = g.tensors[g.tensors[tin].storage_id]
                q = base.producer
                if base.role is not TensorRole.ACTIVATION or q is None or q not in fwd_set or q == i:
                    continue
                if base.id in saved:
                    n = name_of[base.id]
                    if n in r:
                        m.add(u[q] >= u[i] + r[n] - 1)
                else:
                    m.add(u[q] >= u[i])
        # pointwise producers of dropped tensors re-run inside the backward kernels
        f: dict[int, Expr] = {}
        for i, names in made_by.items():
            op = g.ops[i]
            if op.kind in POINTWISE and op.block is not None:
                v = m.new_bool_var(f"f:{i}")
                for n in names:
                    m.add(v >= r[n])
                m.add(v <= sum(r[n] for n in names))
                f[i] = v
        writes = self._unwritten(part, r)
        for k, sel in options:
            if g.ops[k[0]].phase is not Phase.FORWARD:
                continue
            full = m.new_bool_var(f"F:{k}")
            for i in k:
                m.add(full >= sel + u[i] - f.get(i, 0) - 1)
            terms.append((w * self.prices.time(k), full))
            for i in k:
                if i in f:
                    a = m.new_bool_var(f"A:{k}:{i}")
                    m.add(a >= sel + f[i] - 1 - full)
                    terms.append((w * self.prices.arithmetic(k, i), a))
            for n, producer, readers_, tid in writes:
                if producer in k and readers_ <= set(k):
                    gain = self.prices.without_writes(k, self.prices.written(tid))
                    if gain > 0:
                        y = m.new_bool_var(f"y:{k}:{n}")
                        m.add(y <= sel)
                        m.add(y <= r[n])
                        terms.append((-w * gain, y))

    def _unwritten(self, part: Part, r: dict[str, Expr]) -> list[tuple[str, int, frozenset[int], int]]:
        """(name, producer, forward readers, tensor) of each decided tensor a kernel may skip
        writing when it is recomputed (``cost.remat.unwritten_items``'s rule)."""
        g = self.graph
        out = []
        for tid, n, _ in part.saved_items:
            t = g.tensors[tid]
            if n not in r or t.producer is None or tid in g.outputs:
                continue
            fwd = frozenset(c for c in readers(g, tid) if g.ops[c].phase is Phase.FORWARD)
            out.append((n, t.producer, fwd, tid))
        return out

    def _singles(self, reg: Region, chosen: list[tuple[int, ...]]) -> list[tuple[int, ...]]:
        """The region's ops outside ``chosen`` kernels, and its other ops (views), one by one."""
        inside = {i for c in chosen for i in c}
        blocks = {self.graph.ops[i].block for i in reg.ops}
        return [(op.id,) for op in self.graph.ops if op.block in blocks and op.id not in inside]

    def _fixed_kernels(self, plan: Plan) -> list[tuple[int, ...]]:
        idx = self.ctx.index
        out = []
        for grp in plan.fusion.groups:
            ops = [idx.op_by_name[n] for n in grp]
            ids = tuple(
                sorted(op.id for op in ops if op.kind is not OpKind.VIEW and op.phase is not Phase.OPTIMIZER)
            )
            if len(ids) > 1:
                out.append(ids)
        return out


def exact_plan(
    plan: Plan,
    ctx: PlanContext,
    *,
    anchors: bool,
    fusion: bool = True,
    remat: bool = True,
    refine: bool = True,
) -> Plan:
    """``plan``'s layout and precision with the block's kernels (``fusion``) and recompute set
    (``remat``) chosen by the block model, re-priced and re-solved until it fits (module doc);
    the best fitting answer, improved by the local search on the recompute set (``refine``; a
    search over many layouts refines only its winner, with ``polish``)."""
    from coplan.search.joint import _local_search

    bm = BlockModel(plan, ctx, anchors=anchors, fusion=fusion)
    fixed = None if fusion else plan
    held = plan.remat.all_names if not remat else None

    def build(s: Solved) -> Plan:
        p = plan.with_(fusion=as_fusion(ctx, s.kernels)) if fusion else plan
        return with_remat(p, s.recompute if held is None else held, ctx)

    first = bm.solve({}, 0.0, fixed, held)
    if first is None:
        return plan
    out = [build(first)]
    e = ctx.price(out[0])
    if not ctx.fits(e) and held is None:
        none = with_remat(out[0], frozenset(), ctx)
        e0 = ctx.price(none)
        freed = {
            n: e0.memory.peak_bytes - ctx.price(with_remat(none, frozenset({n}), ctx)).memory.peak_bytes
            for n in bm.names
        }
        need = e0.memory.peak_bytes - ctx.budget
        for _ in range(MAX_RESOLVES):
            s = bm.solve(freed, need, fixed)
            if s is None:
                break
            p = build(s)
            out.append(p)
            e = ctx.price(p)
            if ctx.fits(e):
                break
            need += e.memory.peak_bytes - ctx.budget
        # every tensor dropped: what fits when nothing else does
        out.append(with_remat(out[0], frozenset(saved_names(ctx)), ctx))
    best = min(out, key=lambda p: score(p, ctx))
    return _local_search(best, ctx, saved_names(ctx)) if held is None and refine else best


def polish(plan: Plan, ctx: PlanContext) -> Plan:
    """The local search on ``plan``'s recompute set (drop, add or swap one tensor) under the true
    cost model: what the linearised memory and times leave on the table."""
    from coplan.search.joint import _local_search

    if plan.remat.per_stage is not None:
        return plan
    return _local_search(plan, ctx, saved_names(ctx))


def exact_search(
    ctx: PlanContext,
    opts: Options,
    base: Plan,
    anchors: bool,
    name: str,
    warm: Sequence[Plan],
    solved: dict[tuple[object, ...], float] | None = None,
    per_op_dtypes: bool = True,
) -> tuple[Plan | None, int, int]:
    """The block model on every layout x precision of the space (``base``'s where held), explored
    best bound first and pruned against ``warm``: (the best plan or None, combinations, solved).
    A bound is the combination's price under the widest fusion option with nothing recomputed,
    less ``BOUND_MARGIN``, or its fitting step time where ``solved`` has it (keyed by layout,
    precision and fusion option); ``per_op_dtypes``: the precisions include every per-op dtype
    assignment of the block templates. A winner that is not a warm start has its recompute set
    polished."""
    from dataclasses import replace

    space = opts.space
    widest = "epilogue" if anchors else "greedy"
    # per op: each block template's norm and softmax dtypes too, every assignment
    combos = replace(space, fusion=(widest,)).plans(ctx, base, per_op_dtypes=per_op_dtypes)
    remat = "remat" not in space.fixed
    if not remat:
        combos = [c.with_(remat=base.remat) for c in combos]
    known = solved or {}
    library = library_gemms(ctx.cluster)

    def bound(p: Plan) -> float:
        # the widest fusion bounds a per-op fusion from below only where fusing costs nothing: a
        # GEMM template (``matmul_template``) is slower than the library call, so the bound prices
        # the widest plan with its GEMMs at the library's rate, and scales what the named-option
        # search solved for it by the same ratio
        if library is None:
            low = own = ctx.price(p).step_time_s
        else:
            low = ctx.model.estimate(library, ctx.config_of(p)).step_time_s
            own = 0.0
        solved_here = known.get((p.parallel, p.precision, widest), 0.0)
        if not solved_here:
            return low
        own = own or ctx.price(p).step_time_s  # priced once more only where a solution is scaled
        return max(low, solved_here * low / own)

    found, n = bound_search(
        ctx,
        combos,
        lambda p: exact_plan(p, ctx, anchors=anchors, remat=remat, refine=False),
        name,
        opts.progress,
        warm,
        margin=BOUND_MARGIN,
        bound=bound,
    )
    if found is not None and remat and all(found is not w for w in warm):
        found = polish(found, ctx)
    return found, len(combos), n


def library_gemms(cluster: ClusterSpec) -> ClusterSpec | None:
    """``cluster`` with every GEMM template at the library's rate (``matmul_template`` 1), where a
    device prices templates slower; None where none does."""
    from dataclasses import replace

    if all(g.device.efficiency.get("matmul_template", 1.0) >= 1.0 for g in cluster.groups):
        return None
    groups = tuple(
        replace(g, device=replace(g.device, efficiency={**g.device.efficiency, "matmul_template": 1.0}))
        for g in cluster.groups
    )
    return replace(cluster, groups=groups)


@strategy("joint-exact")
def joint_exact(ctx: PlanContext, opts: Options) -> tuple[Plan, list[PassRecord], list[str]]:
    from coplan.search.joint import joint, per_stage_remat, rebalance_stages

    op, anchors = op_level(ctx, opts)
    space = opts.space
    if not op:
        # the stack runs its own kernels (or fusion is held): nothing to decide per op
        plan, records, notes = joint(ctx, opts)
        why = (
            "fusion is held" if "fusion" in space.fixed else f"stack {ctx.stack.name!r} runs its own kernels"
        )
        return plan, records, [*notes, f"{why}: per-op fusion not searched"]
    base = opts.base if opts.base is not None else ctx.default_plan()
    remat = "remat" not in space.fixed
    best, combos, explored = exact_search(ctx, opts, base, anchors, "joint-exact", opts.warm)
    if best is not None and space.stages:
        if "parallel" not in space.fixed:
            best = rebalance_stages(best, ctx)
        if remat:
            best = per_stage_remat(best, ctx)
    if best is None:
        best = base
    regs = regions(ctx, anchors=anchors)
    cands = sum(len(r.candidates) for r in regs)
    gap = gap_note(best, ctx, anchors) if best.fusion.label == "joint" else None
    notes = [
        f"{combos:,} layout x precision combinations, {explored} solved exactly (bound-pruned)",
        f"{cands:,} candidate kernels over {len(regs)} regions"
        + (" (candidate cap reached: a subset of the space)" if any(r.truncated for r in regs) else ""),
    ]
    if gap is not None:
        notes.append(gap)
    return best, [], notes


def gap_note(plan: Plan, ctx: PlanContext, anchors: bool) -> str | None:
    """How far the block model's linear objective is from the cost model on ``plan``: the step
    time it predicts ``plan`` saves against its own layout under the widest fusion option with
    nothing recomputed, and what the full cost model prices that saving at."""
    ref = with_remat(plan.with_(fusion=_widest(ctx, anchors)), frozenset(), ctx)
    bm = BlockModel(plan, ctx, anchors=anchors, fusion=False)
    mine = bm.solve({}, 0.0, plan, plan.remat.all_names)
    theirs = bm.solve({}, 0.0, ref, frozenset())
    if mine is None or theirs is None:
        return None
    predicted = theirs.objective_s - mine.objective_s
    priced = ctx.price(ref).step_time_s - ctx.price(plan).step_time_s
    return (
        f"block model: {predicted * 1e3:+.3f} ms a step against the widest fusion with nothing "
        f"recomputed; the cost model prices {priced * 1e3:+.3f} ms"
    )


def _widest(ctx: PlanContext, anchors: bool) -> FusionPlan:
    from coplan.search.space import fusion_option

    return fusion_option(ctx, "epilogue" if anchors else "greedy")
