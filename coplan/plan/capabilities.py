"""What a plan may choose when a given training stack runs it.

A ``StackSpec`` says which layouts (TP, PP, interleaving, sequence parallelism, ZeRO stages),
fusion options, precisions and checkpointing it executes. The search generates only those
(``passes.parallel.candidates``, ``search.space.SearchSpace``, ``passes.remat.with_remat``) and the
checker refuses a plan that uses anything else, naming it (``problems``).

A stack without ``recompute_sets`` recomputes only what its checkpointing policies do; each is a
recompute set over the reference blocks (``policy_sets``): ``none`` nothing, ``full`` every saved
tensor but the block's output (which the next block reads), Megatron's ``selective`` the attention
core, torchtitan's ``selective-op`` its per-op policy (``cost.checkpoint``). ``selective-layer``
checkpoints every N-th block, which one set for every block cannot express: a plan does not
choose it.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

from coplan.cost.config import TrainingConfig
from coplan.cost.envelope import Validated
from coplan.cost.results import Estimate
from coplan.cost.stacks import StackError, StackSpec, load_stack, load_stack_file
from coplan.cost.stages import split_layers
from coplan.plan.context import PlanContext, policy_sets
from coplan.plan.types import ParallelPlan, Plan, PrecisionPlan

#: the stack a plan is made for unless one is named: Megatron-LM, the full space
DEFAULT_STACK = "megatron"


def plan_stack(name: str | None = None, file: Path | None = None) -> StackSpec:
    """The stack ``coplan plan``/``compare`` plan for: the preset ``name``, the stack ``file``
    (JSON of a preset's shape), or ``megatron`` when neither is given; both is an error."""
    if name is not None and file is not None:
        raise StackError("--stack", None, "give --stack or --stack-file, not both")
    if file is not None:
        return load_stack_file(file)
    return load_stack(name if name is not None else DEFAULT_STACK)


def layout_problem(stack: StackSpec, par: ParallelPlan) -> str | None:
    """Why ``stack`` cannot run layout ``par`` (None: it can)."""
    if par.tp > 1 and not stack.tensor_parallel:
        return f"tensor parallelism (tp {par.tp})"
    if par.pp > 1 and not stack.pipeline_parallel:
        return f"pipeline parallelism (pp {par.pp})"
    if par.vpp > 1 and not stack.interleaved_pipeline:
        return f"interleaved pipeline stages (vpp {par.vpp})"
    if par.sequence_parallel and not stack.sequence_parallel:
        return "sequence parallelism"
    if par.cp > 1 and not stack.context_parallel:
        return f"context parallelism (cp {par.cp})"
    if par.fsdp_shard is not None and not stack.hybrid_shard:
        return f"hybrid sharding (FSDP within groups of {par.fsdp_shard})"
    if not stack.combined_layouts:
        if par.pp > 1 and (par.tp > 1 or par.dp > 1):
            return f"pipeline parallelism combined with tp {par.tp}, dp {par.dp}"
        if par.tp > 1 and par.dp > 1 and par.zero >= 1:
            return f"tensor parallelism combined with ZeRO stage {par.zero}"
    # one data-parallel rank shards nothing: every stage is the same layout
    if par.dp * par.cp > 1 and par.zero not in stack.zero_stages:
        allowed = ", ".join(str(z) for z in stack.zero_stages)
        return f"ZeRO stage {par.zero} (it offers {allowed})"
    if stack.ddp_alone and par.zero == 0 and par.dp > 1 and par.tp * par.pp * par.cp > 1:
        beside = f"tp {par.tp}, pp {par.pp}, cp {par.cp}"
        return f"plain data parallelism (ZeRO 0) beside {beside} (it runs DDP alone)"
    if par.pp > 1 and par.dp * par.cp > 1 and par.zero not in stack.pipeline_zero_stages:
        allowed = ", ".join(str(z) for z in stack.pipeline_zero_stages)
        return f"ZeRO stage {par.zero} with pipeline parallelism (it offers {allowed} there)"
    return None


def config_problems(stack: StackSpec, config: TrainingConfig) -> list[str]:
    """What of a configuration priced for ``stack`` (``coplan estimate --stack``) the stack cannot
    run, one line each: its layout, fp8 GEMMs, a checkpointing policy it does not offer (by name;
    a recompute set is a plan's, which ``problems`` checks against the stack's policies)."""
    out = []
    par = ParallelPlan(
        tp=config.tp, pp=config.pp, dp=config.dp, vpp=config.vpp, cp=config.cp,
        sequence_parallel=config.sequence_parallel, zero=config.zero, microbatch=config.microbatch,
        fsdp_shard=config.hybrid_group,
    )  # fmt: skip
    why = layout_problem(stack, par)
    if why is not None:
        out.append(f"stack {stack.name!r} cannot run {why}")
    if stack.fp8 == "none" and config.dtype == "fp8":
        # torchtitan's float8 runs only compiled: estimate --compile prices it so
        compiled = " only compiled (--compile)" if stack.runs_fp8 else ""
        out.append(f"stack {stack.name!r} {'runs' if compiled else 'cannot run'} fp8 GEMMs{compiled}")
    modes = config.recompute_per_stage or (config.recompute,)
    for mode in modes:
        if isinstance(mode, str) and mode not in stack.checkpointing:
            policies = ", ".join(stack.checkpointing)
            out.append(f"stack {stack.name!r} cannot recompute {mode!r} (its policies: {policies})")
            break
    return out


def default_zero(stack: StackSpec) -> int:
    """The ZeRO stage a plan without one uses under ``stack``: 0 where it replicates, else its
    lowest sharding stage."""
    return stack.zero_stages[0]


def executable_remat(ctx: PlanContext, names: frozenset[str]) -> frozenset[str]:
    """``names`` where the stack recomputes any set; otherwise the smallest policy set that
    recomputes at least ``names`` (the most recomputing one where none covers them): a search
    asking to drop some tensors gets the policy the stack would run for it."""
    if ctx.stack.recompute_sets:
        return names
    sets = list(policy_sets(ctx).values())
    if not sets:
        return names
    for s in sets:
        if names <= s:
            return s
    return sets[-1]


def fusion_problem(ctx: PlanContext, plan: Plan) -> str | None:
    """Why ``ctx.stack`` cannot run ``plan``'s fusion groups (None: it can)."""
    from coplan.search.space import fusion_option  # the options' groups; search imports this module

    allowed = ctx.stack.fusion
    groups = {frozenset(g) for g in plan.fusion.groups}
    if plan.fusion.duplicated and "duplicate" not in allowed:
        n = len(plan.fusion.duplicated)
        return f"{n} duplicated producer{'s' if n > 1 else ''} (its compiler does not duplicate ops)"
    if "duplicate" in allowed and "greedy" not in allowed and plan.fusion.label == "duplicate":
        return None  # an XLA-style compiler runs any grouping and duplication the checker accepts
    if "greedy" in allowed:
        # a stack compiling the plan's own groups runs any grouping the checker's fusion rule
        # accepts and Inductor emits, with a GEMM or attention inside a group only where it emits
        # GEMM epilogues
        from coplan.plan.checker import ANCHORS, inductor_problem

        megatron = "megatron" in allowed and plan.fusion.label == "megatron"
        if megatron and groups == {frozenset(g) for g in fusion_option(ctx, "megatron").groups}:
            return None  # the stack also runs Megatron-LM's own kernel set
        ops = ctx.index.op_by_name
        target = ctx.inductor or "gpu"
        for g in plan.fusion.groups:
            head = ", ".join(g[:3])
            known = [ops[n] for n in g if n in ops]
            if "epilogue" not in allowed and len(known) > 1 and any(op.kind in ANCHORS for op in known):
                return f"fusion group [{head}...] fuses into a library kernel (it runs no GEMM epilogues)"
            why = inductor_problem(ctx.index.graph, tuple(op.id for op in known), target)
            if why is not None:
                return f"fusion group [{head}...]: {why}"
        return None
    for name in allowed:
        if groups == {frozenset(g) for g in fusion_option(ctx, name).groups}:
            return None
    return f"fusion {plan.fusion.label!r} with {len(groups)} groups (it runs {', '.join(allowed)} only)"


def named_fusion(ctx: PlanContext, plan: Plan) -> str | None:
    """The fusion option of ``ctx.stack`` whose kernels ``plan``'s groups are exactly (``megatron``
    for Megatron-LM's kernel set given as groups), or None where the plan groups ops its own way."""
    from coplan.search.space import fusion_option  # the options' groups; search imports this module

    if plan.fusion.duplicated:
        return None
    groups = {frozenset(g) for g in plan.fusion.groups}
    for name in ctx.stack.fusion:
        if name in ("compiled", "duplicate"):
            continue  # a compiler's own grouping, not a named kernel set
        if groups == {frozenset(g) for g in fusion_option(ctx, name).groups}:
            return name
    return None


def precision_problem(ctx: PlanContext, c: PrecisionPlan, fusion_label: str) -> str | None:
    """Why ``ctx.stack`` cannot run precision ``c`` under the fusion option ``fusion_label``
    (None: it can). fp8 GEMMs and fp8 weights are the stack's as that option runs it
    (``StackSpec.kernels_for``): torchtitan runs its float8 linears only compiled."""
    stack = ctx.stack
    runs = stack.kernels_for(fusion_label)
    only = f"only with torch.compile on (fusion 'compiled', as {stack.compile_preset!r})"
    if runs.fp8 == "none" and (c.compute == "fp8" or any(d == "fp8" for _, d in c.ops)):
        return f"runs fp8 GEMMs {only}" if stack.runs_fp8 else "cannot run fp8 GEMMs"
    if c.grad_reduce != "fp32" and not stack.reduce_16bit:
        return f"cannot reduce gradients in {c.grad_reduce} (it reduces fp32)"
    if c.fp8_params and not runs.fp8_params:
        return f"keeps fp8 weights {only}" if stack.keeps_fp8_params else "cannot keep fp8 weights"
    return None


def validated_plan(ctx: PlanContext, plan: Plan, estimate: Estimate) -> Validated:
    """Whether ``plan``'s priced configuration lies inside what the cost model was validated on,
    judged as its stack runs it: a compiled plan against the compile preset's runs, a named kernel
    set by its name, a recompute set that is one of the stack's checkpointing policies (torchtitan's
    per-op set) as that policy's runs (``coplan.cost.envelope.validated``)."""
    from coplan.cost.envelope import validated

    # where the stack recomputes only by policy, a plan's set is the policy it runs; where it
    # recomputes any set, the set is the plan's own choice, priced as such
    sets = policy_sets(ctx) if not ctx.stack.recompute_sets else {}
    policies = {names: name for name, names in sets.items() if names}
    return validated(
        estimate, ctx.model.spec, ctx.kernels_stack(plan).name, named_fusion(ctx, plan), policies
    )


def chunk_sizes(plan: Plan, ctx: PlanContext) -> list[int]:
    """Blocks of each model chunk (virtual pipeline stage) under ``plan``'s layout, as the cost
    model splits them (``cost.stages.split_layers``)."""
    p = plan.parallel
    return split_layers(ctx.reference_profile.n_layers, p.pp * p.vpp, p.stage_layers)


def problems(plan: Plan, ctx: PlanContext) -> Iterator[str]:
    """What in ``plan`` its stack cannot execute, one line each."""
    stack = ctx.stack
    why = layout_problem(stack, plan.parallel)
    if why is not None:
        yield f"stack {stack.name!r} cannot run {why}"
    why = fusion_problem(ctx, plan)
    if why is not None:
        yield f"stack {stack.name!r} cannot run {why}"
    c = plan.precision
    why = precision_problem(ctx, c, plan.fusion.label)
    if why is not None:
        yield f"stack {stack.name!r} {why}"
    r = plan.remat
    if r.layers is not None:
        if stack.layer_checkpointing == "none":
            yield (
                f"stack {stack.name!r} cannot fully recompute only some blocks (its policies: "
                f"{', '.join(stack.checkpointing)})"
            )
        else:
            chunk = min(chunk_sizes(plan, ctx))
            if r.layers < chunk and r.layers not in stack.layer_counts(chunk):
                counts = ", ".join(str(n) for n in stack.layer_counts(chunk))
                yield (
                    f"stack {stack.name!r} checkpoints every N-th block: {r.layers} of {chunk} blocks is "
                    f"not one of its counts ({counts})"
                )
    if not stack.recompute_sets:
        sets = policy_sets(ctx)
        for s in r.per_stage if r.per_stage is not None else (r.recompute,):
            if frozenset(s) not in sets.values():
                yield (
                    f"stack {stack.name!r} cannot recompute a set of {len(s)} tensors (its policies: "
                    f"{', '.join(stack.checkpointing)})"
                )
                break


__all__ = [
    "DEFAULT_STACK",
    "chunk_sizes",
    "config_problems",
    "default_zero",
    "executable_remat",
    "fusion_problem",
    "layout_problem",
    "named_fusion",
    "plan_stack",
    "policy_sets",
    "precision_problem",
    "problems",
    "validated_plan",
]
