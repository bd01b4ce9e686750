"""Time of one kernel on one device: a roofline with shape- and dtype-dependent efficiency.

A kernel takes ``max(compute time, memory time) + launch``: compute at the device's peak for the
kernel's dtype times an achievable efficiency (per dtype for GEMMs, shrinking for small or thin
matrices: ``d / (d + matmul_half_dim)`` per GEMM dimension), memory traffic at the device's
bandwidth times its memory efficiency. One rule per kernel kind, registered by decorator.

Refinements a device opts into by giving the efficiency keys (a calibrated CPU does; the GPU presets
do not, and price exactly as without them):

- ``vector.<family>[.<dtype>]``: non-matrix work at a rate per family (``VECTOR_FAMILIES``);
- ``attention.<dtype>``: a measured fused-attention efficiency, before the shape factor over the
  head dimension too (a CPU flash kernel runs its tiles through generic GEMMs whose inner dimension
  is the head dim: a 32-wide head runs at a fraction of a 128-wide one per FLOP);
  ``attention_backward.<dtype>`` the gradient kernel's, a separate implementation (on a CPU its
  16-bit GEMMs take another, slower path than the forward's);
- ``attention_parallel_half`` (a device field): fused attention slows when a GPU holds few query
  tiles (batch x heads x query length / 128), as measured on an H100;
- ``matmul_call_s`` (a device field): a fixed cost per GEMM call and dtype beyond the launch (a CPU
  BLAS's operand packing and kernel lookup, which sets the time of small GEMMs);
- ``matmul_tn.<dtype>``: the fraction of the GEMM rate reached when the left operand is a transposed
  view (weight gradients; a CPU's 16-bit BLAS path for it is slower);
- ``attention_tiles`` (a device field, ``coplan.hardware.tiling``): the attention kernel's tiling and
  a measured cost per tile, for kernels whose small tiles cost more than their FLOPs (a CPU's);
- ``first_touch``: tensors written to fresh storage at least as large as the last-level cache are
  page-faulted in by the host, at that fraction of the memory bandwidth, on top of the roofline;
- ``host_op_s`` (a device field): the host's time for an op that launches no kernel (a view), paid
  in eager mode where the host is the device (a CPU);
- ``matmul_unaligned``: the fraction of a GEMM's rate it keeps when it loads an operand whose
  leading dimension is not a multiple of 16 bytes, where the stack does not pad it
  (``TrainingConfig.gemm_padding``): cuBLAS then runs kernels built for narrower alignment;
  ``bmm_unaligned`` the same for the unfused attention's batched GEMMs over a misaligned head
  dimension;
- ``memory_upcast``: the fraction of the memory rate an eager copy from 16 bits to fp32 reaches
  (``Kernel.upcast``, the ``x.float()`` kernels of ``coplan.cost.eager``);
- ``gemm_tiles`` (a device field): the library GEMM's output tiles, whose count over the device's
  SMs sets the waves a GEMM runs; the last wave's idle SMs cost time (``wave_efficiency``).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from functools import lru_cache

from coplan.cost.config import ConfigError, TrainingConfig
from coplan.cost.optimizer import FOR_LOOP_OP_S
from coplan.cost.parts import TP, Kernel, Vec, vdot
from coplan.hardware.device import VECTOR_FAMILIES, DeviceSpec
from coplan.hardware.tiling import AttentionTiling

#: Slowdown of a fused (flash) attention kernel that applies dropout to its probabilities: it
#: generates the mask in registers (Philox) in forward and regenerates it in backward, on the
#: CUDA cores next to the tensor-core work. Measured fwd + bwd at p = 0.1: +3% for cuDNN's fused
#: attention on H200 (NVIDIA/TransformerEngine issue #3312, sbhd layout: 0.594 -> 0.614 ms), +5%
#: for FlashAttention-2 on GB200 (TransformerEngine PR #3313: 0.695 -> 0.728 ms), +11-17% for
#: PyTorch's FlashAttention-2 kernels on one H100 (benchmarks/data/h100_microbench.json, causal,
#: head dim 128, seq 4096). Transformer Engine, which the Megatron-Core runs use, picks cuDNN's
#: kernel on Hopper; 5% stands for that class of kernel. A device's ``attention_kernels`` give
#: their own (``DeviceSpec.attention_rates``).
FLASH_DROPOUT_COST = 0.05

#: The precision non-matrix work runs in under each training dtype (fp8 training keeps its
#: activations in 16 bits; tf32 is a matmul mode of fp32 tensors).
_VECTOR_DTYPE = {"tf32": "fp32", "fp8": "bf16"}


@dataclass(frozen=True, slots=True)
class Rates:
    """A device's rates for one training precision, looked up once per estimate."""

    mm_flops: float  # achievable matrix FLOP/s before shape derating
    attn_flops: float  # achievable flash-attention FLOP/s before shape derating (forward)
    vec_flops: float  # achievable vector FLOP/s (elementwise; every family without vec_rates)
    bandwidth: float  # achievable memory bytes/s
    half_dim: float
    launch_s: float
    vec_rates: tuple[float, ...] = ()  # achievable FLOP/s per VECTOR_FAMILIES entry; () = vec_flops
    attn_bwd_flops: float = 0.0  # the same for the attention gradient kernel (0: attn_flops)
    attn_head_half: float = 0.0  # half-dimension derating the head dim of flash attention (0: none)
    first_touch: float = 0.0  # bytes/s of page-faulting fresh storage in (0: no such tier)
    cache_bytes: float = 0.0  # fresh tensors at least this large pay the first-touch tier
    # the attention kernel's tiling and seconds per tile (forward, backward) where the device has
    # one (``coplan.hardware.tiling``): then ``FLOPs / rate + tiles * tile_s``, no shape derating
    attn_tiling: AttentionTiling | None = None
    attn_tile_s: float = 0.0
    attn_bwd_tile_s: float = 0.0
    mm_call_s: float = 0.0  # fixed seconds per GEMM call beyond the launch (a CPU BLAS's; 0 on GPUs)
    mm_tn: float = 1.0  # fraction of mm_flops a GEMM with a transposed left operand reaches
    host_op_s: float = 0.0  # host seconds of an op that launches no kernel, in eager mode
    # query tiles at which fused attention reaches half its full-occupancy rate (0: no derating)
    attn_par_half: float = 0.0
    attn_bwd_par_half: float = 0.0
    attn_dropout: float = FLASH_DROPOUT_COST  # fractional slowdown of fused attention with dropout
    # generated reductions wider than a register-resident row reload their inputs per loop
    # (``looped``): on GPUs; a CPU core's loops over one row hit its own cache
    looped_reductions: bool = False
    mm_unaligned: float = 1.0  # fraction of the GEMM rate kept with a misaligned loaded operand
    bmm_unaligned: float = 1.0  # the same for the unfused attention's batched GEMMs (head dimension)
    mm_template: float = 1.0  # fraction of the GEMM rate a generated GEMM template reaches
    upcast: float = 1.0  # fraction of ``bandwidth`` an eager 16-bit-to-fp32 copy reaches
    # the library GEMMs' output tiles and the SMs their waves fill (``DeviceSpec.gemm_tiles``;
    # () prices no wave quantization beyond the shape derating)
    mm_tiles: tuple[tuple[int, int], ...] = ()
    units: int = 0

    @classmethod
    def of(cls, device: DeviceSpec, dtype: str, attention: str = "auto") -> Rates:
        """``device``'s rates for training in ``dtype``, fused attention by kernel ``attention``
        (``"auto"``: the one the device's ``attention`` efficiencies describe). Memoised: a search
        asks for the same few thousands of times (devices are immutable values)."""
        return _rates_of(device, dtype, attention)

    @classmethod
    def _of(cls, device: DeviceSpec, dtype: str, attention: str) -> Rates:
        mm_dtype = matmul_dtype(device, dtype)
        peak = device.peak(mm_dtype)
        # attention stays in 16 bits under fp8 training (Transformer Engine's default recipe)
        attn_dtype = _fallback(device, "fp8") if mm_dtype == "fp8" else mm_dtype
        vec_dtype = _VECTOR_DTYPE.get(dtype, dtype)
        vec = device.vector_flops * device.efficiency_of("vector", vec_dtype)
        families = tuple(
            device.vector_flops * device.vector_efficiency(f, vec_dtype) for f in VECTOR_FAMILIES
        )
        first = device.efficiency.get("first_touch")
        tiling = device.attention_tiles
        attn = device.peak(attn_dtype)
        fwd = device.efficiency_of("attention", attn_dtype)
        bwd = device.efficiency_of("attention_backward", attn_dtype)
        dropout = FLASH_DROPOUT_COST
        if attention not in ("auto", device.attention_kernel):
            got = device.attention_rates(attention)
            if got is None:
                named = f" (its own is {device.attention_kernel})" if device.attention_kernel else ""
                raise ConfigError(
                    "attention_kernel", f"device {device.name!r} has no rates for {attention!r}{named}"
                )
            fwd, bwd, dropout = got
        return cls(
            mm_flops=peak * device.efficiency_of("matmul", mm_dtype),
            attn_flops=attn * fwd,
            attn_bwd_flops=attn * bwd,
            vec_flops=vec,
            bandwidth=device.memory_bandwidth * device.efficiency_of("memory"),
            half_dim=device.matmul_half_dim,
            launch_s=device.kernel_launch_s,
            vec_rates=() if all(f == vec for f in families) else families,
            attn_head_half=device.matmul_half_dim if device.has_efficiency("attention", attn_dtype) else 0.0,
            first_touch=device.memory_bandwidth * first if first else 0.0,
            cache_bytes=float(device.sram_bytes),
            attn_tiling=tiling,
            attn_tile_s=tiling.cost("forward", attn_dtype) if tiling else 0.0,
            attn_bwd_tile_s=tiling.cost("backward", attn_dtype) if tiling else 0.0,
            mm_call_s=device.matmul_call_s.get(mm_dtype, 0.0),
            mm_tn=device.efficiency_of("matmul_tn", mm_dtype),
            host_op_s=device.host_op_s,
            attn_par_half=device.attention_parallel_half.get("forward", 0.0),
            attn_bwd_par_half=device.attention_parallel_half.get("backward", 0.0),
            attn_dropout=dropout,
            looped_reductions=device.kind == "gpu",
            mm_unaligned=device.efficiency_of("matmul_unaligned"),
            bmm_unaligned=device.efficiency_of("bmm_unaligned"),
            mm_template=device.efficiency_of("matmul_template"),
            upcast=device.efficiency_of("memory_upcast"),
            mm_tiles=device.gemm_tiles,
            units=device.compute_units,
        )


def matmul_dtype(device: DeviceSpec, dtype: str) -> str:
    """The precision ``device``'s matrix units run ``dtype`` GEMMs in (``dtype`` itself where
    supported)."""
    return dtype if device.supports(dtype) else _fallback(device, dtype)


def _fallback(device: DeviceSpec, dtype: str) -> str:
    """The precision a device really runs ``dtype`` matmuls in when its matrix units lack it
    (fp8 on A100 runs as bf16; tf32 on a CPU as fp32): the next wider one it supports."""
    for d in {
        "fp8": ("bf16", "fp16", "fp32"),
        "bf16": ("fp16", "fp32"),
        "fp16": ("bf16", "fp32"),
        "tf32": ("fp32",),
        "fp32": (),
    }.get(dtype, ()):
        if device.supports(d):
            return d
    return "fp32"


def precision_notes(devices: Sequence[DeviceSpec], dtype: str, fp8_params: bool) -> tuple[str, ...]:
    """What an estimate should say when a device's matrix units lack the training dtype: its GEMMs
    are priced in the precision it falls back to (and fp8's casts and weight copies not at all)."""
    out = []
    for dev in dict.fromkeys(devices):
        if not dev.supports(dtype):
            note = f"{dev.name} has no {dtype} matrix units: its GEMMs are priced in {_fallback(dev, dtype)}"
            if dtype == "fp8":
                note += ", without fp8 casts or weight copies" + (
                    " (fp8 params ignored)" if fp8_params else ""
                )
            out.append(note)
    return tuple(out)


@lru_cache(maxsize=4096)
def _rates_of(device: DeviceSpec, dtype: str, attention: str) -> Rates:
    return Rates._of(device, dtype, attention)


@dataclass(frozen=True, slots=True)
class Scale:
    """How a configuration scales a kernel of the unsharded graph."""

    tp: int
    sp: bool
    weights: Vec  # bytes per element of each (precision class, shard class) slot
    act_bytes: int
    flash: bool
    eager: bool = True  # ops dispatched one by one (not a compiled graph): views cost host time
    pads: bool = True  # unaligned GEMM dimensions are padded (``TrainingConfig.gemm_padding``)
    # attention without a fused kernel runs as the model's Python writes it, op by op (eager
    # PyTorch's kernels, ``TrainingConfig.kernels``), not as Megatron's fused softmax
    eager_attention: bool = False
    # kernel launches are synchronous: each pays the host's issue time in series
    # (``TrainingConfig.launch_blocking``)
    launch_blocking: bool = False
    # batched GEMMs are padded too: Inductor's pad_mm pads bmm operands as it pads mm's, where eager
    # PyTorch and Megatron's kernels run the head dimension as the model has it
    pads_bmm: bool = False

    def div(self, shard: int) -> int:
        return self.tp if shard == TP or self.sp else 1

    @classmethod
    def of(cls, config: TrainingConfig) -> Scale:
        t, ab = config.tp, config.act_bytes
        div_rep = t if config.sequence_parallel else 1
        # fp32-class values (loss on logits, main gradients, Adam state) are 4 bytes in mixed
        # precision; a pure 16-bit run (no master weights) keeps them in 16 bits too
        f32 = 4 if (not config.mixed or config.master_weights) else ab
        weights: Vec = (ab / div_rep, ab / t, f32 / div_rep, f32 / t, 1 / div_rep, 1 / t)
        # a named fusion plan runs eagerly (PyTorch with or without Megatron's fused kernels);
        # explicit fusion groups are a compiled graph, whose views cost the host nothing per step
        eager = isinstance(config.fusion, str)
        return cls(
            t,
            config.sequence_parallel,
            weights,
            ab,
            config.flash_attention,
            eager,
            config.gemm_padding,
            config.kernels == "eager",
            config.launch_blocking,
            config.gemm_padding and config.kernels == "inductor",
        )


KernelRule = Callable[[Kernel, Rates, Scale], float]
_RULES: dict[str, KernelRule] = {}


def kernel_rule(kind: str) -> Callable[[KernelRule], KernelRule]:
    def register(fn: KernelRule) -> KernelRule:
        if kind in _RULES:
            raise ValueError(f"kernel rule for {kind!r} registered twice")
        _RULES[kind] = fn
        return fn

    return register


def kernel_time(k: Kernel, r: Rates, s: Scale) -> float:
    t = _RULES[k.kind](k, r, s)
    if s.launch_blocking:
        # the host issues the next kernel only once this one is done: its Python, dispatcher and
        # launch time (measured for eager ops on an H200, ``FOR_LOOP_OP_S``) adds in series
        t += launches(k, s) * FOR_LOOP_OP_S
    return t


#: Query rows per thread block of a GPU's fused attention kernel (FlashAttention-2/3, cuDNN on
#: Hopper with head dim 128), the unit ``attention_parallel_half`` counts.
ATTN_TILE_ROWS = 128


def launches(k: Kernel, s: Scale) -> int:
    """Kernels launched for ``k``: none for views, three forward / five backward for attention
    without a fused kernel (two batched GEMMs and a softmax; their gradients), one more each way
    with dropout on the probabilities (the dropout kernel and its gradient). Written out in eager
    PyTorch (``eager_scores``) the scale and the mask are kernels of their own each way, and under
    autocast the casts around the fp32 softmax two more."""
    if k.kind == "free":
        return 0
    if k.kind == "attention" and not s.flash:
        forward = k.phase.value == "forward"
        n = 3 if forward else 5
        if s.eager_attention:
            n += 2 + (2 if s.act_bytes < 4 else 0)
        return n + (1 if k.dropout else 0)
    return 1


def eager_scores(forward: bool, act_bytes: int) -> float:
    """Bytes per score element that eager PyTorch's written-out attention moves (nanoGPT's
    model.py: ``att = (q @ k.transpose(-2, -1)) * scale``, ``att.masked_fill(mask, -inf)``,
    ``F.softmax(att, dim=-1)``, ``att @ v``; Hugging Face's eager attention is the same sequence
    with an added mask). Forward: S written by the first batched GEMM, read and written by the
    scale and by the mask (4 passes), P read by the second GEMM. Under autocast (16-bit
    activations) softmax is on the fp32 list (aten/src/ATen/autocast_mode.cpp; the AMP docs'
    "CUDA Ops that can autocast to float32"): its input is cast up (16-bit read, fp32 write), it
    reads and writes fp32, and the matmul's autocast casts P back down (fp32 read, 16-bit write):
    8 passes of 16 bits and 4 of fp32. Backward (tools/autograd/derivatives.yaml): dP written and
    P read by the second GEMM's gradients, dP cast up, ``_softmax_backward_data`` reading the
    gradient and the saved fp32 output and writing dS, dS cast down, ``masked_fill``'s gradient
    (``grad.masked_fill(mask, 0)``) and the scale's (``grad * scale``) a read and a write each, dS
    read by the first GEMM's two gradients: 10 passes of 16 bits and 5 of fp32. Without autocast
    the casts go: 8 passes forward, 11 backward, all in the activation dtype."""
    if act_bytes < 4:
        return act_bytes * (8 if forward else 10) + 4 * (4 if forward else 5)
    return act_bytes * (8 if forward else 11)


def shape_factor(dims: tuple[float, ...], half: float) -> float:
    if half <= 0:
        return 1.0
    f = 1.0
    for d in dims:
        f *= d / (d + half)
    return f


@kernel_rule("free")
def _free(k: Kernel, r: Rates, s: Scale) -> float:
    # views launch nothing; in eager mode the host still dispatches and records each one
    return r.host_op_s if s.eager else 0.0


def vector_compute(k: Kernel, r: Rates, s: Scale) -> float:
    """Seconds of a kernel's non-matrix FLOPs, each family at its own rate where the device has them."""
    if r.vec_rates and k.vec_split:
        return sum(f / v for f, v in zip(k.vec_split, r.vec_rates, strict=True) if f) / s.div(k.shard)
    return k.vec_flops / s.div(k.shard) / r.vec_flops


def first_touch(k: Kernel, r: Rates, s: Scale) -> float:
    """Seconds of page-faulting in the fresh storage of the tensors ``k`` writes that are at least
    the cache's size (0 on devices without the tier). Paid on top of the roofline: the faults are
    serialised in the OS, not overlapped with the kernel's own traffic."""
    if r.first_touch <= 0.0 or not k.fresh:
        return 0.0
    big = (b for b in (vdot(v, s.weights) for v in k.fresh) if b >= r.cache_bytes)
    return sum(big) / r.first_touch


def memory_s(k: Kernel, r: Rates, s: Scale) -> float:
    """Seconds of a kernel's traffic at the device's bandwidth: what crosses its boundary, and what
    a looped reduction loads again where rows do not stay in a cache (``Rates.looped_reductions``).
    An eager upcast (``Kernel.upcast``) moves its bytes at the device's ``memory_upcast`` share of
    the rate."""
    memory = vdot(k.bytes, s.weights) / (r.bandwidth * r.upcast if k.upcast else r.bandwidth)
    if r.looped_reductions and any(k.loop_reads):
        memory += vdot(k.loop_reads, s.weights) / r.bandwidth
    return memory


@kernel_rule("vector")
def _vector(k: Kernel, r: Rates, s: Scale) -> float:
    return max(vector_compute(k, r, s), memory_s(k, r, s)) + first_touch(k, r, s) + r.launch_s


def local_dims(k: Kernel, tp: int) -> tuple[int, int, int]:
    """A GEMM's (M, N, K) as one GPU runs it: the tensor-parallel dimension divided by ``tp``."""
    if k.shard_dim < 0 or tp <= 1:
        return k.dims
    m, n, kk = (max(1, d // tp) if i == k.shard_dim else d for i, d in enumerate(k.dims))
    return m, n, kk


#: Bytes a tensor core's operand loads take at once: a leading dimension of a loaded operand that is
#: not a multiple of this many bytes keeps cuBLAS off its 16-byte-aligned kernels (NVIDIA's Matrix
#: Multiplication Background User's Guide, "Tensor Core Requirements": dimensions multiples of 8 in
#: 16 bits, 16 in 8 bits).
GEMM_ALIGN_BYTES = 16


def misaligned(k: Kernel, dims: tuple[int, int, int], elem_bytes: int) -> bool:
    """Whether the GEMM ``k`` (local ``dims`` = M, N, K, operands row-major, weights as
    ``nn.Linear`` keeps them) loads an operand with an unaligned leading dimension: K (the left
    operand's rows; a weight gradient's right operand's too) or, for ``grad.T @ x``, M (the
    transposed left operand's). An unaligned N only misaligns the output, whose epilogue
    stores narrower but whose main loop runs aligned: measured on an H100 at 0.56 of the bf16
    peak, no slower than aligned GEMMs of that shape are priced."""
    align = max(1, GEMM_ALIGN_BYTES // max(1, elem_bytes))
    m, _, kk = dims
    return kk % align != 0 or (k.tn and m % align != 0)


@lru_cache(maxsize=65536)
def wave_efficiency(m: int, n: int, tiles: tuple[tuple[int, int], ...], units: int) -> float:
    """Share of its last wave's SMs an M x N GEMM output keeps busy, for the best of the library's
    ``tiles`` (NVIDIA's Matrix Multiplication Background User's Guide, "wave quantization": the
    ``t`` output tiles run ``ceil(t / units)`` waves). An output of fewer tiles than SMs is split
    along K instead (cuBLAS's split-K), so it is priced whole: 1."""
    best = 0.0
    for tm, tn in tiles:
        t = math.ceil(m / tm) * math.ceil(n / tn)
        if t < units:
            return 1.0
        best = max(best, t / (math.ceil(t / units) * units))
    return best if best > 0.0 else 1.0


@kernel_rule("matmul")
def _matmul(k: Kernel, r: Rates, s: Scale) -> float:
    div = s.div(k.shard)
    dims = local_dims(k, s.tp)
    rate = r.mm_flops * (r.mm_tn if k.tn else 1.0)
    if k.template:
        # a generated GEMM (Inductor's Triton template) carrying its group's other ops: the
        # template's rate, which masks unaligned rows rather than falling to cuBLAS's slow kernels
        rate *= r.mm_template
    elif not s.pads and r.mm_unaligned < 1.0 and misaligned(k, dims, s.act_bytes):
        rate *= r.mm_unaligned
    compute = k.mm_flops / div / (rate * shape_factor(dims, r.half_dim))
    if r.mm_tiles:
        compute /= wave_efficiency(dims[0], dims[1], r.mm_tiles, r.units)
    compute += vector_compute(k, r, s)  # fused epilogue work, if any
    memory = vdot(k.bytes, s.weights) / r.bandwidth
    # fp8: the casts and transposes of the GEMM's operands are kernels of their own, priced per
    # block (``fp8.py``), not here
    return max(compute, memory) + first_touch(k, r, s) + r.launch_s + r.mm_call_s


@kernel_rule("attention")
def _attention(k: Kernel, r: Rates, s: Scale) -> float:
    bh, sq, sk, d = k.attn
    div = s.div(k.shard)
    memory = vdot(k.bytes, s.weights) / r.bandwidth
    if s.flash:
        backward = k.phase.value == "backward"
        rate = r.attn_bwd_flops if backward and r.attn_bwd_flops else r.attn_flops
        if r.attn_tiling is not None:
            # a tiled kernel (a CPU's): its FLOPs at the measured rate plus a fixed cost per tile,
            # which carries what the shape derating would (small tiles, per-call overhead)
            tile_s = r.attn_bwd_tile_s if backward else r.attn_tile_s
            tiles = bh / div * r.attn_tiling.tiles(sq, sk, causal=k.share < 1.0)
            compute = k.share * k.mm_flops / div / rate + tiles * tile_s
        else:
            # a causal flash kernel skips the blocks above the diagonal: half the counted FLOPs
            # (``k.share``: ``CAUSAL_FRACTION``, which model FLOPs count too; all of them without
            # a causal mask)
            shape = shape_factor((sq, sk), r.half_dim) * shape_factor((d,), r.attn_head_half)
            half = r.attn_bwd_par_half if backward else r.attn_par_half
            occupancy = 1.0
            if half > 0:
                # one thread block per 128-row query tile of each local (batch, head): few tiles
                # leave SMs idle in the last, unequal (causal) wave
                occupancy = shape_factor((bh / div * math.ceil(sq / ATTN_TILE_ROWS),), half)
            # under context parallelism only the ring's diagonal step is such a call; its other
            # steps are full blocks of equal tiles (Transformer Engine's ``AttnFuncWithCPAndKVP2P``:
            # step 0 causal, every later one a full block of the rank's queries or keys)
            per_flop = k.diagonal / occupancy + (1.0 - k.diagonal)
            compute = k.share * k.mm_flops / div / (rate * shape) * per_flop
        if k.dropout:
            compute *= 1.0 + r.attn_dropout
        return max(compute, memory) + first_touch(k, r, s) + r.launch_s
    # unfused (Megatron-LM's baddbmm, fused scale-mask-softmax, dropout, bmm): two batched GEMMs at
    # matmul efficiency, and the score matrix through memory. Forward: S written by QK^T, read and
    # P written by softmax, P read by AV = 4 passes. Backward: dP written and P read by AV's two
    # gradient GEMMs, P and dP read and dS written by the softmax gradient, dS read by QK^T's two
    # gradient GEMMs = 7 passes. Dropout on P (torch.nn.Dropout after the softmax, 2021-2022
    # Megatron-LM and NeMo) adds a pass each way (P read and P_d written forward, dP_d read and dP
    # written backward: +2 passes) and a one-byte mask written forward and read backward. Checked
    # on one H100 (benchmarks/data/h100_microbench.json, "unfused_attention"): this sum of derated
    # GEMM time and score traffic is within ~10% of the measured fp16 kernels (a per-GEMM roofline
    # max() is 30-40% too fast: small-K batched GEMMs run below both roofs), and dropout measured
    # +3.3 ms forward / +2.5 ms backward against the +2.8 / +2.8 ms priced here (b16 a24 s2048).
    # These kernels compute the whole score matrix and mask it: all the counted FLOPs are paid,
    # though model FLOPs (MFU) count only the causal share, the useful work.
    compute = k.mm_flops / div / (r.mm_flops * shape_factor((sq, sk, d), r.half_dim))
    if not s.pads_bmm and r.bmm_unaligned < 1.0 and (d * s.act_bytes) % GEMM_ALIGN_BYTES:
        # every one of these batched GEMMs loads an operand whose leading dimension is the head
        # dimension (QK^T's K; V's, P's and dS's partners backward), so a head dimension that is not
        # a multiple of 16 bytes runs them all on cuBLAS's narrow-alignment kernels
        compute /= r.bmm_unaligned
    forward = k.phase.value == "forward"
    if s.eager_attention:
        per_elem = eager_scores(forward, s.act_bytes)
    else:
        per_elem = s.act_bytes * (4 if forward else 7)
    if k.dropout:
        per_elem += 2 * s.act_bytes + 1
    scores = bh * sq * sk / s.tp * per_elem / r.bandwidth
    return compute + max(0.0, memory) + scores + launches(k, s) * r.launch_s
