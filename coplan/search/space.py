"""The space strategies search, shared so that every strategy (and the exhaustive oracle) sees
the same choices."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass, replace

from coplan.passes.fusion import _as_plan, greedy_groups, megatron_fusion, scope_ops, xla_fusion
from coplan.passes.parallel import candidates
from coplan.passes.precision import PRECISION_VARIANTS, block_assignments, precision_variant
from coplan.passes.remat import with_remat
from coplan.plan.capabilities import precision_problem
from coplan.plan.checker import SENSITIVE_16BIT_ERROR
from coplan.plan.context import PlanContext
from coplan.plan.types import FusionPlan, ParallelPlan, Plan, PrecisionPlan, RematPlan

Progress = Callable[[str, int, int], None]

FUSION_OPTIONS: tuple[str, ...] = ("eager", "greedy", "epilogue", "megatron", "duplicate")
#: the four decision spaces, named as the passes are
DECISIONS: tuple[str, ...] = ("fusion", "remat", "parallel", "precision")


@dataclass(frozen=True, slots=True)
class SearchSpace:
    """Which choices a search may make. ``dtypes`` None: every compute precision the devices run
    natively; ``fusion``: named fusion options (``eager``: none; ``greedy``: Inductor-style;
    ``epilogue``: greedy plus pointwise epilogues and prologues fused into GEMMs, as Triton GEMM
    templates and cuBLASLt epilogues allow; ``megatron``: Megatron-LM's fused kernels);
    ``precision``: variants of per-op dtypes (``passes.precision.PRECISION_VARIANTS``); ``stages``:
    whether joint may split layers unevenly and recompute per stage (exhaustive cannot enumerate
    those, so the oracle tests turn it off); ``fixed``: decisions not searched at all but kept as
    the base plan has them (``Options.base``), so a search can optimise one or two spaces with the
    others held (the coupling study, ``coplan.experiments``). Every choice is further kept to what
    the context's stack executes (``plan.capabilities``): its layouts and ZeRO stages, its fusion
    options, fp8 only where it runs fp8 natively."""

    dtypes: tuple[str, ...] | None = None
    fusion: tuple[str, ...] = ("greedy", "epilogue")
    zero: tuple[int, ...] = (0, 1, 2, 3)
    precision: tuple[str, ...] = PRECISION_VARIANTS
    stages: bool = True  # refine pipeline stages: uneven layer split, per-stage recompute sets
    reduce16: bool = True  # gradients may be reduced in 16 bits where the stack can
    fp8_params: bool = True  # fp8 plans may keep fp8 weights where the stack can
    fixed: frozenset[str] = frozenset()  # of DECISIONS: kept from the base plan, not searched
    #: fusion also decided per op, where the stack compiles the plan's own groups: every legal
    #: partition of each region into kernels (``opspace``), which ``joint`` then searches with
    #: ``joint-exact``'s block model beside the named options and ``exhaustive`` enumerates
    #: instead of them (``joint-exact`` always searches per op)
    per_op: bool = True

    def __post_init__(self) -> None:
        unknown = sorted(set(self.fixed) - set(DECISIONS))
        if unknown:
            raise ValueError(f"unknown decision {unknown[0]!r}; decisions: {', '.join(DECISIONS)}")

    def precisions(self, ctx: PlanContext) -> list[PrecisionPlan]:
        """Every compute dtype of the space under every precision variant that applies (the
        16-bit loss only where the job's numerics tolerance allows it)."""
        native = ctx.device_dtypes
        want = self.dtypes if self.dtypes is not None else (ctx.dtypes or ("fp32", "bf16", "fp16", "fp8"))
        out = []
        for d in want:
            if d not in native or (d == "fp8" and not ctx.stack.runs_fp8):
                continue
            if d == "fp16" and "bf16" in native and self.dtypes is None and ctx.dtypes is None:
                continue  # bf16 has fp16's speed without loss scaling: fp16 is never better
            for v in self.precision:
                if v == "loss16" and ctx.numerics.tolerance < SENSITIVE_16BIT_ERROR:
                    continue
                p = precision_variant(ctx, d, v)
                if p is not None:
                    # the storage choices beside the plain variant only: they are orthogonal to the
                    # per-op overrides, and each multiplies the layouts priced
                    out.extend(self._storage(ctx, p) if v == "fused" else [p])
        return out

    def _storage(self, ctx: PlanContext, p: PrecisionPlan) -> list[PrecisionPlan]:
        """``p`` with each gradient-reduction dtype and fp8-weight choice the stack offers and the
        space allows: what experts set beside the compute dtype (a 16-bit reduction halves the
        gradient buffers and their traffic; fp8 weights drop the 16-bit weight copy)."""
        out = [p]
        if self.reduce16 and ctx.stack.reduce_16bit and p.compute in ("bf16", "fp16", "fp8") and ctx.gpus > 1:
            half = "fp16" if p.compute == "fp16" else "bf16"
            out.append(replace(p, grad_reduce=half))
        if self.fp8_params and ctx.stack.keeps_fp8_params and p.compute == "fp8":
            out += [replace(q, fp8_params=True) for q in out]
        return out

    def fusions(self, ctx: PlanContext, precision: PrecisionPlan | None = None) -> list[FusionPlan]:
        """The space's fusion options the stack executes; where it executes none of them, the
        stack's own options, each a setting of the stack (Megatron-DeepSpeed's fused kernels or
        its ``--no-*-fusion`` flags, torchtitan's ``training.compile`` on or off). With
        ``precision``, only the options that run it (torchtitan's float8 only compiled)."""
        names = [n for n in self.fusion if n in ctx.stack.fusion] or list(ctx.stack.fusion)
        if precision is not None:
            names = [n for n in names if precision_problem(ctx, precision, n) is None]
        return [fusion_option(ctx, name) for name in names]

    def parallel(self, ctx: PlanContext) -> Iterator[ParallelPlan]:
        return candidates(ctx, zero=self.zero)

    def plans(self, ctx: PlanContext, base: Plan, per_op_dtypes: bool = False) -> list[Plan]:
        """``base`` under every layout x compute precision x fusion option of the space (a fixed
        decision: ``base``'s own). Nothing is recomputed unless remat is fixed, in which case
        ``base``'s recompute sets are kept and the fusion plan's recomputation inside backward
        kernels is derived for them (as ``with_remat`` does), so each plan is priced as it runs.
        ``per_op_dtypes``: the precisions also take every per-op dtype assignment of the block
        templates (``passes.precision.block_assignments``), as the per-op strategies search them."""
        fixed = self.fixed
        precisions = [base.precision] if "precision" in fixed else self.precisions(ctx)
        if per_op_dtypes and "precision" not in fixed:
            # beside the variants with the default storage only: the reduction dtype and fp8
            # weights are orthogonal to the per-op dtypes (as ``precisions`` keeps them beside
            # the plain variant), and each assignment is another block model to solve
            seen: dict[object, PrecisionPlan] = {}
            for prec in precisions:
                plain = prec.grad_reduce == "fp32" and not prec.fp8_params
                for q in block_assignments(ctx, prec) if plain else [prec]:
                    seen.setdefault(q, q)
            precisions = list(seen.values())
        fusions = (
            [replace(base.fusion, recompute_in_backward=frozenset())]
            if "fusion" in fixed
            else self.fusions(ctx)
        )
        layouts = [base.parallel] if "parallel" in fixed else list(self.parallel(ctx))
        start = base.with_(remat=RematPlan())
        # a precision only under the fusion options that run it (``precision_problem``)
        pairs = [(prec, fus) for prec in precisions for fus in fusions if runs(ctx, prec, fus)]
        out = [
            start.with_(parallel=par, precision=prec, fusion=fus) for par in layouts for prec, fus in pairs
        ]
        if "remat" in fixed:
            out = [keep_remat(p, base.remat, ctx) for p in out]
        return out


def runs(ctx: PlanContext, precision: PrecisionPlan, fusion: FusionPlan) -> bool:
    """Whether the stack runs ``precision`` under ``fusion``'s option: an option's own grouping
    (no label of the stack's) runs what the stack's own kernels run."""
    return precision_problem(ctx, precision, fusion.label) is None


def keep_remat(plan: Plan, remat: RematPlan, ctx: PlanContext) -> Plan:
    """``plan`` recomputing ``remat`` (shared or per-stage sets) under ``plan``'s fusion."""
    p = with_remat(plan, remat.all_names, ctx)
    return p.with_(remat=remat) if remat.per_stage is not None else p


def fusion_option(ctx: PlanContext, name: str) -> FusionPlan:
    graph = ctx.index.graph
    if name == "eager":
        return FusionPlan()
    if name == "compiled":  # the stack's compiler decides: no groups of the plan's
        return FusionPlan(label="compiled")
    if name == "megatron":
        return megatron_fusion(ctx)
    if name == "greedy":
        return _as_plan(graph, greedy_groups(graph, scope_ops(ctx), inductor=ctx.inductor), "greedy")
    if name == "epilogue":
        groups = greedy_groups(graph, scope_ops(ctx), into_anchors=True, inductor=ctx.inductor)
        return _as_plan(graph, groups, "epilogue")
    if name == "duplicate":
        return xla_fusion(ctx)
    raise ValueError(f"unknown fusion option {name!r}; options: {', '.join(FUSION_OPTIONS)}")
