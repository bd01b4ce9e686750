"""Op-level plans applied on this CPU: the per-op joint plan and the sequential passes' plan,
compiled by Inductor under the plan's groups (``coplan run``), measured against predicted.

    python benchmarks/bench_oplevel_apply.py [--profile PATH] [--steps N]

For a small GPT (``benchmarks/data/gpt-b.json``) and a small LLaMA (RMSNorm, SwiGLU, RoPE,
grouped-query attention; ``LLAMA`` below), at a loose budget (the machine's) and a tight one (the
loose joint plan's peak less 60% of its saved activations, so something must be recomputed), the
planner runs ``joint`` (fusion and recomputation decided per op) and ``sequential`` (Inductor-style
greedy fusion, then the min-cut recompute pass, then precision), both for coplan's runner on a CPU,
in fp32. Each plan then trains ``--steps`` steps through ``coplan.apply`` (the path of ``coplan
run``), and ``torch.compile``'s defaults (``--mode compile``) run beside them as the reference.
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
import sys
import time
from pathlib import Path
from typing import Any

import torch

from coplan.apply.predict import make_context
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
    if budget is not None:
        ctx.budget_bytes = budget
    t0 = time.perf_counter()
    res = run_strategy(strategy, ctx, Options(space=SPACE))
    return ctx, res, time.perf_counter() - t0


def row(
    spec: ModelSpec, profile: str, strategy: str, budget: float | None, steps: int, mode: str = "plan"
) -> dict[str, Any]:
    ctx, res, took = plan(spec, profile, strategy, budget)
    if res.plan is None or not res.fits:
        return {"model": spec.name, "strategy": strategy, "fits": False, "budget_bytes": ctx.budget}
    req = RunRequest(
        plan=res.plan,
        spec=spec,
        steps=steps,
        nproc=1,
        global_batch=BATCH,
        seq=SEQ,
        cluster=load_cluster(profile),
        mode=mode,
    )
    out = run_plan(req)
    m, p, f = out["measured"], out["predicted"], out["fusion"]
    est = ctx.price(res.plan)
    return {
        "model": spec.name,
        "strategy": strategy,
        "fits": True,
        "budget_bytes": ctx.budget,
        "plan_time_s": took,
        "layout": res.plan.parallel.describe(),
        "fusion_label": res.plan.fusion.label,
        "recomputed": sorted(res.plan.remat.recompute),
        "decisions": block_decisions(res.plan, ctx.index.graph),
        "predicted": p,
        "measured": m,
        "planned_peak_bytes": est.memory.peak_bytes,
        "step_error": p["step_time_s"] / m["step_time_s"] - 1,
        "saved_error": p["saved_activation_bytes"] / m["saved_activation_bytes"] - 1
        if m["saved_activation_bytes"]
        else None,
        "groups_planned": f.get("groups_planned", 0),
        "groups_honoured": f.get("groups_honoured", 0),
        "not_honoured": f.get("not_honoured", []),
        "grad_check": out["grad_check"],
    }


def tight_budget(spec: ModelSpec, profile: str) -> float:
    ctx, res, _ = plan(spec, profile, "joint", None)
    est = ctx.price(res.plan)
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
    ap.add_argument("--steps", type=int, default=6)
    ap.add_argument("--out", default=str(RESULTS / "oplevel_apply.json"))
    args = ap.parse_args(argv)
    torch.set_num_threads(2)
    rows: list[dict[str, Any]] = []
    t0 = time.perf_counter()
    for spec in (GPT, LLAMA):
        for label, budget in (("loose", None), ("tight", tight_budget(spec, args.profile))):
            for strategy in ("joint", "sequential", "torch.compile"):
                # the reference runs the joint plan's layout with torch.compile's own choices
                chosen = "joint" if strategy == "torch.compile" else strategy
                mode = "compile" if strategy == "torch.compile" else "plan"
                r = row(spec, args.profile, chosen, budget, args.steps, mode)
                r["strategy"], r["budget"] = strategy, label
                if strategy == "torch.compile" and r["fits"]:
                    r["decisions"] = {"kernels": "-", "fused_edges": "-", "recomputed": 0}
                rows.append(r)
                print(f"{spec.name} {label} {strategy}: done", file=sys.stderr)
    planned = sum(r["groups_planned"] for r in rows if r["fits"] and r["strategy"] != "torch.compile")
    honoured = sum(r["groups_honoured"] for r in rows if r["fits"] and r["strategy"] != "torch.compile")
    summary = {
        "groups_planned": planned,
        "groups_honoured": honoured,
        "honoured_share": honoured / planned if planned else None,
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
