"""What eager PyTorch launches for the ops a model writes in Python, beyond the IR's one kernel.

The IR states an RMSNorm, a rotary embedding or a cross-entropy as one op (and one gradient op),
which is what a fused kernel runs. A model that writes them in Python (torchtitan's and fms's Llama,
Meta's reference ``llama/model.py``) runs each ATen op of their bodies as a kernel of its own, and
autograd runs each op's derivative formula (``tools/autograd/derivatives.yaml``). Each plan below
lists those kernels: per big kernel the elements it reads plus writes, 16-bit (activation dtype)
and fp32, per element of the op's main tensor, and the count of token-sized kernels (row
statistics), which cost a launch. The IR's own kernel for the op is replaced by the plan's.

- ``rms_norm`` (forward): ``x.float()`` (read 16-bit, write fp32), ``pow(2)`` (fp32 read, write),
  ``mean(-1)`` (fp32 read), ``+ eps`` and ``rsqrt`` (token-sized), ``x * rstd`` (fp32 read, write),
  ``.type_as(x)`` (fp32 read, 16-bit write), ``* weight`` (16-bit read, write): 6 big kernels,
  2 small.
- ``rms_norm`` (backward): ``* weight``'s gradients (``g * w``: 16-bit read, write; ``g * y``:
  two 16-bit reads, one write, then the sum over tokens: one read), ``type_as``'s (16-bit read,
  fp32 write), ``x * rstd``'s (``g * rstd``: fp32 read, write; ``g * x``: two reads, one write; the
  sum over the row: one read), ``mean``'s (expand / n: fp32 write), ``pow``'s (``pow_backward``:
  ``x.pow(1)``, ``* 2``, ``* g``: 2 + 2 + 3 fp32), the two gradients of ``x.float()`` summed
  (3 fp32) and ``float``'s (fp32 read, 16-bit write): 13 big kernels, 2 small.
- ``rope`` (forward, per q and k tensor): ``xq.float()`` (16-bit read, fp32 write), the complex
  product with ``freqs_cis`` (fp32 read, write), ``type_as`` (fp32 read, 16-bit write); backward
  the same three in reverse (the product with the conjugate).
- ``rope:pairs``, fms's ``RotaryEmbedding.adjusted_qk`` (foundation-model-stack
  ``fms/modules/positions.py`` at 1f181f97bb), which avoids complex numbers: ``q.float()`` viewed
  as pairs (16-bit read, fp32 write), the broadcast product with the 2 x 2 rotation matrices
  (``freqs.mul(q_.unsqueeze(-2))``: the pairs read, twice their elements written), ``.sum(5)``
  (two read, one written) and ``type_as`` (fp32 read, 16-bit write); backward: ``type_as``'s
  gradient, the product's with the rotation (the sum's gradient is an expand, no kernel: one read,
  two written), the reduction of that broadcast back to the pairs (two read, one written) and
  ``float``'s (fp32 read, 16-bit write).
- ``log_softmax`` on the logits (forward): ``logits.float()`` before it (16-bit read, fp32 write),
  then ATen's fp32 log-softmax (read, write). Backward: ``_log_softmax_backward_data`` (reads the
  output gradient and the output, writes the input gradient) and the cast back through
  ``.float()``'s gradient (fp32 read, 16-bit write). A row wider than ATen's shared-memory staging
  holds (``aten/src/ATen/native/cuda/SoftMax.cu``, ``host_softmax``: ``cunn_SoftMaxForwardSmem``
  only while ``dim_size < (sharedMemPerBlock - warps * 4) / sizeof(scalar_t)``, 48 KiB a block,
  about 12K fp32 elements) runs ``cunn_SoftMaxForward``, which reads the row once for its max, once
  for its sum of exponentials and once more to write it (two extra reads), and
  ``cunn_SoftMaxBackward``, which reads the output gradient once for its sum and again to write
  (one extra). Every language model's vocabulary is that wide: on one H200 (torch 2.11,
  ``benchmarks/data/h200_step_probe.json``) a 4,096 x 128,256 fp32 log-softmax took 2.03 ms
  forward and 2.14 backward, four passes over 2.1 GB each. The extra reads are the kernels'
  ``loop_reads``, paid where rows do not stay in a cache between passes (GPUs; ``looped.py``).
- ``log_softmax:autocast``: ``F.cross_entropy`` under ``torch.autocast`` (no ``.float()`` in the
  model: nanoGPT, coplan's runner baselines). ``cross_entropy_loss`` has no autocast rule on CUDA
  and decomposes into ``at::log_softmax(self, dim, self.scalar_type())`` then ``nll_loss``
  (``aten/src/ATen/native/LossNLL.cpp``); autocast's fp32-with-``dtype`` rule for log-softmax keeps
  a dtype the call gives (``aten/src/ATen/autocast_mode.h`` ``set_opt_dtype``), so the log-softmax
  runs in the logits' 16 bits and saves a 16-bit output, and ``nll_loss``, on autocast's fp32
  list, casts those log-probabilities to fp32 first: a 16-bit log-softmax (its wide row read again
  in 16 bits) and a cast kernel forward; backward the cast's gradient back to 16 bits and a
  16-bit log-softmax backward.
- ``log_softmax:none``: the loss in the logits' 16 bits (a model whose logits stay 16-bit and that
  runs no autocast: fms-fsdp's loss on its FSDP-mixed-precision Llama's bf16 output), one 16-bit
  kernel each way, and ``nll_loss``'s zero-filled input gradient in 16 bits.
- ``fused``: a fused cross-entropy kernel (flash-attn's ``CrossEntropyLoss``, a Triton kernel
  reading the 16-bit logits once and writing their gradient in its backward: llm-foundry's
  default ``fused_crossentropy``) is priced as the IR's own log-softmax and loss kernels: no plan
  replaces them; its memory is the eager head's own loss variant's (``parts.FUSED_LOSS``: the
  16-bit logits kept, a new 16-bit gradient).
- ``nll_loss``: forward gathers one log-probability a token (token-sized); backward zero-fills the
  fp32 input gradient (one fp32 write: ``FillFunctor<float>``, 0.45 ms in the same profile) and
  scatters into it (token-sized).
- ``parallel``: the model's ``logits.float()`` on vocabulary-sharded logits under DTensor's
  ``loss_parallel`` (torchtitan under tensor parallelism: ``loss_parallel_enabled`` is
  ``tp > 1`` unless disabled, torchtitan/parallelisms/parallel_dims.py). Its handlers
  (``torch/distributed/tensor/parallel/loss.py``) write the log-softmax out op by op, following
  ``torch._decomp``'s: ``amax`` (fp32 read), ``x - max`` (read, write), ``exp`` (read, write),
  ``sum`` (read), ``log`` and two all-reduces of the row statistics (token-sized), ``shifted -
  logsumexp`` (read, write). ``nll_loss``'s backward handler computes the log-softmax's gradient
  too (``_nll_loss_and_log_softmax_backward``): ``zeros_like`` (fp32 write), the masked scatter of
  the targets (token-sized, with the masks and offsets of ``_MaskPartial``: 15 launches), ``exp``
  of the log-probabilities (read, write), ``+`` (two reads, a write) and ``*`` by the output
  gradient (read, write); the log-softmax's backward handler then only returns its input, and
  ``.float()``'s gradient casts it back. At its peak the backward holds the saved log-probabilities,
  the zeros, the ``exp`` and their sum: one fp32 logits tensor more than ATen's (log-probabilities,
  ``nll_loss``'s gradient, the log-softmax's gradient), which ``parallel_loss_temporary`` adds to
  the loss's working set. Measured on this CPU (``tests/unit/test_loss_parallel.py``): 16 bytes a
  logit at the peak where ATen's loss holds 12, 14 where it holds 10 in the forward.

LayerNorm (``F.layer_norm``), SDPA, GEMMs and SiLU/GeLU are single ATen kernels either way.

Grouped-query attention: models written for eager PyTorch repeat the key/value heads to the query
heads before ``F.scaled_dot_product_attention`` (torchtitan's ``repeat_kv``, fms's ``expand``,
Hugging Face's ``repeat_kv``): a copy kernel each for keys and values (the key/value heads read,
all heads written) and, backward, the gradient of the expand (all heads read, summed into the
key/value heads). SDPA then saves the repeated copies for its backward, so the block saves what it
would with as many key/value heads as query heads (measured on this CPU: a torchtitan-style block's
saved bytes per token are the same with 8 and with 2 key/value heads of 8,
``tests/unit/test_eager.py``); ``repeat_kv_saved`` is that difference.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import replace
from typing import TYPE_CHECKING

from coplan.cost.parts import ACT, F32, FIX, NV, REPL, TP, ZERO, Kernel, Vec
from coplan.ir.types import Graph, Op

if TYPE_CHECKING:
    from coplan.cost.config import TrainingConfig

#: (big kernels as (16-bit elements, fp32 elements) read + written per element, small kernels),
#: forward and backward, per IR op target; see the module docstring for each.
PLANS: dict[str, tuple[tuple[tuple[float, float], ...], int]] = {
    "rms_norm": (((1, 1), (0, 2), (0, 1), (0, 2), (1, 1), (2, 0)), 2),
    "norm_bwd:rms_norm": (
        (
            (2, 0),
            (3, 0),
            (1, 0),
            (1, 1),
            (0, 2),
            (0, 3),
            (0, 1),
            (0, 1),
            (0, 2),
            (0, 2),
            (0, 3),
            (0, 3),
            (1, 1),
        ),
        2,
    ),
    "rope": (((1, 1), (0, 2), (1, 1)), 0),
    "rope_bwd": (((1, 1), (0, 2), (1, 1)), 0),
    "rope:pairs": (((1, 1), (0, 3), (0, 3), (1, 1)), 0),
    "rope_bwd:pairs": (((1, 1), (0, 3), (0, 3), (1, 1)), 0),
    "log_softmax": (((1, 1), (0, 2)), 0),
    "log_softmax_bwd": (((0, 3), (1, 1)), 0),
    "log_softmax:autocast": (((2, 0), (1, 1)), 0),
    "log_softmax_bwd:autocast": (((1, 1), (3, 0)), 0),
    "log_softmax:none": (((2, 0),), 0),
    "log_softmax_bwd:none": (((3, 0),), 0),
    "nll_loss_bwd:none": (((1, 0),), 1),
    "nll_loss": ((), 1),
    "nll_loss_bwd": (((0, 1),), 1),
    "log_softmax:parallel": (((1, 1), (0, 1), (0, 2), (0, 2), (0, 1), (0, 2)), 3),
    "log_softmax_bwd:parallel": (((1, 1),), 0),
    "nll_loss_bwd:parallel": (((0, 1), (0, 2), (0, 3), (0, 2)), 15),
}

#: per plan key, its big kernels that copy a 16-bit tensor to fp32 (``x.float()``, ``type_as``'s
#: gradient, autocast's cast for ``nll_loss``): on CUDA, ATen's copy has a vectorized kernel for
#: fp32 to 16 bits only (``bfloat16_copy_kernel_cuda``, ``float16_copy_kernel_cuda``; the reverse
#: pair exists under ``USE_ROCM`` alone, ``aten/src/ATen/native/cuda/Copy.cu``), so the upcast goes
#: through ``gpu_kernel``'s dynamic casting: ``unrolled_elementwise_kernel`` with ``LoadWithCast``
#: and ``StoreWithCast``, one element a thread per step. Priced at the device's ``memory_upcast``
#: (``Kernel.upcast``): on one H200 (torch 2.11, ``benchmarks/data/h200_step_probe.json``) these
#: kernels moved 5.97 GB in 3.07 ms in the eager step (0.48 of the memory rate the device prices
#: elementwise kernels at) and 3.35 GB in 1.75 ms with the blocks compiled (0.47), where the
#: vectorized downcast of the same logits ran at 0.91 of the peak bandwidth.
UPCASTS: dict[str, frozenset[int]] = {
    "rms_norm": frozenset({0}),
    "norm_bwd:rms_norm": frozenset({3}),
    "rope": frozenset({0}),
    "rope_bwd": frozenset({0}),
    "rope:pairs": frozenset({0}),
    "rope_bwd:pairs": frozenset({0}),
    "log_softmax": frozenset({0}),
    "log_softmax:autocast": frozenset({1}),
    "log_softmax:parallel": frozenset({0}),
}

#: ATen's shared memory a softmax block stages its row in (``sharedMemPerBlock``: 48 KiB on every
#: CUDA GPU; the opt-in larger carve-out is not asked for), less nothing for the few warps' partial
#: sums, which this rounding ignores
SOFTMAX_SMEM_BYTES = 48 * 1024
#: per plan key, (big kernel's index, the 16-bit and the fp32 elements it reads again per element,
#: the bytes of an element of the row it stages) where the row is wider than
#: ``SOFTMAX_SMEM_BYTES`` holds (module docstring)
WIDE_ROW_READS: dict[str, tuple[int, float, float, int]] = {
    "log_softmax": (1, 0.0, 2.0, 4),
    "log_softmax_bwd": (0, 0.0, 1.0, 4),
    "log_softmax:autocast": (0, 2.0, 0.0, 2),
    "log_softmax_bwd:autocast": (1, 1.0, 0.0, 2),
    "log_softmax:none": (0, 2.0, 0.0, 2),
    "log_softmax_bwd:none": (0, 1.0, 0.0, 2),
}
#: the plan keys a loss cast (``TrainingConfig.eager_loss_cast``) other than ``float`` replaces
LOSS_KEYS = frozenset({"log_softmax", "log_softmax_bwd", "nll_loss_bwd"})


def plan_key(graph: Graph, op: Op) -> str:
    """The ``PLANS`` key of ``op`` ("" where eager PyTorch runs it as the IR's one kernel)."""
    if op.target == "norm_bwd" and op.forward_op is not None:
        fwd = graph.ops[op.forward_op]
        return "norm_bwd:rms_norm" if fwd.target == "rms_norm" else ""
    return op.target if op.target in PLANS else ""


def _vec(act: float, f32: float, shard: int) -> Vec:
    out = [0.0] * NV
    out[ACT * 2 + shard] = act
    out[F32 * 2 + shard] = f32
    return tuple(out)  # type: ignore[return-value]


def _main_tensors(graph: Graph, op: Op) -> list[float]:
    """Elements of each tensor the plan runs over: q and k for RoPE (each its own kernels), the
    input for a norm and its gradient, the logits for the loss."""
    if op.target in ("rope", "rope_bwd"):
        # q and k, the forward's outputs: the IR's gradient op writes the fused QKV gradient
        fwd = graph.ops[op.forward_op] if op.target == "rope_bwd" and op.forward_op is not None else op
        return [float(graph.tensors[t].numel) for t in fwd.outputs if graph.tensors[t].shape]
    src = op.inputs[0] if op.target in ("rms_norm", "log_softmax", "nll_loss") else op.outputs[0]
    return [float(graph.tensors[src].numel)] if op.inputs else []


def op_kernels(
    graph: Graph, op: Op, shard: int, rows: float, rope: str = "complex", loss: str = "float"
) -> list[Kernel]:
    """The kernels eager PyTorch launches for ``op`` (a ``PLANS`` op), ``rows`` the tokens of
    its row statistics, RoPE in the form ``rope`` (``TrainingConfig.eager_rope``), the logits
    brought to the loss as ``loss`` says (``TrainingConfig.eager_loss_cast``)."""
    key = plan_key(graph, op)
    if key in ("rope", "rope_bwd") and rope != "complex":
        key = f"{key}:{rope}"
    if key in LOSS_KEYS and f"{key}:{loss}" in PLANS:
        key = f"{key}:{loss}"  # a form that changes nothing for an op keeps the op's own plan
    big, small = PLANS[key]
    again = WIDE_ROW_READS.get(key)
    up = UPCASTS.get(key, frozenset())
    out: list[Kernel] = []
    for n in _main_tensors(graph, op):
        width = n / rows if rows > 0 else 0.0
        for i, (a, f) in enumerate(big):
            loop = ZERO
            if again is not None and i == again[0] and width * again[3] >= SOFTMAX_SMEM_BYTES:
                loop = _vec(again[1] * n, again[2] * n, shard)
            out.append(
                Kernel(
                    op.phase,
                    "vector",
                    shard,
                    0.0,
                    n,
                    _vec(a * n, f * n, shard),
                    ops=(op.id,),
                    loop_reads=loop,
                    upcast=i in up,
                )
            )
    tok = [0.0] * NV
    tok[FIX * 2 + shard] = 8 * rows
    out += [Kernel(op.phase, "vector", shard, 0.0, rows, tuple(tok), ops=(op.id,)) for _ in range(small)]  # type: ignore[arg-type]
    return out


def parallel_loss_temporary(graph: Graph, op_ids: Sequence[int]) -> Vec:
    """The fp32 logits-sized temporary DTensor's loss-parallel backward holds beyond ATen's loss
    (module docstring, ``parallel``): the logits of the forward log-softmax among ``op_ids``,
    sharded by tensor parallelism; nothing where the part has no loss."""
    for i in op_ids:
        op = graph.ops[i]
        if op.target == "log_softmax" and op.phase.name == "FORWARD" and op.inputs:
            return _vec(0.0, float(graph.tensors[op.inputs[0]].numel), TP)
    return ZERO


def gqa_repeat(graph: Graph, op: Op) -> tuple[float, float] | None:
    """(key/value elements, repeated elements) of one of keys or values for an attention op (forward
    or backward) reading fewer key/value heads than query heads; None otherwise."""
    fwd = graph.ops[op.forward_op] if op.forward_op is not None else op
    if fwd.kind.name != "ATTENTION" or len(fwd.inputs) < 2:
        return None
    q, k = graph.tensors[fwd.inputs[0]].shape, graph.tensors[fwd.inputs[1]].shape
    if len(q) != 4 or len(k) != 4 or k[1] >= q[1]:
        return None
    kv = float(k[0] * k[1] * k[2] * k[3])
    return kv, kv * q[1] / k[1]


def _repeat_kernels(graph: Graph, op: Op, shard: int) -> list[Kernel]:
    """The copies of keys and values to every query head (forward) or the sums of their gradients
    back into the key/value heads (backward)."""
    got = gqa_repeat(graph, op)
    if got is None:
        return []
    kv, full = got
    return [Kernel(op.phase, "vector", shard, 0.0, full, _vec(kv + full, 0.0, shard), ops=(op.id,))] * 2


def unpad_kernels(graph: Graph, op: Op, shard: int) -> list[Kernel]:
    """The kernels around one attention call of the flash-attn package's variable-length path with
    padded inputs (``TrainingConfig.attention_unpad``; flash_attn/bert_padding.py, which
    llm-foundry's ``flash_attn_fn`` calls on q, k and v and on the output). Forward: a
    ``torch.gather`` per input (read and written once), ``pad_input``'s zero fill and index-put on
    the output. Backward: the index-put's gradient, a gather of the output gradient, and each
    input's gradient a zero fill and a ``scatter_``. All 16-bit; the expanded index is a view."""
    fwd = graph.ops[op.forward_op] if op.forward_op is not None else op
    if not fwd.inputs or not fwd.outputs:
        return []
    # q, k and v: the attention op's three inputs, or the one fused QKV output it splits (a model
    # without RoPE), gathered a third at a time
    qkv = [float(graph.tensors[t].numel) for t in fwd.inputs[:3]]
    ins = qkv if len(qkv) == 3 else [qkv[0] / 3] * 3
    out = float(graph.tensors[fwd.outputs[0]].numel)

    def k(elements: float, moved: float) -> Kernel:
        return Kernel(op.phase, "vector", shard, 0.0, elements, _vec(moved, 0.0, shard), ops=(op.id,))

    if op.phase.name == "FORWARD":
        return [*(k(n, 2 * n) for n in ins), k(out, out), k(out, 2 * out)]
    return [k(out, 2 * out), *(x for n in ins for x in (k(n, n), k(n, 2 * n)))]


def unpad_saved(graph: Graph, op_ids: Sequence[int]) -> Vec:
    """What the variable-length path keeps beyond the IR's saved set: flash-attn saves its
    unpadded output for its backward, and the next projection the padded one."""
    extra = 0.0
    for i in op_ids:
        op = graph.ops[i]
        if op.phase.name == "FORWARD" and op.kind.name == "ATTENTION" and op.outputs:
            extra += float(graph.tensors[op.outputs[0]].numel)
    return _vec(extra, 0.0, TP)


def repeat_kv_saved(graph: Graph, op_ids: Sequence[int]) -> Vec:
    """What SDPA keeps beyond the IR's saved set when eager PyTorch repeats the key/value heads
    (module docstring): per grouped-query attention op, the saved set of as many key/value heads as
    query heads, less the IR's: its rotated keys and the key and value columns of the fused QKV
    output, 3 x (query heads - key/value heads) head rows per token."""
    extra = 0.0
    for i in op_ids:
        op = graph.ops[i]
        if op.phase.name == "FORWARD" and (got := gqa_repeat(graph, op)) is not None:
            kv, full = got
            extra += 3 * (full - kv)
    return _vec(extra, 0.0, TP)


#: the ``PLANS`` a fused RMSNorm kernel replaces (``TrainingConfig.fused_rmsnorm``)
FUSED_RMSNORM = frozenset({"rms_norm", "norm_bwd:rms_norm"})


def eager_kernels(
    graph: Graph,
    fwd: Sequence[Kernel],
    bwd: Sequence[Kernel],
    shard_of: Callable[[Op], int],
    fused: frozenset[str] = frozenset(),
    rope: str = "complex",
    loss: str = "float",
    unpad: bool = False,
) -> tuple[tuple[Kernel, ...], tuple[Kernel, ...]]:
    """``(fwd, bwd)`` with each single-op kernel of a ``PLANS`` op replaced by its eager kernels, and
    grouped-query attention's key/value repeats beside its kernels. ``fused``: plan keys the stack
    runs as the IR's one kernel instead (``FUSED_RMSNORM``); ``rope``: the model's RoPE form;
    ``loss``: how the logits reach the loss; ``unpad``: attention unpads its inputs and pads its
    output around each call (``unpad_kernels``)."""

    # a fused cross-entropy keeps the IR's loss kernels
    kept = (*LOSS_KEYS, "nll_loss") if loss == "fused" else ()

    def expand(k: Kernel, op: Op) -> Sequence[Kernel] | None:
        if op.kind.name == "ATTENTION":
            # forward: the repeats before the kernel; backward: the sums after it
            reps = _repeat_kernels(graph, op, TP)
            if unpad:
                reps = [*reps, *unpad_kernels(graph, op, TP)]
            return [*reps, k] if op.phase.name == "FORWARD" else [k, *reps]
        if plan_key(graph, op) in ("", *fused, *kept):
            return None
        main = graph.tensors[op.inputs[0]] if op.inputs else None
        rows = float(main.numel // main.shape[-1]) if main is not None and main.shape else 0.0
        return op_kernels(graph, op, shard_of(op), rows, rope, loss)

    return _expand_single_ops(graph, fwd, expand), _expand_single_ops(graph, bwd, expand)


def _expand_single_ops(
    graph: Graph, kernels: Sequence[Kernel], expand: Callable[[Kernel, Op], Sequence[Kernel] | None]
) -> tuple[Kernel, ...]:
    """``kernels`` with each kernel of one op (views aside) replaced by what ``expand`` gives for
    it; kept where it gives None, and every kernel of several ops kept."""
    out: list[Kernel] = []
    for k in kernels:
        real = [graph.ops[i] for i in k.ops if graph.ops[i].kind.name != "VIEW"]
        got = expand(k, real[0]) if len(real) == 1 else None
        out.extend((k,) if got is None else got)
    return tuple(out)


#: The ``PLANS`` Inductor leaves to ATen: RoPE through ``view_as_complex`` (torchtitan's and Meta's
#: Llama). Inductor generates no code for complex dtypes and falls back to the ATen op
#: (``torch/_inductor/lowering.py`` warns "Torchinductor does not support code generation for
#: complex operators"; github.com/pytorch/torchtitan/issues/15 reports it for its RoPE; complex
#: compilation is an opt-in from torch 2.14, ``torch._functorch.config.enable_complex_wrapper``).
#: On one H200 (torch 2.11, ``benchmarks/data/h200_step_probe.json``) the compiled blocks ran ATen's
#: ``BinaryFunctor<c10::complex<float>>`` kernel. Around it the generated kernels write the fp32
#: pairs the complex view needs and read its fp32 product back: the eager plan's three kernels, its
#: casts in generated code (vectorized, so not ``UPCASTS``). A fusion group holding the op (RoPE's
#: gradient and the add summing it into the fused QKV gradient) runs as those kernels: compiled on
#: this CPU, a torchtitan-style block's backward lists the casts to fp32 pairs, ATen's complex
#: product and the casts back for q and k, and no kernel of the add
#: (``tests/unit/test_inductor_saved.py``).
INDUCTOR_FALLBACKS = frozenset({"rope", "rope_bwd"})


def inductor_kernels(
    graph: Graph,
    fwd: Sequence[Kernel],
    bwd: Sequence[Kernel],
    shard_of: Callable[[Op], int],
    rope: str = "complex",
) -> tuple[tuple[Kernel, ...], tuple[Kernel, ...]]:
    """``(fwd, bwd)`` as torch.compile runs them: each single-op kernel of an
    ``INDUCTOR_FALLBACKS`` op (RoPE written with complex numbers, ``rope`` ``"complex"``) replaced
    by the ATen kernel Inductor falls back to and the generated casts around it."""
    if rope != "complex":
        return tuple(fwd), tuple(bwd)

    def expand(ks: Sequence[Kernel]) -> tuple[Kernel, ...]:
        out: list[Kernel] = []
        for k in ks:
            ops = [graph.ops[i] for i in k.ops if graph.ops[i].kind.name != "VIEW"]
            falls = [op for op in ops if plan_key(graph, op) in INDUCTOR_FALLBACKS]
            if not falls:
                out.append(k)
                continue
            # a group holding the fallback (RoPE's gradient with the add that sums it into the
            # fused QKV gradient) runs as the fallback's kernels, the rest of the group fused into
            # the generated casts around the ATen product (as the compiled step lists them)
            for op in falls:
                out.extend(replace(e, upcast=False) for e in op_kernels(graph, op, shard_of(op), 0.0))
        return tuple(out)

    return expand(fwd), expand(bwd)


def stack_kernels(
    graph: Graph, fwd: Sequence[Kernel], bwd: Sequence[Kernel], config: TrainingConfig, post: bool
) -> tuple[tuple[Kernel, ...], tuple[Kernel, ...]]:
    """The kernels ``config``'s stack launches for a part's IR kernels ``fwd`` and ``bwd``: eager
    PyTorch's decompositions under eager kernels, or on the loss side (``post``) beside compiled
    blocks (``eager_loss``); Inductor's, with the ops it leaves to ATen; else the IR's own."""
    if config.kernels == "eager" or (config.eager_loss and post):
        fused = FUSED_RMSNORM if config.fused_rmsnorm else frozenset()
        return eager_kernels(
            graph,
            fwd,
            bwd,
            shard_class,
            fused,
            config.eager_rope,
            config.eager_loss_cast,
            config.attention_unpad,
        )
    if config.kernels == "inductor":
        return inductor_kernels(graph, fwd, bwd, shard_class, config.eager_rope)
    return tuple(fwd), tuple(bwd)


def shard_class(op: Op) -> int:
    """Norms run on replicated activations (sequence parallelism divides them); RoPE on the heads
    and the loss on the vocabulary, which tensor parallelism divides."""
    return TP if op.target.startswith(("rope", "log_softmax", "nll_loss")) else REPL


__all__ = [
    "FUSED_RMSNORM",
    "INDUCTOR_FALLBACKS",
    "PLANS",
    "UPCASTS",
    "eager_kernels",
    "gqa_repeat",
    "inductor_kernels",
    "op_kernels",
    "parallel_loss_temporary",
    "plan_key",
    "repeat_kv_saved",
    "shard_class",
    "stack_kernels",
    "unpad_kernels",
    "unpad_saved",
]
