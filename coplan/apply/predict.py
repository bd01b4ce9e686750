"""What the cost model predicts for a run, and which plans a run must refuse.

The prediction prices the plan on the cluster the run executes on. On a CPU, ``nproc`` processes
share one machine: each process gets ``1/nproc`` of the threads, so each modelled device is the
calibrated device (measured with all threads) with ``1/nproc`` of its arithmetic and memory
throughput (launch overhead per kernel unchanged). Processes talk through the cluster's measured
link when it has one (``coplan calibrate --procs N``), else through shared memory at the device's
bandwidth.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from coplan.apply.dist import supported
from coplan.cost import CostModel, StackSpec
from coplan.errors import SpecError
from coplan.hardware.cluster import ClusterSpec, InterconnectLevel, NodeGroup
from coplan.hardware.device import DeviceSpec
from coplan.models.spec import ModelSpec
from coplan.plan.checker import check
from coplan.plan.context import PlanContext
from coplan.plan.types import Plan, PlanError

#: checker findings a run applies anyway (reported as notes): the cost model cannot price them
#: yet, but the runner can execute them, which is how they get measured


def cpu_share(device: DeviceSpec, share: float) -> DeviceSpec:
    """``device`` with ``share`` of its throughput (processes splitting one CPU's threads)."""
    return replace(
        device,
        name=f"{device.name} x{share:.2g}",
        peak_flops={k: v * share for k, v in device.peak_flops.items()},
        vector_flops=device.vector_flops * share,
        memory_bandwidth=device.memory_bandwidth * share,
    )


def run_cluster(cluster: ClusterSpec, nproc: int, device: str) -> ClusterSpec:
    """The cluster a run of ``nproc`` processes on ``device`` executes on, as the cost model sees it."""
    first = cluster.groups[0]
    dev = first.device
    if device == "cpu" and nproc > 1:
        dev = cpu_share(dev, 1 / nproc)
    elif nproc <= cluster.num_devices and device != "cpu":
        return cluster.resized(nproc)
    link = first.intra_node
    if nproc > 1 and link.name == "loopback":
        link = InterconnectLevel("shared-memory", dev.memory_bandwidth, 0.0, "fully-connected", "node")
    group = NodeGroup(dev, nproc, 1, link)
    return ClusterSpec(f"{cluster.name}[{nproc}]", (group,), None, cluster.source)


def make_context(
    spec: ModelSpec, cluster: ClusterSpec, global_batch: int, seq: int, device: str = "cpu"
) -> PlanContext:
    """The planning problem of a run on ``device``, priced as coplan's runner executes plans
    (``StackSpec.runner``: pipeline stages keep their outputs, ZeRO >= 1 is FSDP2 per block, and on a
    CPU collectives do not overlap compute)."""
    return PlanContext(
        CostModel(spec=spec), cluster, global_batch=global_batch, seq=seq, stack=StackSpec.runner(device)
    )


def refuse(plan: Plan, ctx: PlanContext, nproc: int) -> list[str]:
    """Validate ``plan`` for this run: raises ``PlanError`` (exit 2, one line) when it was made for
    another model, world size, batch or sequence, or is invalid; returns notes on what is applied
    the run should know."""
    src = "plan"
    if plan.model != ctx.model_name:
        raise PlanError("model", f"plan is for model {plan.model!r}, this run trains {ctx.model_name!r}", src)
    if plan.gpus != nproc:
        raise PlanError(
            "gpus",
            f"plan is for a world size of {plan.gpus}, this run has --nproc {nproc} "
            f"(re-plan with --gpus {nproc})",
            src,
        )
    why = supported(plan.parallel)
    if why:
        raise PlanError("parallel", why, src)
    notes: list[str] = []
    problems = [str(v) for v in check(plan, ctx, memory=False)]
    if problems:
        more = f" (+{len(problems) - 1} more)" if len(problems) > 1 else ""
        raise PlanError(None, f"cannot be applied to this run: {problems[0]}{more}", src)
    return notes


@dataclass(frozen=True, slots=True)
class Prediction:
    step_time_s: float
    saved_activation_bytes: float
    peak_bytes: float
    breakdown_s: dict[str, float]

    def figures(self) -> dict[str, float]:
        return {
            "step_time_s": self.step_time_s,
            "saved_activation_bytes": self.saved_activation_bytes,
            "peak_bytes": self.peak_bytes,
        }


def predict(plan: Plan, ctx: PlanContext) -> Prediction:
    """The cost model's step time, activation bytes (one microbatch in flight, most loaded rank)
    and peak memory for ``plan``."""
    priced = plan
    try:
        est = ctx.price(priced)
    except SpecError as e:
        raise PlanError(None, f"cannot be priced: {e}", "plan") from None
    return Prediction(
        step_time_s=est.step_time_s,
        # the most loaded rank's, as measured (a pipeline's stages differ; est.memory is the stage
        # with the highest peak, which need not hold the most activations)
        saved_activation_bytes=max(st.memory.activations_bytes for st in est.stages),
        peak_bytes=est.memory.peak_bytes,
        breakdown_s=dict(est.breakdown_s),
    )


def plan_for(
    ctx: PlanContext,
    *,
    recompute: frozenset[str] = frozenset(),
    compute: str = "fp32",
    tp: int = 1,
    zero: int = 0,
    microbatch: int | None = None,
    pp: int = 1,
) -> Plan:
    """A hand-made plan for ``ctx`` (tests, benchmarks): eager kernels, the given recompute set,
    precision and layout over all of ``ctx``'s devices (data parallel over what tensor and
    pipeline parallelism leave)."""
    from coplan.plan.types import ParallelPlan, PrecisionPlan, RematPlan

    dp = ctx.gpus // (tp * pp)
    # a pipeline needs microbatches to overlap: as many as stages by default
    mb = microbatch or max(1, ctx.global_batch // (dp * pp))
    return ctx.default_plan().with_(
        parallel=ParallelPlan(tp=tp, pp=pp, dp=dp, zero=zero, microbatch=mb),
        remat=RematPlan(recompute=recompute),
        precision=PrecisionPlan(compute=compute, loss_scaling=compute == "fp16"),
    )


def mode_stack(stack: StackSpec, mode: str, device: str = "cuda") -> StackSpec:
    """``stack`` as a run in ``mode`` on ``device`` executes it: ``torch.compile``'s own path
    partitions and schedules the whole step, loss included, so what one of its kernels alone reads
    is never written (``kernel_local_buffers``); a plan's groups write their outputs, an fp32
    loss-path output already cast (the stack's ``fused_output_casts``); eager runs write all. An
    eager run on a GPU launches each op the model writes in Python as eager PyTorch decomposes it
    (``kernels="eager"``, ``coplan.cost.eager``): ``F.cross_entropy``'s 16-bit log-softmax over the
    vocabulary and the fp32 cast autocast makes for ``nll_loss``, ``nn.RMSNorm`` as the fused kernel
    PyTorch dispatches it to (the stack's ``fused_rmsnorm``). With
    autocast's fp32 residual stream (``baseline_plan``) this moved the eager / compiled ratios
    priced for GPT-2 124M and Llama 3.2 1B on one H200 from 23-38 points under the measured to
    6-34 (``benchmarks/reprice_gpu.py``). On a CPU the runner's profile was fitted to
    the IR's own kernels (``coplan.hardware.calibrate``), so they stay."""
    want = mode == "compile"
    if stack.kernel_local_buffers != want:
        stack = replace(stack, kernel_local_buffers=want)
    if mode == "eager" and stack.fused_output_casts:
        stack = replace(stack, fused_output_casts=False)  # an fp32 output and its cast: two kernels
    if mode == "eager" and device != "cpu" and stack.kernels == "megatron":
        stack = replace(stack, kernels="eager")
    return stack


def baseline_plan(plan: Plan, ctx: PlanContext, mode: str, *, keep_recompute: bool = False) -> Plan:
    """What a baseline run (``Job.mode``) executes, as a plan the cost model can price: the plan's
    layout and batch; recomputation as the baseline's own (eager: none; ``torch.compile``: what its
    min-cut partitioner recomputes by default, ``passes.remat.with_mincut``; ``keep_recompute``:
    the plan's recompute set, for a compiled baseline given the plan's memory budget), autocast to
    the plan's 16-bit compute dtype (fp8 plans: bf16, which autocast offers; fp32 plans: fp32),
    and kernels as ``torch.compile``'s defaults fuse them (greedy pointwise fusion) or, eagerly,
    one per op."""
    from coplan.passes.precision import autocast_stream_ops, precision_variant
    from coplan.passes.remat import with_mincut
    from coplan.plan.types import RematPlan
    from coplan.search.space import fusion_option, keep_remat

    if mode == "plan":
        return plan
    compute = {"fp8": "bf16", "tf32": "fp32"}.get(plan.precision.compute, plan.precision.compute)
    prec = precision_variant(ctx, compute, "autocast") or precision_variant(ctx, compute, "fused")
    assert prec is not None
    if prec.ops and mode == "eager":
        # autocast over the fp32 model a baseline keeps: the residual stream stays fp32 too, and
        # eager autograd saves the fp32 tensors the norms read (on one H200 the eager runs saved
        # 41.3 GiB where this prices 40.2, 38.1 without). Compiled, the partitioner picks what to
        # save (the same run saved 28.4 GiB, 33.9 priced this way, 31.9 without), so the
        # compiled baseline keeps autocast's list alone
        prec = replace(prec, ops=autocast_stream_ops(ctx, compute))
    fusion = fusion_option(ctx, "greedy" if mode == "compile" else "eager")
    ran = plan.with_(fusion=fusion, remat=RematPlan(), precision=prec)
    if keep_recompute:
        # Inductor re-runs a recomputed pointwise op inside the backward kernels reading it, as
        # the plan's own compiled kernels do (``passes.remat.with_remat``)
        return keep_remat(ran, plan.remat, ctx)
    return with_mincut(ran, ctx) if mode == "compile" else ran


def megatron_recompute(ctx: PlanContext, mode: str) -> frozenset[str]:
    """Megatron's recompute modes as plan sets: ``full`` = every saved tensor of the block but its
    output (the next block's input, which full recomputation keeps); ``selective`` = the attention
    core; anything else = nothing."""
    names = [n for v in ctx.index.saved_names.values() for n in v]
    if mode == "full":
        return frozenset(n for n in names if not n.endswith("mlp_residual"))
    if mode == "selective":
        return frozenset(n for n in names if n.endswith((".attn.out", ".attn.lse")))
    return frozenset()
