"""The choices of ``coplan estimate``'s flags (and ``coplan inspect``'s optimizer), each the cost
model's own tuple of settings as a Typer choice (the tuple named beside each class)."""

from __future__ import annotations

import enum


class Recompute(enum.StrEnum):
    none = "none"
    selective = "selective"
    full = "full"
    # torchtitan's per-op policy (``coplan.cost.checkpoint.selective_op_names``), as a recompute set
    selective_op = "selective-op"


class Dtype(enum.StrEnum):
    fp32 = "fp32"
    tf32 = "tf32"
    bf16 = "bf16"
    fp16 = "fp16"
    fp8 = "fp8"


class Fusion(enum.StrEnum):
    megatron = "megatron"
    none = "none"


class BucketScope(enum.StrEnum):  # coplan.cost.buckets.BUCKET_SCOPES
    megatron_core = "megatron-core"
    all = "all"
    padded = "padded"
    none = "none"


class AttentionKernel(enum.StrEnum):  # coplan.cost.config.ATTENTION_KERNEL_CHOICES
    auto = "auto"
    cudnn = "cudnn"
    flash2 = "flash2"
    flash3 = "flash3"
    triton = "triton"


class LossFusion(enum.StrEnum):  # coplan.cost.config.LOSS_FUSIONS
    none = "none"
    native = "native"
    te = "te"
    inductor = "inductor"


class Fp8Scaling(enum.StrEnum):  # coplan.cost.config.FP8_SCALINGS
    tensorwise = "tensorwise"
    rowwise = "rowwise"


class Zero3Gather(enum.StrEnum):  # coplan.cost.config.ZERO3_GATHERS
    unit = "unit"
    module = "module"
    tensor_list = "tensor-list"


class GradAccumulation(enum.StrEnum):  # coplan.cost.config.GRAD_ACCUMULATIONS
    fused = "fused"
    autograd16 = "autograd16"
    autograd32 = "autograd32"
    fp32_buffer = "fp32-buffer"


class Optimizer(enum.StrEnum):  # coplan.cost.config.OPTIMIZER_IMPLEMENTATIONS, coplan.inspect.step.OPTIMIZERS
    fused = "fused"
    foreach = "foreach"
    for_loop = "for-loop"


class FsdpPipeline(enum.StrEnum):  # coplan.cost.config.FSDP_PIPELINES
    microbatch = "microbatch"
    step = "step"


class CpExchange(enum.StrEnum):  # coplan.cost.config.CP_EXCHANGES
    p2p = "p2p"
    allgather = "allgather"


class PpSend(enum.StrEnum):  # coplan.cost.config.PP_SENDS
    scatter_gather = "scatter-gather"
    whole = "whole"


class LossCast(enum.StrEnum):  # coplan.cost.config.LOSS_CASTS
    float = "float"
    autocast = "autocast"
    none = "none"
    fused = "fused"
    parallel = "parallel"
