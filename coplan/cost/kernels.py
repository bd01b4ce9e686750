"""Time of one kernel on one device: a roofline with shape- and dtype-dependent efficiency.

A kernel takes ``max(compute time, memory time) + launch``: compute at the device's peak for the
kernel's dtype times an achievable efficiency (per dtype for GEMMs, shrinking for small or thin
matrices: ``d / (d + matmul_half_dim)`` per GEMM dimension), memory traffic at the device's
bandwidth times its memory efficiency. One rule per kernel kind, registered by decorator.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from coplan.cost.profile import TP, Kernel, Vec, vdot
from coplan.hardware.device import DeviceSpec


@dataclass(frozen=True, slots=True)
class Rates:
    """A device's rates for one training precision, looked up once per estimate."""

    mm_flops: float  # achievable matrix FLOP/s before shape derating
    attn_flops: float  # achievable flash-attention FLOP/s before shape derating
    vec_flops: float  # achievable vector FLOP/s
    bandwidth: float  # achievable memory bytes/s
    half_dim: float
    launch_s: float

    @classmethod
    def of(cls, device: DeviceSpec, dtype: str) -> Rates:
        mm_dtype = dtype if device.supports(dtype) else _fallback(device, dtype)
        peak = device.peak(mm_dtype)
        # attention stays in 16 bits under fp8 training (Transformer Engine's default recipe)
        attn_dtype = _fallback(device, "fp8") if mm_dtype == "fp8" else mm_dtype
        return cls(
            mm_flops=peak * device.efficiency_of("matmul", mm_dtype),
            attn_flops=device.peak(attn_dtype) * device.efficiency_of("attention", attn_dtype),
            vec_flops=device.vector_flops * device.efficiency_of("vector"),
            bandwidth=device.memory_bandwidth * device.efficiency_of("memory"),
            half_dim=device.matmul_half_dim,
            launch_s=device.kernel_launch_s,
        )


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


@dataclass(frozen=True, slots=True)
class Scale:
    """How a configuration scales a kernel of the unsharded graph."""

    tp: int
    sp: bool
    weights: Vec  # bytes per element of each (precision class, shard class) slot
    act_bytes: int
    flash: bool

    def div(self, shard: int) -> int:
        return self.tp if shard == TP or self.sp else 1


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
    return _RULES[k.kind](k, r, s)


def launches(k: Kernel, s: Scale) -> int:
    """Kernels launched for ``k``: none for views, three forward / five backward for attention
    without a fused kernel (two batched GEMMs and a softmax; their gradients)."""
    if k.kind == "free":
        return 0
    if k.kind == "attention" and not s.flash:
        return 3 if k.phase.value == "forward" else 5
    return 1


def shape_factor(dims: tuple[int, ...], half: float) -> float:
    if half <= 0:
        return 1.0
    f = 1.0
    for d in dims:
        f *= d / (d + half)
    return f


@kernel_rule("free")
def _free(k: Kernel, r: Rates, s: Scale) -> float:
    return 0.0


@kernel_rule("vector")
def _vector(k: Kernel, r: Rates, s: Scale) -> float:
    compute = k.vec_flops / s.div(k.shard) / r.vec_flops
    memory = vdot(k.bytes, s.weights) / r.bandwidth
    return max(compute, memory) + r.launch_s


@kernel_rule("matmul")
def _matmul(k: Kernel, r: Rates, s: Scale) -> float:
    div = s.div(k.shard)
    dims = k.dims
    if k.shard_dim >= 0 and s.tp > 1:
        dims = tuple(max(1, d // s.tp) if i == k.shard_dim else d for i, d in enumerate(dims))  # type: ignore[assignment]
    compute = k.mm_flops / div / (r.mm_flops * shape_factor(dims, r.half_dim))
    compute += k.vec_flops / div / r.vec_flops  # fused epilogue work, if any
    memory = vdot(k.bytes, s.weights) / r.bandwidth
    # fp8: Transformer Engine fuses the quantisation of activations into the kernel producing them
    # (norm, activation function) and casts weights once per step, so no extra pass is priced here
    return max(compute, memory) + r.launch_s


@kernel_rule("attention")
def _attention(k: Kernel, r: Rates, s: Scale) -> float:
    bh, sq, sk, d = k.attn
    div = s.div(k.shard)
    memory = vdot(k.bytes, s.weights) / r.bandwidth
    if s.flash:
        # a causal flash kernel skips the blocks above the diagonal: half the counted FLOPs
        compute = 0.5 * k.mm_flops / div / (r.attn_flops * shape_factor((sq, sk), r.half_dim))
        return max(compute, memory) + r.launch_s
    # unfused: two batched GEMMs at matmul efficiency, and the score matrix through memory
    # (forward: written by QK^T, read and written by softmax, read by AV = 4 passes;
    # backward: dP written, P and dP read, dS written, dS read by two GEMMs = 6 passes)
    compute = k.mm_flops / div / (r.mm_flops * shape_factor((sq, sk, d), r.half_dim))
    passes = 4 if k.phase.value == "forward" else 6
    scores = bh * sq * sk / s.tp * s.act_bytes * passes / r.bandwidth
    return compute + max(0.0, memory) + scores + launches(k, s) * r.launch_s
