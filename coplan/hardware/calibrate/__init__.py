"""Calibrate a device profile on this machine: time real torch kernels, fit the cost model's rates.

Every microbenchmark is priced with the cost model's own kernel rules (``coplan.cost.kernels``)
and collective formulas (``coplan.cost.comm``), so a fitted profile reproduces the measured times
as closely as those formulas can. The fit runs in stages, each a least-squares fit of
``log(predicted) - log(measured)`` (relative errors, so a 10 us kernel weighs as much as a 10 ms
one):

1. ``kernel_launch_s``: the per-kernel cost of an autograd chain of tiny ops, forward and backward
   (eager training pays a dispatch and an autograd node per aten op, not just the bare dispatch);
   on a CPU ``host_op_s``, the same for views, which launch no kernel but are dispatched and
   recorded all the same;
2. ``efficiency.memory`` and ``efficiency.vector.<family>.<dtype>`` from elementwise ops,
   transcendental activations, reductions, norms and softmax at several sizes (``vector``, the
   fallback, is the widest dtype's elementwise rate), each rotating over operand copies that
   overflow the last-level cache: a training step's kernels read operands from memory;
3. on a CPU, ``efficiency.first_touch`` from writing fresh tensors as large as the last-level cache
   (the host allocator returns such blocks to the OS, so every step page-faults them in again);
4. ``efficiency.matmul.<dtype>`` and ``matmul_half_dim`` from GEMMs of several sizes and shapes,
   ``efficiency.matmul_tn.<dtype>`` where the weight-gradient layout (a transposed left operand)
   runs slower than the others, and on a CPU ``matmul_call_s`` (a fixed cost per GEMM call and dtype);
5. ``efficiency.attention.<dtype>`` and ``efficiency.attention_backward.<dtype>`` from fused
   attention forward and backward at several sequence lengths and head dimensions; on a CPU with
   ``attention_tiles``' cost per tile of PyTorch's tiled flash kernel (``coplan.hardware.tiling``);
6. with several processes, the intra-node link's latency and bandwidth from all-reduce and
   all-gather at several message sizes.

Data-sheet values (``peak_flops``, ``vector_flops``, ``memory_bandwidth``) are kept and the measured
fraction goes into ``efficiency``; a fraction above 1 means the data sheet undersells the machine,
so the data-sheet value is raised to the measurement instead (and the ``source`` says so).
"""

from __future__ import annotations

import datetime
import json
import platform
import re
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import torch

from coplan.errors import CoplanError
from coplan.hardware.allocator import pin_host_allocator
from coplan.hardware.calibrate.fit import KINDS, Measurement, Params, fit, predict, rms_residuals
from coplan.hardware.calibrate.probes import (
    Plan,
    _Clock,
    attention_probes,
    first_touch_probes,
    host_op_probes,
    launch_probes,
    matmul_probes,
    measure_collectives,
    run_probes,
    vector_probes,
)
from coplan.hardware.cluster import ClusterSpec, InterconnectLevel, NodeGroup
from coplan.hardware.device import DeviceSpec
from coplan.hardware.registry import device_presets
from coplan.hardware.tiling import TORCH_CPU_FLASH, AttentionTiling

DEVICES: tuple[str, ...] = ("cpu", "cuda")
#: Links fitted from fewer processes than this are not measured (one process has no peer).
MIN_PROCS = 2

Progress = Callable[[str, int, int], None]


#: The largest root-mean-square relative residual of the fit (``Calibration.residuals``, per kind
#: of microbenchmark) that a calibration may leave and still be written. On a quiet machine the
#: fits leave 3-7% on GEMMs, 10-13% on attention and 20-25% on vector work (the widest: one rate
#: per family stands for many kernels); a machine whose cores other processes take mid-measurement
#: has left several hundred percent, and a profile fitted to such timings prices every plan wrongly.
#: 50% is twice the worst quiet residual: noise above it is the machine, not the model.
MAX_RESIDUAL = 0.5


class CalibrationError(CoplanError):
    """A calibration that cannot run on this machine (exit code 2)."""


class NoisyCalibration(CalibrationError):
    """Timings too noisy to fit (``MAX_RESIDUAL``): exit code 1, a failed measurement rather than
    bad input; nothing is written."""

    exit_code = 1


def check_residuals(residuals: dict[str, float], bound: float = MAX_RESIDUAL) -> None:
    """Raise ``NoisyCalibration`` naming every kind whose rms residual exceeds ``bound`` (or is NaN)."""
    over = {k: v for k, v in residuals.items() if not v <= bound}
    if over:
        worst = ", ".join(f"{k} {v:.0%}" for k, v in over.items())
        raise NoisyCalibration(
            f"the fit leaves rms residuals of {worst}, above the {bound:.0%} bound: the timings are too "
            "noisy to trust (is the machine busy?); no profile written, run it again on a quiet machine"
        )


@dataclass(frozen=True, slots=True)
class Calibration:
    """A fitted device, the cluster written to disk, and the measurements behind them.

    ``residuals`` is the root-mean-square relative error (``exp(rms log residual) - 1``) of each
    microbenchmark kind after the fit.
    """

    device: DeviceSpec
    cluster: ClusterSpec
    measurements: tuple[Measurement, ...]
    residuals: dict[str, float] = field(default_factory=dict)
    notes: tuple[str, ...] = ()

    def to_dict(self) -> dict[str, Any]:
        """The cluster spec (what ``write_profile`` writes and ``load_cluster`` reads) plus the
        residuals, notes and measurements (``--json``; the spec loader refuses unknown keys)."""
        return {
            **self.cluster.to_dict(),
            "residuals": dict(self.residuals),
            "notes": list(self.notes),
            "measurements": [m.to_dict() for m in self.measurements],
        }


# --- the device to start from -----------------------------------------------------------------------

# torch.cuda.get_device_name patterns -> device preset; the first match wins (order matters: the
# PCIe H100 has lower clocks and memory bandwidth than the SXM preset, so it matches nothing).
_CUDA_PRESETS: tuple[tuple[str, str], ...] = (
    (r"h100(?!.*pcie)", "h100-sxm"),
    (r"h200", "h200"),
    (r"b200", "b200"),
    (r"a100.*80", "a100-sxm-80gb"),
    (r"a100(?!.*pcie)", "a100-sxm-40gb"),
    (r"\bl4\b", "l4"),
    (r"mi300x", "mi300x"),
)


def preset_for_gpu(name: str) -> str | None:
    """The device preset matching a ``torch.cuda.get_device_name`` string, or None."""
    low = name.lower()
    for pattern, preset in _CUDA_PRESETS:
        if re.search(pattern, low):
            return preset
    return None


def _check_device(dev: str) -> None:
    if dev not in DEVICES:
        raise CalibrationError(f"unknown device {dev!r}; expected one of: {', '.join(DEVICES)}")
    if dev == "cuda" and not torch.cuda.is_available():
        raise CalibrationError("--device cuda: torch sees no CUDA device on this machine (try --device cpu)")


def base_device(dev: str) -> tuple[DeviceSpec | None, str]:
    """The preset to start from and a description of the hardware (None: no preset matches)."""
    presets = device_presets()
    if dev == "cpu":
        return presets["cpu"], platform.processor() or platform.machine() or "cpu"
    gpu = torch.cuda.get_device_name(0)
    preset = preset_for_gpu(gpu)
    return (presets[preset] if preset else None), gpu


def _bare_gpu(gpu: str, ms: Sequence[Measurement]) -> DeviceSpec:
    """A device built from measurements only: the best rate seen stands in for each peak."""
    props = torch.cuda.get_device_properties(0)
    peaks: dict[str, float] = {}
    for m in ms:
        if m.kind == "matmul":
            peaks[m.dtype] = max(peaks.get(m.dtype, 0.0), m.flops / m.seconds)
    vec = [m for m in ms if m.kind == "vector"]
    bandwidth = max((m.bytes / m.seconds for m in vec), default=1e12)
    vector = max((m.vec_flops / m.seconds for m in vec), default=1e13)
    return DeviceSpec(
        name=re.sub(r"[^a-z0-9]+", "-", gpu.lower()).strip("-") or "gpu",
        vendor="amd" if getattr(torch.version, "hip", None) else "nvidia",
        peak_flops=peaks or {"fp32": 1e13},
        vector_flops=vector,
        memory_bytes=int(props.total_memory),
        memory_bandwidth=bandwidth,
        sram_bytes=int(getattr(props, "L2_cache_size", 0) or 1),
        kernel_launch_s=5e-6,
        source=f"built from measurements: no preset matches {gpu!r}",
    )


def _dtypes(dev: str, base: DeviceSpec | None) -> list[str]:
    wanted = ["fp32", "bf16"] if dev == "cpu" else ["fp32", "tf32", "bf16", "fp16"]
    return [d for d in wanted if base is None or base.supports(d)]


# --- turning fitted rates into a device and a cluster -----------------------------------------------


def _start_params(
    base: DeviceSpec, dtypes: Sequence[str], tiling: AttentionTiling | None = None, fit_calls: bool = False
) -> Params:
    return Params(
        peaks={d: base.peak(d) for d in dtypes},
        mm_flops={d: base.peak(d) * base.efficiency_of("matmul", d) for d in dtypes},
        attention={d: base.efficiency_of("attention", d) for d in dtypes},
        vec_flops=base.vector_flops * base.efficiency_of("vector"),
        bandwidth=base.memory_bandwidth * base.efficiency_of("memory"),
        half_dim=base.matmul_half_dim or 64.0,
        launch_s=base.kernel_launch_s,
        link_bandwidth=base.memory_bandwidth,
        link_latency_s=1e-5,
        cache_bytes=float(base.sram_bytes),
        attn_tiling=tiling,
        fit_calls=fit_calls,
        attn_par_half=(
            base.attention_parallel_half.get("forward", 0.0),
            base.attention_parallel_half.get("backward", 0.0),
        ),
    )


def to_device(
    base: DeviceSpec, p: Params, dtypes: Sequence[str], name: str, source: str, attention_kernel: str = ""
) -> tuple[DeviceSpec, list[str]]:
    """``base`` with the fitted rates as efficiencies of its data-sheet values; a fraction above 1
    raises the data-sheet value to the measurement instead (listed in the returned notes).

    ``attention_kernel`` names the fused-attention kernel the probes ran (PyTorch SDPA's on a GPU:
    FlashAttention-2): the fitted attention efficiencies describe it, so the device is labelled
    with it, and the base's own kernel, where another, stays priceable among ``attention_kernels``
    at the base's rates."""
    notes: list[str] = []
    eff = dict(base.efficiency)
    peaks = dict(base.peak_flops)

    def fraction(label: str, rate: float, sheet: float) -> tuple[float, float]:
        frac = rate / sheet
        if frac <= 1.0:
            return frac, sheet
        notes.append(
            f"{label} measured {rate:.4g}/s above the data sheet's {sheet:.4g}/s: raised to the measurement"
        )
        return 1.0, rate

    for d in dtypes:
        eff[f"matmul.{d}"], peaks[d] = fraction(f"matmul {d}", p.mm_flops[d], peaks[d])
    # a transposed left operand no slower than the others is the default (absent: 1)
    for d, tn in p.mm_tn.items():
        if tn < 1.0:
            eff[f"matmul_tn.{d}"] = tn
        else:
            eff.pop(f"matmul_tn.{d}", None)
    # measured per dtype (it then derates the head dimension too: see coplan.cost.kernels)
    attn = [d for d in dtypes if d in p.attention]
    for d in attn:
        eff[f"attention.{d}"] = min(1.0, p.attention[d])
    for d, fraction_bwd in p.attention_backward.items():
        eff[f"attention_backward.{d}"] = min(1.0, fraction_bwd)
    # the entries without a dtype are what other dtypes fall back to: the widest fitted one
    if attn:
        eff["attention"] = eff[f"attention.{attn[0]}"]
    eff["matmul"] = eff[f"matmul.{dtypes[0]}"]
    # one data-sheet vector rate for every family: raised to the fastest measured one if below it
    _, vector = fraction("vector", max([p.vec_flops, *p.vec_rates.values()]), base.vector_flops)
    eff["vector"] = p.vec_flops / vector
    for key, rate in p.vec_rates.items():
        eff[f"vector.{key}"] = rate / vector
    eff["memory"], bandwidth = fraction("memory bandwidth", p.bandwidth, base.memory_bandwidth)
    if p.first_touch > 0.0:
        eff["first_touch"] = min(1.0, p.first_touch / bandwidth)
    tiles = p.attn_tiling.with_costs(p.attn_tile_s) if p.attn_tiling is not None else base.attention_tiles
    label, kernels = base.attention_kernel, dict(base.attention_kernels)
    if attn and attention_kernel and attention_kernel != label:
        from coplan.cost.kernels import FLASH_DROPOUT_COST  # the default kernel's, as Rates prices it

        kernels = {k: v for k, v in kernels.items() if k.partition(".")[0] != attention_kernel}
        if label:
            d = "bf16" if "bf16" in attn else attn[0]
            kernels[f"{label}.forward"] = base.efficiency_of("attention", d)
            kernels[f"{label}.backward"] = base.efficiency_of("attention_backward", d)
            kernels[f"{label}.dropout"] = FLASH_DROPOUT_COST
        label = attention_kernel
    device = replace(
        base,
        name=name,
        peak_flops=peaks,
        vector_flops=vector,
        memory_bandwidth=bandwidth,
        kernel_launch_s=p.launch_s,
        efficiency=eff,
        matmul_half_dim=round(p.half_dim, 3),
        source=source,
        attention_tiles=tiles,
        matmul_call_s={**base.matmul_call_s, **p.mm_call_s},
        host_op_s=p.host_op_s or base.host_op_s,
        attention_kernel=label,
        attention_kernels=kernels,
    )
    return device, notes


def _level(p: Params, device: DeviceSpec, backend: str) -> InterconnectLevel:
    # the cost model multiplies link bandwidth by the device's network efficiency: divide it out
    net = device.efficiency_of("network")
    return InterconnectLevel(
        f"{backend}-measured", p.link_bandwidth / net, p.link_latency_s, "switch", "node"
    )


# --- the whole run ----------------------------------------------------------------------------------


def calibrate(
    device: str = "cpu",
    *,
    procs: int | None = None,
    quick: bool = False,
    progress: Progress | None = None,
    between_passes: Callable[[int], None] | None = None,
    max_residual: float | None = MAX_RESIDUAL,
) -> Calibration:
    """Measure ``device`` ("cpu" or "cuda") and fit a profile. ``procs`` processes (default 2 on
    cpu, the GPU count on cuda, at least 2 to measure a link; 1 skips collectives).
    ``between_passes(i)`` runs after the ``i``-th pass over the microbenchmarks (see ``run_probes``).
    A fit whose residuals exceed ``max_residual`` raises ``NoisyCalibration`` (None: no check)."""
    _check_device(device)
    if procs is None:
        procs = 2 if device == "cpu" else torch.cuda.device_count()
    if isinstance(procs, bool) or not isinstance(procs, int) or procs < 1:
        raise CalibrationError(f"--procs must be a positive integer, got {procs!r}")
    if device == "cuda" and procs > torch.cuda.device_count():
        raise CalibrationError(f"--procs {procs}: only {torch.cuda.device_count()} CUDA devices are visible")
    base, hardware = base_device(device)
    dtypes = _dtypes(device, base)
    plan = Plan.of(device, quick)
    clock = _Clock(device, target_s=plan.target_s, samples=plan.samples)
    # attention has no TF32 path, and vector work on tf32 runs is fp32 work
    wide = [d for d in dtypes if d != "tf32"]
    cache = base.sram_bytes if base is not None else int(torch.cuda.get_device_properties(0).L2_cache_size)
    probes = launch_probes(device) + vector_probes(device, wide, plan, cache)
    if device == "cpu":  # a GPU's caching allocator keeps its blocks mapped: no first-touch tier
        probes += first_touch_probes(cache)
        # a GPU's host dispatches views while earlier kernels run: only a CPU's step pays them
        probes += host_op_probes(device)
    probes += matmul_probes(device, dtypes, plan, cache) + attention_probes(device, wide, plan)
    total = len(probes) * plan.passes + (1 if procs >= MIN_PROCS else 0)
    done = 0

    def tick(label: str) -> None:
        nonlocal done
        done += 1
        if progress is not None:
            progress(label, done, total)

    # on a CPU the probes allocate their outputs as a training step does: hold glibc's thresholds as
    # `coplan run` holds them, so that no probe pays page faults that a run would not
    # (``coplan.hardware.allocator``; whole-process, like a run)
    pinned = pin_host_allocator() if device == "cpu" else None
    started, elsewhere = time.perf_counter(), 0.0

    def between(n: int) -> None:  # the caller's interleaved work is not the calibration's time
        nonlocal elsewhere
        if between_passes is not None:
            t0 = time.perf_counter()
            between_passes(n)
            elsewhere += time.perf_counter() - t0

    ms = run_probes(probes, clock, plan.passes, tick, between)
    backend = ""
    if procs >= MIN_PROCS:
        coll, backend = measure_collectives(device, procs, plan, tick)
        ms += coll
    extra: list[str] = [pinned] if pinned else []
    if base is None:
        base = _bare_gpu(hardware, ms)
        extra.append(f"no device preset matches {hardware!r}: its peaks are the best rates measured")
    # a CPU runs PyTorch's tiled flash kernel, whose small tiles cost more than their FLOPs, and
    # BLAS calls whose fixed cost (packing, kernel lookup) sets the time of small GEMMs
    cpu = device == "cpu"
    params = fit(ms, _start_params(base, dtypes, TORCH_CPU_FLASH if cpu else None, fit_calls=cpu))
    fitted = tuple(replace(m, fitted=predict(m, params)) for m in ms)
    residuals = rms_residuals(fitted)
    if max_residual is not None:
        check_residuals(residuals, max_residual)
    took = time.perf_counter() - started - elsewhere
    when = datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%dT%H:%M:%SZ")
    res_text = ", ".join(f"{k} {v:.1%}" for k, v in residuals.items())
    source = (
        f"measured by `coplan calibrate --device {device}{' --quick' if quick else ''}` on {hardware} "
        f"({torch.get_num_threads()} torch threads) at {when} with torch {torch.__version__}, "
        f"{len(ms)} microbenchmarks in {took:.0f} s; started from preset "
        f"'{base.name}' (data-sheet peaks kept); rms relative residual of the fit: {res_text}"
    )
    # PyTorch's SDPA runs its FlashAttention-2 kernels first on NVIDIA GPUs (ROCm's differ: unnamed)
    sdpa = "flash2" if device == "cuda" and not getattr(torch.version, "hip", None) else ""
    dev_spec, notes = to_device(base, params, dtypes, f"{base.name}-calibrated", source, sdpa)
    notes = extra + notes
    if notes:
        dev_spec = replace(dev_spec, source=source + "; " + "; ".join(notes))
    if procs >= MIN_PROCS:
        level = _level(params, dev_spec, backend)
        if device == "cpu":
            notes.append(f"the {procs} cpu 'devices' are processes sharing one CPU's cores")
    else:
        level = InterconnectLevel.loopback(dev_spec.memory_bandwidth * dev_spec.efficiency_of("memory"))
    count = procs if procs >= MIN_PROCS else 1
    cluster = ClusterSpec(
        f"{device}-calibrated" if count == 1 else f"{device}-calibrated[{count}]",
        (NodeGroup(dev_spec, count, 1, level),),
        None,
        f"one node of {count} x {dev_spec.name}; "
        + (
            f"link measured with {backend} all-reduce and all-gather over {procs} processes"
            if procs >= MIN_PROCS
            else "no link measured (one process): loopback at the measured memory bandwidth"
        ),
    )
    return Calibration(dev_spec, cluster, fitted, residuals, tuple(notes))


def write_profile(cal: Calibration, path: str | Path) -> Path:
    """Write the calibrated cluster spec (what ``load_cluster`` accepts) to ``path``."""
    out = Path(path).expanduser()
    try:
        out.write_text(json.dumps(cal.cluster.to_dict(), indent=2) + "\n", encoding="utf-8")
    except OSError as err:
        raise CalibrationError(f"cannot write {out}: {err.strerror or err}") from None
    return out


__all__ = [
    "DEVICES",
    "KINDS",
    "MAX_RESIDUAL",
    "Calibration",
    "CalibrationError",
    "Measurement",
    "NoisyCalibration",
    "Params",
    "calibrate",
    "check_residuals",
    "fit",
    "predict",
    "write_profile",
]
