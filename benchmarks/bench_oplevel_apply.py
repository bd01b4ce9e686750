"""Op-level plans applied on this CPU: the per-op joint plan and the sequential passes' plan,
compiled by Inductor under the plan's groups (``coplan run``), measured against predicted.

    python benchmarks/bench_oplevel_apply.py [--profile PATH] [--steps N]

For a small GPT (``benchmarks/data/gpt-b.json``) and a small LLaMA (RMSNorm, SwiGLU, RoPE,
grouped-query attention; ``LLAMA`` below), at a loose budget (the machine's) and a tight one (the
peak of one sequence per microbatch with nothing recomputed, less 60% of its saved activations:
no microbatching fits it, something must be recomputed), the
planner runs ``joint`` (fusion and recomputation decided per op) and ``sequential`` (Inductor-style
greedy fusion, then the min-cut recompute pass, then precision), both for coplan's runner on a CPU,
in fp32. Each plan then trains ``--steps`` steps through ``coplan.apply`` (the path of ``coplan
run``), ``--repeats`` times in rounds over all plans (the median run is kept: this machine's speed
drifts by tens of percent over minutes), and ``torch.compile``'s defaults (``--mode compile``,
joint's layout, nothing recomputed) run beside them as the reference.
Each row: measured and predicted step time, saved activation bytes measured and predicted, the
planned kernel groups Inductor honoured (and the ones it did not, with its reason), and the
decisions counted per block.

The cost model prices with the CPU profile ``--profile`` (default
``benchmarks/results/cpu_profile.json``, fitted by ``coplan calibrate --device cpu``). Results go to
``benchmarks/results/oplevel_apply.json``; a markdown table is printed.
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import torch

from coplan.apply.predict import make_context, plan_for
from coplan.apply.run import RunRequest, run_plan
from coplan.hardware import load_cluster
from coplan.models.spec import ModelSpec
from coplan.plan.decisions import block_decisions
from coplan.search import Options, run_strategy
from coplan.search.space import SearchSpace

HERE = Path(__file__).parent
RESULTS = HERE / "results"
GPT = ModelSpec(**json.loads((HERE / "data" / "gpt-b.json").read_text()))
LLAMA = ModelSpec(
    name="llama-b",
    n_layers=4,
    d_model=256,
    n_heads=4,
    n_kv_heads=2,
    ffn_hidden=688,
    vocab_size=4096,
    seq_len=256,
    norm="rmsnorm",
    activation="swiglu",
    position="rope",
    bias=False,
    tied_embeddings=False,
)
BATCH, SEQ = 8, 128
#: the share of the loose plan's saved activations the tight budget takes away
TIGHTEN = 0.6
#: fp32, no ZeRO (one process): the decisions left are fusion and recomputation, per op
SPACE = SearchSpace(dtypes=("fp32",), zero=(0,), per_op=True)


def plan(spec: ModelSpec, profile: str, strategy: str, budget: float | None) -> tuple[Any, Any, float]:
    ctx = make_context(spec, load_cluster(profile), BATCH, SEQ)
    ctx.dtypes = ("fp32",)  # every strategy, its passes included (``plan --dtypes fp32``)
    if budget is not None:
        ctx.budget_bytes = budget
    t0 = time.perf_counter()
    res = run_strategy(strategy, ctx, Options(space=SPACE))
    return ctx, res, time.perf_counter() - t0


def planned(spec: ModelSpec, profile: str, strategy: str, budget: float | None) -> dict[str, Any]:
    """One strategy's plan for the job, with what was decided (a row before it is measured)."""
    chosen = "joint" if strategy == "torch.compile" else strategy  # the reference: joint's layout
    ctx, res, took = plan(spec, profile, chosen, budget)
    if res.plan is None or not res.fits:
        return {"model": spec.name, "strategy": strategy, "fits": False, "budget_bytes": ctx.budget}
    baseline = strategy == "torch.compile"
    return {
        "model": spec.name,
        "strategy": strategy,
        "fits": True,
        "budget_bytes": ctx.budget,
        "plan_time_s": took,
        "layout": res.plan.parallel.describe(),
        "fusion_label": "torch.compile" if baseline else res.plan.fusion.label,
        "recomputed": [] if baseline else sorted(res.plan.remat.recompute),
        "decisions": {"kernels": "-", "fused_edges": "-", "recomputed": 0}
        if baseline
        else block_decisions(res.plan, ctx.index.graph),
        "planned_peak_bytes": ctx.price(res.plan).memory.peak_bytes,
        "_plan": res.plan,
        "_mode": "compile" if baseline else "plan",
        "runs": [],
    }


def measure(r: dict[str, Any], spec: ModelSpec, profile: str, steps: int) -> None:
    """Train ``r``'s plan once and add the run to it."""
    req = RunRequest(
        plan=r["_plan"],
        spec=spec,
        steps=steps,
        nproc=1,
        global_batch=BATCH,
        seq=SEQ,
        cluster=load_cluster(profile),
        mode=r["_mode"],
    )
    out = run_plan(req)
    f = out["fusion"]
    r["runs"].append(out["measured"])
    r["predicted"] = out["predicted"]
    r["groups_planned"] = f.get("groups_planned", 0)
    r["groups_honoured"] = f.get("groups_honoured", 0)
    r["not_honoured"] = f.get("not_honoured", [])
    r["grad_check"] = out["grad_check"]


def summarise(r: dict[str, Any]) -> None:
    """The median run of ``r`` as its measurement, and the errors of the prediction against it."""
    r.pop("_plan", None)
    r.pop("_mode", None)
    if not r["fits"]:
        return
    times = sorted(m["step_time_s"] for m in r["runs"])
    m = dict(r["runs"][0])
    m["step_time_s"] = statistics.median(times)
    r["measured"], p = m, r["predicted"]
    r["step_error"] = p["step_time_s"] / m["step_time_s"] - 1
    saved = m["saved_activation_bytes"]
    r["saved_error"] = p["saved_activation_bytes"] / saved - 1 if saved else None


def tight_budget(spec: ModelSpec, profile: str) -> float:
    """The peak of one sequence per microbatch with nothing recomputed, less ``TIGHTEN`` of its
    saved activations: no microbatch is small enough, so something must be recomputed."""
    ctx = make_context(spec, load_cluster(profile), BATCH, SEQ)
    est = ctx.price(plan_for(ctx, compute="fp32", microbatch=1))
    saved = max(st.memory.activations_bytes for st in est.stages)
    return est.memory.peak_bytes - TIGHTEN * saved


def table(rows: list[dict[str, Any]]) -> str:
    head = (
        "| model | budget | strategy | kernels / fused edges / recomputed (block) | step ms measured | "
        "predicted | saved MiB measured / predicted | groups honoured |\n|---|---|---|---|---:|---:|---|---|"
    )
    out = [head]
    for r in rows:
        if not r["fits"]:
            out.append(f"| {r['model']} | {r['budget']} | {r['strategy']} | does not fit | | | | |")
            continue
        d = r["decisions"]
        m, p = r["measured"], r["predicted"]
        out.append(
            f"| {r['model']} | {r['budget']} | {r['strategy']} | {d['kernels']} / {d['fused_edges']} / "
            f"{d['recomputed']} | {1e3 * m['step_time_s']:.1f} | {1e3 * p['step_time_s']:.1f} | "
            f"{m['saved_activation_bytes'] / 2**20:.1f} / {p['saved_activation_bytes'] / 2**20:.1f} | "
            f"{r['groups_honoured']}/{r['groups_planned']} |"
        )
    return "\n".join(out)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--profile", default=str(RESULTS / "cpu_profile.json"))
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--repeats", type=int, default=3, help="runs of each plan, in rounds (median kept)")
    ap.add_argument("--out", default=str(RESULTS / "oplevel_apply.json"))
    args = ap.parse_args(argv)
    torch.set_num_threads(2)
    rows: list[dict[str, Any]] = []
    t0 = time.perf_counter()
    specs = {s.name: s for s in (GPT, LLAMA)}
    for spec in specs.values():
        for label, budget in (("loose", None), ("tight", tight_budget(spec, args.profile))):
            for strategy in ("joint", "sequential", "torch.compile"):
                r = planned(spec, args.profile, strategy, budget)
                r["budget"] = label
                rows.append(r)
    # rounds over every row, so the machine's drift over minutes reaches every plan alike
    for k in range(args.repeats):
        for r in rows:
            if r["fits"]:
                measure(r, specs[r["model"]], args.profile, args.steps)
                print(f"round {k + 1}: {r['model']} {r['budget']} {r['strategy']}", file=sys.stderr)
    for r in rows:
        summarise(r)
    ours = [r for r in rows if r["fits"] and r["strategy"] != "torch.compile"]
    n_planned = sum(r["groups_planned"] for r in ours)
    n_honoured = sum(r["groups_honoured"] for r in ours)
    summary = {
        "groups_planned": n_planned,
        "groups_honoured": n_honoured,
        "honoured_share": n_honoured / n_planned if n_planned else None,
        "repeats": args.repeats,
        "steps": args.steps,
        "wall_s": time.perf_counter() - t0,
        "machine": platform.processor() or platform.machine(),
        "torch": torch.__version__,
        "profile": args.profile,
    }
    Path(args.out).write_text(json.dumps({"summary": summary, "rows": rows}, indent=2) + "\n")
    print(table(rows))
    print(json.dumps(summary, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
