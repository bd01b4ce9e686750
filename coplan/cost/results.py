"""The cost model's answers: an ``Estimate`` of a step (time, throughput, MFU, breakdown), the
``StageEstimate`` of each pipeline stage and the ``MemoryEstimate`` of its most loaded GPU.

Immutable values, produced by ``coplan.cost.estimate.estimate``; ``to_dict`` is what ``coplan
estimate --json`` prints.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from coplan.cost.config import TrainingConfig

BREAKDOWN_KEYS: tuple[str, ...] = (
    "compute",
    "recompute",
    "tp_comm",
    "cp_comm",
    "pp_comm",
    "pipeline_bubble",
    "dp_comm",
    "zero_comm",
    "optimizer",
)


@dataclass(frozen=True, slots=True)
class MemoryEstimate:
    """Bytes on one GPU (the ``stage``'s most loaded rank). ``activations_bytes`` is what is kept
    for backward at the peak; ``peak_bytes`` adds the transient working set."""

    params_bytes: float
    grads_bytes: float
    optimizer_bytes: float
    activations_bytes: float
    transient_bytes: float
    peak_bytes: float
    capacity_bytes: float
    stage: int = 0
    #: the gradients held at the peak: ``grads_bytes``, none where the peak comes before backward
    #: makes them, twice it where PyTorch DDP's buckets sit beside ``.grad``
    #: (``coplan.cost.stages.peak_of``); -1: ``grads_bytes``
    peak_grads_bytes: float = -1.0

    def __post_init__(self) -> None:
        if self.peak_grads_bytes < 0:
            object.__setattr__(self, "peak_grads_bytes", self.grads_bytes)

    @property
    def fits(self) -> bool:
        return self.peak_bytes <= self.capacity_bytes

    def to_dict(self) -> dict[str, Any]:
        return {
            "params_bytes": int(self.params_bytes),
            "grads_bytes": int(self.grads_bytes),
            "peak_grads_bytes": int(self.peak_grads_bytes),
            "optimizer_bytes": int(self.optimizer_bytes),
            "activations_bytes": int(self.activations_bytes),
            "transient_bytes": int(self.transient_bytes),
            "peak_bytes": int(self.peak_bytes),
            "capacity_bytes": int(self.capacity_bytes),
            "stage": self.stage,
        }


@dataclass(frozen=True, slots=True)
class StageEstimate:
    """One pipeline stage, per microbatch (``*_s``) and per step (``tail_s``)."""

    index: int
    layers: int
    device: str
    forward_s: float
    backward_s: float
    recompute_s: float
    tp_comm_s: float
    cp_comm_s: float  # context parallelism's ring transfers not hidden by attention
    pp_comm_s: float
    zero_comm_s: float  # per microbatch (ZeRO-3 parameter gathers not hidden by compute)
    dp_comm_s: float  # per step, exposed
    param_gather_s: float  # per step, exposed (ZeRO 1/2 all-gather after the update)
    optimizer_s: float
    in_flight: float  # microbatches whose activations the stage holds at its peak
    kernels: int  # kernels launched per microbatch
    memory: MemoryEstimate

    @property
    def microbatch_s(self) -> float:
        return (
            self.forward_s
            + self.backward_s
            + self.recompute_s
            + self.tp_comm_s
            + self.cp_comm_s
            + self.pp_comm_s
            + self.zero_comm_s
        )

    @property
    def tail_s(self) -> float:
        return self.dp_comm_s + self.param_gather_s + self.optimizer_s

    def to_dict(self) -> dict[str, Any]:
        return {
            "index": self.index,
            "layers": self.layers,
            "device": self.device,
            "forward_s": self.forward_s,
            "backward_s": self.backward_s,
            "recompute_s": self.recompute_s,
            "tp_comm_s": self.tp_comm_s,
            "pp_comm_s": self.pp_comm_s,
            "zero_comm_s": self.zero_comm_s,
            "dp_comm_s": self.dp_comm_s,
            "param_gather_s": self.param_gather_s,
            "optimizer_s": self.optimizer_s,
            "in_flight": self.in_flight,
            "kernels": self.kernels,
            "memory": self.memory.to_dict(),
        }


@dataclass(frozen=True, slots=True)
class Estimate:
    """What one configuration costs. ``breakdown_s`` sums to ``step_time_s``.

    ``model_tflops_per_gpu`` counts the step's matrix FLOPs with causal attention at half its full
    score matrix (``coplan.cost.parts.CAUSAL_FRACTION``), as the attention kernels are priced.
    ``mfu`` takes them against the 16-bit dense peak of the devices (``peak_flops_16bit``, bf16 or
    fp16 where a device lacks bf16), whatever the training dtype, so MFUs of bf16 and fp8 runs
    compare; ``mfu_dtype_peak`` against the peak of the precision the devices' matrix units run the
    dtype in (``peak_flops``, in ``peak_dtype``: fp8's on an H100, bf16's for fp8 on an A100). On a
    mixed cluster each is the lowest device's peak.
    """

    step_time_s: float
    tokens_per_s: float
    model_tflops_per_gpu: float
    mfu: float
    memory: MemoryEstimate
    breakdown_s: Mapping[str, float]
    stages: tuple[StageEstimate, ...]
    config: TrainingConfig
    cluster: str
    gpus: int
    peak_flops: float
    launch_overhead_s: float
    kernels_per_step: int
    mfu_dtype_peak: float
    peak_flops_16bit: float
    peak_dtype: str
    peak_dtype_16bit: str
    notes: tuple[str, ...] = field(default=())

    @property
    def fits(self) -> bool:
        return all(s.memory.fits for s in self.stages)

    def to_dict(self) -> dict[str, Any]:
        return {
            "step_time_s": self.step_time_s,
            "tokens_per_s": self.tokens_per_s,
            "model_tflops_per_gpu": self.model_tflops_per_gpu,
            "mfu": self.mfu,
            "peak_flops_16bit_per_gpu": self.peak_flops_16bit,
            "peak_dtype_16bit": self.peak_dtype_16bit,
            "mfu_dtype_peak": self.mfu_dtype_peak,
            "peak_flops_per_gpu": self.peak_flops,
            "peak_dtype": self.peak_dtype,
            "fits": self.fits,
            "memory": self.memory.to_dict(),
            "breakdown_s": dict(self.breakdown_s),
            "launch_overhead_s": self.launch_overhead_s,
            "kernels_per_step": self.kernels_per_step,
            "cluster": self.cluster,
            "gpus": self.gpus,
            "config": self.config.to_dict(),
            "stages": [s.to_dict() for s in self.stages],
            "notes": list(self.notes),
        }


# --- the model -------------------------------------------------------------------------------------
