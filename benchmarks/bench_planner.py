"""Planner quality and speed: joint planning against the pass-at-a-time baselines.

    python benchmarks/bench_planner.py [--quick] [--out benchmarks/results/planner.json]

For each scenario (a model preset, a cluster preset, a GPU count, global batch x sequence length
and a memory budget) every strategy is run on one planning context, as ``coplan compare`` does:
sequential, sequential-best, iterated, hierarchical, then joint warm-started from the others'
plans. Reported per scenario: each strategy's step time and whether it fits the budget, the gain
of joint over sequential, sequential-best and iterated (step_other / step_joint, the ratio of
throughputs; only when both plans fit), and joint's planning time.

Budgets: "loose" is the default (capacity x 0.95 - 1 GiB); "tight" is ``TIGHT_FRACTION`` of the
smallest device's capacity, which forces recomputation, sharding or infeasibility.

Also measured, each on a fresh context: the two planning-time targets, run as ``coplan plan``
runs joint (sequential + hierarchical as warm starts, then joint):
GPT-2 124M on 1 H100, and LLaMA-2 70B on 1,024 H100s.

Any scenario where joint is slower than another strategy (or another fits and joint does not) is
listed as an anomaly: that would be a planner bug.
"""

from __future__ import annotations

import argparse
import json
import platform
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from coplan.cli.plan_cmd import make_context, run_all
from coplan.hardware import load_cluster
from coplan.plan import GiB

STRATEGIES = ["sequential", "sequential-best", "iterated", "hierarchical", "joint"]
BASELINES = ["sequential", "sequential-best", "iterated"]
TIGHT_FRACTION = 0.5
#: joint may be slower than a baseline by at most this relative margin before it is flagged
SLOWER_TOL = 1e-9
DEFAULT_OUT = Path(__file__).parent / "results" / "planner.json"


@dataclass(frozen=True)
class Scenario:
    model: str
    cluster: str
    gpus: int
    global_batch: int
    seq: int
    budget: str  # "loose" | "tight"

    @property
    def label(self) -> str:
        return f"{self.model} {self.cluster} x{self.gpus} b{self.global_batch}x{self.seq} {self.budget}"


S = Scenario
FULL: list[Scenario] = [
    S("gpt2-124m", "dgx-h100", 1, 32, 1024, "loose"),
    S("gpt2-124m", "dgx-h100", 1, 32, 1024, "tight"),
    S("gpt2-124m", "dgx-a100-40gb", 8, 64, 1024, "loose"),
    S("gpt2-124m", "l4-node", 1, 64, 1024, "tight"),
    S("gpt2-1.5b", "dgx-a100-40gb", 1, 16, 1024, "loose"),
    S("gpt2-1.5b", "dgx-a100-40gb", 1, 16, 1024, "tight"),
    S("gpt2-1.5b", "l4-node", 8, 64, 1024, "loose"),
    S("llama2-7b", "dgx-a100-40gb", 1, 8, 2048, "loose"),
    S("llama2-7b", "dgx-h100", 8, 64, 4096, "loose"),
    S("llama2-7b", "dgx-h100", 8, 64, 4096, "tight"),
    S("llama2-7b", "dgx-a100-80gb", 16, 128, 4096, "loose"),
    S("llama2-7b", "mi300x-node", 8, 64, 4096, "loose"),
    S("llama2-13b", "dgx-a100-80gb", 32, 256, 4096, "loose"),
    S("llama2-13b", "dgx-a100-40gb", 64, 256, 4096, "tight"),
    S("llama2-13b", "dgx-h200", 16, 128, 4096, "loose"),
    S("llama2-70b", "dgx-h100", 64, 256, 4096, "loose"),
    S("llama2-70b", "dgx-h100", 64, 256, 4096, "tight"),
    S("llama2-70b", "dgx-a100-80gb", 256, 512, 4096, "loose"),
    S("llama2-70b", "dgx-h100", 1024, 1024, 4096, "loose"),
    S("llama3-70b", "dgx-h100", 512, 1024, 4096, "loose"),
    S("llama3-70b", "dgx-b200", 256, 512, 4096, "tight"),
    S("gpt3-175b", "dgx-a100-80gb", 1024, 1536, 2048, "loose"),
    S("gpt3-175b", "dgx-h100", 512, 1024, 2048, "tight"),
    S("gpt3-175b", "dgx-a100-40gb", 8, 8, 2048, "loose"),
]
QUICK: list[Scenario] = [FULL[i] for i in (0, 5, 7, 9, 12)]

TARGETS: list[tuple[str, Scenario]] = [
    ("gpt2-124m on 1 H100", S("gpt2-124m", "dgx-h100", 1, 32, 1024, "loose")),
    ("llama2-70b on 1,024 H100", S("llama2-70b", "dgx-h100", 1024, 1024, 4096, "loose")),
]


def budget_gb(sc: Scenario) -> float | None:
    if sc.budget == "loose":
        return None
    cluster = load_cluster(sc.cluster, sc.gpus)
    cap = min(d.memory_bytes for d in cluster.devices)
    return TIGHT_FRACTION * cap / GiB


def run_scenario(sc: Scenario) -> dict[str, Any]:
    start = time.perf_counter()
    gb = budget_gb(sc)
    ctx = make_context(sc.model, sc.cluster, sc.gpus, sc.global_batch, sc.seq, gb, 0.0)
    results = run_all(ctx, STRATEGIES, None)
    wall = time.perf_counter() - start
    strategies = {
        name: {
            "step_time_s": r.step_time_s,
            "fits": r.fits,
            "plan_time_s": r.plan_time_s,
            "peak_bytes": r.estimate.memory.peak_bytes,
            "evaluations": r.evaluations,
            "parallel": r.plan.parallel.describe(),
            "recomputed_tensors": len(r.plan.remat.all_names),
            "compute_dtype": str(r.plan.precision.compute),
        }
        for name, r in results.items()
    }
    joint = strategies["joint"]
    gains: dict[str, float | None] = {}
    for base in BASELINES:
        b = strategies[base]
        gains[base] = b["step_time_s"] / joint["step_time_s"] if b["fits"] and joint["fits"] else None
    anomalies = []
    for name, s in strategies.items():
        if name == "joint" or not s["fits"]:
            continue
        if not joint["fits"]:
            anomalies.append(f"{name} fits but joint does not")
        elif joint["step_time_s"] > s["step_time_s"] * (1 + SLOWER_TOL):
            anomalies.append(
                f"joint {joint['step_time_s'] * 1e3:.3f} ms slower than "
                f"{name} {s['step_time_s'] * 1e3:.3f} ms"
            )
    return {
        "scenario": sc.__dict__ | {"label": sc.label},
        "budget_bytes": ctx.budget,
        "feasible": any(s["fits"] for s in strategies.values()),
        "strategies": strategies,
        "gain_of_joint_over": gains,
        "joint_plan_time_s": joint["plan_time_s"],
        "wall_s": wall,
        "anomalies": anomalies,
    }


def run_target(name: str, sc: Scenario) -> dict[str, Any]:
    """As ``coplan plan --strategy joint`` runs it: sequential and hierarchical warm starts, then joint."""
    start = time.perf_counter()
    ctx = make_context(sc.model, sc.cluster, sc.gpus, sc.global_batch, sc.seq, budget_gb(sc), 0.0)
    results = run_all(ctx, ["sequential", "hierarchical", "joint"], None)
    wall = time.perf_counter() - start
    r = results["joint"]
    return {
        "target": name,
        "scenario": sc.__dict__ | {"label": sc.label},
        "joint_plan_time_s": r.plan_time_s,
        "warm_start_plan_time_s": {n: results[n].plan_time_s for n in ("sequential", "hierarchical")},
        "wall_s_with_context_and_warm_starts": wall,
        "joint_step_time_s": r.step_time_s,
        "joint_fits": r.fits,
        "joint_parallel": r.plan.parallel.describe(),
    }


def _ms(s: dict[str, Any]) -> str:
    return f"{s['step_time_s'] * 1e3:.1f}" + ("" if s["fits"] else "*")


def _gain(g: float | None) -> str:
    return "-" if g is None else f"{g:.2f}x"


def markdown(rows: list[dict[str, Any]]) -> str:
    head = (
        "| # | model | cluster | GPUs | batch x seq | budget GiB | seq ms | seq-best ms | iter ms | hier ms "
        "| joint ms | joint vs seq | vs seq-best | vs iter | joint plan s | joint parallel |"
    )
    lines = [head, "|" + "---|" * (head.count("|") - 1)]
    for i, row in enumerate(rows, 1):
        sc = row["scenario"]
        budget = f"{row['budget_bytes'] / GiB:.1f} ({sc['budget']})"
        if "error" in row:
            lines.append(
                f"| {i} | {sc['model']} | {sc['cluster']} | {sc['gpus']} | {sc['global_batch']}x{sc['seq']} "
                f"| {budget} | error: {row['error']} |" + " |" * 9
            )
            continue
        st = row["strategies"]
        g = row["gain_of_joint_over"]
        least = min(v["peak_bytes"] for v in st.values()) / GiB
        par = st["joint"]["parallel"] if row["feasible"] else f"infeasible (least peak {least:.1f} GiB)"
        lines.append(
            f"| {i} | {sc['model']} | {sc['cluster']} | {sc['gpus']} | {sc['global_batch']}x{sc['seq']} "
            f"| {budget} | "
            + " | ".join(_ms(st[n]) for n in STRATEGIES)
            + f" | {_gain(g['sequential'])} | {_gain(g['sequential-best'])} | {_gain(g['iterated'])} "
            f"| {row['joint_plan_time_s']:.2f} | {par} |"
        )
    lines.append("")
    lines.append(
        "`*` the plan does not fit the budget; gains only where both plans fit (step_other / step_joint)."
    )
    return "\n".join(lines)


def _commit() -> str | None:
    try:
        out = subprocess.run(
            ["git", "rev-parse", "HEAD"],
            capture_output=True,
            text=True,
            check=True,
            cwd=Path(__file__).parent,
        )
    except (OSError, subprocess.CalledProcessError):
        return None
    return out.stdout.strip()


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help=f"run {len(QUICK)} scenarios instead of {len(FULL)}")
    ap.add_argument("--out", type=Path, default=DEFAULT_OUT, help="JSON results file")
    ap.add_argument("--no-targets", action="store_true", help="skip the planning-time targets")
    args = ap.parse_args(argv)

    t0 = time.perf_counter()
    targets = []
    if not args.no_targets:
        for name, sc in TARGETS:
            t = run_target(name, sc)
            targets.append(t)
            print(
                f"target {name}: joint {t['joint_plan_time_s']:.2f} s "
                f"(with warm starts and context {t['wall_s_with_context_and_warm_starts']:.2f} s)",
                file=sys.stderr,
                flush=True,
            )

    scenarios = QUICK if args.quick else FULL
    rows = []
    for i, sc in enumerate(scenarios, 1):
        try:
            row = run_scenario(sc)
        except Exception as exc:  # a failing scenario is reported, not fatal
            row = {
                "scenario": sc.__dict__ | {"label": sc.label},
                "budget_bytes": float("nan"),
                "error": f"{type(exc).__name__}: {exc}",
            }
        rows.append(row)
        print(
            f"[{i}/{len(scenarios)}] {sc.label}: {row.get('wall_s', 0.0):.1f} s", file=sys.stderr, flush=True
        )
    total = time.perf_counter() - t0

    print(markdown(rows))
    print()
    for t in targets:
        print(
            f"- planning-time target, {t['target']}: joint {t['joint_plan_time_s']:.2f} s "
            "(sequential + hierarchical + joint with context: "
            f"{t['wall_s_with_context_and_warm_starts']:.2f} s), "
            f"joint {t['joint_parallel']}, {t['joint_step_time_s'] * 1e3:.1f} ms/step, fits={t['joint_fits']}"
        )
    anomalies = [(r["scenario"]["label"], a) for r in rows for a in r.get("anomalies", [])]
    errors = [(r["scenario"]["label"], r["error"]) for r in rows if "error" in r]
    print(f"- joint slower than another strategy: {len(anomalies)} case(s)")
    for label, a in anomalies:
        print(f"  - {label}: {a}")
    for label, e in errors:
        print(f"- error in {label}: {e}")
    print(f"- total runtime {total:.1f} s")

    args.out.parent.mkdir(parents=True, exist_ok=True)
    doc = {
        "meta": {
            "quick": args.quick,
            "total_runtime_s": total,
            "tight_fraction_of_capacity": TIGHT_FRACTION,
            "python": platform.python_version(),
            "machine": platform.platform(),
            "commit": _commit(),
            "time": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        },
        "targets": targets,
        "scenarios": rows,
        "anomalies": [{"scenario": label, "anomaly": a} for label, a in anomalies],
    }
    args.out.write_text(json.dumps(doc, indent=2) + "\n")
    print(f"wrote {args.out}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
