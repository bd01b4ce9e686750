"""GPT-2 124M (and Llama 3.2 1B) trained on one GPU under coplan's plans and the baselines they
are compared with.

    # the prepared benchmark (``gpu_all.py``): five runs per model at a tight and a loose batch
    python benchmarks/bench_gpu.py all-plans                      # here: plan them (OR-Tools)
    python benchmarks/bench_gpu.py all --out DIR [--model NAME]   # on the GPU: DIR/bench_gpu.json
    python benchmarks/bench_gpu.py all --device cpu --out DIR     # the same end to end on a CPU
    python benchmarks/bench_gpu.py all-table DIR/bench_gpu.json   # the markdown tables
    # on a lent GPU (coplan not installed there; one model, one batch per call fits its time):
    PYTHONPATH=. python3 benchmarks/bench_gpu.py all --model gpt2-124m --batches tight --out $OUT

    # here (planning needs OR-Tools): write the plans the GPU runs apply
    python benchmarks/bench_gpu.py plans
    # on the GPU machine: run them (JSON per part to --out)
    python benchmarks/bench_gpu.py apply --out DIR      # joint plan vs torch.compile and eager
    python benchmarks/bench_gpu.py corners --out DIR    # fusion x remat: 2 x 4 corners
    # here: the markdown tables of docs/applying-plans.md from the JSON the GPU runs wrote
    python benchmarks/bench_gpu.py table DIR

``apply`` (applying a plan): at a memory-tight global batch (``BATCH`` sequences of ``SEQ`` tokens, where
the planner must split the batch into microbatches to fit 75 GiB), the joint plan (bf16: the
runner emulates fp8, so fp8 plans would not be faster on real hardware; ``--dtypes bf16``) against
``torch.compile`` with Inductor's defaults and eager PyTorch, both under bf16 autocast with the
plan's microbatching. Measured: tokens/s, peak memory, saved activations; the gradient check
against eager fp32; predicted next to measured.

``corners`` (the coupling study's measured mode): GPT-2 124M at ``CORNER_BATCH`` sequences under compiled
(greedy fusion through Inductor, constrained to the plan's groups) or eager kernels x
recomputation none, full, selective and planned (the planner's recompute set for those kernels
under a budget of 75% of the unrecomputed plan's peak: ``search.joint.optimise_remat``), all bf16,
one microbatch, measured against predicted.

Each run is ``coplan run``'s path (``coplan.apply.run.run_plan``) with ``--steps STEPS``.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from typing import Any

HERE = Path(__file__).parent
sys.path.insert(0, str(HERE))  # gpu_all, beside this file
PLANS = HERE / "data" / "gpu"
MODEL, CLUSTER = "gpt2-124m", "dgx-h100"
BATCH, SEQ, STEPS = 128, 1024, 6
CORNER_BATCH = 16
RECOMPUTE = ("none", "full", "selective", "planned")


def _ctx(batch: int, device: str = "cuda") -> Any:
    from coplan.apply.predict import make_context, run_cluster
    from coplan.hardware import load_cluster
    from coplan.models.spec import load_model_spec

    return make_context(
        load_model_spec(MODEL), run_cluster(load_cluster(CLUSTER), 1, device), batch, SEQ, device
    )


def write_plans() -> None:
    """The plans the GPU runs apply, planned here (OR-Tools is not on the GPU machine)."""
    from coplan.apply.predict import megatron_recompute, plan_for
    from coplan.plan.types import RematPlan
    from coplan.search import Options, run_strategy
    from coplan.search.joint import optimise_remat
    from coplan.search.space import SearchSpace, fusion_option

    PLANS.mkdir(parents=True, exist_ok=True)
    ctx = _ctx(BATCH)
    joint = run_strategy("joint", ctx, Options(space=SearchSpace(dtypes=("bf16",)))).plan
    (PLANS / "joint.json").write_text(joint.to_json() + "\n")
    # the same search without GEMM epilogues: what the default Inductor (cuBLAS GEMMs) can honour
    space = SearchSpace(dtypes=("bf16",), fusion=("greedy",))
    (PLANS / "joint_greedy.json").write_text(
        run_strategy("joint", _ctx(BATCH), Options(space=space)).plan.to_json() + "\n"
    )
    ctx = _ctx(CORNER_BATCH)
    base = plan_for(ctx, compute="bf16", microbatch=CORNER_BATCH)
    budget = 0.75 * ctx.price(base).memory.peak_bytes
    for fusion in ("eager", "greedy"):
        fused = base.with_(fusion=fusion_option(ctx, fusion))
        for mode in RECOMPUTE:
            if mode == "planned":  # the planner's recompute set for these kernels and batch
                ctx.budget_bytes = budget
                plan = optimise_remat(fused, ctx)
                ctx.budget_bytes = None
            else:
                plan = fused.with_(remat=RematPlan(recompute=megatron_recompute(ctx, mode)))
            (PLANS / f"corner_{fusion}_{mode}.json").write_text(plan.to_json() + "\n")
    print(f"plans -> {PLANS}")


def _run(plan_file: Path, batch: int, mode: str = "plan") -> dict[str, Any]:
    from coplan.apply.run import RunRequest, run_plan
    from coplan.hardware import load_cluster
    from coplan.models.spec import load_model_spec
    from coplan.plan.types import Plan

    plan = Plan.load(str(plan_file))
    req = RunRequest(
        plan=plan,
        spec=load_model_spec(MODEL),
        steps=STEPS,
        nproc=1,
        global_batch=batch,
        seq=SEQ,
        cluster=load_cluster(CLUSTER),
        device="cuda",
        mode=mode,
    )
    t0 = time.perf_counter()
    try:
        out = run_plan(req)
    except Exception as e:  # an out-of-memory baseline is a result, not a crash of the benchmark
        import torch

        torch.cuda.empty_cache()
        return {"plan": plan_file.name, "mode": mode, "error": f"{type(e).__name__}: {str(e)[:300]}"}
    out["wall_s"] = time.perf_counter() - t0
    out["plan"] = plan_file.name
    out["kernels"] = plan.fusion.label if mode == "plan" else {"compile": "Inductor defaults"}.get(mode, mode)
    out["tokens_per_s"] = batch * SEQ / out["measured"]["step_time_s"]
    out["predicted_tokens_per_s"] = batch * SEQ / out["predicted"]["step_time_s"]
    print(
        f"{plan_file.name} {mode}: {out['measured']['step_time_s'] * 1e3:.1f} ms "
        f"(pred {out['predicted']['step_time_s'] * 1e3:.1f}), {out['tokens_per_s']:,.0f} tok/s, "
        f"peak {out['measured']['peak_bytes'] / 2**30:.1f} GiB, grad {out['grad_check']}, "
        f"fusion {out['fusion']}, {out['wall_s']:.0f} s",
        flush=True,
    )
    return out


APPLY_CASES = (("joint", "plan"), ("joint_greedy", "plan"), ("joint", "compile"), ("joint", "eager"))


def run_part(part: str, out_dir: Path, case: int | None = None) -> None:
    out_dir.mkdir(parents=True, exist_ok=True)
    rows = []
    if part == "apply":
        for i, (plan, mode) in enumerate(APPLY_CASES):
            if case is not None and i != case:
                continue
            rows.append(_run(PLANS / f"{plan}.json", BATCH, mode))
            name = "gpu_apply.json" if case is None else f"gpu_apply_{i}.json"
            (out_dir / name).write_text(json.dumps(rows, indent=1, default=str))
    elif part == "corners":
        for fusion in ("greedy", "eager"):
            for rec in RECOMPUTE:
                rows.append(_run(PLANS / f"corner_{fusion}_{rec}.json", CORNER_BATCH))
                (out_dir / "gpu_corners.json").write_text(json.dumps(rows, indent=1, default=str))


def table(src: Path) -> None:
    for name in ("gpu_apply", "gpu_corners"):
        files = sorted(src.glob(f"{name}*.json"))
        if not files:
            continue
        rows = [r for f in files for r in json.loads(f.read_text())]
        print(f"\n{name}\n")
        print(
            "| run | kernels | recompute | step ms meas | step ms pred | tokens/s | peak GiB meas "
            "| peak GiB pred | saved GiB meas | saved GiB pred | grad err (tol) | groups honoured |"
        )
        print("|---|---|---|---:|---:|---:|---:|---:|---:|---:|---|---|")
        for r in rows:
            if "error" in r:
                print(f"| {r['plan']} {r['mode']} | failed: {r['error'][:80]} |")
                continue
            m, p, g, run = r["measured"], r["predicted"], r["grad_check"], r["run"]
            label = run["mode"] if run["mode"] != "plan" else r["plan"].removesuffix(".json")
            r.setdefault("kernels", "")
            print(
                f"| {label} | {r.get('kernels', '')} | {len(run['recomputed'])} "
                f"| {m['step_time_s'] * 1e3:.1f} | {p['step_time_s'] * 1e3:.1f} | {r['tokens_per_s']:,.0f} "
                f"| {m['peak_bytes'] / 2**30:.2f} | {p['peak_bytes'] / 2**30:.2f} "
                f"| {m['saved_activation_bytes'] / 2**30:.2f} | {p['saved_activation_bytes'] / 2**30:.2f} "
                f"| {g['max_rel_err']:.1e} ({g['tolerance']:.0e}) | {r['fusion']['groups_honoured']}"
                f"/{r['fusion']['groups_planned']} |"
            )
        if rows and "run" in rows[0]:
            print(f"\ndevice: {rows[0]['run'].get('device_name')}")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("part", choices=("plans", "apply", "corners", "table", "all", "all-plans", "all-table"))
    ap.add_argument("src", nargs="?", default=".")
    ap.add_argument("--out", default=".")
    ap.add_argument("--case", type=int, default=None, help="apply: run only this case (a process each)")
    ap.add_argument("--device", choices=("cuda", "cpu"), default="cuda", help="all: where to run")
    ap.add_argument("--model", action="append", help="all: this model only (repeatable) [default: all]")
    ap.add_argument("--steps", type=int, default=STEPS, help="all: steps per run")
    ap.add_argument("--batches", default="tight,loose", help="all: which batches (tight, loose)")
    ap.add_argument("--runs", default=None, help="all: these runs only, comma-separated [default: all five]")
    ap.add_argument("--plans", default=None, help="all: the plans' folder [default: benchmarks/data/gpu/all]")
    ap.add_argument(
        "--profile",
        default=None,
        help="all: a profile `coplan calibrate` fitted here, to price each run again",
    )
    args = ap.parse_args(argv)
    if args.part.startswith("all"):
        import gpu_all

        models = args.model or gpu_all.DEFAULT[args.device]
        unknown = [m for m in models if m not in gpu_all.MODELS[args.device]]
        if unknown:
            ap.error(
                f"--model {unknown[0]}: not one of {', '.join(gpu_all.MODELS[args.device])} on {args.device}"
            )
        plan_dir = Path(args.plans) if args.plans else gpu_all.PLAN_DIR
        if args.part == "all-plans":
            gpu_all.write_plans(models, args.device, plan_dir)
        elif args.part == "all-table":
            print(gpu_all.table(json.loads(Path(args.src).read_text())))
        else:
            kinds = tuple(k for k in args.batches.split(",") if k)
            only = tuple(args.runs.split(",")) if args.runs else gpu_all.RUNS
            bad = [x for x in (*kinds, *only) if x not in ("tight", "loose", *gpu_all.RUNS)]
            if bad:
                ap.error(f"unknown batch or run {bad[0]!r}")
            if args.profile and not Path(args.profile).is_file():
                ap.error(f"--profile {args.profile}: no such file")
            result = gpu_all.run_all(
                models, args.device, Path(args.out), args.steps, plan_dir, kinds, only, profile=args.profile
            )
            print(gpu_all.table(result))
        return 0
    if args.part == "plans":
        write_plans()
    elif args.part == "table":
        table(Path(args.src))
    else:
        run_part(args.part, Path(args.out), args.case)
    return 0


if __name__ == "__main__":
    sys.exit(main())
