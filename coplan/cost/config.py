"""A full training configuration: everything about a step that is not the model or the cluster.

Vocabulary: ``microbatch`` is sequences per microbatch per data-parallel rank; ``global_batch`` is
sequences per optimizer step over the whole job; ``tp``, ``pp``, ``dp`` are the tensor, pipeline and
data-parallel degrees (``tp * pp * dp`` devices); ``vpp`` is the number of model chunks per pipeline
rank (interleaved 1F1B when > 1).
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Any

from coplan.cost.buckets import BUCKET_SCOPES, default_bucket_params
from coplan.cost.tp_overlap import ub_slots
from coplan.errors import SpecError
from coplan.hardware.device import ATTENTION_KERNELS
from coplan.limits import (
    MAX_DEVICES,
    MAX_GLOBAL_BATCH,
    MAX_LAYERS,
    MAX_SEQ,
    bounded_int,
)

if TYPE_CHECKING:
    from coplan.hardware.device import DeviceSpec

RECOMPUTE_MODES: tuple[str, ...] = ("none", "selective", "full")
DTYPES: tuple[str, ...] = ("fp32", "tf32", "bf16", "fp16", "fp8")
#: Dtypes a single op may be given (``TrainingConfig.op_dtypes``).
OP_DTYPES: tuple[str, ...] = ("fp32", "bf16", "fp16", "fp8")
FUSION_MODES: tuple[str, ...] = ("megatron", "none")
#: The kernels a stack launches for each op (``TrainingConfig.kernels``, ``coplan.cost.stacks``):
#: Megatron-LM / Transformer Engine's fused kernels, eager PyTorch's decompositions
#: (``coplan.cost.eager``), torch.compile's Inductor-generated kernels.
KERNEL_SETS: tuple[str, ...] = ("megatron", "eager", "inductor")
#: Megatron's cross-entropy kernels (``--cross-entropy-loss-fusion``, ``--cross-entropy-fusion-impl``):
#: unfused (the default), jit-fused ("native"), Transformer Engine's ("te"); see ``cost/loss.py``.
LOSS_FUSIONS: tuple[str, ...] = ("none", "native", "te", "inductor")
#: Fused-attention kernels a configuration may ask for: ``"auto"`` prices the one each device's
#: profile describes (what Transformer Engine selects there: cuDNN's on Hopper, FlashAttention-2 on
#: Ampere); a kernel name prices that kernel where the device has rates for it
#: (``DeviceSpec.attention_kernels``), and is an error elsewhere.
ATTENTION_KERNEL_CHOICES: tuple[str, ...] = ("auto", *ATTENTION_KERNELS)
#: How fp8 GEMM operands are scaled (``TrainingConfig.fp8_scaling``): one scale per tensor
#: (Transformer Engine's recipes, torchao's ``tensorwise``) or one per row of each operand along its
#: reduction axis (torchao's ``rowwise`` recipe, ``Float8LinearRecipeName.ROWWISE``).
FP8_SCALINGS: tuple[str, ...] = ("tensorwise", "rowwise")
#: PyTorch DDP's default ``bucket_cap_mb`` (25 MiB of gradients).
DDP_BUCKET_BYTES = 25 * 2**20


class OpGroups(tuple[tuple[int, ...], ...]):
    """Fusion groups already in ``TrainingConfig``'s form (tuples of int op ids), as ``PlanContext``
    builds them once per fusion plan. ``TrainingConfig`` takes them as they are: re-converting every
    op id of every configuration a search prices took 40% of planning a 128-layer model on 3,072
    GPUs (thousands of ids per configuration, tens of thousands of configurations)."""

    __slots__ = ()


class ConfigError(SpecError):
    """A training configuration that cannot run (exit code 2)."""

    def __init__(self, field: str | None, message: str) -> None:
        super().__init__("training config", field, message)


#: How the AdamW update runs (``coplan.cost.optimizer``): "" prices the plan's own optimizer
#: kernels (a fusion group per block: fused AdamW; an update of its own: one kernel per parameter
#: at the fused update's traffic), "fused" the same; "foreach" and "for-loop" as PyTorch runs them
OPTIMIZER_IMPLEMENTATIONS: tuple[str, ...] = ("", "fused", "foreach", "for-loop")
#: How ZeRO-3 issues its parameter all-gathers and gradient reduce-scatters (``coplan.cost.zero``):
#: ``unit`` one of each per layer (PyTorch FSDP's flat or per-unit buffers, Megatron-FSDP),
#: ``module`` one per module that owns parameters (DeepSpeed from v0.5.6: a submodule's parameters
#: gathered together), ``tensor-list`` one per parameter tensor, each handing PyTorch one output
#: (gather) or input (reduce-scatter) tensor per rank, which ProcessGroupNCCL copies one by one,
#: each gather after a device synchronize, so none overlaps compute (DeepSpeed before v0.5.6).
ZERO3_GATHERS: tuple[str, ...] = ("unit", "module", "tensor-list")
#: How FSDP's units meet a pipeline's microbatches (``TrainingConfig.fsdp_pipeline``): ``microbatch``
#: each microbatch gathers the units and reduce-scatters their gradients, as FSDP's hooks run in a
#: plain training loop; ``step`` the units stay gathered from the first microbatch's forward to the
#: stage's last backward, and the gradients accumulate unsharded and are reduce-scattered once
FSDP_PIPELINES: tuple[str, ...] = ("microbatch", "step")
#: How context parallelism's ranks exchange keys and values (``coplan.cost.context``): ``p2p``
#: around a ring, a chunk a step beside that step's attention (Transformer Engine's
#: ``AttnFuncWithCPAndKVP2P``); ``allgather`` in one all-gather beside the first step, with the
#: steps' outputs and gradients merged in fp32 and the key/value gradients sent on in fp32
#: (PyTorch's ``context_parallel``, torchtitan's)
CP_EXCHANGES: tuple[str, ...] = ("p2p", "allgather")
#: How a pipeline stage sends its activation on under tensor parallelism without sequence
#: parallelism: ``scatter-gather``, each TP rank sends 1/t and the receivers all-gather it
#: (Megatron-LM's p2p_communication); ``whole``, every TP rank sends the stage's whole outputs,
#: the causal mask with the activation in the forward (DeepSpeed's pipeline engine)
PP_SENDS: tuple[str, ...] = ("scatter-gather", "whole")
#: How a model written for eager PyTorch rotates q and k (``coplan.cost.eager``): ``complex`` as a
#: complex product (torchtitan's and Meta's Llama: ``torch.view_as_complex`` times ``freqs_cis``),
#: ``pairs`` as a 2 x 2 rotation matrix applied to real pairs by a broadcast product and a sum
#: (fms's ``RotaryEmbedding``, written to avoid complex numbers)
ROPE_FORMS: tuple[str, ...] = ("complex", "pairs")
#: How eager kernels bring a 16-bit model's logits to the loss (``coplan.cost.eager``): the model
#: casts them (``logits.float()``), autocast casts the 16-bit log-probabilities for ``nll_loss``, the
#: loss runs in the logits' own 16 bits, a fused cross-entropy kernel takes them as they are, or the
#: model casts them and DTensor's loss-parallel handlers compute the loss over vocabulary shards
LOSS_CASTS: tuple[str, ...] = ("float", "autocast", "none", "fused", "parallel")
#: How gradients accumulate over a step's microbatches (``TrainingConfig.grad_accumulation``):
#: ``fused`` inside the weight-gradient GEMMs, ``autograd16`` / ``autograd32`` by autograd into
#: 16-bit or fp32 parameters' ``.grad``, ``fp32-buffer`` by a copy of each microbatch's 16-bit
#: gradients into fp32 buffers
GRAD_ACCUMULATIONS: tuple[str, ...] = ("fused", "autograd16", "autograd32", "fp32-buffer")
#: Where a step's gradients live (``TrainingConfig.grad_storage``): buffers allocated once, autograd's
#: ``.grad`` made by each backward, or that beside PyTorch DDP's buckets where DDP runs
GRAD_STORAGES: tuple[str, ...] = ("buffer", "autograd", "ddp")


def recomputes_fully(recompute: object, per_stage: tuple[object, ...] | None) -> bool:
    """Whether some pipeline stage recomputes every block (``recompute`` "full", or one of
    ``per_stage``'s modes): what a count of fully recomputed blocks (``recompute_layers``) needs."""
    return "full" in (per_stage or (recompute,))


@dataclass(frozen=True, slots=True, kw_only=True)
class TrainingConfig:
    """One point of the parallel / memory / precision space, validated on construction.

    Attributes:
        cp: context-parallel ranks per sequence (Megatron-Core's ``--context-parallel-size``,
            torchtitan's ``context_parallel_degree``): each holds ``seq / cp`` tokens of every
            sequence of its microbatch, its attention meets the other ranks' keys and values passed
            around a ring, and its gradients are reduced with the data-parallel ranks', over
            ``dp x cp`` ranks (Megatron-Core's ``data_parallel_group_with_cp``). Ranks are ordered
            TP, CP, DP, PP, TP fastest (Megatron-Core's default ``order="tp-cp-ep-dp-pp"``).
        recompute: ``"none"`` (save what autograd saves), ``"selective"`` (recompute the attention
            core, as Megatron-LM's selective recomputation), ``"full"`` (save each block's input and
            recompute the block), or a set of tensor names of block 0 (the template every block
            follows) to recompute instead of saving.
        fusion: ``"megatron"`` (the kernels a Megatron-LM step launches: GEMMs with bias epilogues,
            fused bias-GeLU / bias-dropout-add, fused norms and softmax, multi-tensor Adam),
            ``"none"`` (eager PyTorch: every non-view op a kernel), or explicit groups of op ids.
        zero: 0 plain data parallel; 1 optimizer states sharded over data-parallel ranks (Megatron's
            distributed optimizer); 2 also gradients; 3 also parameters (FSDP).
        dtype: the matmul precision; 16-bit and fp8 runs keep fp32 master weights, fp32 gradients
            and fp32 Adam moments (``master_weights``), activations in 16 bits.
        overlap_grad_reduce: data-parallel gradient reduction runs during the last microbatch's
            backward (Megatron ``--overlap-grad-reduce``, PyTorch DDP buckets); otherwise after it.
        overlap_param_gather: ZeRO's parameter all-gather after the optimizer overlaps the next
            step's forward (Megatron ``--overlap-param-gather``).
        tp_comm_overlap: tensor-parallel collectives overlap GEMMs (Transformer Engine userbuffers),
            each as its slot's method prices it (``coplan.cost.tp_overlap``).
        async_tp: tensor-parallel collectives overlapped as PyTorch's async TP does it (torchtitan's
            ``enable_async_tensor_parallel``: Inductor's micro-pipeline pass over symmetric memory,
            ``coplan.cost.tp_overlap.async_tp_slots``): only the pairs that pass fuses, the rest
            exposed. Needs sequence parallelism; not with ``tp_comm_overlap``.
        tp_overlap_cfg: a recipe's userbuffers settings, ``(slot, method, num_sm, num_splits,
            set_sm_margin)`` per slot it sets (NeMo's ``ub_cfg_*.yaml``); the rest are TE's defaults.
        overlap_p2p: under the interleaved schedule, pipeline sends and receives overlap the next
            chunk's compute (Megatron-Core's ``--overlap-p2p-communication``, on by default); off,
            each exchange blocks (2021 Megatron-LM's batched isend/irecv followed by
            ``torch.cuda.synchronize()``, megatron/p2p_communication.py at 6985e58938).
        grad_reduce_fp32: mixed-precision gradients are accumulated and reduced in fp32 (Megatron
            forces it for bf16: arguments.py ``accumulate_allreduce_grads_in_fp32``); off, in the
            16-bit training dtype (2021 Megatron-LM's fp16 default, Megatron-Bridge's
            ``grad_reduce_in_fp32 = False``): half the gradient memory and reduction traffic.
        activation_fusion: the MLP activation runs as Megatron's fused kernels (bias-GeLU,
            bias-SwiGLU, NeMo 1.x's compiled squared ReLU); off, op by op as eager PyTorch runs it
            (NeMo 2.x's squared ReLU: ``coplan.cost.activation``).
        fp8_params: under fp8, the block GEMMs' weights are fp8 themselves (Transformer Engine's
            ``fp8_model_init``; NeMo ``fp8_params``, Megatron ``--fp8-param-gather``): no 16-bit copy
            beside TE's fp8 one, and the distributed optimizer all-gathers them in fp8.
        fp8_scaling: how fp8 GEMM operands are scaled (``FP8_SCALINGS``). ``"tensorwise"``: one scale
            per tensor, the casts Transformer Engine runs (``coplan.cost.fp8``). ``"rowwise"``:
            torchao's rowwise recipe: every operand cast along its own axis in forward and again
            along the other in backward, the backward GEMMs rescaled by a kernel of their own, and
            tensor-parallel gathers in 16 bits (``coplan.cost.fp8.rowwise_bytes``).
        stage_layers: layers held by each pipeline stage (default: an even split).
        recompute_per_stage: one recompute mode or set per pipeline stage, overriding ``recompute``
            (the first stage holds the most in-flight microbatches and may recompute more).
        recompute_layers: with full recomputation, how many blocks of each model chunk (virtual
            pipeline stage) recompute: its first ones, as Megatron-LM's ``--recompute-method block
            --recompute-num-layers N`` places them (megatron/core/transformer/transformer_block.py
            ``_checkpointed_forward``); the chunk's other blocks save what autograd saves. None:
            every block. torchtitan's every-N-th-block and fms-fsdp's evenly spaced share place
            theirs otherwise; a count prices them too (``cost.checkpoint.checkpointed_blocks``),
            the saved bytes within one block input per chunk (where the checkpoints sit).
        recompute_fused: names of pointwise forward ops of block 0 that a recompute set re-runs
            inside the backward kernel reading their output (Inductor's partitioner does this):
            their arithmetic is paid, but no launch, no memory traffic and no stored copy.
        loss_fusion: which cross-entropy kernels the loss runs as under ``fusion="megatron"``
            (``LOSS_FUSIONS``: Megatron's, or Inductor's for a compiled loss; other fusion plans
            price the IR's loss ops).
        pipeline_keeps_outputs: a pipeline stage keeps the output it sent for its backward
            (torch.distributed.pipelining, which backpropagates through it) instead of freeing it
            after the send (Megatron-LM's ``deallocate_pipeline_outputs``).
        fsdp_units: ZeRO 1 and 2 run as FSDP does (PyTorch FSDP2 without resharding after
            forward): each layer (unit) all-gathers its parameters in forward and reduce-scatters
            its gradients after its backward, every microbatch, instead of Megatron's distributed
            optimizer (one bucketed reduce-scatter per step, one all-gather after the update).
        dp_bucket_params: parameters per data-parallel gradient bucket (Megatron ``--ddp-bucket-size``,
            Apex ``bucket_cap_mb`` over the gradient's bytes); ``None``: Megatron-Core's default,
            ``max(4e7, 1e6 * dp)`` (``coplan.cost.buckets``).
        dp_bucket_scope: how the gradient buffers are bucketed: ``"megatron-core"`` (pipeline stage
            0's first chunk, and only with ``overlap_grad_reduce``), ``"all"`` (every stage and
            chunk: PyTorch DDP), ``"padded"`` (every layer opens whole buckets: Apex's distributed
            Adam as NeMo drives it) or ``"none"`` (one collective per chunk); ``coplan.cost.buckets``.
        kernels: the kernels the stack launches around the model's math (``KERNEL_SETS``):
            ``"megatron"`` prices the fusion groups as they are; ``"eager"`` also runs each
            Python-level op as eager PyTorch decomposes it (RMSNorm's fp32 upcast, RoPE's complex
            product: ``coplan.cost.eager``); ``"inductor"`` prices torch.compile's fused kernels.
        fsdp_shard: FSDP's sharding group (``fsdp_units``): ``None`` shards over every data-parallel
            rank; ``n`` shards parameters, gradients and optimizer states within groups of ``n``
            ranks and replicates them across the groups (HYBRID_SHARD / HSDP).
        eager_loss: the model's loss side (the IR's ``post`` part: final norm, output projection
            and loss) runs eager PyTorch, op by op, beside blocks that run the configured kernels:
            torch.compile applied to each block (torchtitan) or to the model without its loss.
        attention_kernel: the fused-attention kernel (``ATTENTION_KERNEL_CHOICES``): ``"auto"``, what
            the device's profile describes, or one the stack forces (``"flash2"``: Transformer
            Engine with ``NVTE_FUSED_ATTN=0`` on Hopper, or PyTorch's SDPA flash backend).
        overlap_zero: ZeRO-3 / FSDP unit collectives are prefetched behind compute (GPUs: NCCL on
            its own stream); off where communication and compute share the same cores (gloo on
            a CPU), so every collective shows.
        gemm_padding: GEMM dimensions the tensor cores' 16-byte loads cannot take are padded before
            the GEMM runs, as Megatron-LM pads the vocabulary (``--make-vocab-size-divisible-by``,
            128 x TP) and Inductor pads matrix multiplies (``torch._inductor.config.shape_padding``,
            ``torch/_inductor/fx_passes/pad_mm.py``); false where the stack runs the model's shapes
            as they are (eager PyTorch, coplan's runner), and an unaligned GEMM then runs at the
            device's ``matmul_unaligned`` fraction of its rate (``coplan.cost.kernels``).
        kernel_local_buffers: under explicit fusion groups, the compiler scheduled the whole
            step (``torch.compile``'s own partition of a model with its loss): a temporary every
            reader of which runs in the kernel that computes it is never written (Inductor's
            ``Scheduler.remove_kernel_local_buffers``, ``torch/_inductor/scheduler.py`` at v2.13.0),
            and an fp32 loss-path output read only at the training dtype is written already cast
            (``coplan.cost.liveness.fused_temporaries``). On this machine's Inductor the whole
            cross-entropy of bf16 logits compiles to one forward kernel saving the logits and two
            row statistics and one backward kernel writing the gradient into the logits' buffer
            (``tests/unit/test_liveness_fused.py``). Off, a plan's groups are priced as kernels
            compiled one by one, which write their outputs (coplan's runner: its compiled corners on
            an H100 peaked 1.5 GiB under the eager ones, not the 4.5 GiB these would free).
        fused_output_casts: under explicit fusion groups, an fp32 loss-path output read only at
            the training dtype is written already cast, the cast fused into the generated kernel
            that computes it, while the groups' other outputs are written (coplan's runner, whose
            Inductor compiles the plan's groups with each fused cast in its producer:
            ``coplan.cost.liveness.fused_temporaries``' narrowed outputs alone). Implied by
            ``kernel_local_buffers``.
        eager_rope: how eager kernels rotate q and k (``ROPE_FORMS``): a complex product, three
            kernels each way per tensor, or fms's rotation of real pairs, four each way over twice
            the fp32 elements (``coplan.cost.eager``).
        eager_loss_cast: how eager kernels bring 16-bit logits to the loss (``LOSS_CASTS``):
            ``"float"``, the model's own ``logits.float()`` (a cast kernel each way and an fp32
            copy, torchtitan's and Meta's Llama); ``"autocast"``, ``F.cross_entropy`` under
            ``torch.autocast``: a 16-bit log-softmax, then ``nll_loss``'s cast of the
            log-probabilities to fp32;
            ``"none"``, the loss in the logits' 16 bits; ``"fused"``, a fused cross-entropy
            kernel each way, priced as the IR's own loss kernels, that keeps the 16-bit logits
            and writes a new 16-bit gradient (flash-attn's ``CrossEntropyLoss``, llm-foundry's
            default ``fused_crossentropy``; ``coplan.cost.parts.FUSED_LOSS``); ``"parallel"``,
            the model's ``.float()`` and then DTensor's ``loss_parallel`` over vocabulary-sharded
            logits (torchtitan under tensor parallelism): a log-softmax written out op by op that
            holds one more fp32 logits tensor than ATen's at its peak, and a backward fused into
            ``nll_loss``'s.
        fused_rmsnorm: RMSNorm runs as one fused kernel each way that keeps its input and row
            statistics for backward, not the normalized tensor, and recomputes that inside its
            backward kernel (torchtitan's ``norm_type = "fused_rmsnorm"``, a Triton kernel:
            torchtitan/models/norms.py ``TritonFusedRMSNorm``, whose forward saves ``x, weight,
            rstd``); off, a Python RMSNorm keeps ``x * rstd`` for the weight's gradient and,
            under eager PyTorch, launches each of its ATen ops (``coplan.cost.eager``).
        attention_unpad: eager attention through the flash-attn package's variable-length kernel
            with its inputs unpadded and its output padded back around each call (llm-foundry's
            ``attn_impl: flash``: ``bert_padding.index_first_axis`` on q, k and v,
            ``pad_input`` on the output; ``coplan.cost.eager.unpad_kernels``): a gather kernel per
            input and a zero fill and an index-put on the output forward, the gather's and the
            index-put's gradients backward, and the unpadded output kept beside the padded one.
        optimizer: how the AdamW update runs (``coplan.cost.optimizer``): ``""`` as the plan's
            optimizer kernels say (a group per block is fused AdamW), ``"fused"`` the same,
            ``"foreach"`` PyTorch's multi-tensor ops (its default on CUDA), ``"for-loop"`` eight
            ops per parameter issued from Python (``foreach=False``).
        zero3_gather: how ZeRO-3's collectives are issued (``ZERO3_GATHERS``): per layer
            (``"unit"``), per module owning parameters (``"module"``), or per parameter tensor with
            a tensor per rank for PyTorch to copy in or out, each gather waiting for the device
            (``"tensor-list"``: nothing overlaps); each collective pays its own ring latency, and
            each per-rank copy a launch (``coplan.cost.zero``).
        grad_accumulation: how gradients accumulate over the step's microbatches where they are
            not sharded between them (ZeRO 0-1; ``GRAD_ACCUMULATIONS``): ``"fused"``, the
            weight-gradient GEMMs add into the gradient buffer themselves (Megatron-LM's
            ``--gradient-accumulation-fusion``, on by default: nothing more to price);
            ``"autograd16"`` / ``"autograd32"``, autograd adds each later microbatch's gradient
            into the 16-bit or fp32 parameters' ``.grad`` (AccumulateGrad's in-place add: the
            old and new gradient read, the sum written, per local parameter); ``"fp32-buffer"``,
            each microbatch's 16-bit gradients added into fp32 buffers (DeepSpeed's
            ``BF16_Optimizer.update_hp_grads``: 2 + 4 + 4 bytes a parameter). Memory-bound passes
            on the compute stream after each microbatch's backward
            (``coplan.cost.optimizer.accumulation_s``).
        fsdp_pipeline: how FSDP's units run under pipeline parallelism (``FSDP_PIPELINES``; only
            with ``pp > 1`` and FSDP units sharding over more than one rank): ``"microbatch"``,
            each microbatch gathers and reduce-scatters as without a pipeline; ``"step"``, as
            torchtitan runs FSDP2 under ``torch.distributed.pipelining``: its blocks are not
            resharded after forward when a pipeline is on (``reshard_after_forward = not
            pp_enabled``, torchtitan's ``apply_fsdp``), and the pipeline stage turns off resharding
            after backward and gradient sync for every microbatch
            (``backward_maybe_with_nosync``), then reduce-scatters once after the stage's last
            backward (``perform_reduce_grad``, the schedule's ``REDUCE_GRAD``), its compute stream
            waiting on the reductions (FSDP2's ``_root_post_backward_final_callback``). So each
            unit is gathered once a step, the stage's parameters stay gathered in the parameter
            dtype and its gradients accumulate unsharded in the reduce dtype through the step
            (``FSDPParam.to_accumulated_grad_if_needed``), and the reduction is exposed
            (``coplan.cost.zero.pipelined_fsdp``).
        cp_exchange: how context parallelism's ranks exchange keys and values (``CP_EXCHANGES``):
            ``"p2p"``, Transformer Engine's ring (Megatron-Core's ``cp_comm_type`` "p2p", its
            default); ``"allgather"``, PyTorch's ``context_parallel`` as torchtitan runs it
            (``torch/distributed/tensor/experimental/_context_parallel/_attention.py``:
            ``_ContextParallelOptions`` rotates by all-gather and merges in fp32 by default), priced
            by ``coplan.cost.context.torch_ring``.
        pp_send: how a pipeline stage sends on under tensor parallelism (``PP_SENDS``).
        grad_storage: where the gradients live (``GRAD_STORAGES``; ``coplan.cost.stages.peak_of``):
            ``"buffer"``, buffers allocated once and held through the run (Megatron-LM's and
            DeepSpeed's gradient buffers); ``"autograd"``, autograd's ``.grad`` tensors (FSDP's
            sharded ones after each unit's reduce-scatter), made by each backward and dropped by
            ``zero_grad(set_to_none=True)``; ``"ddp"``, the same, and where the step runs PyTorch
            DDP (ZeRO 0 over more than one data-parallel rank) its reducer's buckets hold another
            copy of every gradient through the run (``gradient_as_bucket_view=False``, DDP's
            default: torch/nn/parallel/distributed.py, "the saved memory size will be equal to the
            total gradients size" where it is set).
        gather_copies: the stack copies each gathered unit out of the all-gather buffer into
            its parameters and each unit's gradients into the reduce-scatter buffer on the compute
            stream (PyTorch FSDP2; ``coplan.cost.zero.fsdp_copies``), priced with the unit's
            collectives.
        launch_blocking: kernel launches are synchronous (``CUDA_LAUNCH_BLOCKING=1``, CUDA
            programming guide: "kernel launches are synchronous"), so the host's cost of issuing
            each kernel no longer overlaps the GPU's work: every launch adds the measured host
            time of an eager op (``coplan.cost.optimizer.FOR_LOOP_OP_S``) in series.
        nccl_ub: the data-parallel parameter and gradient buffers are registered with NCCL
            (Megatron-Core's ``ddp_config.nccl_ub``), whose SM-efficient algorithms hold fewer SMs
            beside the compute they overlap (``coplan.cost.contention``).
        op_dtypes: (op id, dtype) overrides of the precision each op runs in; a backward op
            follows its forward op. ``"fp32"`` stores the op's outputs in fp32 (autocast's fp32
            list), ``"bf16"``/``"fp16"`` runs it in 16 bits, ``"fp8"`` (GEMMs) quantises its
            inputs with per-tensor scales. A library kernel (GEMM, attention) reading a tensor
            stored in another dtype needs a cast: free when a generated (fused) kernel next to it
            can do it, else a kernel of its own.
    """

    tp: int = 1
    pp: int = 1
    dp: int = 1
    cp: int = 1
    vpp: int = 1
    microbatch: int = 1
    global_batch: int = 1
    seq: int | None = None
    sequence_parallel: bool = False
    recompute: str | frozenset[str] = "none"
    zero: int = 0
    dtype: str = "bf16"
    flash_attention: bool = True
    fusion: str | tuple[tuple[int, ...], ...] = "megatron"
    master_weights: bool = True
    overlap_grad_reduce: bool = True
    overlap_param_gather: bool = False
    tp_comm_overlap: bool = False
    async_tp: bool = False
    tp_overlap_cfg: tuple[tuple[str, str, int, int, bool], ...] = ()
    overlap_p2p: bool = True
    grad_reduce_fp32: bool = True
    fp8_params: bool = False
    fp8_scaling: str = "tensorwise"
    activation_fusion: bool = True
    stage_layers: tuple[int, ...] | None = None
    recompute_per_stage: tuple[str | frozenset[str], ...] | None = None
    recompute_fused: frozenset[str] = frozenset()
    recompute_layers: int | None = None
    op_dtypes: tuple[tuple[int, str], ...] = ()
    loss_fusion: str = "none"
    pipeline_keeps_outputs: bool = False
    fsdp_units: bool = False
    overlap_zero: bool = True
    dp_bucket_params: int | None = None
    dp_bucket_scope: str = "megatron-core"
    attention_kernel: str = "auto"
    kernels: str = "megatron"
    eager_loss: bool = False
    fsdp_shard: int | None = None
    nccl_ub: bool = False
    gemm_padding: bool = True
    kernel_local_buffers: bool = False
    fused_output_casts: bool = False
    fused_rmsnorm: bool = False
    attention_unpad: bool = False
    eager_rope: str = "complex"
    eager_loss_cast: str = "float"
    optimizer: str = ""
    zero3_gather: str = "unit"
    grad_accumulation: str = "fused"
    fsdp_pipeline: str = "microbatch"
    cp_exchange: str = "p2p"
    pp_send: str = "scatter-gather"
    launch_blocking: bool = False
    gather_copies: bool = False
    grad_storage: str = "buffer"

    def __post_init__(self) -> None:
        for name, bound in (
            ("tp", MAX_DEVICES),
            ("pp", MAX_DEVICES),
            ("dp", MAX_DEVICES),
            ("cp", MAX_DEVICES),
            ("vpp", MAX_LAYERS),
            ("microbatch", MAX_GLOBAL_BATCH),
            ("global_batch", MAX_GLOBAL_BATCH),
        ):
            why = bounded_int(getattr(self, name), bound)
            if why is not None:
                raise ConfigError(name, why)
        if self.seq is not None and (why := bounded_int(self.seq, MAX_SEQ)) is not None:
            raise ConfigError("seq", why)
        object.__setattr__(self, "recompute", _recompute_mode("recompute", self.recompute))
        if self.recompute_per_stage is not None:
            modes = tuple(_recompute_mode("recompute_per_stage", r) for r in self.recompute_per_stage)
            if len(modes) != self.pp:
                raise ConfigError(
                    "recompute_per_stage", f"needs one mode per pipeline stage ({self.pp}), got {len(modes)}"
                )
            object.__setattr__(self, "recompute_per_stage", modes)
        object.__setattr__(self, "recompute_fused", frozenset(str(n) for n in self.recompute_fused))
        if self.recompute_layers is not None:
            if (why := bounded_int(self.recompute_layers, MAX_LAYERS)) is not None:
                raise ConfigError("recompute_layers", why)
            if not recomputes_fully(self.recompute, self.recompute_per_stage):
                raise ConfigError(
                    "recompute_layers", "counts fully recomputed blocks: needs recompute 'full'"
                )
        dts = tuple(sorted((int(i), str(d)) for i, d in dict(self.op_dtypes).items()))
        for i, d in dts:
            if d not in OP_DTYPES:
                raise ConfigError(
                    "op_dtypes", f"op {i}: dtype must be one of {', '.join(OP_DTYPES)}, got {d!r}"
                )
        object.__setattr__(self, "op_dtypes", dts)
        if self.zero not in (0, 1, 2, 3) or isinstance(self.zero, bool):
            raise ConfigError("zero", f"must be 0, 1, 2 or 3, got {self.zero!r}")
        if self.dtype not in DTYPES:
            raise ConfigError("dtype", f"must be one of {', '.join(DTYPES)}, got {self.dtype!r}")
        if isinstance(self.fusion, str):
            if self.fusion not in FUSION_MODES:
                raise ConfigError(
                    "fusion", f"must be one of {', '.join(FUSION_MODES)} or op groups, got {self.fusion!r}"
                )
        elif not isinstance(self.fusion, OpGroups):
            object.__setattr__(self, "fusion", OpGroups(tuple(int(i) for i in g) for g in self.fusion))
        try:
            cfg = tuple((str(a), str(m), int(n), int(k), bool(g)) for a, m, n, k, g in self.tp_overlap_cfg)
            ub_slots(cfg)
        except (TypeError, ValueError) as exc:
            raise ConfigError("tp_overlap_cfg", str(exc)) from None
        object.__setattr__(self, "tp_overlap_cfg", cfg)
        if self.loss_fusion not in LOSS_FUSIONS:
            raise ConfigError(
                "loss_fusion", f"must be one of {', '.join(LOSS_FUSIONS)}, got {self.loss_fusion!r}"
            )
        if self.dp_bucket_params is not None and (
            isinstance(self.dp_bucket_params, bool)
            or not isinstance(self.dp_bucket_params, int)
            or self.dp_bucket_params < 1
        ):
            raise ConfigError(
                "dp_bucket_params", f"must be a positive integer, got {self.dp_bucket_params!r}"
            )
        if self.dp_bucket_scope not in BUCKET_SCOPES:
            raise ConfigError(
                "dp_bucket_scope",
                f"must be one of {', '.join(BUCKET_SCOPES)}, got {self.dp_bucket_scope!r}",
            )
        if self.attention_kernel not in ATTENTION_KERNEL_CHOICES:
            raise ConfigError(
                "attention_kernel",
                f"must be one of {', '.join(ATTENTION_KERNEL_CHOICES)}, got {self.attention_kernel!r}",
            )
        if self.kernels not in KERNEL_SETS:
            raise ConfigError("kernels", f"must be one of {', '.join(KERNEL_SETS)}, got {self.kernels!r}")
        n = self.fsdp_shard
        if n is not None and (isinstance(n, bool) or not isinstance(n, int) or n < 1 or self.dp_cp % n):
            raise ConfigError(
                "fsdp_shard", f"must be a positive divisor of dp x cp ({self.dp_cp}), got {n!r}"
            )
        if not isinstance(self.eager_loss, bool):
            raise ConfigError("eager_loss", f"must be true or false, got {self.eager_loss!r}")
        if not isinstance(self.gemm_padding, bool):
            raise ConfigError("gemm_padding", f"must be true or false, got {self.gemm_padding!r}")
        if self.grad_storage not in GRAD_STORAGES:
            raise ConfigError(
                "grad_storage", f"must be one of {', '.join(GRAD_STORAGES)}, got {self.grad_storage!r}"
            )
        if not isinstance(self.gather_copies, bool):
            raise ConfigError("gather_copies", f"must be true or false, got {self.gather_copies!r}")
        if not isinstance(self.launch_blocking, bool):
            raise ConfigError("launch_blocking", f"must be true or false, got {self.launch_blocking!r}")
        if self.eager_loss_cast not in LOSS_CASTS:
            raise ConfigError(
                "eager_loss_cast", f"must be one of {', '.join(LOSS_CASTS)}, got {self.eager_loss_cast!r}"
            )
        if self.eager_rope not in ROPE_FORMS:
            raise ConfigError(
                "eager_rope", f"must be one of {', '.join(ROPE_FORMS)}, got {self.eager_rope!r}"
            )
        if not isinstance(self.fused_output_casts, bool):
            raise ConfigError("fused_output_casts", f"must be true or false, got {self.fused_output_casts!r}")
        if not isinstance(self.kernel_local_buffers, bool):
            raise ConfigError(
                "kernel_local_buffers", f"must be true or false, got {self.kernel_local_buffers!r}"
            )
        if not isinstance(self.fused_rmsnorm, bool):
            raise ConfigError("fused_rmsnorm", f"must be true or false, got {self.fused_rmsnorm!r}")
        if not isinstance(self.attention_unpad, bool):
            raise ConfigError("attention_unpad", f"must be true or false, got {self.attention_unpad!r}")
        if self.optimizer not in OPTIMIZER_IMPLEMENTATIONS:
            choices = ", ".join(repr(x) for x in OPTIMIZER_IMPLEMENTATIONS)
            raise ConfigError("optimizer", f"must be one of {choices}, got {self.optimizer!r}")
        if self.zero3_gather not in ZERO3_GATHERS:
            raise ConfigError(
                "zero3_gather", f"must be one of {', '.join(ZERO3_GATHERS)}, got {self.zero3_gather!r}"
            )
        if self.zero3_gather != "unit" and self.fsdp_units:
            raise ConfigError(
                "zero3_gather", "FSDP gathers each unit's parameters in one collective (needs 'unit')"
            )
        if self.grad_accumulation not in GRAD_ACCUMULATIONS:
            raise ConfigError(
                "grad_accumulation",
                f"must be one of {', '.join(GRAD_ACCUMULATIONS)}, got {self.grad_accumulation!r}",
            )
        if self.cp_exchange not in CP_EXCHANGES:
            raise ConfigError(
                "cp_exchange", f"must be one of {', '.join(CP_EXCHANGES)}, got {self.cp_exchange!r}"
            )
        if self.pp_send not in PP_SENDS:
            raise ConfigError("pp_send", f"must be one of {', '.join(PP_SENDS)}, got {self.pp_send!r}")
        if self.fsdp_pipeline not in FSDP_PIPELINES:
            raise ConfigError(
                "fsdp_pipeline",
                f"must be one of {', '.join(FSDP_PIPELINES)}, got {self.fsdp_pipeline!r}",
            )
        if self.fp8_scaling not in FP8_SCALINGS:
            raise ConfigError(
                "fp8_scaling", f"must be one of {', '.join(FP8_SCALINGS)}, got {self.fp8_scaling!r}"
            )
        if self.fp8_params and self.fp8_scaling != "tensorwise":
            raise ConfigError("fp8_params", "fp8 primary weights need tensorwise scaling")
        if self.fp8_params and self.dtype != "fp8":
            raise ConfigError("fp8_params", f"needs dtype fp8, got {self.dtype!r}")
        if self.vpp > 1 and self.pp == 1:
            raise ConfigError("vpp", "interleaved stages need pipeline parallelism (pp > 1)")
        if self.sequence_parallel and self.tp == 1:
            raise ConfigError("sequence_parallel", "needs tensor parallelism (tp > 1)")
        if self.tp_comm_overlap and self.tp > 1 and not self.sequence_parallel:
            # Megatron-Core asserts the same: userbuffers overlap all-gathers and reduce-scatters
            raise ConfigError(
                "tp_comm_overlap",
                "needs sequence parallelism (Transformer Engine overlaps the all-gathers and "
                "reduce-scatters of sequence parallelism, not all-reduces)",
            )
        if self.async_tp and self.tp > 1 and not self.sequence_parallel:
            # torchtitan refuses it too: the pass matches sequence parallelism's all-gathers and
            # reduce-scatters
            raise ConfigError("async_tp", "needs sequence parallelism (tp > 1 with sequence_parallel)")
        if self.async_tp and self.tp_comm_overlap:
            raise ConfigError("async_tp", "is another overlap of the same collectives than tp_comm_overlap")
        per_step = self.microbatch * self.dp
        if self.global_batch % per_step:
            raise ConfigError(
                "global_batch",
                f"{self.global_batch} is not divisible by microbatch x dp = {self.microbatch} x {self.dp}",
            )
        if self.stage_layers is not None:
            layers = tuple(self.stage_layers)
            if len(layers) != self.pp * self.vpp or any(n < 0 for n in layers):
                raise ConfigError(
                    "stage_layers", f"needs {self.pp * self.vpp} non-negative counts, got {layers}"
                )
            object.__setattr__(self, "stage_layers", layers)

    @property
    def gpus(self) -> int:
        return self.tp * self.cp * self.pp * self.dp

    @property
    def dp_cp(self) -> int:
        """The ranks that hold the same parameters and reduce their gradients together: the
        data-parallel ranks times the context-parallel ones."""
        return self.dp * self.cp

    def recompute_of(self, stage: int) -> str | frozenset[str]:
        """The recompute mode or set of pipeline stage ``stage``."""
        if self.recompute_per_stage is not None:
            return self.recompute_per_stage[stage]
        return self.recompute

    @property
    def num_microbatches(self) -> int:
        """Microbatches per pipeline per step (gradient-accumulation steps)."""
        return self.global_batch // (self.microbatch * self.dp)

    @property
    def shard_ranks(self) -> int:
        """The ranks ZeRO / FSDP shards the model states over: every data-parallel rank, or FSDP's
        hybrid sharding group."""
        return self.dp_cp if self.fsdp_shard is None else self.fsdp_shard

    @property
    def hybrid_group(self) -> int | None:
        """FSDP's hybrid sharding group where the ZeRO-2/3 state is replicated across groups
        (HSDP: ``fsdp_shard`` smaller than dp x cp), else None."""
        n = self.fsdp_shard
        return n if self.zero >= 2 and n is not None and n != self.dp_cp else None

    @property
    def gathers_per_unit(self) -> bool:
        """Whether parameters are gathered layer by layer and freed after use (ZeRO-3, or ZeRO-1/2
        run as FSDP units) across more than one data-parallel rank."""
        return (self.zero == 3 or (self.fsdp_units and self.zero >= 1)) and self.dp_cp > 1

    @property
    def fsdp_per_step(self) -> bool:
        """Whether FSDP's units are gathered and their gradients reduced once a step rather than
        each microbatch: ``fsdp_pipeline="step"`` under a pipeline (``pp > 1``) with FSDP units
        that gather (``gathers_per_unit``)."""
        return self.fsdp_pipeline == "step" and self.pp > 1 and self.fsdp_units and self.gathers_per_unit

    @property
    def bucket_params(self) -> int:
        """Parameters per data-parallel gradient bucket (Megatron-Core's rule unless set)."""
        if self.dp_bucket_params is not None:
            return self.dp_bucket_params
        return default_bucket_params(self.dp_cp)

    @property
    def mixed(self) -> bool:
        """Whether activations run in fewer than 32 bits."""
        return self.dtype in ("bf16", "fp16", "fp8")

    @property
    def act_bytes(self) -> int:
        """Bytes per element of activations and model weights as the kernels see them."""
        return 2 if self.mixed else 4

    def with_(self, **changes: Any) -> TrainingConfig:
        return replace(self, **changes)

    def to_dict(self) -> dict[str, Any]:
        rec = self.recompute if isinstance(self.recompute, str) else sorted(self.recompute)
        fus = self.fusion if isinstance(self.fusion, str) else [list(g) for g in self.fusion]
        return {
            "tp": self.tp,
            "pp": self.pp,
            "dp": self.dp,
            **({"cp": self.cp} if self.cp > 1 else {}),
            "vpp": self.vpp,
            "microbatch": self.microbatch,
            "global_batch": self.global_batch,
            "seq": self.seq,
            "sequence_parallel": self.sequence_parallel,
            "recompute": rec,
            "zero": self.zero,
            "dtype": self.dtype,
            "flash_attention": self.flash_attention,
            "fusion": fus,
            "master_weights": self.master_weights,
            "overlap_grad_reduce": self.overlap_grad_reduce,
            "overlap_param_gather": self.overlap_param_gather,
            "tp_comm_overlap": self.tp_comm_overlap,
            "tp_overlap_cfg": [list(e) for e in self.tp_overlap_cfg],
            "overlap_p2p": self.overlap_p2p,
            "grad_reduce_fp32": self.grad_reduce_fp32,
            "fp8_params": self.fp8_params,
            "activation_fusion": self.activation_fusion,
            "stage_layers": list(self.stage_layers) if self.stage_layers else None,
            "recompute_per_stage": (
                None
                if self.recompute_per_stage is None
                else [r if isinstance(r, str) else sorted(r) for r in self.recompute_per_stage]
            ),
            "recompute_fused": sorted(self.recompute_fused),
            **({"recompute_layers": self.recompute_layers} if self.recompute_layers is not None else {}),
            "op_dtypes": [list(x) for x in self.op_dtypes],
            "loss_fusion": self.loss_fusion,
            "dp_bucket_params": self.bucket_params,
            "dp_bucket_scope": self.dp_bucket_scope,
            "attention_kernel": self.attention_kernel,
            **({"kernels": self.kernels} if self.kernels != "megatron" else {}),
            **({"eager_loss": True} if self.eager_loss else {}),
            **({"fsdp_shard": self.fsdp_shard} if self.fsdp_shard is not None else {}),
            **({"nccl_ub": True} if self.nccl_ub else {}),
            **({"fp8_scaling": self.fp8_scaling} if self.fp8_scaling != "tensorwise" else {}),
            **({"async_tp": True} if self.async_tp else {}),
            **({"gemm_padding": False} if not self.gemm_padding else {}),
            **({"kernel_local_buffers": True} if self.kernel_local_buffers else {}),
            **({"fused_output_casts": True} if self.fused_output_casts else {}),
            **({"fused_rmsnorm": True} if self.fused_rmsnorm else {}),
            **({"attention_unpad": True} if self.attention_unpad else {}),
            **({"eager_rope": self.eager_rope} if self.eager_rope != "complex" else {}),
            **({"eager_loss_cast": self.eager_loss_cast} if self.eager_loss_cast != "float" else {}),
            **({"optimizer": self.optimizer} if self.optimizer else {}),
            **({"zero3_gather": self.zero3_gather} if self.zero3_gather != "unit" else {}),
            **({"grad_accumulation": self.grad_accumulation} if self.grad_accumulation != "fused" else {}),
            **({"fsdp_pipeline": self.fsdp_pipeline} if self.fsdp_pipeline != "microbatch" else {}),
            **({"cp_exchange": self.cp_exchange} if self.cp_exchange != "p2p" else {}),
            **({"pp_send": self.pp_send} if self.pp_send != "scatter-gather" else {}),
            **({"overlap_zero": False} if not self.overlap_zero else {}),
            **({"launch_blocking": True} if self.launch_blocking else {}),
            **({"gather_copies": True} if self.gather_copies else {}),
            **({"grad_storage": self.grad_storage} if self.grad_storage != "buffer" else {}),
        }


def production_overlaps(
    devices: Sequence[DeviceSpec], tp: int, sequence_parallel: bool, zero: int
) -> dict[str, bool]:
    """The communication overlaps a production Megatron-Core stack runs with, for a user who names
    none (``coplan estimate``'s "auto"): Transformer Engine's userbuffers overlap of tensor-parallel
    collectives with the GEMMs where sequence parallelism shards them (it needs SP) on Hopper or
    newer GPUs, the generation whose recipes turn it on (NeMo, Megatron-Bridge, Megatron-LM's
    published H100 runs; the published Ampere runs predate it), and the parameter all-gather
    overlapped with the forward wherever the distributed optimizer shards (ZeRO 1/2), as those
    recipes pair them."""
    return {
        "tp_comm_overlap": userbuffers_overlap(devices, tp, sequence_parallel),
        "overlap_param_gather": zero >= 1,
    }


def userbuffers_overlap(devices: Sequence[DeviceSpec], tp: int, sequence_parallel: bool) -> bool:
    """Whether a production Megatron-Core stack overlaps this layout's TP collectives with
    Transformer Engine's userbuffers: sequence parallelism with TP > 1 on Hopper or newer GPUs."""
    hopper = bool(devices) and all(d.supports("fp8") and d.vendor == "nvidia" for d in devices)
    return sequence_parallel and tp > 1 and hopper


def _recompute_mode(field: str, mode: object) -> str | frozenset[str]:
    if isinstance(mode, str):
        if mode not in RECOMPUTE_MODES:
            raise ConfigError(field, f"must be one of {', '.join(RECOMPUTE_MODES)}, got {mode!r}")
        return mode
    if isinstance(mode, Iterable):
        return frozenset(str(t) for t in mode)
    raise ConfigError(field, f"expected a mode or a set of tensor names, got {mode!r}")


def degrees(tp: int, cp: int, pp: int, dp: int | None = None) -> str:
    """A layout's degrees as a refusal quotes them, ``"tp x pp x dp = 2 x 1 x 4"``: ``cp`` named
    only above 1, ``dp`` left out where None."""
    named = [
        ("tp", tp),
        *([("cp", cp)] if cp > 1 else []),
        ("pp", pp),
        *([("dp", dp)] if dp is not None else []),
    ]
    return " x ".join(n for n, _ in named) + " = " + " x ".join(str(v) for _, v in named)


def check_against(
    config: TrainingConfig, *, gpus: int, n_heads: int, n_layers: int, n_kv_heads: int | None = None
) -> None:
    """The divisibility rules that tie a configuration to a model and a cluster size."""
    if config.gpus != gpus:
        raise ConfigError(
            "dp",
            f"{degrees(config.tp, config.cp, config.pp, config.dp)} = {config.gpus} "
            f"does not equal the {gpus} GPUs",
        )
    if n_heads % config.tp:
        raise ConfigError("tp", f"{config.tp} does not divide the model's {n_heads} attention heads")
    if n_kv_heads is not None and n_kv_heads % config.tp and config.tp % n_kv_heads:
        raise ConfigError(
            "tp", f"{config.tp} and the model's {n_kv_heads} key/value heads do not divide each other"
        )
    chunks = config.pp * config.vpp
    if config.stage_layers is None and n_layers % chunks:
        raise ConfigError(
            "pp",
            f"the model's {n_layers} layers are not divisible by pp x vpp = {config.pp} x {config.vpp} "
            "(stage_layers, --stage-layers, splits them unevenly)",
        )
    if config.stage_layers is not None and sum(config.stage_layers) != n_layers:
        raise ConfigError(
            "stage_layers", f"sum {sum(config.stage_layers)} is not the model's {n_layers} layers"
        )
    if config.vpp > 1 and config.num_microbatches % config.pp:
        raise ConfigError(
            "vpp",
            f"interleaved pipelining needs microbatches ({config.num_microbatches}) "
            f"divisible by pp ({config.pp})",
        )
