"""Op-level planning: joint and joint-exact against the production passes, with fusion and
recomputation decided per op.

    python benchmarks/bench_oplevel.py [--quick] [--out benchmarks/results/oplevel.json]

The scenarios of ``bench_planner.py`` (GPT-2 124M to GPT-3 175B, 1 to 1,024 GPUs, A100, H100,
H200, B200, L4 and MI300X, loose and tight budgets), planned for coplan's own runner (stack
``coplan``), where the plan's kernels are compiled as grouped, so fusion is a per-op decision:
every strategy runs on one context, as ``coplan compare`` does, joint last (warm-started from the
others). Reported per scenario: each strategy's step time and whether it fits, the gain of
``joint`` and ``joint-exact`` over ``sequential``, ``sequential-best`` and ``iterated`` (ratios of
step times, only where both fit), planning times, and where joint's gain over sequential comes
from: the layout, the compute dtype, the block's kernels and recomputed tensors of each plan
(``plan.decisions``), and the step time of sequential's plan with joint's layout and precision
(the share of the gain that the per-op decisions carry on their own).

Also measured: ``joint-exact`` on one LLaMA-2 7B block under one layout (TP2 on 8 H100, bf16, a
tight budget), the planning-time target of the per-op model.
"""

from __future__ import annotations

import argparse
import json
import platform
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).parent))

from bench_planner import FULL, QUICK, Scenario, _ms, budget_gb

from coplan.cli.plan_cmd import make_context, run_all
from coplan.cost.stacks import load_stack
from coplan.plan import GiB
from coplan.plan.decisions import block_decisions

STRATEGIES = ["sequential", "sequential-best", "iterated", "joint-exact", "joint"]
BASELINES = ["sequential", "sequential-best", "iterated"]
STACK = "coplan"
DEFAULT_OUT = Path(__file__).parent / "results" / "oplevel.json"


def _gain(base: dict[str, Any], other: dict[str, Any]) -> float | None:
    return base["step_time_s"] / other["step_time_s"] if base["fits"] and other["fits"] else None


def run_scenario(sc: Scenario) -> dict[str, Any]:
    start = time.perf_counter()
    ctx = make_context(
        sc.model, sc.cluster, sc.gpus, sc.global_batch, sc.seq, budget_gb(sc), 0.0, load_stack(STACK)
    )
    results = run_all(ctx, STRATEGIES, None)
    wall = time.perf_counter() - start
    graph = ctx.index.graph
    out: dict[str, dict[str, Any]] = {}
    for name, r in results.items():
        d = block_decisions(r.plan, graph)
        out[name] = {
            "step_time_s": r.step_time_s,
            "fits": r.fits,
            "plan_time_s": r.plan_time_s,
            "peak_bytes": r.estimate.memory.peak_bytes,
            "parallel": r.plan.parallel.describe(),
            "compute_dtype": str(r.plan.precision.compute),
            "kernels": d["kernels"],
            "fused_edges": d["fused_edges"],
            "recomputed": d["recomputed"],
            "notes": list(r.notes),
        }
    seq, joint = results["sequential"], results["joint"]
    # sequential's per-op decisions under joint's layout and precision: what the layout and dtype
    # are worth alone; the rest of joint's gain is the per-op fusion and recomputation
    swapped = seq.plan.with_(parallel=joint.plan.parallel, precision=joint.plan.precision)
    try:
        est = ctx.price(swapped)
        layout_only: dict[str, Any] | None = {"step_time_s": est.step_time_s, "fits": ctx.fits(est)}
    except Exception as e:  # a layout the sequential plan's fusion cannot take: say so
        layout_only = {"error": str(e).splitlines()[0]}
    return {
        "scenario": sc.__dict__ | {"label": sc.label},
        "budget_bytes": ctx.budget,
        "feasible": any(s["fits"] for s in out.values()),
        "strategies": out,
        "gain": {who: {b: _gain(out[b], out[who]) for b in BASELINES} for who in ("joint", "joint-exact")},
        "sequential_with_joint_layout": layout_only,
        "wall_s": wall,
    }


def block_target() -> dict[str, Any]:
    from coplan.plan.types import ParallelPlan, PrecisionPlan
    from coplan.search.exact import exact_plan
    from coplan.search.space import fusion_option

    ctx = make_context("llama2-7b", "dgx-h100", 8, 64, 4096, 0.5 * 80, 0.0, load_stack(STACK))
    plan = ctx.default_plan().with_(
        parallel=ParallelPlan(tp=2, dp=4, microbatch=1, sequence_parallel=True, zero=1),
        precision=PrecisionPlan(compute="bf16"),
        fusion=fusion_option(ctx, "epilogue"),
    )
    ctx.price(plan)  # the context's profiles built first, as a search has them
    t0 = time.perf_counter()
    got = exact_plan(plan, ctx, anchors=True)
    dt = time.perf_counter() - t0
    est = ctx.price(got)
    return {
        "target": "joint-exact, one llama2-7b block under one layout (TP2 SP ZeRO-1, bf16, 8 H100, 40 GiB)",
        "plan_time_s": dt,
        "step_time_s": est.step_time_s,
        "fits": ctx.fits(est),
        "recomputed": sorted(got.remat.recompute),
        "kernels_in_block": block_decisions(got, ctx.index.graph)["kernels"],
    }


def _x(g: float | None) -> str:
    return "-" if g is None else f"{g:.3f}x"


def markdown(rows: list[dict[str, Any]]) -> str:
    head = (
        "| # | model | cluster | GPUs | budget GiB | seq ms | seq-best ms | iter ms | joint-exact ms "
        "| joint ms "
        "| joint vs seq | vs seq-best | vs iter | exact vs seq | joint plan s | seq -> joint: layout, dtype, "
        "kernels, recomputed | seq at joint's layout ms |"
    )
    lines = [head, "|" + "---|" * (head.count("|") - 1)]
    for i, row in enumerate(rows, 1):
        sc = row["scenario"]
        budget = f"{row['budget_bytes'] / GiB:.1f} ({sc['budget']})"
        if "error" in row:
            lines.append(
                f"| {i} | {sc['model']} | {sc['cluster']} | {sc['gpus']} | {budget} | error: {row['error']} |"
            )
            continue
        st = row["strategies"]
        g, ge = row["gain"]["joint"], row["gain"]["joint-exact"]
        s, j = st["sequential"], st["joint"]
        where = (
            f"{s['parallel']} -> {j['parallel']}; {s['compute_dtype']} -> {j['compute_dtype']}; "
            f"{s['kernels']} -> {j['kernels']}; {s['recomputed']} -> {j['recomputed']}"
        )
        lo = row["sequential_with_joint_layout"]
        lo_s = lo.get("error", "") if "error" in lo else _ms(lo)
        lines.append(
            f"| {i} | {sc['model']} | {sc['cluster']} | {sc['gpus']} | {budget} | "
            + " | ".join(_ms(st[n]) for n in STRATEGIES)
            + f" | {_x(g['sequential'])} | {_x(g['sequential-best'])} | {_x(g['iterated'])} "
            f"| {_x(ge['sequential'])} | {j['plan_time_s']:.1f} | {where} | {lo_s} |"
        )
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--out", type=Path, default=DEFAULT_OUT)
    args = ap.parse_args()
    start = time.perf_counter()
    commit = subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True).stdout.strip()
    target = block_target()
    todo = QUICK if args.quick else FULL
    rows: list[dict[str, Any]] = []

    def write() -> None:
        # after every scenario: a long run stopped early keeps what it measured
        doc = {
            "meta": {
                "quick": args.quick,
                "stack": STACK,
                "total_runtime_s": time.perf_counter() - start,
                "scenarios_done": len(rows),
                "scenarios_total": len(todo),
                "python": platform.python_version(),
                "machine": platform.platform(),
                "commit": commit,
                "time": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
            },
            "block_target": target,
            "scenarios": rows,
            "markdown": markdown(rows),
        }
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(doc, indent=1) + "\n")

    print(json.dumps(target, indent=1), file=sys.stderr, flush=True)
    for sc in todo:
        try:
            rows.append(run_scenario(sc))
        except Exception as e:  # an infeasible or unpriceable job is a row, not a crash
            rows.append(
                {
                    "scenario": sc.__dict__ | {"label": sc.label},
                    "error": str(e).splitlines()[0],
                    "budget_bytes": float("nan"),
                }
            )
        print(markdown(rows[-1:]).splitlines()[-1], file=sys.stderr, flush=True)
        write()
    print(markdown(rows))


if __name__ == "__main__":
    main()
