"""Plans applied to real training on this CPU: measured against predicted.

    python benchmarks/bench_apply.py [--profile PATH] [--steps N] [--quick]
    python benchmarks/bench_apply.py --calibrate-only benchmarks/results/apply_runs.jsonl
    python benchmarks/bench_apply.py --sweep     # the calibration sweep alone (~30 s)

A small GPT is trained under several plans with ``coplan.apply`` (the same path as ``coplan
run``): no recompute, Megatron-style full and selective recompute, and a plan chosen by the joint
strategy under a tight memory budget (kernels restricted to eager, which is what the runner
executes without Inductor); fp32 and bf16; one process, and two processes over gloo with DDP,
FSDP2 (ZeRO-1), tensor parallelism and a two-stage pipeline (1F1B). Each run reports measured
and predicted step time, saved activation bytes and peak memory, and the gradient check against
eager fp32. The summary is the
largest saved-bytes error (target 5%) and Spearman's rank correlation of predicted against
measured step times (target 0.8). The cost model prices with a CPU profile calibrated at the
start of the run with two processes (``coplan calibrate --device cpu --procs 2``, written to
``benchmarks/results/cpu_profile_2p.json``): the machine's speed drifts by tens of percent over a
day, and the two-process runs need the measured gloo link (latency ~1 ms per collective), which a
one-process profile does not have. ``--profile PATH`` prices with a given profile instead.

Every run is also recorded as ``coplan run --record`` records it (``results/apply_runs.jsonl``),
and the runs calibrate the profile (``coplan calibrate --runs``: GEMM and vector rates and the
per-kernel cost fitted to the step times): the summary gives the step-time error and Spearman's
correlation of the profile as given and of held-out predictions (each run predicted by the
factors fitted to the other runs, leave-one-out). ``--calibrate-only RUNS`` redoes that part
from recorded runs without training. ``--sweep`` trains a sweep of one-process runs from
launch-bound to GEMM-bound steps instead (``SWEEP``) and calibrates on it (``results/apply_sweep.json``).

Results go to ``benchmarks/results/apply.json`` and a markdown table is printed.
"""

from __future__ import annotations

import argparse
import json
import platform
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from coplan.apply.measure import spearman
from coplan.apply.predict import make_context, megatron_recompute, plan_for, run_cluster
from coplan.apply.run import RunRequest, run_plan
from coplan.cli.run_cmd import append_record
from coplan.hardware import load_cluster
from coplan.models.spec import ModelSpec
from coplan.plan.types import Plan, RematPlan

RESULTS = Path(__file__).parent / "results"
SPEC = ModelSpec(name="gpt-a", n_layers=2, d_model=128, n_heads=4, vocab_size=2048, seq_len=256)
BATCH, SEQ = 8, 128
SAVED_TARGET, SPEARMAN_TARGET = 0.05, 0.8


@dataclass(frozen=True, slots=True)
class Case:
    label: str
    nproc: int
    compute: str
    recompute: str  # none | full | selective | joint
    tp: int = 1
    zero: int = 0
    pp: int = 1


CASES = (
    Case("1p none fp32", 1, "fp32", "none"),
    Case("1p full fp32", 1, "fp32", "full"),
    Case("1p selective fp32", 1, "fp32", "selective"),
    Case("1p joint fp32", 1, "fp32", "joint"),
    Case("1p none bf16", 1, "bf16", "none"),
    Case("1p full bf16", 1, "bf16", "full"),
    Case("2p DDP none fp32", 2, "fp32", "none"),
    Case("2p FSDP2 none fp32", 2, "fp32", "none", zero=1),
    Case("2p TP none fp32", 2, "fp32", "none", tp=2),
    Case("2p DDP full bf16", 2, "bf16", "full"),
    Case("2p PP none fp32", 2, "fp32", "none", pp=2),
)
QUICK = (0, 1, 2, 4, 6, 8)


def joint_plan(ctx: Any, compute: str) -> Plan:
    """The joint strategy's plan in the space the runner applies (eager kernels, no ZeRO, the
    given dtype) under a budget of 70% of the unrecomputed plan's peak, so recomputation pays."""
    from coplan.search import Options, run_strategy
    from coplan.search.space import SearchSpace

    ctx.budget_bytes = 0.7 * ctx.price(plan_for(ctx, compute=compute)).memory.peak_bytes
    opts = Options(space=SearchSpace(dtypes=(compute,), fusion=("eager",), zero=(0,)))
    return run_strategy("joint", ctx, opts).plan


def run_case(case: Case, profile: str, steps: int, record: Path | None = None) -> dict[str, Any]:
    base = load_cluster(profile)
    ctx = make_context(SPEC, run_cluster(base, case.nproc, "cpu"), BATCH, SEQ)
    if case.recompute == "joint":
        plan = joint_plan(ctx, case.compute)
    else:
        plan = plan_for(ctx, compute=case.compute, tp=case.tp, zero=case.zero, pp=case.pp)
        plan = plan.with_(remat=RematPlan(recompute=megatron_recompute(ctx, case.recompute)))
    req = RunRequest(
        plan=plan, spec=SPEC, steps=steps, nproc=case.nproc, global_batch=BATCH, seq=SEQ, cluster=base
    )
    out = run_plan(req)
    if record is not None:
        append_record(record, req, out)
    m, p = out["measured"], out["predicted"]
    return {
        "case": case.label,
        "layout": plan.parallel.describe(),
        "recompute": sorted(plan.remat.recompute),
        "measured": m,
        "predicted": p,
        "step_error": p["step_time_s"] / m["step_time_s"] - 1,
        "saved_error": p["saved_activation_bytes"] / m["saved_activation_bytes"] - 1,
        "peak_error": p["peak_bytes"] / m["peak_bytes"] - 1 if m["peak_bytes"] else None,
        "grad_check": out["grad_check"],
        "loss": out["loss"],
        "not_found": out["run"]["not_found"],
        "notes": out["run"]["notes"],
    }


#: ``--sweep``: one process, the step's size from launch-bound to GEMM-bound (batch x sequence),
#: both dtypes, with and without full recompute: runs that tell the three calibrated rates apart
SWEEP = tuple(
    (batch, seq, compute, recompute)
    for batch, seq in ((2, 64), (8, 128), (16, 256))
    for compute in ("fp32", "bf16")
    for recompute in ("none", "full")
)


def sweep(profile: str, steps: int, runs: Path) -> dict[str, Any]:
    """Train the ``SWEEP`` runs, record them, and calibrate the profile on them (leave-one-out)."""
    base = load_cluster(profile)
    runs.unlink(missing_ok=True)
    for batch, seq, compute, recompute in SWEEP:
        ctx = make_context(SPEC, run_cluster(base, 1, "cpu"), batch, seq)
        plan = plan_for(ctx, compute=compute)
        plan = plan.with_(remat=RematPlan(recompute=megatron_recompute(ctx, recompute)))
        req = RunRequest(
            plan=plan, spec=SPEC, steps=steps, nproc=1, global_batch=batch, seq=seq, cluster=base
        )
        out = run_plan(req)
        append_record(runs, req, out)
        m, p = out["measured"]["step_time_s"], out["predicted"]["step_time_s"]
        print(
            f"batch {batch} x seq {seq} {compute} {recompute}: {m * 1e3:.1f} ms, predicted {p * 1e3:.1f} ms"
        )
    return calibration(runs, profile)


def calibration(runs: Path, profile: str) -> dict[str, Any]:
    """Fit the profile to the recorded runs; the step-time error and rank correlation before, after
    (in sample) and held out (leave-one-out)."""
    from coplan.hardware.calibrate.runs import fit_runs, read_runs

    records, _ = read_runs(runs)
    fit = fit_runs(records, load_cluster(profile))
    m = fit.measured_s
    out: dict[str, Any] = {
        "runs": len(records),
        "scales": fit.scales.to_dict(),
        "rms_error": {"before": fit.rms_before, "after": fit.rms_after, "held_out": fit.loo_after},
        "spearman": {
            "before": spearman(m, fit.before_s),
            "after": spearman(m, fit.after_s),
            "held_out": spearman(m, fit.loo_after_s) if fit.loo_after_s else None,
        },
    }
    e, r = out["rms_error"], out["spearman"]
    print(
        f"\ncalibrated on {len(records)} runs (gemm x{fit.scales.gemm:.3g}, vector x{fit.scales.vector:.3g}, "
        f"launch x{fit.scales.launch:.3g}, link x{fit.scales.link:.3g}): "
        f"step-time rms error {e['before']:.1%} -> {e['after']:.1%} "
        f"in sample, {e['held_out']:.1%} held out; Spearman {r['before']:.3f} -> {r['after']:.3f}, "
        f"held out {r['held_out'] if r['held_out'] is None else round(r['held_out'], 3)}"
    )
    return out


def calibrate_now(path: Path) -> Path:
    """Calibrate this CPU with two processes (microbenchmarks and gloo collectives) into ``path``."""
    from coplan.hardware.calibrate import calibrate, write_profile

    t0 = time.perf_counter()
    out = write_profile(calibrate("cpu", procs=2), path)
    print(f"calibrated {out} in {time.perf_counter() - t0:.0f} s", file=sys.stderr)
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--profile", default=None, help="a profile to price with (default: calibrate now)")
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--quick", action="store_true", help=f"{len(QUICK)} cases")
    ap.add_argument("--out", default=str(RESULTS / "apply.json"))
    ap.add_argument("--runs", default=str(RESULTS / "apply_runs.jsonl"), help="run records written")
    ap.add_argument("--calibrate-only", metavar="RUNS", help="only calibrate from these recorded runs")
    ap.add_argument(
        "--sweep",
        action="store_true",
        help=f"only the calibration sweep: {len(SWEEP)} one-process runs (results/apply_sweep.json)",
    )
    args = ap.parse_args(argv)
    if args.profile is None:
        args.profile = str(calibrate_now(RESULTS / "cpu_profile_2p.json"))
    if args.calibrate_only:
        calibration(Path(args.calibrate_only), args.profile)
        return 0
    if args.sweep:
        cal = sweep(args.profile, args.steps, RESULTS / "apply_sweep_runs.jsonl")
        machine = f"{platform.processor() or platform.machine()}, torch {torch.__version__}"
        result = {"machine": machine, "model": SPEC.to_dict(), "steps": args.steps, "calibration": cal}
        (RESULTS / "apply_sweep.json").write_text(json.dumps(result, indent=2) + "\n")
        return 0
    started = time.perf_counter()
    cases = [CASES[i] for i in QUICK] if args.quick else list(CASES)
    runs = Path(args.runs)
    runs.unlink(missing_ok=True)
    rows = []
    for case in cases:
        t0 = time.perf_counter()
        rows.append(run_case(case, args.profile, args.steps, runs))
        print(f"{case.label}: {time.perf_counter() - t0:.0f} s", file=sys.stderr)
    rho = spearman(
        [r["measured"]["step_time_s"] for r in rows], [r["predicted"]["step_time_s"] for r in rows]
    )
    worst_saved = max(abs(r["saved_error"]) for r in rows)
    grads_ok = all(r["grad_check"]["ok"] for r in rows)
    print(
        "\n| plan | layout | measured ms | predicted ms | saved MB meas | saved MB pred | saved err "
        "| peak MB meas | peak MB pred | grad rel err (tol) |"
    )
    print("|---|---|---:|---:|---:|---:|---:|---:|---:|---|")
    for r in rows:
        m, p, g = r["measured"], r["predicted"], r["grad_check"]
        print(
            f"| {r['case']} | {r['layout']} | {m['step_time_s'] * 1e3:.1f} | {p['step_time_s'] * 1e3:.1f} "
            f"| {m['saved_activation_bytes'] / 1e6:.2f} | {p['saved_activation_bytes'] / 1e6:.2f} "
            f"| {r['saved_error']:+.1%} | {m['peak_bytes'] / 1e6:.1f} | {p['peak_bytes'] / 1e6:.1f} "
            f"| {g['max_rel_err']:.1e} ({g['tolerance']:.0e}) {'ok' if g['ok'] else 'FAIL'} |"
        )
    ok = worst_saved <= SAVED_TARGET and rho >= SPEARMAN_TARGET and grads_ok
    print(
        f"\nsaved bytes max |error| {worst_saved:.2%} (target {SAVED_TARGET:.0%}), Spearman {rho:.3f} "
        f"(target {SPEARMAN_TARGET}), gradients {'' if grads_ok else 'NOT '}all within tolerance"
        f" -> targets {'met' if ok else 'MISSED'}"
    )
    fitted = calibration(runs, args.profile) if len(rows) >= 3 else None
    result = {
        "machine": f"{platform.processor() or platform.machine()}, torch {torch.__version__}",
        "model": SPEC.to_dict(),
        "batch": BATCH,
        "seq": SEQ,
        "steps": args.steps,
        "profile": args.profile,
        "summary": {
            "spearman": rho,
            "max_abs_saved_error": worst_saved,
            "grads_ok": grads_ok,
            "targets_met": ok,
        },
        "results": rows,
        "calibration": fitted,
        "runtime_s": time.perf_counter() - started,
    }
    Path(args.out).write_text(json.dumps(result, indent=2) + "\n")
    print(f"{len(rows)} runs in {result['runtime_s']:.0f} s -> {args.out}")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
