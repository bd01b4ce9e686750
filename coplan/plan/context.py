"""What every pass and strategy needs to know about a planning problem, in one explicit object.

``PlanContext`` binds a model (its cost model and graph), a cluster, the job (GPUs, global batch,
sequence length) and the constraints (memory budget, numerics tolerance). It turns a ``Plan`` into
the cost model's ``TrainingConfig`` (expanding per-template decisions to every block) and prices
it, so every strategy is measured by the same cost model.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from functools import cached_property
from typing import NamedTuple

from coplan.cost import ConfigError, CostModel, Estimate, TrainingConfig
from coplan.cost.checkpoint import selective_op_names
from coplan.cost.config import OpGroups, degrees, recomputes_fully, userbuffers_overlap
from coplan.cost.parts import GraphProfile
from coplan.cost.stacks import StackSpec, load_stack
from coplan.errors import SpecError
from coplan.hardware.cluster import ClusterSpec
from coplan.ir.fingerprint import fingerprint as graph_fingerprint
from coplan.ir.types import Graph, Op
from coplan.limits import MAX_GLOBAL_BATCH, MAX_SEQ, bounded_int
from coplan.plan.labels import Labels
from coplan.plan.types import FusionPlan, ParallelPlan, Plan, PlanError, PrecisionPlan, RematPlan

GiB = 1024**3
#: Memory a job cannot plan for: the CUDA context and NCCL buffers (about 1 GiB on current
#: drivers) and allocator fragmentation (PyTorch's caching allocator typically strands a few
#: percent of the heap). The default budget is capacity minus this reserve.
RESERVE_FIXED_BYTES = 1 * GiB
RESERVE_FRACTION = 0.05


def binary_bytes(n: float) -> str:
    """``3.5 * 2**30`` -> ``"3.5 GiB"``; small sizes in MiB, KiB or bytes (budgets of tiny test
    models would all read ``0.0 GiB``)."""
    for scale, unit in ((2**40, "TiB"), (GiB, "GiB"), (2**20, "MiB"), (2**10, "KiB")):
        if abs(n) >= scale:
            return f"{n / scale:.1f} {unit}"
    return f"{int(n)} B"


def default_budget(capacity_bytes: float) -> float:
    return capacity_bytes * (1 - RESERVE_FRACTION) - RESERVE_FIXED_BYTES


@dataclass(frozen=True, slots=True)
class Numerics:
    """Per-op numerics tolerance: the relative error a planner may accept from lowering a
    sensitive op (softmax, norm, loss) below fp32. 0 keeps every sensitive op in fp32."""

    tolerance: float = 0.0


class BlockIndex:
    """Names of the reference block's ops and tensors, and their positions in every other block.

    Blocks of one template have the same ops in the same order (``profile._signature``), so a
    decision about the op at position ``i`` of the reference block applies to position ``i`` of
    every block of the template.
    """

    def __init__(self, graph: Graph, profile: GraphProfile) -> None:
        self.graph = graph
        by_block: dict[int | None, list[Op]] = {}
        for op in graph.ops:
            by_block.setdefault(op.block, []).append(op)
        self.block_ops = {b: ops for b, ops in by_block.items() if b is not None}
        self.outside = tuple(by_block.get(None, ()))
        self.ref_of: dict[int, int] = {}  # block -> its template's reference block
        for t in profile.templates:
            for b in t.blocks:
                self.ref_of[b] = t.blocks[0]
        self.op_by_name: dict[str, Op] = {}
        self.position: dict[str, tuple[int, int]] = {}  # name -> (reference block, position)
        for ref in sorted(set(self.ref_of.values())):
            for i, op in enumerate(self.block_ops[ref]):
                self.op_by_name[op.name] = op
                self.position[op.name] = (ref, i)
        for op in self.outside:
            self.op_by_name[op.name] = op
        # reference tensors by name -> the op producing them (what recomputing one re-runs)
        self.producer_of: dict[str, Op] = {
            graph.tensors[t].name: op for op in self.op_by_name.values() for t in op.outputs
        }
        self.saved_names: dict[int, tuple[str, ...]] = {
            t.blocks[0]: tuple(n for _, n, _ in t.saved_items) for t in profile.templates
        }
        self._labels: Labels | None = None

    @property
    def labels(self) -> Labels:
        """Module-path labels of the names plans use (built on first use: only reports need them)."""
        if self._labels is None:
            self._labels = Labels(self.graph, self.block_ops, self.outside, self.ref_of)
        return self._labels

    def expand(self, names: tuple[str, ...]) -> list[tuple[int, ...]]:
        """Op-id groups of every block for one group of reference names (one per block, or one
        for ops outside blocks)."""
        unknown = [n for n in names if n not in self.op_by_name]
        if unknown:
            raise PlanError("fusion.groups", f"unknown op {unknown[0]!r}")
        refs = {self.position[n][0] if n in self.position else None for n in names}
        if refs == {None}:
            return [tuple(self.op_by_name[n].id for n in names)]
        if len(refs) > 1:  # the checker's fusion rule reports this as a group spanning blocks
            raise PlanError("fusion.groups", f"group {list(names)} spans blocks")
        ref = next(iter(refs))
        assert ref is not None
        pos = [self.position[n][1] for n in names]
        return [
            tuple(self.block_ops[b][i].id for i in pos) for b, r in sorted(self.ref_of.items()) if r == ref
        ]


@dataclass
class PlanContext:
    """A planning problem. ``budget_bytes`` defaults to device capacity minus the stated reserve."""

    model: CostModel
    cluster: ClusterSpec
    global_batch: int
    seq: int
    budget_bytes: float | None = None
    numerics: Numerics = field(default_factory=Numerics)
    stack: StackSpec = field(default_factory=lambda: load_stack("megatron"))
    #: the compute dtypes the job allows (``plan --dtypes``); None: every one the devices run
    dtypes: tuple[str, ...] | None = None
    _priced: dict[Decisions, Estimate] = field(default_factory=dict, repr=False)
    _configs: dict[Decisions, TrainingConfig] = field(default_factory=dict, repr=False)
    _expanded: dict[FusionPlan, tuple[tuple[int, ...], ...]] = field(default_factory=dict, repr=False)
    _dtypes: dict[object, tuple[tuple[int, str], ...]] = field(default_factory=dict, repr=False)
    _policies: dict[frozenset[str], str] | None = field(default=None, repr=False)
    #: what searches derive from the problem alone (the per-op fusion regions), computed once
    memo: dict[object, object] = field(default_factory=dict, repr=False)
    evaluations: int = 0

    def __post_init__(self) -> None:
        for name, value, bound in (
            ("global_batch", self.global_batch, MAX_GLOBAL_BATCH),
            ("seq", self.seq, MAX_SEQ),
        ):
            why = bounded_int(value, bound)
            if why is not None:
                raise SpecError("job", name, why)
        if self.on_cpus:
            # a stack on CPUs runs as it does there (no GEMM epilogues, gloo on the compute cores)
            self.stack = self.stack.runner_for("cpu")
        small = min(self.cluster.devices, key=lambda d: d.memory_bytes)
        cap = small.memory_bytes
        if self.budget_bytes is None:
            self.budget_bytes = default_budget(cap)
            return
        budget = self.budget_bytes
        if isinstance(budget, bool) or not isinstance(budget, int | float) or not _finite(budget):
            raise SpecError("memory budget", None, f"must be a finite number of bytes, got {budget!r}")
        if budget <= 0:
            raise SpecError("memory budget", None, f"must be positive, got {binary_bytes(budget)} per GPU")
        # a budget beyond the memory the device has would let plans "fit" that cannot run
        if budget > cap:
            raise SpecError(
                "memory budget",
                None,
                f"{binary_bytes(budget)} per GPU exceeds the {binary_bytes(cap)} of {small.name}",
            )

    # --- the problem ---------------------------------------------------------------------------

    @property
    def gpus(self) -> int:
        return self.cluster.num_devices

    @property
    def on_cpus(self) -> bool:
        """Whether every device of the cluster is a CPU (the host computes)."""
        return all(d.kind == "cpu" for d in self.cluster.devices)

    @property
    def inductor(self) -> str | None:
        """Where the stack compiles the plan's own groups with Inductor (its ``greedy`` fusion):
        ``"cpu"`` (the C++ backend) when every device is a CPU, else ``"gpu"`` (Triton); None
        where the stack launches kernels of its own."""
        if "greedy" not in self.stack.fusion:
            return None
        return "cpu" if self.on_cpus else "gpu"

    @cached_property
    def attention_kernel(self) -> str:
        """The stack's fused-attention kernel where every device of the cluster prices it, else
        the devices' own: a kernel without measured rates on some device is not invented."""
        kernel = self.stack.attention_kernel
        return kernel if all(d.prices_attention(kernel) for d in self.cluster.devices) else "auto"

    @property
    def budget(self) -> float:
        assert self.budget_bytes is not None
        return self.budget_bytes

    @cached_property
    def reference_profile(self) -> GraphProfile:
        graph = self.model.graph
        batch = graph.meta.batch if graph is not None else 1
        return self.model.profile(batch, self.seq, "none")

    @cached_property
    def index(self) -> BlockIndex:
        prof = self.reference_profile
        return BlockIndex(prof.graph, prof)

    @cached_property
    def graph_fingerprint(self) -> str:
        return graph_fingerprint(self.reference_profile.graph)

    @property
    def model_name(self) -> str:
        return self.model.name

    @cached_property
    def device_dtypes(self) -> frozenset[str]:
        """Precisions every device of the cluster runs natively in its matrix units."""
        sets = [
            frozenset(d for d in ("fp32", "tf32", "bf16", "fp16", "fp8") if dev.supports(d))
            for dev in self.cluster.devices
        ]
        out = sets[0]
        for s in sets[1:]:
            out &= s
        return out | {"fp32"}

    @property
    def compute_dtypes(self) -> frozenset[str]:
        """The compute dtypes a plan of this job may use: the devices' own, within ``dtypes``."""
        native = self.device_dtypes
        return native if self.dtypes is None else native & frozenset(self.dtypes)

    def default_plan(self) -> Plan:
        """What a user gets without planning: eager kernels, nothing recomputed, plain data
        parallelism over every GPU with microbatch 1 (the stack's first ZeRO stage: 0 where it
        replicates), fp32. A stack that cannot run eager kernels runs its own fusion (its first
        option: a compiled stack, Inductor's groups)."""
        fusion = FusionPlan()
        if "eager" not in self.stack.fusion:
            from coplan.search.space import fusion_option  # the options are built by the passes

            fusion = fusion_option(self, self.stack.fusion[0])
        return Plan(
            model=self.model_name,
            graph=self.graph_fingerprint,
            cluster=self.cluster.name,
            gpus=self.gpus,
            global_batch=self.global_batch,
            seq=self.seq,
            parallel=ParallelPlan(
                dp=self.gpus, microbatch=1, zero=self.stack.zero_stages[0] if self.gpus > 1 else 0
            ),
            fusion=fusion,
            remat=RematPlan(),
            precision=PrecisionPlan(compute="fp32"),
        )

    # --- pricing -------------------------------------------------------------------------------

    def expand_fusion(self, fusion: FusionPlan) -> tuple[tuple[int, ...], ...]:
        """The plan's groups as op-id groups of the whole graph; every other op a singleton
        (memoised: a search prices many recompute sets under one fusion plan)."""
        got = self._expanded.get(fusion)
        if got is None:
            got = self._expanded[fusion] = self._expand(fusion)
        return got

    def _expand(self, fusion: FusionPlan) -> tuple[tuple[int, ...], ...]:
        idx = self.index
        grouped: list[tuple[int, ...]] = []
        covered: set[int] = set()
        for g in fusion.groups:
            for ids in idx.expand(g):
                grouped.append(ids)
                covered.update(ids)
        if fusion.duplicated:
            grouped = self._duplicate(fusion.duplicated, grouped, covered)
        singles = [(op.id,) for op in idx.graph.ops if op.id not in covered]
        return OpGroups((*grouped, *singles))

    def _duplicate(
        self, names: frozenset[str], grouped: list[tuple[int, ...]], covered: set[int]
    ) -> list[tuple[int, ...]]:
        """``grouped`` with each duplicated op (every block's) added to the kernel of each of its
        readers in its own phase (a reader alone becomes a kernel of two); the op is then in
        several groups, which the cost model reads as copies (``cost.profile``)."""
        from coplan.cost.fusion import readers

        graph = self.index.graph
        out = list(grouped)
        where = {i: n for n, g in enumerate(out) for i in g}
        for name in sorted(names):
            for (p,) in self.index.expand((name,)):
                phase = graph.ops[p].phase
                for t in graph.ops[p].outputs:
                    for r in sorted(readers(graph, t)):
                        if graph.ops[r].phase is not phase:
                            continue  # read in backward: kept or recomputed, as remat decides
                        n = where.get(r)
                        if n is None:
                            where[r] = n = len(out)
                            out.append((r,))
                            covered.add(r)
                        if p not in out[n]:
                            out[n] = (*out[n], p)
                covered.add(p)
        return out

    def expand_dtypes(self, precision: PrecisionPlan) -> tuple[tuple[int, str], ...]:
        """The plan's per-op dtypes as (op id, dtype) for every block (memoised)."""
        if not precision.ops:
            return ()
        got = self._dtypes.get(precision.ops)
        if got is None:
            out: list[tuple[int, str]] = []
            for name, dtype in precision.ops:
                for ids in self.index.expand((name,)):
                    out.extend((i, dtype) for i in ids)
            got = self._dtypes[precision.ops] = tuple(out)
        return got

    def _policy_names(self) -> dict[frozenset[str], str]:
        """The recompute sets of the stack's checkpointing policies that the cost model prices by
        name (Megatron's ``selective`` and ``full``), for a stack that recomputes only by policy:
        its plans are priced as the published runs of that policy were."""
        if self._policies is None:
            self._policies = {}
            if not self.stack.recompute_sets:
                for name, names in policy_sets(self).items():
                    if name in ("selective", "full") and names:
                        self._policies[names] = name
        return self._policies

    def kernels_stack(self, plan: Plan) -> StackSpec:
        """The stack whose kernels ``plan`` runs: its stack's compile preset where the plan turns
        ``torch.compile`` on, else its stack (``StackSpec.kernels_for``)."""
        return self.stack.kernels_for(plan.fusion.label)

    def config_of(self, plan: Plan) -> TrainingConfig:
        """The cost model's configuration for ``plan`` (raises ``ConfigError`` when impossible)."""
        key = _decisions(plan)
        got = self._configs.get(key)
        if got is not None:
            return got
        p = plan.parallel
        fusion: str | tuple[tuple[int, ...], ...] = (
            self.expand_fusion(plan.fusion)
            if plan.fusion.groups or plan.fusion.duplicated
            else "megatron"
            # Megatron-LM's own kernel set, named not grouped, where the stack runs only that set
            if plan.fusion.label == "megatron" and self.stack.megatron_kernels_only
            else "none"
        )
        dp = self.gpus // (p.tp * p.cp * p.pp) if p.tp * p.cp * p.pp else 0
        if p.dp != dp:
            raise ConfigError("dp", f"{degrees(p.tp, p.cp, p.pp, p.dp)} does not equal the {self.gpus} GPUs")
        rem = plan.remat
        policy = self._policy_names()
        per_stage = (
            None
            if rem.per_stage is None
            else tuple(policy.get(names, names) if names else "none" for names in rem.per_stage)
        )
        recompute = policy.get(rem.recompute, rem.recompute) if rem.recompute else "none"
        if rem.layers is not None and rem.recompute and rem.recompute == policy_sets(self).get("full"):
            # some blocks fully recomputed: priced by name wherever the stack recomputes sets too
            recompute = "full"
        config = TrainingConfig(
            tp=p.tp,
            pp=p.pp,
            dp=p.dp,
            cp=p.cp,
            vpp=p.vpp,
            microbatch=p.microbatch,
            global_batch=plan.global_batch,
            seq=plan.seq,
            sequence_parallel=p.sequence_parallel,
            recompute=recompute,
            recompute_per_stage=per_stage,
            # a count without full recomputation is the checker's remat finding, priced as none
            recompute_layers=rem.layers if recomputes_fully(recompute, per_stage) else None,
            recompute_fused=plan.fusion.recompute_in_backward,
            op_dtypes=self.expand_dtypes(plan.precision),
            zero=p.zero,
            dtype=plan.precision.compute,
            flash_attention=plan.flash_attention,
            fusion=fusion,
            master_weights=plan.precision.master_weights,
            grad_reduce_fp32=plan.precision.grad_reduce == "fp32",
            fp8_params=plan.precision.fp8_params,
            overlap_grad_reduce=self.stack.overlap,
            overlap_param_gather=p.zero >= 1 and self.stack.overlap,
            tp_comm_overlap=self.stack.tp_comm_overlap
            and userbuffers_overlap(self.cluster.devices, p.tp, p.sequence_parallel),
            # async TP where the stack runs it as the plan does (torchtitan: compiled only)
            async_tp=self.kernels_stack(plan).async_tp and p.tp > 1 and p.sequence_parallel,
            overlap_zero=self.stack.overlap,
            pipeline_keeps_outputs=self.stack.pipeline_keeps_outputs,
            fsdp_units=self.stack.fsdp_units,
            dp_bucket_params=self.stack.dp_bucket_params,
            dp_bucket_scope=self.stack.dp_bucket_scope,
            attention_kernel=self.attention_kernel,
            stage_layers=p.stage_layers,
            fsdp_shard=p.fsdp_shard,
        )
        # the stack's kernels (and the loss they imply), as ``coplan estimate --stack`` prices them:
        # its compiled preset's where the plan turns torch.compile on (``StackSpec.kernels_for``);
        # the fusion groups, attention kernel and layout stay the plan's
        config = self.kernels_stack(plan).with_kernels(config)
        self._configs[key] = config
        return config

    def price(self, plan: Plan) -> Estimate:
        """The cost model's estimate of ``plan`` (memoised by decisions)."""
        key = _decisions(plan)
        got = self._priced.get(key)
        if got is None:
            config = self.config_of(plan)
            got = self.model.estimate(self.cluster, config)
            self._priced[key] = got
            self.evaluations += 1
        return got

    def fits(self, est: Estimate) -> bool:
        return est.memory.peak_bytes <= self.budget

    def describe_budget(self) -> str:
        return f"{binary_bytes(self.budget)} per GPU"


def _finite(x: float) -> bool:
    try:
        return math.isfinite(x)
    except OverflowError:  # an integer beyond the float range
        return False


class Decisions(NamedTuple):
    """What pricing depends on (not the plan's identity fields, which the checker compares): the
    key of every priced plan, and what a report says of a plan it plots."""

    parallel: ParallelPlan
    fusion: FusionPlan
    remat: RematPlan
    precision: PrecisionPlan
    flash_attention: bool

    @classmethod
    def of(cls, plan: Plan) -> Decisions:
        return cls(plan.parallel, plan.fusion, plan.remat, plan.precision, plan.flash_attention)


def _decisions(plan: Plan) -> Decisions:
    return Decisions.of(plan)


def policy_sets(ctx: PlanContext) -> dict[str, frozenset[str]]:
    """The recompute set of each checkpointing policy of ``ctx.stack`` a plan can express, from
    the least recomputed to the most."""
    names = [n for v in ctx.index.saved_names.values() for n in v]
    out: dict[str, frozenset[str]] = {}
    for policy in ctx.stack.checkpointing:
        if policy == "none":
            out[policy] = frozenset()
        elif policy == "selective":
            out[policy] = frozenset(n for n in names if n.endswith((".attn.out", ".attn.lse")))
        elif policy == "selective-op":
            graph = ctx.index.graph
            ops: set[str] = set()
            for ref in ctx.index.saved_names:
                ops |= selective_op_names(graph, ref)
            out[policy] = frozenset(n for n in names if n in ops)
        elif policy == "full":
            out[policy] = frozenset(n for n in names if not n.endswith("mlp_residual"))
    return dict(sorted(out.items(), key=lambda kv: len(kv[1])))


#: how ``plan_summary`` names a stack's checkpointing policy a plan's recompute set is
POLICY_WORDS = {
    "selective": "Megatron's selective checkpointing",
    "selective-op": "per-op checkpointing (torchtitan's policy)",
    "full": "full checkpointing",
}


def plan_summary(
    plan: Plan,
    est: Estimate | None = None,
    index: BlockIndex | None = None,
    policies: Mapping[str, frozenset[str]] | None = None,
) -> Mapping[str, str]:
    """What a plan decided, in words (for tables and reports). With the job's ``index``, ops and
    tensors are named by where they are in the model (``h[*].ln_1``), not by their IR names; with
    its stack's ``policies`` (``policy_sets``), a recompute set one of them makes is named so."""
    p, f, r, c = plan.parallel, plan.fusion, plan.remat, plan.precision
    policy = next(
        (
            POLICY_WORDS[k]
            for k, v in (policies or {}).items()
            if k in POLICY_WORDS and v and v == r.recompute
        ),
        None,
    )
    labels = index.labels if index is not None else None
    if labels is not None:
        rec = [labels.tensor(n) for n in labels.tensors_in_order(r.all_names)]
    else:
        rec = [n.split(".", 2)[-1] for n in sorted(r.all_names)]
    out = {
        "parallel": p.describe(),
        "remat": "nothing recomputed"
        if not rec
        else (f"{policy}: " if policy and r.per_stage is None else "")
        + f"recompute {len(rec)}: {_listed(rec)}"
        + (f" (first {r.layers} blocks of each chunk)" if r.layers is not None else ""),
        **(
            {"remat per stage": " / ".join(str(len(x)) for x in r.per_stage) + " tensors"}
            if r.per_stage is not None
            else {}
        ),
        **(
            {"recomputed in backward kernels": str(len(f.recompute_in_backward))}
            if f.recompute_in_backward
            else {}
        ),
        "fusion": "Megatron-LM's fused kernels"
        if f.label == "megatron" and not f.groups
        else "torch.compile (Inductor fuses as it decides)"
        if f.label == "compiled" and not f.groups
        else "none (eager: each op its own kernel)"
        if f.label == "eager" and not f.groups
        else f"{len(f.groups)} fused groups ({f.fused_ops} ops), {f.label}",
        "precision": c.compute
        + (f", {len(c.ops)} ops overridden" if c.ops else "")
        + (", loss scaling" if c.loss_scaling else "")
        + (f", gradients reduced in {c.grad_reduce}" if c.grad_reduce != "fp32" else "")
        + (", fp8 weights" if c.fp8_params else ""),
    }
    if est is not None:
        out["kernels"] = f"{est.kernels_per_step:,} kernels/step"
    if labels is not None and c.ops:
        dtypes = dict(c.ops)
        for dtype in sorted(set(dtypes.values()), key=lambda d: d != "fp32"):
            names = [labels.op(n) for n in labels.ops_in_order(n for n, d in dtypes.items() if d == dtype)]
            out["precision"] += f"; {dtype}: {_listed(names)}"
    return out


def _listed(names: list[str], shown: int = 4) -> str:
    """The first ``shown`` names and how many more there are."""
    more = len(names) - shown
    return ", ".join(names[:shown]) + (f" (+{more} more)" if more > 0 else "")


__all__ = [
    "BlockIndex",
    "Decisions",
    "GiB",
    "Numerics",
    "PlanContext",
    "binary_bytes",
    "default_budget",
    "plan_summary",
    "policy_sets",
]
