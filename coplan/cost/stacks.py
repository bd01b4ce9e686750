"""Training stacks as data: what the software around a model's math does, preset by name.

A plan says *what* a step computes (layout, batch, recompute, precision). The stack that runs it
decides the rest: which kernels each op launches, the attention kernel, how parameters and
gradients are sharded and communicated, which checkpointing policies exist, what the allocator
reserves and the host's part. ``StackSpec`` names those settings; each cites where it comes from
(``sources``). Presets live in ``coplan/cost/stacks/*.json`` (``megatron``, the default, prices
exactly what the cost model priced before stacks were named); ``--stack-file`` reads one of the
same shape.
"""

from __future__ import annotations

import json
from collections.abc import Iterable
from dataclasses import dataclass, fields, replace
from functools import cache
from importlib import resources
from pathlib import Path
from typing import Any

from coplan.cost.buckets import BUCKET_SCOPES
from coplan.cost.config import (
    ATTENTION_KERNEL_CHOICES,
    CP_EXCHANGES,
    DDP_BUCKET_BYTES,
    FSDP_PIPELINES,
    GRAD_ACCUMULATIONS,
    KERNEL_SETS,
    LOSS_CASTS,
    OPTIMIZER_IMPLEMENTATIONS,
    PP_SENDS,
    ROPE_FORMS,
    ZERO3_GATHERS,
    TrainingConfig,
)
from coplan.cost.stages import PIPELINE_SPLITS, weighted_split
from coplan.errors import SpecError

#: How parameters, gradients and optimizer states are sharded and communicated:
#: ``megatron-distopt`` (Megatron's distributed optimizer: one bucketed reduce-scatter per step, one
#: all-gather after the update), ``fsdp1`` (PyTorch FSDP with flat parameters per wrapped unit),
#: ``fsdp2`` (per-parameter DTensor sharding, ``fully_shard`` per block), ``deepspeed-zero``
#: (DeepSpeed's ZeRO stages 1-3), ``ddp`` (replicated, bucketed all-reduce).
SHARDINGS: tuple[str, ...] = ("megatron-distopt", "fsdp1", "fsdp2", "deepspeed-zero", "ddp")
#: The PyTorch-native shardings and where their gradients live (``TrainingConfig.grad_storage``):
#: autograd's ``.grad`` everywhere; beside DDP's buckets at ZeRO 0 where the stack runs DDP
#: (nanoGPT's ``DDP(model)``; coplan's runner and torchtitan run DDP, or torchtitan's ``replicate``,
#: which wraps it, for ZeRO 0 beside FSDP2 for the rest), not where FSDP1's presets run
#: (fms-fsdp and llm-foundry shard with FSDP1 only). Megatron's and DeepSpeed's gradient buffers
#: live through the run.
PYTORCH_GRADS: dict[str, str] = {"fsdp1": "autograd", "fsdp2": "ddp", "ddp": "ddp"}
#: Activation-checkpointing policies a stack may offer: ``none``, ``full`` (each block), Megatron's
#: ``selective`` (the attention core), torchtitan's per-op ``selective-op`` (save matmul outputs but
#: every second one, and attention's; recompute the rest) and ``selective-layer`` (some blocks fully
#: checkpointed, the others not, placed as ``layer_checkpointing`` says).
CHECKPOINT_POLICIES: tuple[str, ...] = ("none", "full", "selective", "selective-op", "selective-layer")
#: Which blocks a stack's per-layer checkpointing (``selective-layer``) checkpoints: ``first`` (the
#: first N of each model chunk, Megatron-LM's ``--recompute-method block``: any count), ``every``
#: (every N-th block, torchtitan's ``selective_ac_option = "N"``: counts ``layers // N``),
#: ``spread`` (a share evenly spaced, fms-fsdp's ``selective_checkpointing = p``: any count) or
#: ``none`` (the stack has no per-layer checkpointing).
LAYER_CHECKPOINTINGS: tuple[str, ...] = ("none", "first", "every", "spread")
#: The settings a stack file may give, besides ``name``, ``about`` and ``sources``.
SETTINGS: tuple[str, ...] = (
    "kernels",
    "eager_loss",
    "attention_kernel",
    "sharding",
    "fsdp_units",
    "pipeline_keeps_outputs",
    "overlap",
    "tp_comm_overlap",
    "dp_bucket_params",
    "dp_bucket_scope",
    "checkpointing",
    "reserved_fraction",
    "expandable_segments",
    "reduce_input",
    "tensor_parallel",
    "pipeline_parallel",
    "interleaved_pipeline",
    "sequence_parallel",
    "context_parallel",
    "combined_layouts",
    "zero_stages",
    "pipeline_zero_stages",
    "ddp_alone",
    "fusion",
    "fp8",
    "recompute_sets",
    "reduce_16bit",
    "fp8_params",
    "async_tp",
    "gemm_padding",
    "kernel_local_buffers",
    "fused_output_casts",
    "eager_rope",
    "eager_loss_cast",
    "fused_rmsnorm",
    "optimizer",
    "zero3_gather",
    "grad_accumulation",
    "fsdp_pipeline",
    "pipeline_split",
    "cp_exchange",
    "pipeline_send",
    "layer_checkpointing",
    "hybrid_shard",
    "compile_preset",
)
#: Where FSDP2 allocates a unit's reduce-scatter input (``coplan.cost.steptrace``): on the
#: compute stream, kept until the next unit's reduction (``compute``: PyTorch since
#: pytorch/pytorch#129721 of 2024-06-27, "[FSDP2] Ran reduce-scatter copy-in in default stream"),
#: or on its reduce-scatter stream, freed once reduced (``reduce-scatter``: FSDP2 before it, whose
#: ``foreach_reduce_scatter`` made the input inside ``torch.cuda.stream(reduce_scatter_stream)``).
REDUCE_INPUTS: tuple[str, ...] = ("compute", "reduce-scatter")
#: How a stack runs fp8 GEMMs: natively, emulated (runs, not faster) or not at all.
FP8_MODES: tuple[str, ...] = ("native", "emulated", "none")
#: The fusion options a stack can execute (``coplan.search.space.FUSION_OPTIONS``): ``eager`` (each
#: op its own kernel), ``greedy`` (Inductor's pointwise/reduction groups), ``epilogue`` (greedy
#: plus epilogues fused into GEMMs), ``megatron`` (Megatron-LM's hand-written fused kernels), and
#: ``compiled``: no groups a plan imposes, the stack's compiler fuses as it does (priced as
#: ``configure`` prices it under Inductor's kernels).
FUSION_CHOICES: tuple[str, ...] = ("eager", "greedy", "epilogue", "megatron", "compiled", "duplicate")


class StackError(SpecError):
    """A stack preset or file that cannot be read (exit code 2)."""

    def __init__(self, source: str, field: str | None, message: str) -> None:
        super().__init__(source, field, message)


@dataclass(frozen=True, slots=True, kw_only=True)
class StackSpec:
    """A training stack, validated on construction.

    Attributes:
        name: the preset's name (or the file's ``name``).
        kernels: the kernels each op launches (``KERNEL_SETS``): ``megatron`` (Megatron-LM /
            Transformer Engine fused kernels), ``eager`` (eager PyTorch: each op of a module's
            Python as PyTorch decomposes it, ``coplan.cost.eager``), ``inductor`` (torch.compile:
            pointwise chains fused into the kernels around them).
        eager_loss: under compiled kernels, the loss side of the model (final norm, output
            projection, loss) still runs eager: torch.compile wraps each block, or the model
            without the loss computed outside it.
        attention_kernel: the fused-attention kernel the stack runs (``"auto"``: the device's own).
        sharding: how state is sharded and communicated (``SHARDINGS``).
        fsdp_units: ZeRO 1/2 run as per-block units (all-gather in forward, reduce-scatter after
            each block's backward) rather than once per step.
        pipeline_keeps_outputs: a pipeline stage keeps the output it sent for its backward.
        overlap: collectives run on their own stream behind compute (prefetch, bucketed overlap).
        tp_comm_overlap: Transformer Engine's userbuffers overlap of TP collectives where a
            production Megatron-Core stack turns it on.
        dp_bucket_params / dp_bucket_scope: gradient buckets (``coplan.cost.buckets``).
        checkpointing: the activation-checkpointing policies the stack offers.
        tensor_parallel / pipeline_parallel / interleaved_pipeline / sequence_parallel: the
            layouts the stack can run (a planner searches only these).
        context_parallel: it splits each sequence over ranks, attention over a ring
            (``TrainingConfig.cp``).
        combined_layouts: it combines them: pipelining with TP or DP, TP with ZeRO sharding.
        zero_stages: the ZeRO stages (0: replicated, DDP) the stack's sharding offers.
        pipeline_zero_stages: the ZeRO stages it runs together with pipeline parallelism, of
            those it offers (DeepSpeed's pipeline engine refuses ZeRO-2 and ZeRO-3).
        ddp_alone: its plain data parallelism (ZeRO 0 over more than one replica) runs only as the
            job's one parallelism, never beside tensor, pipeline or context parallelism.
        fusion: the fusion options it executes (``FUSION_CHOICES``).
        fp8: how it runs fp8 GEMMs (``FP8_MODES``): ``native`` (Transformer Engine, torchao
            float8), ``emulated`` (it runs an fp8 plan, quantizing in higher precision, no
            faster: a search does not choose fp8) or ``none``.
        recompute_sets: it recomputes any per-tensor set a plan names (a partitioner keeping
            exactly the plan's saved set); otherwise only its ``checkpointing`` policies' sets.
        reduce_16bit: it can reduce (and accumulate) data-parallel gradients in the 16-bit compute
            dtype instead of fp32, which a plan then may choose.
        fp8_params: under native fp8 it can keep the GEMMs' weights in fp8 (and gather them so),
            which a plan then may choose.
        async_tp: a plan with sequence-parallel TP runs PyTorch's async TP (Inductor's
            micro-pipeline pass; ``TrainingConfig.async_tp``), which the plan's recipe turns on.
        gemm_padding: GEMM dimensions the tensor cores cannot load aligned are padded (Megatron's
            vocabulary padding, Inductor's ``shape_padding``); false where the model's shapes run
            as they are (``TrainingConfig.gemm_padding``).
        kernel_local_buffers: its compiler partitions and schedules the whole step's graph itself
            (``torch.compile`` of a model and its loss), so what one generated kernel alone reads
            never reaches memory and an fp32 loss gradient is written already cast
            (``TrainingConfig.kernel_local_buffers``); false where a plan's groups are compiled
            one by one (coplan's runner) or the loss runs eagerly.
        fused_output_casts: where a plan's groups are compiled, each fp32 loss-path output read
            only at the training dtype is written already cast, the cast fused into the kernel
            that computes it (``TrainingConfig.fused_output_casts``).
        eager_rope: how the model it trains rotates q and k where its kernels are eager
            (``TrainingConfig.eager_rope``, ``ROPE_FORMS``): a complex product or fms's real pairs.
        eager_loss_cast: how its model's 16-bit logits reach the loss where its kernels are eager
            (``TrainingConfig.eager_loss_cast``, ``LOSS_CASTS``): the model's ``.float()``,
            ``F.cross_entropy`` under autocast (a 16-bit log-softmax, an fp32 cast for
            ``nll_loss``), none (the loss in 16 bits), a fused cross-entropy kernel, or the
            ``.float()`` then DTensor's ``loss_parallel`` (``"parallel"``: taken only under tensor
            parallelism, which shards the logits; without it the ``.float()`` alone).
        fused_rmsnorm: where its kernels are eager, its model's RMSNorm runs as one fused kernel
            each way (``TrainingConfig.fused_rmsnorm``): ``nn.RMSNorm`` / ``F.rms_norm``, which
            PyTorch's CUDA build dispatches to ``_fused_rms_norm`` where input and weight share a
            dtype, not a model's own RMSNorm written in tensor ops.
        optimizer: how its AdamW update runs (``TrainingConfig.optimizer``, ``coplan.cost.optimizer``):
            ``""`` as a plan's optimizer kernels say, ``"fused"``, ``"foreach"`` or ``"for-loop"``.
        zero3_gather: how its ZeRO-3 issues the parameter all-gathers and gradient reduce-scatters
            (``TrainingConfig.zero3_gather``): per layer, per module or per parameter tensor.
        grad_accumulation: how its gradients accumulate over microbatches where they are not
            sharded (``TrainingConfig.grad_accumulation``): inside the GEMMs, by autograd into
            16-bit or fp32 ``.grad``, or copied into fp32 buffers.
        fsdp_pipeline: how its FSDP units run under pipeline parallelism
            (``TrainingConfig.fsdp_pipeline``): gathered and reduced each microbatch, or kept
            gathered through the step and reduced once after the stage's last backward.
        pipeline_split: how it splits the blocks over a pipeline's chunks where the chunks do not
            divide them (``coplan.cost.stages.PIPELINE_SPLITS``): not at all (``even``), or as
            torchtitan does, the embedding and the output counting as a block each
            (``weighted``; ``stage_split``).
        pipeline_send: how its pipeline stages send on under tensor parallelism
            (``TrainingConfig.pp_send``): Megatron-LM's scatter-gather, or every tensor-parallel
            rank the whole outputs (DeepSpeed's pipeline engine).
        cp_exchange: how its context parallelism exchanges keys and values
            (``TrainingConfig.cp_exchange``): Transformer Engine's ring, or PyTorch's all-gather
            with fp32 merging.
        layer_checkpointing: which blocks its per-layer checkpointing (``selective-layer``)
            checkpoints (``LAYER_CHECKPOINTINGS``); ``none`` exactly where it offers none.
        hybrid_shard: its FSDP units can shard within groups of the data-parallel ranks and
            replicate across them (HSDP: ``ParallelPlan.fsdp_shard``, ``TrainingConfig.fsdp_shard``),
            which a plan then may choose.
        compile_preset: the preset that prices this stack's plans which turn ``torch.compile`` on
            (fusion option ``compiled``): the same stack with its compile flag set, whose kernels
            (``with_kernels``) such a plan runs (``kernels_for``), and whose fp8 GEMMs, fp8
            weights and async TP such a plan may use (torchtitan runs those compiled only);
            ``""`` where the stack has no compile flag or compiles always.
        reserved_fraction: reserved bytes beyond what the caching allocator's replay gives
            (``coplan.cost.steptrace.reserved_memory``), as a fraction of the allocated peak: what
            a stack's own allocator or memory pools hold besides; 0 in every preset.
        expandable_segments: the stack's runs set ``PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True``
            (each stream's pool one growing range; ``coplan.cost.caching``).
        reduce_input: where its FSDP2 allocates each unit's reduce-scatter input
            (``REDUCE_INPUTS``); FSDP1 always casts on its post-backward stream.
        sources: (setting, citation) for each setting the preset gives.
    """

    name: str
    kernels: str = "megatron"
    eager_loss: bool = False
    attention_kernel: str = "auto"
    sharding: str = "megatron-distopt"
    fsdp_units: bool = False
    pipeline_keeps_outputs: bool = False
    overlap: bool = True
    tp_comm_overlap: bool = True
    dp_bucket_params: int | None = None
    dp_bucket_scope: str = "megatron-core"
    checkpointing: tuple[str, ...] = ("none", "selective", "full")
    reserved_fraction: float = 0.0
    expandable_segments: bool = False
    reduce_input: str = "compute"
    tensor_parallel: bool = True
    pipeline_parallel: bool = True
    interleaved_pipeline: bool = True
    sequence_parallel: bool = True
    context_parallel: bool = False
    combined_layouts: bool = True
    zero_stages: tuple[int, ...] = (0, 1, 2, 3)
    pipeline_zero_stages: tuple[int, ...] = (0, 1, 2, 3)
    ddp_alone: bool = False
    fusion: tuple[str, ...] = FUSION_CHOICES[:4]
    fp8: str = "native"
    recompute_sets: bool = True
    reduce_16bit: bool = True
    fp8_params: bool = True
    async_tp: bool = False
    gemm_padding: bool = True
    kernel_local_buffers: bool = False
    fused_output_casts: bool = False
    eager_rope: str = "complex"
    eager_loss_cast: str = "float"
    fused_rmsnorm: bool = False
    optimizer: str = ""
    zero3_gather: str = "unit"
    grad_accumulation: str = "fused"
    fsdp_pipeline: str = "microbatch"
    pipeline_split: str = "even"
    cp_exchange: str = "p2p"
    pipeline_send: str = "scatter-gather"
    layer_checkpointing: str = "none"
    hybrid_shard: bool = False
    compile_preset: str = ""
    about: str = ""
    sources: tuple[tuple[str, str], ...] = ()

    def __post_init__(self) -> None:
        src = f"stack {self.name!r}"
        if not isinstance(self.name, str) or not self.name:
            raise StackError("stack", "name", "must be a non-empty string")
        _choice(src, "kernels", self.kernels, KERNEL_SETS)
        _choice(src, "attention_kernel", self.attention_kernel, ATTENTION_KERNEL_CHOICES)
        _choice(src, "sharding", self.sharding, SHARDINGS)
        _choice(src, "dp_bucket_scope", self.dp_bucket_scope, BUCKET_SCOPES)
        _choice(src, "fp8", self.fp8, FP8_MODES)
        _choice(src, "optimizer", self.optimizer, OPTIMIZER_IMPLEMENTATIONS)
        _choice(src, "zero3_gather", self.zero3_gather, ZERO3_GATHERS)
        _choice(src, "grad_accumulation", self.grad_accumulation, GRAD_ACCUMULATIONS)
        _choice(src, "fsdp_pipeline", self.fsdp_pipeline, FSDP_PIPELINES)
        _choice(src, "pipeline_split", self.pipeline_split, PIPELINE_SPLITS)
        _choice(src, "cp_exchange", self.cp_exchange, CP_EXCHANGES)
        _choice(src, "pipeline_send", self.pipeline_send, PP_SENDS)
        _choice(src, "eager_rope", self.eager_rope, ROPE_FORMS)
        _choice(src, "eager_loss_cast", self.eager_loss_cast, LOSS_CASTS)
        _choice(src, "reduce_input", self.reduce_input, REDUCE_INPUTS)
        if self.zero3_gather != "unit" and self.fsdp_units:
            raise StackError(src, "zero3_gather", "FSDP gathers a unit in one collective (needs 'unit')")
        if self.hybrid_shard and not self.fsdp_units:
            raise StackError(src, "hybrid_shard", "shards FSDP units within groups (needs fsdp_units)")
        for flag in (
            "ddp_alone",
            "eager_loss",
            "fsdp_units",
            "pipeline_keeps_outputs",
            "overlap",
            "tp_comm_overlap",
            "tensor_parallel",
            "pipeline_parallel",
            "interleaved_pipeline",
            "sequence_parallel",
            "context_parallel",
            "combined_layouts",
            "recompute_sets",
            "reduce_16bit",
            "fp8_params",
            "async_tp",
            "gemm_padding",
            "kernel_local_buffers",
            "fused_output_casts",
            "fused_rmsnorm",
            "expandable_segments",
            "hybrid_shard",
        ):
            if not isinstance(getattr(self, flag), bool):
                raise StackError(src, flag, f"must be true or false, got {getattr(self, flag)!r}")
        b = self.dp_bucket_params
        if b is not None and (isinstance(b, bool) or not isinstance(b, int) or b < 1):
            raise StackError(src, "dp_bucket_params", f"must be a positive integer or null, got {b!r}")
        object.__setattr__(
            self,
            "checkpointing",
            _choices(src, "checkpointing", self.checkpointing, CHECKPOINT_POLICIES, "policy"),
        )
        _choice(src, "layer_checkpointing", self.layer_checkpointing, LAYER_CHECKPOINTINGS)
        if ("selective-layer" in self.checkpointing) != (self.layer_checkpointing != "none"):
            raise StackError(
                src,
                "layer_checkpointing",
                "must name where the blocks sit exactly when checkpointing offers 'selective-layer' "
                f"(got {self.layer_checkpointing!r})",
            )
        for key in ("zero_stages", "pipeline_zero_stages"):
            zs = tuple(getattr(self, key))
            if not zs or any(isinstance(z, bool) or z not in (0, 1, 2, 3) for z in zs):
                raise StackError(src, key, f"must list stages among 0, 1, 2, 3, got {list(zs)!r}")
            object.__setattr__(self, key, tuple(sorted(set(zs))))
        object.__setattr__(
            self, "fusion", _choices(src, "fusion", self.fusion, FUSION_CHOICES, "fusion option")
        )
        if not isinstance(self.compile_preset, str):
            raise StackError(
                src, "compile_preset", f"must name a preset or be empty, got {self.compile_preset!r}"
            )
        if self.compile_preset and (self.kernels != "eager" or "compiled" not in self.fusion):
            raise StackError(
                src,
                "compile_preset",
                "prices plans that turn torch.compile on: needs eager kernels and the 'compiled' fusion",
            )
        if self.compile_preset:
            if self.compile_preset not in stack_names():
                raise StackError(
                    src,
                    "compile_preset",
                    f"must name a preset ({', '.join(stack_names())}), got {self.compile_preset!r}",
                )
            if load_stack(self.compile_preset).kernels != "inductor":
                raise StackError(
                    src,
                    "compile_preset",
                    f"preset {self.compile_preset!r} does not run torch.compile's kernels",
                )
        r = self.reserved_fraction
        if isinstance(r, bool) or not isinstance(r, int | float) or not 0.0 <= r < 1.0:
            raise StackError(src, "reserved_fraction", f"must be a number in [0, 1), got {r!r}")
        srcs = tuple((str(k), str(v)) for k, v in dict(self.sources).items())
        for k, v in srcs:
            if k not in SETTINGS:
                raise StackError(
                    src, "sources", f"cites {k!r}, which is not a setting ({', '.join(SETTINGS)})"
                )
            if not v.strip():
                raise StackError(src, "sources", f"the citation of {k!r} is empty")
        object.__setattr__(self, "sources", srcs)

    def kernels_for(self, fusion_label: str) -> StackSpec:
        """The stack that runs a plan of this stack with fusion ``fusion_label``: its
        ``compile_preset`` for a plan that turns ``torch.compile`` on (``compiled``), else this
        stack. Its kernels price the plan, and what a stack runs only compiled is its to allow
        (fp8 GEMMs, fp8 weights, async TP: ``fp8``, ``fp8_params``, ``async_tp``); the plan's
        layouts and checkpointing stay this stack's."""
        if fusion_label == "compiled" and self.compile_preset:
            return load_stack(self.compile_preset)
        return self

    @property
    def variants(self) -> tuple[StackSpec, ...]:
        """This stack as each of its fusion options runs it (``kernels_for``), first its own:
        where a precision is open to some option (``runs_fp8``), a search offers it."""
        out = [self]
        for name in self.fusion:
            s = self.kernels_for(name)
            if all(s is not o for o in out):
                out.append(s)
        return tuple(out)

    @property
    def runs_fp8(self) -> bool:
        """Whether some fusion option of the stack runs fp8 GEMMs natively (torchtitan's float8
        linears only with ``torch.compile`` on)."""
        return any(s.fp8 == "native" for s in self.variants)

    @property
    def keeps_fp8_params(self) -> bool:
        """Whether some fusion option of the stack keeps fp8 primary weights (torchtitan's float8
        all-gathers only with ``torch.compile`` on)."""
        return any(s.fp8_params for s in self.variants)

    @property
    def megatron_kernels_only(self) -> bool:
        """It runs Megatron-LM's own kernel set and no other grouping: a plan for it names that set
        instead of grouping ops itself, and is priced by name (``fusion="megatron"``)."""
        return self.fusion == ("megatron",)

    def layer_counts(self, layers: int) -> tuple[int, ...]:
        """The numbers of fully checkpointed blocks, short of all of them, its per-layer
        checkpointing can give a chunk of ``layers`` blocks (``layer_checkpointing``): any count
        where it places them itself, ``layers // N`` where it checkpoints every N-th block."""
        if self.layer_checkpointing == "none" or layers < 2:
            return ()
        if self.layer_checkpointing == "every":
            return tuple(sorted({layers // n for n in range(2, layers + 1)} - {0}))
        return tuple(range(1, layers))

    def stage_split(self, n_layers: int, pp: int, vpp: int = 1) -> tuple[int, ...] | None:
        """Blocks per model chunk (``TrainingConfig.stage_layers``) where this stack splits
        ``n_layers`` blocks over ``pp x vpp`` chunks that do not divide them (``pipeline_split``);
        None where they divide (the even split), or where it splits only evenly or cannot split
        them at all."""
        chunks = pp * vpp
        if pp <= 1 or n_layers % chunks == 0 or self.pipeline_split == "even":
            return None
        return weighted_split(n_layers, chunks)

    def source_of(self, setting: str) -> str:
        """The citation of ``setting`` ("" where the preset leaves it at the default)."""
        return dict(self.sources).get(setting, "")

    def configure(self, config: TrainingConfig) -> TrainingConfig:
        """``config`` with what this stack decides: its kernels (and the fusion groups they
        imply), its attention kernel (where the config leaves it to the device), its FSDP units,
        no overlapped data-parallel collectives where it overlaps none (``overlap``) and no
        userbuffers overlap of tensor-parallel collectives where it has none (``tp_comm_overlap``)."""
        if (
            self.kernels == "megatron"
            and not self.fsdp_units
            and self.attention_kernel == "auto"
            and not self.optimizer
            and self.zero3_gather == "unit"
            and self.grad_accumulation == "fused"
            and self.overlap
            and self.tp_comm_overlap
            and self.eager_rope == "complex"
            and self.eager_loss_cast == "float"
            and not self.fused_rmsnorm
            and not self.kernel_local_buffers
            and not self.fused_output_casts
        ):
            return config  # Megatron's own: nothing to change
        changes: dict[str, Any] = {}
        if not self.overlap:
            # the stack issues its data-parallel collectives after the compute they could hide
            # behind, as a plan for it is priced (``PlanContext``)
            changes.update(overlap_grad_reduce=False, overlap_param_gather=False, overlap_zero=False)
        if config.attention_kernel == "auto":
            changes["attention_kernel"] = self.attention_kernel
        if config.tp_comm_overlap and not self.tp_comm_overlap:
            # Transformer Engine's userbuffers overlap is Megatron-Core's: a stack without it
            # issues its tensor-parallel collectives in line (or as async TP, its own setting)
            changes["tp_comm_overlap"] = False
        if self.fsdp_units:
            changes["fsdp_units"] = True
        return self.with_kernels(config.with_(**changes) if changes else config)

    def with_kernels(self, config: TrainingConfig) -> TrainingConfig:
        """``config`` run with this stack's kernels, the fusion they imply where ``config`` names
        none of its own (a fusion mode, not groups) and the loss they imply; its attention kernel
        and sharding units kept. How a planner prices a plan for this stack: the plan decides
        the layout and any fusion groups."""
        if not self.gemm_padding:
            config = config.with_(gemm_padding=False)
        if self.kernel_local_buffers and not config.kernel_local_buffers:
            config = config.with_(kernel_local_buffers=True)
        if self.fused_output_casts and not config.fused_output_casts:
            config = config.with_(fused_output_casts=True)
        if self.eager_rope != "complex":
            config = config.with_(eager_rope=self.eager_rope)
        if self.eager_loss_cast != "float" and (self.eager_loss_cast != "parallel" or config.tp > 1):
            # loss parallelism needs vocabulary-sharded logits: without tensor parallelism the
            # stack's loss is the model's .float() and ATen's (torchtitan's loss_parallel_enabled)
            config = config.with_(eager_loss_cast=self.eager_loss_cast)
        if self.optimizer and not config.optimizer:
            config = config.with_(optimizer=self.optimizer)
        if self.fused_rmsnorm and self.kernels == "eager" and not config.fused_rmsnorm:
            # the model's RMSNorm as PyTorch dispatches it where the kernels are eager
            config = config.with_(fused_rmsnorm=True)
        if self.sharding == "fsdp2" and self.fsdp_units:
            # FSDP2's copies around its collectives, on the compute stream (``zero.fsdp_copies``)
            config = config.with_(gather_copies=True)
        if self.sharding in PYTORCH_GRADS and config.grad_storage == "buffer":
            # autograd's ``.grad``, and DDP's buckets where the stack runs DDP at ZeRO 0
            config = config.with_(grad_storage=PYTORCH_GRADS[self.sharding])
        if self.fsdp_pipeline != "microbatch" and config.fsdp_pipeline == "microbatch":
            config = config.with_(fsdp_pipeline=self.fsdp_pipeline)
        if self.cp_exchange != "p2p" and config.cp_exchange == "p2p":
            config = config.with_(cp_exchange=self.cp_exchange)
        if self.pipeline_send != "scatter-gather" and config.pp_send == "scatter-gather":
            config = config.with_(pp_send=self.pipeline_send)
        if self.zero3_gather != "unit" and config.zero3_gather == "unit":
            config = config.with_(zero3_gather=self.zero3_gather)
        if self.grad_accumulation != "fused" and config.grad_accumulation == "fused":
            config = config.with_(grad_accumulation=self.grad_accumulation)
        if self.kernels == "megatron":
            return config
        changes: dict[str, Any] = {"kernels": self.kernels}
        if isinstance(config.fusion, str):
            # eager PyTorch launches each op; Inductor fuses pointwise chains as Megatron's
            # groups do (norms, activations, residual adds into their neighbours)
            changes["fusion"] = "none" if self.kernels == "eager" else "megatron"
        if self.eager_loss and self.kernels == "inductor":
            changes["eager_loss"] = True
        elif self.kernels == "inductor" and config.loss_fusion == "none":
            # a compiled loss runs as Inductor generates it, not as Megatron's cross-entropy
            changes["loss_fusion"] = "inductor"
        return config.with_(**changes)

    def runner_for(self, device: str) -> StackSpec:
        """This stack on ``device``'s kind (``"cpu"`` or a GPU): on a CPU, gloo's collectives run
        on the cores that compute (no overlap), attention is the device's own kernel, and GEMMs are
        library calls that take no fused epilogue (``coplan.apply.fusion`` compiles GEMM templates
        only for CUDA tensors; Inductor's CPU GEMM template needs max_autotune, which the runner
        does not turn on)."""
        if device != "cpu":
            return self
        fusion = tuple(f for f in self.fusion if f != "epilogue") or self.fusion
        return replace(self, overlap=False, attention_kernel="auto", fusion=fusion)

    def to_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = {"name": self.name}
        for f in SETTINGS:
            v = getattr(self, f)
            out[f] = list(v) if isinstance(v, tuple) else v
        out["sources"] = dict(self.sources)
        return out

    @classmethod
    def runner(cls, device: str) -> StackSpec:
        """coplan's runner (the ``coplan`` preset) on ``device``."""
        return load_stack("coplan").runner_for(device)


def _choice(src: str, field: str, value: object, choices: tuple[str, ...]) -> None:
    if value not in choices:
        raise StackError(src, field, f"must be one of {', '.join(choices)}, got {value!r}")


def _choices(
    src: str, field: str, values: Iterable[str], choices: tuple[str, ...], what: str
) -> tuple[str, ...]:
    """``values`` as a tuple of at least one of ``choices``."""
    got = tuple(values)
    if not got:
        raise StackError(src, field, f"must name at least one {what}")
    for v in got:
        _choice(src, field, v, choices)
    return got


def stack_from_dict(data: object, source: str) -> StackSpec:
    """A ``StackSpec`` from a parsed stack file: ``name``, the ``SETTINGS`` it gives, ``sources``,
    an optional ``about`` and an optional ``extends``; anything else is an error.

    ``extends`` names a packaged preset the file starts from: its settings and their citations,
    which the file's own settings replace (each cited by the file). Without it, what the file
    leaves out keeps ``StackSpec``'s defaults (Megatron-LM's)."""
    if not isinstance(data, dict):
        raise StackError(source, None, "must be a JSON object")
    known = {f.name for f in fields(StackSpec)} | {"extends"}
    unknown = sorted(set(data) - known)
    if unknown:
        raise StackError(source, unknown[0], f"unknown setting (known: {', '.join(sorted(known))})")
    if "name" not in data:
        raise StackError(source, "name", "is missing")
    kw = dict(data)
    base = _extended(kw.pop("extends", None), source)
    cited = kw.get("sources", {})
    if not isinstance(cited, dict):
        raise StackError(source, "sources", "must map settings to citations")
    # every setting a file gives says where it comes from, as the presets' do
    given = sorted(k for k in data if k in SETTINGS)
    missing = [k for k in given if k not in cited]
    if missing:
        raise StackError(source, "sources", f"no citation for {missing[0]!r}")
    if base is not None:
        inherited = base.to_dict()
        kw = {k: inherited[k] for k in SETTINGS} | kw
        changed = f" with {', '.join(given)} from {source}" if given else f" as {source} names it"
        kw.setdefault("about", f"the {base.name} preset{changed}")
        # the preset's citations, but for the settings the file gives itself
        cited = {k: v for k, v in base.sources if k not in data} | dict(cited)
    for key in ("checkpointing", "zero_stages", "pipeline_zero_stages", "fusion"):
        if key in kw and isinstance(kw[key], list):
            kw[key] = tuple(kw[key])
    kw["sources"] = tuple(cited.items())
    try:
        return StackSpec(**kw)
    except TypeError as exc:
        raise StackError(source, None, str(exc)) from None


def _extended(name: object, source: str) -> StackSpec | None:
    """The packaged preset a stack file ``extends`` (None where it names none)."""
    if name is None:
        return None
    if not isinstance(name, str) or name not in stack_names():
        raise StackError(source, "extends", f"must name a preset ({', '.join(stack_names())}), got {name!r}")
    return load_stack(name)


@cache
def stack_names() -> tuple[str, ...]:
    """The packaged presets, sorted."""
    root = resources.files("coplan.cost") / "stacks"
    return tuple(sorted(p.name[:-5] for p in root.iterdir() if p.name.endswith(".json")))


@cache
def load_stack(name: str) -> StackSpec:
    """The packaged preset ``name``."""
    if name not in stack_names():
        raise StackError("--stack", None, f"unknown stack {name!r} (choose from {', '.join(stack_names())})")
    text = (resources.files("coplan.cost") / "stacks" / f"{name}.json").read_text()
    return stack_from_dict(json.loads(text), f"stack preset {name}")


def load_stack_file(path: Path) -> StackSpec:
    """A stack read from a JSON file of a preset's shape."""
    try:
        text = Path(path).read_text()
    except OSError as exc:
        raise StackError(str(path), None, f"cannot read: {exc.strerror or exc}") from None
    try:
        data = json.loads(text)
    except json.JSONDecodeError as exc:
        raise StackError(str(path), None, f"not JSON: {exc.msg} (line {exc.lineno})") from None
    return stack_from_dict(data, str(path))


#: PyTorch DDP's default gradient bucket in fp32 master-gradient elements (``bucket_cap_mb`` 25).
DDP_BUCKET_PARAMS = DDP_BUCKET_BYTES // 4

__all__ = [
    "CHECKPOINT_POLICIES",
    "DDP_BUCKET_PARAMS",
    "FP8_MODES",
    "FUSION_CHOICES",
    "REDUCE_INPUTS",
    "SETTINGS",
    "SHARDINGS",
    "StackError",
    "StackSpec",
    "load_stack",
    "load_stack_file",
    "stack_from_dict",
    "stack_names",
]
