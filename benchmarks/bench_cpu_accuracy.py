"""Cost-model accuracy on this CPU: real training steps of small GPTs against the calibrated estimate.

    python benchmarks/bench_cpu_accuracy.py [--profile PATH] [--quick] [--ops N]

For each configuration (model, batch, sequence, recompute mode, precision) the benchmark times full
eager training steps (forward, backward, AdamW step, zero_grad; 2 threads; the median of 3 steps
after 2 of warm-up, in 5 rounds over all configurations, the fastest round kept; the first rounds
run after the calibration's passes over its microbenchmarks, so both see the same minutes),
captures the same step with ``capture_module`` and prices it with ``CostModel(graph=...).estimate``
on the calibrated profile (``coplan calibrate``, run here unless ``--profile`` names one), and
measures the activation bytes autograd really saves (``saved_tensors_hooks``, each storage once,
parameters and inputs excluded) against the estimate's ``activations_bytes``.

The process holds glibc malloc's thresholds as ``coplan run`` does (``--host-allocator pinned``,
``coplan/hardware/allocator.py``): tensors below 32 MiB reuse a heap that is never trimmed, larger ones are
mapped and faulted in afresh, which is what the cost model prices; ``default`` leaves the allocator
to the process's history.

Targets: step-time error within 20% for every configuration, Spearman rank correlation >= 0.8,
activation bytes within 5%. ``--ops N`` also profiles configuration N with ``torch.profiler`` and
prints measured vs modelled time per aten op (where the model misprices).

Results go to ``benchmarks/results/cpu_accuracy.json`` (and the profile used to
``benchmarks/results/cpu_profile.json`` when calibrated here), with the share of the CPU other
processes used during the run (``contention``) and a canary's speed (a fixed GEMM and a tiny
autograd chain) at the start and after each round (``canary_s``): on a shared machine a busy
stretch reads slow, and its numbers are not this CPU's.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import statistics
import sys
import time
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch._subclasses.fake_tensor import FakeTensorMode

from coplan.apply.measure import spearman
from coplan.capture.api import capture_module
from coplan.cost import CostModel, Estimate, TrainingConfig
from coplan.hardware import ClusterSpec, load_cluster
from coplan.hardware.allocator import HOST_ALLOCATORS, pin_host_allocator
from coplan.ir.types import Graph
from coplan.models.spec import ModelSpec
from coplan.models.transformer import Transformer, example_batch

RESULTS = Path(__file__).parent / "results"
THREADS = 2
STEP_TARGET = 0.20  # max error per configuration
SPEARMAN_TARGET = 0.8
ACT_TARGET = 0.05
OP_FIELDS = ("op", "measured_s", "calls", "modelled_s", "kernels")

SPECS = {
    "gpt-a": ModelSpec(name="gpt-a", n_layers=2, d_model=128, n_heads=4, vocab_size=2048, seq_len=256),
    "gpt-b": ModelSpec(name="gpt-b", n_layers=4, d_model=256, n_heads=4, vocab_size=4096, seq_len=256),
    "gpt-c": ModelSpec(name="gpt-c", n_layers=6, d_model=384, n_heads=6, vocab_size=8192, seq_len=256),
}


@dataclass(frozen=True, slots=True)
class Case:
    model: str
    batch: int
    seq: int
    recompute: str
    dtype: str

    @property
    def label(self) -> str:
        return f"{self.model} b{self.batch} s{self.seq} {self.recompute} {self.dtype}"

    def config(self) -> TrainingConfig:
        return TrainingConfig(
            microbatch=self.batch,
            global_batch=self.batch,
            seq=self.seq,
            recompute=self.recompute,
            dtype=self.dtype,
            master_weights=self.dtype == "fp32",
            fusion="none",
            flash_attention=True,
        )


CASES: tuple[Case, ...] = (
    Case("gpt-a", 16, 64, "none", "fp32"),
    Case("gpt-a", 4, 128, "none", "fp32"),
    Case("gpt-a", 8, 256, "none", "fp32"),
    Case("gpt-a", 8, 256, "full", "fp32"),
    Case("gpt-a", 4, 128, "none", "bf16"),
    Case("gpt-b", 4, 128, "none", "fp32"),
    Case("gpt-b", 8, 256, "none", "fp32"),
    Case("gpt-b", 8, 256, "selective", "fp32"),
    Case("gpt-b", 8, 256, "full", "fp32"),
    Case("gpt-b", 8, 256, "none", "bf16"),
    Case("gpt-b", 4, 128, "selective", "bf16"),
    Case("gpt-b", 8, 256, "full", "bf16"),
    Case("gpt-c", 4, 128, "none", "fp32"),
    Case("gpt-c", 4, 256, "full", "fp32"),
    Case("gpt-c", 4, 256, "none", "bf16"),
    Case("gpt-c", 2, 256, "selective", "bf16"),
)
QUICK = (0, 2, 4, 6, 8, 9, 10, 12, 14)


# --- measuring --------------------------------------------------------------------------------------


def _torch_dtype(dtype: str) -> torch.dtype:
    return torch.bfloat16 if dtype == "bf16" else torch.float32


def _optimizer(params: Sequence[torch.Tensor] | Any) -> torch.optim.Optimizer:
    # the hyper-parameters capture uses (coplan.capture.trace.default_optimizer), per-tensor updates
    return torch.optim.AdamW(params, lr=3e-4, betas=(0.9, 0.95), weight_decay=0.1, foreach=False)


def _model(case: Case) -> Transformer:
    torch.manual_seed(0)
    model = Transformer(SPECS[case.model]).to(_torch_dtype(case.dtype))
    model.recompute = case.recompute
    return model


def time_steps(case: Case, warmup: int, steps: int) -> list[float]:
    """Seconds of each timed full training step after ``warmup`` untimed ones."""
    model = _model(case)
    opt = _optimizer(model.parameters())
    idx, targets = example_batch(SPECS[case.model], case.batch, case.seq)

    def step() -> None:
        loss = model(idx, targets)
        loss.backward()
        opt.step()
        opt.zero_grad()

    for _ in range(warmup):
        step()
    times = []
    for _ in range(steps):
        t0 = time.perf_counter()
        step()
        times.append(time.perf_counter() - t0)
    return times


def saved_bytes(case: Case) -> int:
    """Bytes of the distinct storages autograd saves in one forward (recompute as configured),
    parameters and the batch excluded (the cost model counts activations only)."""
    model = _model(case)
    idx, targets = example_batch(SPECS[case.model], case.batch, case.seq)
    exclude = {p.untyped_storage().data_ptr() for p in model.parameters()}
    exclude |= {idx.untyped_storage().data_ptr(), targets.untyped_storage().data_ptr()}
    seen: dict[int, int] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        storage = t.untyped_storage()
        ptr = storage.data_ptr()
        if ptr not in exclude and t.device.type != "meta":
            seen.setdefault(ptr, storage.nbytes())
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        loss = model(idx, targets)
    del loss
    return sum(seen.values())


def capture(case: Case) -> Graph:
    """The plain step (no recomputation: the cost model adds it) at the case's batch and precision."""
    spec = SPECS[case.model]
    # fake parameters cannot be converted with .to() (swapping them breaks fake-tensor weakrefs):
    # create them in the case's precision instead
    default = torch.get_default_dtype()
    torch.set_default_dtype(_torch_dtype(case.dtype))
    try:
        with FakeTensorMode(allow_non_fake_inputs=True):
            model = Transformer(spec)
            idx, targets = example_batch(spec, case.batch, case.seq)
    finally:
        torch.set_default_dtype(default)
    return capture_module(model, (idx, targets), name=spec.name, batch=case.batch, seq=case.seq)


# --- statistics -------------------------------------------------------------------------------------


def op_breakdown(case: Case, graph: Graph, cluster: ClusterSpec) -> list[tuple[str, float, int, float, int]]:
    """(aten op, measured s per step, calls, modelled s per step, kernels) from torch.profiler."""
    from torch.profiler import ProfilerActivity, profile

    from coplan.cost.kernels import Rates, Scale, kernel_time

    model = _model(case)
    opt = _optimizer(model.parameters())
    idx, targets = example_batch(SPECS[case.model], case.batch, case.seq)
    for _ in range(3):
        model(idx, targets).backward()
        opt.step()
        opt.zero_grad()
    reps = 3
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        for _ in range(reps):
            model(idx, targets).backward()
            opt.step()
            opt.zero_grad()
    real: Counter[str] = Counter()
    calls: Counter[str] = Counter()
    for e in prof.key_averages():
        if e.key.startswith("aten::"):
            real[e.key] += e.self_cpu_time_total / reps / 1e6
            calls[e.key] += e.count // reps
    cfg = case.config()
    prof_ = CostModel(graph=graph).profile(case.batch, case.seq, "none")
    rates = Rates.of(cluster.device, cfg.dtype)
    ab = cfg.act_bytes
    # fp32-class tensors (gradients, optimizer state, the loss) are 16-bit in a pure 16-bit run, as
    # the estimate prices them
    wide = 4 if (cfg.master_weights or not cfg.mixed) else ab
    scale = Scale(1, False, (ab, ab, wide, wide, 1, 1), ab, True)
    modelled: Counter[str] = Counter()
    kernels: Counter[str] = Counter()
    for part, n in [(t, len(t.blocks)) for t in prof_.templates] + [(prof_.pre, 1), (prof_.post, 1)]:
        for k in (*part.forward, *part.backward, *part.optimizer):
            if k.kind == "free":
                continue
            name = "aten::" + graph.ops[k.ops[0]].target.split(".")[1]
            modelled[name] += n * kernel_time(k, rates, scale)
            kernels[name] += n
    keys = sorted(set(real) | set(modelled), key=lambda k: -max(real[k], modelled[k]))
    return [(k, real[k], calls[k], modelled[k], kernels[k]) for k in keys]


# --- the run ----------------------------------------------------------------------------------------


class Contention:
    """The share of the machine's CPU time other processes used while a phase ran (Linux
    ``/proc/stat``; None elsewhere). Every figure here is a time measured on a possibly shared
    machine: a phase another tenant kept busy reads slow, so the results say how disturbed it was."""

    def __init__(self) -> None:
        self.start = self._sample()

    @staticmethod
    def _sample() -> tuple[float, float, float] | None:
        try:
            with open("/proc/stat") as f:
                ticks = [int(v) for v in f.readline().split()[1:]]
        except (OSError, ValueError):
            return None
        hz = os.sysconf("SC_CLK_TCK")
        busy = (sum(ticks) - ticks[3] - ticks[4]) / hz  # all but idle and iowait
        own = sum(os.times()[:4])  # this process and its reaped children (collective workers)
        return busy, own, time.perf_counter()

    def share(self) -> float | None:
        end = self._sample()
        if self.start is None or end is None:
            return None
        busy, own, wall = (b - a for a, b in zip(self.start, end, strict=True))
        return max(0.0, busy - own) / max(wall * (os.cpu_count() or 1), 1e-9)


def canary() -> tuple[float, float]:
    """The machine's speed at this moment: seconds of a fixed fp32 GEMM, and per op of a tiny
    autograd chain (dispatch-bound, as the small configurations are), each the fastest of 20. A
    neighbour on the same host (shared caches, memory) slows them without using this machine's
    CPUs, which ``Contention`` cannot see; calibration and measurement should see the same speed."""
    a, b = torch.randn(384, 384), torch.randn(384, 384)
    x, g = torch.ones(8, requires_grad=True), torch.ones(8)

    def chain() -> object:
        z = x
        for _ in range(32):
            z = z * 1.0001
        return torch.autograd.grad(z, x, g)

    def fastest(fn: Any) -> float:
        best = math.inf
        for _ in range(20):
            t0 = time.perf_counter()
            fn()
            best = min(best, time.perf_counter() - t0)
        return best

    return fastest(lambda: torch.mm(a, b)), fastest(chain) / 64


def _profile(
    args: argparse.Namespace, between: Callable[[int], None]
) -> tuple[ClusterSpec, str, list[dict[str, Any]]]:
    if args.profile:
        return load_cluster(args.profile, 1), args.profile, []
    from coplan.hardware.calibrate import calibrate, write_profile

    t0 = time.perf_counter()
    cal = calibrate("cpu", procs=1, quick=args.quick, between_passes=between)
    path = write_profile(cal, RESULTS / "cpu_profile.json")
    print(f"calibrated and measured in {time.perf_counter() - t0:.0f} s -> {path}")
    print("fit residuals: " + ", ".join(f"{k} {v:.0%}" for k, v in cal.residuals.items()))
    return load_cluster(str(path), 1), str(path), [m.to_dict() for m in cal.measurements]


class Rounds:
    """Step times of every case, one round-robin round at a time: ``times[case][round][step]``. A
    case's time is its fastest round's median: on a shared VM another tenant can slow every step of
    a minute by a third, and spreading each case over the run keeps one bad minute from spoiling one
    case. The rounds run between the calibration's passes over its microbenchmarks (which keeps each
    one's fastest pass the same way), so calibration and measurement see the same stretches of the
    host's load rather than one a quiet minute and the other a busy one. ``speed`` is the canary
    after each round."""

    def __init__(self, cases: Sequence[Case], rounds: int, warmup: int, steps: int) -> None:
        self.cases, self.rounds, self.warmup, self.steps = cases, rounds, warmup, steps
        self.times: list[list[list[float]]] = [[] for _ in cases]
        self.speed: dict[str, tuple[float, float]] = {}

    @property
    def done(self) -> int:
        return len(self.times[0]) if self.times else self.rounds

    def run(self, _pass: int = 0) -> None:
        """One more round, if any is left (``_pass``: the calibration pass it follows)."""
        if self.done >= self.rounds:
            return
        for i, case in enumerate(self.cases):
            self.times[i].append(time_steps(case, self.warmup, self.steps))
        self.speed[f"after round {self.done}"] = canary()


def row(
    case: Case, graph: Graph, cluster: ClusterSpec, preset: ClusterSpec, times: list[list[float]]
) -> dict[str, Any]:
    cfg = case.config()
    est: Estimate = CostModel(graph=graph).estimate(cluster, cfg)
    base: Estimate = CostModel(graph=graph).estimate(preset, cfg)
    measured = min(statistics.median(r) for r in times)
    act = saved_bytes(case) if case.recompute == "none" else None
    predicted = est.step_time_s
    return {
        "config": case.label,
        "model": case.model,
        "batch": case.batch,
        "seq": case.seq,
        "recompute": case.recompute,
        "dtype": case.dtype,
        "measured_s": measured,
        "round_medians_s": [statistics.median(r) for r in times],
        "step_times_s": times,
        "predicted_s": predicted,
        "error": predicted / measured - 1,
        "preset_predicted_s": base.step_time_s,
        "preset_error": base.step_time_s / measured - 1,
        "breakdown_s": dict(est.breakdown_s),
        "kernels_per_step": est.kernels_per_step,
        "saved_bytes_measured": act,
        "saved_bytes_predicted": est.memory.activations_bytes,
        "saved_bytes_error": (est.memory.activations_bytes / act - 1) if act else None,
    }


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--profile", help="a calibrated profile (coplan calibrate --out); default: calibrate now")
    ap.add_argument("--quick", action="store_true", help="fewer configurations and steps, quick calibration")
    ap.add_argument("--ops", type=int, default=None, help="profile configuration N per aten op")
    ap.add_argument("--out", default=str(RESULTS / "cpu_accuracy.json"))
    ap.add_argument(
        "--host-allocator",
        choices=HOST_ALLOCATORS,
        default="pinned",
        help="pinned: glibc malloc held as `coplan run` holds it (coplan/hardware/allocator.py); "
        "default: as found",
    )
    args = ap.parse_args(argv)
    torch.set_num_threads(THREADS)
    allocator = pin_host_allocator() if args.host_allocator == "pinned" else None
    RESULTS.mkdir(exist_ok=True)
    started = time.perf_counter()
    preset = load_cluster("cpu")
    cases = [CASES[i] for i in QUICK] if args.quick else list(CASES)
    graphs = [capture(case) for case in cases]
    # five short rounds (the first three after the calibration's passes): on this shared VM the host
    # can slow a whole round of a small configuration by a fifth, and more rounds spread over the
    # run are likelier to catch one quiet stretch each
    rounds = Rounds(cases, *((1, 2, 3) if args.quick else (5, 2, 3)))
    load, speed = Contention(), {"at the start": canary()}
    cluster, profile_path, calibration = _profile(args, rounds.run)
    while rounds.done < rounds.rounds:
        rounds.run()
    contention, speed = load.share(), {**speed, **rounds.speed}
    times = rounds.times
    rows = [row(c, g, cluster, preset, t) for c, g, t in zip(cases, graphs, times, strict=True)]
    print(
        f"\n{'#':>2} {'config':32} {'measured s':>10} {'predicted s':>11} {'error':>7} {'preset err':>10} "
        f"{'saved MB meas':>13} {'saved MB pred':>13} {'act err':>7}"
    )
    for i, (case, r) in enumerate(zip(cases, rows, strict=True)):
        meas = r["saved_bytes_measured"]
        pred_mb = r["saved_bytes_predicted"] / 1e6
        if meas:
            act = f"{meas / 1e6:13.2f} {pred_mb:13.2f} {r['saved_bytes_error']:+7.1%}"
        else:
            act = f"{'-':>13} {pred_mb:13.2f} {'-':>7}"
        print(
            f"{i:2d} {case.label:32} {r['measured_s']:10.4f} {r['predicted_s']:11.4f} "
            f"{r['error']:+7.1%} {r['preset_error']:+10.1%} {act}"
        )
    errors = [abs(r["error"]) for r in rows]
    acts = [abs(r["saved_bytes_error"]) for r in rows if r["saved_bytes_error"] is not None]
    summary = {
        "mape": statistics.fmean(errors),
        "max_abs_error": max(errors),
        "spearman": spearman([r["measured_s"] for r in rows], [r["predicted_s"] for r in rows]),
        "preset_mape": statistics.fmean(abs(r["preset_error"]) for r in rows),
        "max_abs_saved_bytes_error": max(acts) if acts else None,
        "within_step_target": sum(e <= STEP_TARGET for e in errors),
        "configs": len(rows),
    }
    ok = (
        summary["max_abs_error"] <= STEP_TARGET
        and summary["spearman"] >= SPEARMAN_TARGET
        and (not acts or max(acts) <= ACT_TARGET)
    )
    print(
        f"\nMAPE {summary['mape']:.1%} (preset profile {summary['preset_mape']:.1%}), max |error| "
        f"{summary['max_abs_error']:.1%}, Spearman {summary['spearman']:.3f}, "
        f"{summary['within_step_target']}/{len(rows)} within {STEP_TARGET:.0%}, saved bytes max |error| "
        + (f"{summary['max_abs_saved_bytes_error']:.2%}" if acts else "-")
        + f" -> targets {'met' if ok else 'MISSED'}"
    )
    if contention is not None:
        busy = contention > 0.1
        print(
            f"other processes used {contention:.0%} of the CPU during the run"
            + (": a busy machine reads slow, re-run when it is quiet" if busy else "")
        )
    for i, what in enumerate(("a 384^3 fp32 GEMM", "an op of an autograd chain")):
        seen = [v[i] for v in speed.values()]
        drift = max(seen) / min(seen) - 1
        print(
            f"{what} took "
            + ", ".join(f"{v[i] * 1e6:.1f} us {k}" for k, v in speed.items())
            + (f": the machine's speed drifted {drift:.0%} during the run" if drift > 0.1 else "")
        )
    ops = None
    if args.ops is not None:
        case = cases[args.ops]
        ops = op_breakdown(case, capture(case), cluster)
        print(f"\nper aten op, {case.label} (ms per step; measured self CPU time vs cost model):")
        for name, real, n, modelled, k in ops[:30]:
            print(f"  {name:58} {real * 1e3:9.2f} ({n:4d} calls) {modelled * 1e3:9.2f} ({k:4d} kernels)")
    machine = platform.processor() or platform.machine()
    result = {
        "machine": f"{machine}, {THREADS} threads, torch {torch.__version__}",
        "host_allocator": allocator or "as the process found it",
        "profile": profile_path,
        "device": cluster.device.to_dict(),
        "targets": {"step_error": STEP_TARGET, "spearman": SPEARMAN_TARGET, "saved_bytes_error": ACT_TARGET},
        "summary": {**summary, "targets_met": ok},
        "contention": contention,
        "canary_s": {k: {"gemm": g, "autograd_op": d} for k, (g, d) in speed.items()},
        "results": rows,
        "ops": [dict(zip(OP_FIELDS, o, strict=True)) for o in ops] if ops else None,
        "calibration_measurements": calibration,
        "runtime_s": time.perf_counter() - started,
    }
    Path(args.out).write_text(json.dumps(result, indent=2) + "\n")
    print(f"\n{len(rows)} configurations in {result['runtime_s']:.0f} s -> {args.out}")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
