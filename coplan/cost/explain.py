"""Where a stage's compute goes: every kernel of one microbatch on one pipeline stage, priced.

``estimate`` sums kernels into the step's ``compute``; this lists them (the same rates, scale and
kernel rules, so the rows add up to the stage's forward and backward time), for a compiler engineer
asking which GEMM, attention or pointwise kernel a configuration spends its time in, and whether
each is compute-, memory- or launch-bound. Transformer Engine's fp8 casts (``fp8.py``) are one row
per block template and direction; a recompute, the tensor-parallel collectives and the pipeline are
not kernels of the model and stay in the estimate's breakdown.
"""

from __future__ import annotations

from dataclasses import dataclass

from coplan.cost.config import TrainingConfig
from coplan.cost.eager import stack_kernels
from coplan.cost.fp8 import fp8_cost, runs_fp8
from coplan.cost.kernels import Rates, Scale, kernel_time, local_dims, memory_s
from coplan.cost.parts import GraphProfile, Kernel, Part, part_dtype, run_kernels
from coplan.cost.stages import stage_devices, stage_parts
from coplan.hardware.cluster import ClusterSpec
from coplan.hardware.device import DeviceSpec
from coplan.ir.types import Graph, OpKind


@dataclass(frozen=True, slots=True)
class KernelCost:
    """One kernel of a part, as a stage runs it in one microbatch."""

    part: str  # the block template ("block[0]"), "embedding" or "head"
    count: float  # times the stage runs it per microbatch (its layers using the template)
    phase: str  # "forward" or "backward"
    kind: str  # "matmul", "attention", "vector" or "fp8 casts"
    name: str  # module path and ops of the kernel
    dims: str  # "M x N x K" of a GEMM as one GPU runs it (tensor-parallel dimension divided)
    seconds: float  # one launch on this stage's device, sharded as the configuration says
    bound: str  # "compute", "memory" or "launch": what sets its time

    @property
    def total_s(self) -> float:
        return self.count * self.seconds

    def to_dict(self) -> dict[str, object]:
        return {
            "part": self.part,
            "count": self.count,
            "phase": self.phase,
            "kind": self.kind,
            "name": self.name,
            "dims": self.dims,
            "seconds": self.seconds,
            "total_s": self.total_s,
            "bound": self.bound,
        }


def kernel_costs(
    profile: GraphProfile, cluster: ClusterSpec, config: TrainingConfig, stage: int = 0
) -> tuple[KernelCost, ...]:
    """Every kernel pipeline stage ``stage`` runs in one microbatch, most expensive first.

    Prices kernels as ``estimate`` does: the stage's pacing device, the training dtype's rates (a
    kernel with a precision override at its own; under fp8 the embedding and head at bf16's), the
    kernels ``run_kernels`` chooses (Megatron's loss kernels, an eager MLP activation)."""
    if not 0 <= stage < config.pp:
        raise ValueError(f"stage {stage} is outside the pipeline's {config.pp} stages")
    device = stage_devices(cluster, config)[stage]
    scale = Scale.of(config)
    rates: dict[str, Rates] = {}

    def rates_of(dtype: str) -> Rates:
        got = rates.get(dtype)
        if got is None:
            got = rates[dtype] = Rates.of(device, dtype, config.attention_kernel)
        return got

    g = profile.graph
    rows: list[KernelCost] = []
    for part, n in stage_parts(profile, config, stage):
        base = part_dtype(part, config.dtype)
        fwd, bwd = run_kernels(part, config.loss_fusion, config.activation_fusion)
        # as ``estimate`` prices them: eager PyTorch's decompositions, Inductor's ATen fallbacks
        fwd, bwd = stack_kernels(g, fwd, bwd, config, part is profile.post)
        for k in (*fwd, *bwd):
            if k.kind == "free":
                continue
            r = rates_of(k.dtype or base)
            t = kernel_time(k, r, scale)
            rows.append(
                KernelCost(
                    part.name,
                    n,
                    k.phase.value,
                    k.kind,
                    _name(g, k),
                    _dims(k, config.tp),
                    t,
                    _bound(k, r, scale, t),
                )
            )
        rows.extend(_fp8_rows(part, n, config, device, rates_of(base)))
    rows.sort(key=lambda row: -row.total_s)
    return tuple(rows)


def _fp8_rows(part: Part, n: float, config: TrainingConfig, device: DeviceSpec, r: Rates) -> list[KernelCost]:
    if not runs_fp8(config.dtype, device) or not part.fp8_gemms:
        return []
    f8 = fp8_cost(part.fp8_gemms, config, r.bandwidth, r.launch_s)
    out = []
    for phase, t, launches in (
        ("forward", f8.forward_s, f8.forward_kernels),
        ("backward", f8.backward_s, f8.backward_kernels),
    ):
        if launches:
            name = f"{launches} Transformer Engine casts and transposes"
            out.append(KernelCost(part.name, n, phase, "fp8 casts", name, "", t, "memory"))
    name = "weight casts (per use)" if config.gathers_per_unit else "weight casts (a share of once per step)"
    out.append(KernelCost(part.name, n, "forward", "fp8 casts", name, "", f8.weight_cast_s, "memory"))
    return out


def _name(g: Graph, k: Kernel) -> str:
    real = [g.ops[i] for i in k.ops if g.ops[i].kind is not OpKind.VIEW]
    anchor = next(
        (op for op in real if op.kind in (OpKind.MATMUL, OpKind.ATTENTION)), real[0] if real else None
    )
    if anchor is None:
        return ""
    names = list(dict.fromkeys(op.target.split(".")[-2] if "." in op.target else op.target for op in real))
    more = f" +{len(names) - 3}" if len(names) > 3 else ""
    return f"{anchor.module_path or '(top)'}: {', '.join(names[:3])}{more}"


def _dims(k: Kernel, tp: int) -> str:
    if k.kind != "matmul":
        return ""
    return " x ".join(str(d) for d in local_dims(k, tp))


def _bound(k: Kernel, r: Rates, s: Scale, t: float) -> str:
    """What sets a kernel's time: its launch (over half of it), else memory where its traffic at
    the device's bandwidth takes the rest, else compute."""
    fixed = r.launch_s + (r.mm_call_s if k.kind == "matmul" else 0.0)
    if fixed >= t / 2:
        return "launch"
    memory = memory_s(k, r, s)
    return "memory" if memory >= (t - fixed) * (1 - 1e-9) else "compute"


__all__ = ["KernelCost", "kernel_costs"]
