"""One accelerator (or CPU) as data: the numbers a roofline cost model needs.

Units are SI throughout the data model: bytes, bytes/s, FLOP/s, seconds. Only ``summary()`` rounds
for display. Peak numbers are *dense* data-sheet peaks (NVIDIA and others often headline the 2:4
structured-sparsity figure, which is exactly twice the dense one; a planner for dense training must
not use it).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from coplan.hardware._fields import (
    DTYPES,
    FieldError,
    FrozenMap,
    Reader,
    anchored,
    check_int,
    check_number,
    check_str,
    fail,
    kind,
)
from coplan.hardware.tiling import PHASES, AttentionTiling

#: Kinds of work a device's ``efficiency`` may derate. ``matmul`` may also be given per dtype as
#: ``matmul.<dtype>`` (e.g. ``matmul.fp32`` on a CPU whose fp32 GEMM reaches a lower fraction of peak
#: than its bf16 one); ``attention`` is the fused (flash) attention kernel's fraction of the matrix
#: peak, ``network`` the fraction of link bandwidth collectives achieve (NCCL's bus bandwidth).
#: ``attention`` and ``vector`` may be given per dtype too (``DTYPED_KINDS``), and ``vector`` per
#: family of non-matrix work (``vector.<family>``, ``vector.<family>.<dtype>``; see
#: ``vector_efficiency``). ``attention_backward`` is the fused attention gradient kernel's fraction
#: where it differs from the forward kernel's (absent: ``attention``). ``first_touch`` is the fraction
#: of ``memory_bandwidth`` at which memory newly mapped by the host allocator is written (page
#: faults: a CPU's allocator hands tensors too large for the last-level cache back to the OS on
#: free); absent, no such tier is priced. ``matmul_tn`` is the fraction of the same dtype's
#: ``matmul`` rate that a GEMM whose left operand is a transposed view reaches (a weight gradient,
#: ``grad.T @ x``: a CPU BLAS packs such an operand on another, slower path in 16 bits); absent, 1.
#: ``matmul_unaligned`` is the fraction of a GEMM's rate it keeps when an operand it loads has a
#: leading dimension the tensor cores' 16-byte loads cannot take (8 elements of 16 bits), where the
#: stack does not pad it (``TrainingConfig.gemm_padding``); absent, 1. ``bmm_unaligned`` is the same
#: fraction for the unfused attention's batched GEMMs, whose misaligned operand is the head dimension
#: (a short K, both operands of QK^T misaligned) where a linear's is a long one; absent, the
#: ``matmul_unaligned`` figure. ``matmul_template`` is the
#: fraction of the GEMM rate a compiler's generated GEMM (Inductor's Triton template, the only GEMM
#: that can carry a fused epilogue or prologue) reaches beside the vendor library's; absent, 1.
#: ``memory_upcast`` is the fraction of the achievable ``memory`` rate an eager copy from a 16-bit
#: tensor to fp32 reaches (``x.float()``: ATen's CUDA copy has a vectorized kernel only for the
#: other direction, so the upcast runs TensorIterator's dynamically casting, unrolled loop); absent, 1.
EFFICIENCY_KINDS: tuple[str, ...] = (
    "matmul",
    "matmul_tn",
    "matmul_unaligned",
    "bmm_unaligned",
    "matmul_template",
    "memory_upcast",
    "attention",
    "attention_backward",
    "vector",
    "memory",
    "network",
    "first_touch",
)

#: Fused-attention kernels a device may price (``DeviceSpec.attention_kernel`` names the one its
#: ``attention`` efficiencies describe, ``attention_kernels`` gives others): NVIDIA cuDNN's fused
#: attention (what Transformer Engine selects on Hopper), the flash-attn package's FlashAttention-2
#: (Transformer Engine's choice on Ampere, and on Hopper with ``NVTE_FUSED_ATTN=0``; PyTorch's SDPA
#: flash backend), FlashAttention-3, and the FlashAttention algorithm written in Triton (Tri Dao's
#: ``flash_attn_triton.py``, which MPT runs as ``attn_impl: triton``).
ATTENTION_KERNELS: tuple[str, ...] = ("cudnn", "flash2", "flash3", "triton")

#: What ``attention_kernels`` gives per kernel: its forward and backward fractions of the 16-bit
#: matrix peak (as ``attention`` / ``attention_backward``) and its slowdown with dropout on.
ATTENTION_KERNEL_KEYS: tuple[str, ...] = ("forward", "backward", "dropout")

#: Kinds whose efficiency may be refined per dtype as ``<kind>.<dtype>``.
DTYPED_KINDS: tuple[str, ...] = ("matmul", "matmul_tn", "attention", "attention_backward", "vector")

#: Families of non-matrix work whose achievable rate per counted FLOP differs (the op rules count a
#: few FLOPs per element; a tanh-GELU executes tens of instructions for its 8, a sum one for its 1).
VECTOR_FAMILIES: tuple[str, ...] = ("elementwise", "transcendental", "reduction", "norm", "softmax")

# torch / numpy spellings accepted by ``canonical_dtype`` so callers can pass IR dtype names as-is.
_DTYPE_ALIASES: dict[str, str] = {
    "float32": "fp32",
    "float": "fp32",
    "tf32": "tf32",
    "bfloat16": "bf16",
    "float16": "fp16",
    "half": "fp16",
    "float8_e4m3fn": "fp8",
    "float8_e4m3fnuz": "fp8",
    "float8_e5m2": "fp8",
    "float8_e5m2fnuz": "fp8",
}


def canonical_dtype(name: str) -> str:
    """Map ``"bf16"``, ``"bfloat16"`` or ``"torch.bfloat16"`` to the ``DTYPES`` key ``"bf16"``.

    Raises ``SpecError`` for names that are not matrix dtypes (e.g. ``"int8"``, ``"fp64"``).
    """
    key = str(name).removeprefix("torch.").lower()
    key = _DTYPE_ALIASES.get(key, key)
    if key not in DTYPES:
        raise FieldError("dtype", None, f"unknown dtype {name!r}; expected one of: {', '.join(DTYPES)}")
    return key


_REQUIRED = (
    "name",
    "vendor",
    "peak_flops",
    "vector_flops",
    "memory_bytes",
    "memory_bandwidth",
    "sram_bytes",
    "kernel_launch_s",
)
_OPTIONAL = (
    "source",
    "efficiency",
    "matmul_half_dim",
    "attention_tiles",
    "matmul_call_s",
    "attention_parallel_half",
    "host_op_s",
    "compute_units",
    "attention_kernel",
    "attention_kernels",
    "kind",
    "gemm_tiles",
)
#: What a device is to the software that runs on it: a GPU, a CPU (the host computes: its compiler
#: calls the BLAS library for GEMMs) or another accelerator (TPU, Trainium).
DEVICE_KINDS = ("gpu", "cpu", "accelerator")


def _tiles(src: str, value: object, units: int) -> tuple[tuple[int, int], ...]:
    """``gemm_tiles`` as a tuple of (rows, columns) pairs of positive integers; they need the
    device's ``compute_units`` to count waves."""
    if isinstance(value, (str, bytes)) or not isinstance(value, (list, tuple)):
        fail(src, "gemm_tiles", f"expected a list of [rows, columns] pairs, got {kind(value)}")
    out = []
    for i, pair in enumerate(value):
        ok = isinstance(pair, (list, tuple)) and len(pair) == 2
        if not ok or not all(isinstance(x, int) and not isinstance(x, bool) and x > 0 for x in pair):
            fail(src, f"gemm_tiles[{i}]", f"expected [rows, columns] of positive integers, got {pair!r}")
        out.append((int(pair[0]), int(pair[1])))
    if out and units <= 0:
        fail(src, "gemm_tiles", "needs compute_units (the SMs the tiles' waves fill)")
    return tuple(out)


@dataclass(frozen=True, slots=True)
class DeviceSpec:
    """One device. Hashable and immutable; build from JSON with ``from_dict``.

    Attributes:
        name: preset-style identifier, e.g. ``"h100-sxm"``.
        vendor: e.g. ``"nvidia"``, ``"amd"``, ``"google"``, ``"aws"``.
        peak_flops: dense matrix-unit peak in FLOP/s per dtype (keys among ``DTYPES``). A missing
            key means the matrix units do not support that dtype (fp8 on A100); a 0 given on input
            means the same and is dropped. ``"fp32"`` is what a plain fp32 matmul gets (on NVIDIA
            that is the CUDA-core figure, since TF32 is opt-in in PyTorch).
        vector_flops: non-matrix fp32 FLOP/s (elementwise, reductions, softmax...).
        memory_bytes: device memory (HBM/GDDR/DRAM) capacity in bytes.
        memory_bandwidth: device memory bandwidth in bytes/s.
        sram_bytes: on-chip cache/scratchpad in bytes (L2, Infinity Cache, SBUF, VMEM, or LLC).
        kernel_launch_s: fixed cost in seconds per kernel/op dispatched, paid even by tiny kernels.
        source: free text naming the data sheets (and any estimate) behind the numbers.
        efficiency: achievable fraction of peak per kind of work (``EFFICIENCY_KINDS``), in (0, 1].
            These are *starting values* for the cost model, meant to be calibrated by measurement;
            a missing kind means no derating (1.0), except ``attention`` (defaults to ``matmul``)
            and ``<kind>.<dtype>`` (defaults to ``<kind>``). A measured ``attention.<dtype>`` is the
            fraction before the head-dimension shape derating (see ``coplan.cost.kernels``).
        matmul_half_dim: shape derating of matrix work: a GEMM of sizes M, N, K reaches
            ``efficiency * prod(d / (d + matmul_half_dim))`` of peak, so small or thin matrices
            (tile and wave quantization, fixed per-kernel work) run slower per FLOP than large ones.
            0 means no shape dependence.
        attention_tiles: how the device's fused attention kernel tiles its work and what a tile
            costs beyond its FLOPs (``coplan.hardware.tiling``); None (the GPU presets) prices
            attention by the shape-derated roofline alone.
        matmul_call_s: fixed seconds of one GEMM call beyond ``kernel_launch_s``, per dtype: a CPU
            BLAS packs its operands and looks up a kernel per call (oneDNN's bf16 path costs a few
            times MKL's fp32 one), which sets the time of small GEMMs; absent: none (the GPUs).
        attention_parallel_half: how a GPU's fused attention kernel slows when it has little
            parallel work, by phase (``"forward"``, ``"backward"``): the kernel runs one thread block
            per 128-row query tile of each (batch, head), and a causal mask makes those tiles unequal,
            so with few tiles per SM the last wave leaves SMs idle. ``u`` tiles reach
            ``u / (u + half)`` of the full-occupancy rate. Absent: no such derating.
        host_op_s: seconds the host spends on an op that launches no kernel (a view, and its
            autograd record) in eager PyTorch, where the host is the device (a CPU) and so adds it
            to the step; 0 where the host runs ahead of the device's kernels (the GPUs).
        compute_units: streaming multiprocessors (NVIDIA) or compute units (AMD): what a
            communication kernel running beside a GEMM takes its SMs from
            (``coplan.cost.tp_overlap``); 0 where unknown or not such a design (SM sharing unpriced).
        attention_kernel: which of ``ATTENTION_KERNELS`` the ``attention`` efficiencies describe:
            the kernel the device's usual stack runs (Transformer Engine: cuDNN's on Hopper,
            FlashAttention-2 on Ampere); "" where unnamed.
        attention_kernels: other fused-attention kernels the device can price, as
            ``<kernel>.forward`` / ``<kernel>.backward`` (fractions of the 16-bit peak before the
            shape and occupancy deratings, which all kernels share) and ``<kernel>.dropout`` (the
            fractional slowdown with dropout on the probabilities); a training configuration picks
            one with ``attention_kernel``.
        gemm_tiles: output tiles (rows, columns) the vendor library's 16-bit GEMM kernels compute per
            thread block, largest first. A GEMM whose output cuts into ``t`` such tiles runs
            ``ceil(t / compute_units)`` waves, the last one partly idle (NVIDIA's Matrix
            Multiplication Background User's Guide, "wave quantization"); the cost model takes
            the tile that quantizes best. Empty (the default): no wave derating beyond
            ``matmul_half_dim``'s smooth one (libraries whose kernels schedule tiles persistently).
        kind: one of ``DEVICE_KINDS``. On a ``"cpu"`` coplan's runner compiles GEMMs as library
            calls (``coplan.apply.fusion``: Inductor's GEMM templates run only on CUDA tensors),
            so no pointwise work fuses into them (``StackSpec.runner_for``).
    """

    name: str
    vendor: str
    peak_flops: Mapping[str, float]
    vector_flops: float
    memory_bytes: int
    memory_bandwidth: float
    sram_bytes: int
    kernel_launch_s: float
    source: str = ""
    efficiency: Mapping[str, float] = field(default_factory=FrozenMap)
    matmul_half_dim: float = 0.0
    attention_tiles: AttentionTiling | None = None
    matmul_call_s: Mapping[str, float] = field(default_factory=FrozenMap)
    attention_parallel_half: Mapping[str, float] = field(default_factory=FrozenMap)
    host_op_s: float = 0.0
    compute_units: int = 0
    attention_kernel: str = ""
    attention_kernels: Mapping[str, float] = field(default_factory=FrozenMap)
    kind: str = "gpu"
    gemm_tiles: tuple[tuple[int, int], ...] = ()

    def __post_init__(self) -> None:
        named = isinstance(self.name, str) and bool(self.name.strip())
        src = f"device {self.name!r}" if named else "device"
        put = object.__setattr__  # frozen dataclass: normalising in __post_init__ needs the raw setter
        check_str(src, "name", self.name)
        check_str(src, "vendor", self.vendor)
        put(self, "peak_flops", _peaks(src, self.peak_flops))
        put(self, "vector_flops", check_number(src, "vector_flops", self.vector_flops))
        put(self, "memory_bytes", check_int(src, "memory_bytes", self.memory_bytes))
        put(self, "memory_bandwidth", check_number(src, "memory_bandwidth", self.memory_bandwidth))
        put(self, "sram_bytes", check_int(src, "sram_bytes", self.sram_bytes))
        # 0 is allowed: an idealised device, or one whose dispatch cost is modelled elsewhere.
        put(self, "kernel_launch_s", check_number(src, "kernel_launch_s", self.kernel_launch_s, strict=False))
        check_str(src, "source", self.source, allow_empty=True)
        put(self, "efficiency", _efficiency(src, self.efficiency))
        put(self, "matmul_half_dim", check_number(src, "matmul_half_dim", self.matmul_half_dim, strict=False))
        if self.attention_tiles is not None and not isinstance(self.attention_tiles, AttentionTiling):
            fail(src, "attention_tiles", f"expected an AttentionTiling, got {kind(self.attention_tiles)}")
        put(
            self, "matmul_call_s", _keyed_numbers(src, "matmul_call_s", self.matmul_call_s, DTYPES, "seconds")
        )
        put(
            self,
            "attention_parallel_half",
            _keyed_numbers(src, "attention_parallel_half", self.attention_parallel_half, PHASES, "tiles"),
        )
        put(self, "host_op_s", check_number(src, "host_op_s", self.host_op_s, strict=False))
        put(self, "compute_units", check_int(src, "compute_units", self.compute_units, minimum=0))
        check_str(src, "attention_kernel", self.attention_kernel, allow_empty=True)
        if self.attention_kernel and self.attention_kernel not in ATTENTION_KERNELS:
            fail(src, "attention_kernel", f"unknown kernel; expected one of: {', '.join(ATTENTION_KERNELS)}")
        put(self, "attention_kernels", _attention_kernels(src, self.attention_kernels, self.attention_kernel))
        put(self, "gemm_tiles", _tiles(src, self.gemm_tiles, self.compute_units))
        if self.kind not in DEVICE_KINDS:
            fail(src, "kind", f"expected one of: {', '.join(DEVICE_KINDS)}, got {self.kind!r}")

    # --- queries -------------------------------------------------------------------------------

    def peak(self, dtype: str) -> float:
        """Dense matrix peak in FLOP/s for ``dtype`` (any spelling ``canonical_dtype`` accepts);
        0.0 when the device's matrix units do not support it."""
        return self.peak_flops.get(canonical_dtype(dtype), 0.0)

    def supports(self, dtype: str) -> bool:
        """Whether the matrix units run ``dtype`` natively (peak > 0)."""
        return self.peak(dtype) > 0.0

    def efficiency_of(self, work: str, dtype: str | None = None) -> float:
        """Achievable fraction of peak for ``work`` in ``EFFICIENCY_KINDS`` (1.0 when not given).

        ``dtype`` refines the ``DTYPED_KINDS``: ``<kind>.<dtype>`` wins over ``<kind>``, so a device
        without per-dtype entries prices every dtype as before. ``attention.<dtype>`` falls back to
        ``attention``, then to the matmul figure of the same dtype; ``attention_backward.<dtype>``
        to ``attention_backward``, then to the forward figure of the same dtype."""
        if work not in EFFICIENCY_KINDS:
            raise ValueError(f"unknown efficiency kind {work!r}; expected one of {EFFICIENCY_KINDS}")
        eff = self.efficiency
        key = canonical_dtype(dtype) if dtype and work in DTYPED_KINDS else None
        if work in ("matmul", "attention"):
            mm = eff.get(f"matmul.{key}", eff.get("matmul", 1.0)) if key else eff.get("matmul", 1.0)
            if work == "matmul":
                return mm
            return eff.get(f"attention.{key}", eff.get("attention", mm)) if key else eff.get("attention", mm)
        if work == "bmm_unaligned":
            return eff.get(work, self.efficiency_of("matmul_unaligned"))
        if work == "attention_backward":
            fwd = self.efficiency_of("attention", dtype)
            return eff.get(f"{work}.{key}", eff.get(work, fwd)) if key else eff.get(work, fwd)
        if key:
            return eff.get(f"{work}.{key}", eff.get(work, 1.0))
        return eff.get(work, 1.0)

    def vector_efficiency(self, family: str, dtype: str | None = None) -> float:
        """Achievable fraction of ``vector_flops`` for one of ``VECTOR_FAMILIES`` in ``dtype``:
        ``vector.<family>.<dtype>``, else ``vector.<family>``, else ``efficiency_of("vector", dtype)``."""
        if family not in VECTOR_FAMILIES:
            raise ValueError(f"unknown vector family {family!r}; expected one of {VECTOR_FAMILIES}")
        eff = self.efficiency
        if dtype:
            key = f"vector.{family}.{canonical_dtype(dtype)}"
            if key in eff:
                return eff[key]
        return eff.get(f"vector.{family}", self.efficiency_of("vector", dtype))

    def has_efficiency(self, work: str, dtype: str) -> bool:
        """Whether ``<work>.<dtype>`` is given (a measured per-dtype figure, not a fallback)."""
        return f"{work}.{canonical_dtype(dtype)}" in self.efficiency

    def attention_rates(self, kernel: str) -> tuple[float, float, float] | None:
        """(forward, backward, dropout) of fused-attention kernel ``kernel`` from
        ``attention_kernels``; None where the device does not price it there."""
        keys = tuple(f"{kernel}.{k}" for k in ATTENTION_KERNEL_KEYS)
        if keys[0] not in self.attention_kernels:
            return None
        fwd = self.attention_kernels[keys[0]]
        bwd = self.attention_kernels.get(keys[1], fwd)
        return fwd, bwd, self.attention_kernels.get(keys[2], 0.0)

    def prices_attention(self, kernel: str) -> bool:
        """Whether ``kernel`` (or ``"auto"``) can be priced on this device."""
        return kernel in ("auto", self.attention_kernel) or self.attention_rates(kernel) is not None

    def summary(self) -> str:
        """One human-readable line (memory in GiB, bandwidth in TB/s, peaks in TFLOP/s)."""
        peaks = ", ".join(f"{d} {self.peak_flops[d] / 1e12:g}" for d in DTYPES if d in self.peak_flops)
        return (
            f"{self.name} ({self.vendor}): {self.memory_bytes / 2**30:.0f} GiB @ "
            f"{self.memory_bandwidth / 1e12:.3g} TB/s; TFLOP/s {peaks}"
        )

    # --- serialisation -------------------------------------------------------------------------

    def to_dict(self) -> dict[str, Any]:
        """Plain JSON-ready dict; ``DeviceSpec.from_dict(d.to_dict()) == d``."""
        out = {
            "name": self.name,
            "vendor": self.vendor,
            "peak_flops": dict(self.peak_flops),
            "vector_flops": self.vector_flops,
            "memory_bytes": self.memory_bytes,
            "memory_bandwidth": self.memory_bandwidth,
            "sram_bytes": self.sram_bytes,
            "kernel_launch_s": self.kernel_launch_s,
            "source": self.source,
            "efficiency": dict(self.efficiency),
            "matmul_half_dim": self.matmul_half_dim,
        }
        if self.attention_tiles is not None:
            out["attention_tiles"] = self.attention_tiles.to_dict()
        if self.matmul_call_s:
            out["matmul_call_s"] = dict(self.matmul_call_s)
        if self.attention_parallel_half:
            out["attention_parallel_half"] = dict(self.attention_parallel_half)
        if self.host_op_s:
            out["host_op_s"] = self.host_op_s
        if self.compute_units:
            out["compute_units"] = self.compute_units
        if self.attention_kernel:
            out["attention_kernel"] = self.attention_kernel
        if self.attention_kernels:
            out["attention_kernels"] = dict(self.attention_kernels)
        if self.kind != "gpu":
            out["kind"] = self.kind
        if self.gemm_tiles:
            out["gemm_tiles"] = [list(t) for t in self.gemm_tiles]
        return out

    @classmethod
    def from_dict(cls, data: object, source: str = "<dict>", *, path: str = "") -> DeviceSpec:
        """Build from a parsed JSON object. Errors are ``SpecError(source, field, reason)`` naming the
        unknown, missing or badly typed field; ``path`` prefixes field names when nested."""
        r = Reader(data, source, path)
        r.check_keys(_REQUIRED, _OPTIONAL)
        efficiency = r.numbers("efficiency") if "efficiency" in r.data else {}
        name, vendor, peaks = r.text("name"), r.text("vendor"), r.numbers("peak_flops")
        vector, memory = r.number("vector_flops"), r.integer("memory_bytes")
        bandwidth, sram = r.number("memory_bandwidth"), r.integer("sram_bytes")
        launch, text = r.number("kernel_launch_s", strict=False), r.text("source", default="")
        half = r.number("matmul_half_dim", strict=False) if "matmul_half_dim" in r.data else 0.0
        tiles = AttentionTiling.read(r.sub("attention_tiles")) if "attention_tiles" in r.data else None
        calls = r.numbers("matmul_call_s") if "matmul_call_s" in r.data else {}
        par = r.numbers("attention_parallel_half") if "attention_parallel_half" in r.data else {}
        host = r.number("host_op_s", strict=False) if "host_op_s" in r.data else 0.0
        units = r.integer("compute_units", minimum=0) if "compute_units" in r.data else 0
        attn = r.text("attention_kernel", default="")
        attn_kernels = r.numbers("attention_kernels") if "attention_kernels" in r.data else {}
        dev_kind = r.text("kind", default="gpu")
        gemm_tiles = r.data.get("gemm_tiles", ())
        # Readers above already name ``source`` and the full path; only __post_init__ errors need
        # re-anchoring, so nothing else may run inside this block.
        with anchored(source, path):
            return cls(
                name=name,
                vendor=vendor,
                peak_flops=peaks,
                vector_flops=vector,
                memory_bytes=memory,
                memory_bandwidth=bandwidth,
                sram_bytes=sram,
                kernel_launch_s=launch,
                source=text,
                efficiency=efficiency,
                matmul_half_dim=half,
                attention_tiles=tiles,
                matmul_call_s=calls,
                attention_parallel_half=par,
                host_op_s=host,
                compute_units=units,
                attention_kernel=attn,
                attention_kernels=attn_kernels,
                kind=dev_kind,
                gemm_tiles=gemm_tiles,
            )


def _peaks(src: str, value: object) -> FrozenMap:
    if not isinstance(value, Mapping):
        fail(src, "peak_flops", f"expected an object of dtype -> FLOP/s, got {kind(value)}")
    peaks: dict[str, float] = {}
    for dtype, flops in value.items():
        where = f"peak_flops.{dtype}"
        if dtype not in DTYPES:
            fail(src, where, f"unknown dtype; expected one of: {', '.join(DTYPES)}")
        number = check_number(src, where, flops, strict=False)
        if number > 0.0:  # 0 means unsupported, same as absent: drop it so equality is not fooled
            peaks[dtype] = number
    if not peaks:
        fail(src, "peak_flops", "needs at least one dtype with a positive peak")
    return FrozenMap(peaks)


def _keyed_numbers(src: str, name: str, value: object, keys: tuple[str, ...], unit: str) -> FrozenMap:
    """A mapping of ``keys`` (any subset) to non-negative numbers, for the optional device fields."""
    if not isinstance(value, Mapping):
        fail(src, name, f"expected an object of {' | '.join(keys)} -> {unit}, got {kind(value)}")
    out: dict[str, float] = {}
    for key, number in value.items():
        where = f"{name}.{key}"
        if key not in keys:
            fail(src, where, f"unknown key; expected one of: {', '.join(keys)}")
        out[key] = check_number(src, where, number, strict=False)
    return FrozenMap(out)


def _attention_kernels(src: str, value: object, default: str) -> FrozenMap:
    """``<kernel>.<forward|backward|dropout>`` -> number, each kernel with its forward fraction."""
    if not isinstance(value, Mapping):
        fail(src, "attention_kernels", f"expected an object of <kernel>.<key> -> number, got {kind(value)}")
    out: dict[str, float] = {}
    for key, number in value.items():
        where = f"attention_kernels.{key}"
        name, _, what = str(key).partition(".")
        if name not in ATTENTION_KERNELS:
            fail(src, where, f"unknown kernel {name!r}; expected one of: {', '.join(ATTENTION_KERNELS)}")
        if name == default:
            fail(src, where, f"{name!r} is the device's attention_kernel, priced by its efficiency")
        if what not in ATTENTION_KERNEL_KEYS:
            fail(src, where, f"unknown key; expected {name}.<{'|'.join(ATTENTION_KERNEL_KEYS)}>")
        # fractions of peak are positive; a kernel may run dropout for free (0)
        if what == "dropout":
            out[key] = check_number(src, where, number, strict=False)
        else:
            out[key] = _fraction(src, where, number)
    for key in out:
        name = key.partition(".")[0]
        if f"{name}.forward" not in out:
            fail(src, f"attention_kernels.{name}.forward", "missing: every kernel needs its forward fraction")
    return FrozenMap(out)


def _efficiency(src: str, value: object) -> FrozenMap:
    if not isinstance(value, Mapping):
        fail(src, "efficiency", f"expected an object of kind -> fraction, got {kind(value)}")
    out: dict[str, float] = {}
    for work, fraction in value.items():
        where = f"efficiency.{work}"
        base, _, rest = str(work).partition(".")
        if base == "vector" and rest.partition(".")[0] in VECTOR_FAMILIES:
            family, _, dtype = rest.partition(".")
            if dtype and dtype not in DTYPES:
                fail(src, where, f"unknown dtype {dtype!r}; expected vector.{family}.<{'|'.join(DTYPES)}>")
        elif base in DTYPED_KINDS and rest:
            if rest not in DTYPES:
                fail(src, where, f"unknown dtype {rest!r}; expected {base}.<{'|'.join(DTYPES)}>")
        elif work not in EFFICIENCY_KINDS:
            fail(src, where, f"unknown kind; expected one of: {', '.join(EFFICIENCY_KINDS)}")
        out[work] = _fraction(src, where, fraction)
    return FrozenMap(out)


def _fraction(src: str, where: str, value: object) -> float:
    """A fraction of peak, in (0, 1]."""
    number = check_number(src, where, value)
    if number > 1.0:
        fail(src, where, f"must be a fraction of peak in (0, 1], got {value!r}")
    return number
