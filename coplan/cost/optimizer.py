"""How a training step runs its optimizer, and what that costs on a GPU.

A plan's fusion groups price the optimizer as the kernels they name: a group of a block's updates
is one multi-tensor kernel reading each parameter, gradient and Adam state once and writing the
parameter and states once, as fused AdamW (``torch.optim.AdamW(fused=True)``, Apex's and
Transformer Engine's FusedAdam) runs it. PyTorch's other two forms of the same update do more:

- ``for-loop`` (``foreach=False``, ``torch/optim/adam.py`` ``_single_tensor_adam`` with decoupled
  weight decay): for every parameter tensor, eight ATen ops issued from Python, ``param.mul_``,
  ``exp_avg.lerp_``, ``exp_avg_sq.mul_`` and ``.addcmul_``, ``sqrt``, ``/``, ``.add_`` (the
  denominator) and ``param.addcdiv_``. Each is a kernel of its own, and together they make 21
  element accesses where the fused update makes 7 (reads of p, g, m, v; writes of p, m, v): three
  times the traffic. The kernels are small (an average GPT-2 tensor is under a million elements,
  a few microseconds of memory traffic), so the host, which issues them one by one, is what
  takes the time.
- ``foreach`` (PyTorch's default on CUDA: ``torch/optim/optimizer.py``
  ``_default_to_fused_or_foreach``; ``_multi_tensor_adam``): the same eight ops, each over all
  tensors at once as a ``torch._foreach_*`` kernel, so the same three-fold traffic in few launches
  (``aten/src/ATen/native/cuda/MultiTensorApply.cuh``: a launch holds at most 320 chunks of 65,536
  elements, and 36 to 110 tensors by the number of tensor lists an op reads).

Before the update, where a step runs several microbatches, each one's gradients are accumulated:
inside the weight-gradient GEMMs (Megatron), or by a pass of their own (``accumulation_s``).
"""

from __future__ import annotations

import math
from collections.abc import Sequence

from coplan.cost.parts import Kernel

#: ATen ops of one parameter's AdamW update in the for-loop and foreach forms (module docstring)
ADAMW_OPS = 8
#: their element accesses over the fused update's: (2+3+2+4+2+2+2+4) / 7
UNFUSED_TRAFFIC = 21 / 7
#: host seconds per op of the for-loop form on a GPU: Python, the dispatcher and the launch. On
#: one H200 (torch 2.11, benchmarks/results/gpu/bench_gpu.json) the runs whose AdamW ran as this
#: loop (eager and torch.compile, GPT-2 124M: 148 tensors, 1,184 ops) took 14-16 ms per step
#: beyond their per-microbatch time, read off the difference between one and four microbatches
#: of 32: 12.7 us an op; the fused update took 4 ms or less. The same loop over 148 four-element
#: tensors on this project's CPU machine (no launch, no CUDA dispatch) takes 3.4 us an op.
FOR_LOOP_OP_S = 12.7e-6
#: multi_tensor_apply's limits per launch: chunks of this many elements, this many chunks, and
#: this many tensors for the ops that read 3-4 tensor lists (lerp_, addcmul_, addcdiv_)
MTA_CHUNK, MTA_BLOCKS, MTA_TENSORS = 65536, 320, 36
#: bytes of one element's fused update with fp32 parameter, gradient and states (7 accesses):
#: counts elements for multi-tensor launches, which only the launch count reads
FUSED_ELEMENT_BYTES = 28


def optimizer_seconds(
    kernels: Sequence[Kernel],
    times: Sequence[float],
    sizes: Sequence[float],
    launch_s: float,
    implementation: str,
) -> tuple[float, int]:
    """(seconds, kernels launched) of the optimizer kernels ``kernels`` (priced ``times`` as their
    groups say, moving ``sizes`` bytes each) run as ``implementation``."""
    real = [(k, t, b) for k, t, b in zip(kernels, times, sizes, strict=True) if k.kind != "free"]
    if implementation in ("", "fused") or not real:
        return sum(times), len(real)
    tensors = sum(max(1, len(k.ops)) for k, _, _ in real)
    # each kernel's time less its launch is its traffic, which the eight ops make three times over
    traffic = UNFUSED_TRAFFIC * sum(max(0.0, t - launch_s) for _, t, _ in real)
    if implementation == "for-loop":
        ops = tensors * ADAMW_OPS
        # the host issues the loop's ops one by one; the GPU runs them as they come, so the step
        # takes the longer of the two
        return max(traffic + ops * launch_s, ops * FOR_LOOP_OP_S), ops
    # ``kernels`` are one model part's (a block, the embedding): its ops launch at least once each,
    # where PyTorch's lists span the model, so a model of many small parts is charged a few more
    # launches than it makes (8 per part, microseconds each)
    elements = sum(b for _, _, b in real) / FUSED_ELEMENT_BYTES
    chunks = elements / MTA_CHUNK + tensors  # each tensor's last chunk is a partial one
    per_op = max(math.ceil(chunks / MTA_BLOCKS), math.ceil(tensors / MTA_TENSORS))
    return traffic + ADAMW_OPS * per_op * launch_s, ADAMW_OPS * per_op


#: Bytes moved accumulating one parameter's gradient over a step's microbatches
#: (``TrainingConfig.grad_accumulation``): (bytes in the first microbatch, bytes in each later one).
#: AccumulateGrad steals the first microbatch's gradient and adds the later ones in place (the old
#: and the new read, the sum written: torch/csrc/autograd/functions/accumulate_grad.h); DeepSpeed's
#: BF16_Optimizer adds every microbatch's 16-bit gradient into its fp32 copy (the 16-bit read, the
#: fp32 read and written: deepspeed/runtime/bf16_optimizer.py ``update_hp_grads`` at 56c522386,
#: 2022-04). ``fsdp-unsharded`` is FSDP2 accumulating a gathered unit's gradients in its reduce
#: dtype while gradient sync is off (``TrainingConfig.fsdp_pipeline`` "step"): the first
#: microbatch's 16-bit gradient cast to fp32 (read 2, written 4:
#: ``FSDPParam.to_accumulated_grad_if_needed``), each later one added into it (read 2, the fp32
#: read and written: ``accumulate_unsharded_grad_if_needed``;
#: torch/distributed/fsdp/_fully_shard/_fsdp_param.py at v2.13.0); not a stack's choice, what
#: that schedule implies.
ACCUMULATION_BYTES: dict[str, tuple[float, float]] = {
    "fused": (0.0, 0.0),
    "autograd16": (0.0, 3 * 2.0),
    "autograd32": (0.0, 3 * 4.0),
    "fp32-buffer": (2.0 + 4.0 + 4.0, 2.0 + 4.0 + 4.0),
    "fsdp-unsharded": (2.0 + 4.0, 2.0 + 4.0 + 4.0),
}


def accumulation_s(mode: str, params: float, microbatches: int, bandwidth: float) -> float:
    """Seconds per microbatch (averaged over ``microbatches``) of accumulating ``params``
    parameters' gradients as ``mode`` does (``ACCUMULATION_BYTES``), memory-bound at
    ``bandwidth`` bytes/s; with one microbatch only what the first one moves."""
    first, later = ACCUMULATION_BYTES[mode]
    if params <= 0 or bandwidth <= 0 or not (first or later):
        return 0.0
    m = max(1, microbatches)
    return params * (first + later * (m - 1)) / m / bandwidth
