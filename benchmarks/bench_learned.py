"""Planning time and plan quality of the learned strategies against joint on the planner's two
timing targets (``bench_planner.py``): GPT-2 124M on one H100 and LLaMA-2 70B on 1,024 H100s,
planned for the default ``megatron`` stack and for ``coplan``'s own runner.

    python benchmarks/bench_learned.py [--policy FILE] [--out benchmarks/results/learned_speed.json]

Each strategy runs on a fresh planning context, as ``coplan plan`` runs it (joint with its warm
starts, sequential and hierarchical, timed apart); times are wall-clock seconds of the strategy
alone, imports, policy loading and context construction excluded; step times are the analytic cost
model's.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import coplan.learn.strategy  # noqa: E402,F401  (registers the learned strategies)
from coplan.cost import CostModel, load_stack  # noqa: E402
from coplan.hardware import load_cluster  # noqa: E402
from coplan.models.spec import PRESETS  # noqa: E402
from coplan.plan import PlanContext  # noqa: E402
from coplan.search import Options, run_strategy  # noqa: E402

JOBS = (("gpt2-124m", 1, 32, 1024), ("llama2-70b", 1024, 1024, 4096))


def _ctx(model: str, gpus: int, batch: int, seq: int, stack: str) -> PlanContext:
    ctx = PlanContext(
        CostModel(spec=PRESETS[model]), load_cluster("dgx-h100", gpus), batch, seq, stack=load_stack(stack)
    )
    _ = ctx.index  # the context's own set-up, not planning
    return ctx


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--policy", type=Path, default=None)
    ap.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results" / "learned_speed.json")
    args = ap.parse_args()
    torch.set_num_threads(1)
    from coplan.learn.decode import default_policy

    default_policy(args.policy)  # imports (PyTorch Geometric) and loading excluded, as for joint
    rows = []
    for model, gpus, batch, seq in JOBS:
        for stack in ("megatron", "coplan"):
            row: dict[str, object] = {
                "model": model,
                "gpus": gpus,
                "batch": batch,
                "seq": seq,
                "stack": stack,
            }
            for name in ("learned-greedy", "learned", "learned-search", "joint"):
                ctx = _ctx(model, gpus, batch, seq, stack)
                warm = []
                t_warm = 0.0
                if name == "joint":
                    for w in ("sequential", "hierarchical"):
                        t0 = time.perf_counter()
                        warm.append(run_strategy(w, ctx).plan)
                        t_warm += time.perf_counter() - t0
                r = run_strategy(name, ctx, Options(warm=warm, policy=args.policy))
                row[name] = {
                    "plan_time_s": r.plan_time_s,
                    "warm_start_s": t_warm,
                    "step_time_s": r.step_time_s,
                    "fits": r.fits,
                    "notes": list(r.notes),
                }
                print(
                    f"{model} x{gpus} {stack:8s} {name:14s} {r.plan_time_s:7.2f} s  "
                    f"{r.step_time_s * 1e3:9.1f} ms  fits={r.fits}",
                    flush=True,
                )
            j = row["joint"]
            for name in ("learned-greedy", "learned", "learned-search"):
                mine = row[name]
                assert isinstance(mine, dict) and isinstance(j, dict)
                mine["speedup_vs_joint"] = (j["plan_time_s"] + j["warm_start_s"]) / mine["plan_time_s"]
                mine["step_vs_joint"] = mine["step_time_s"] / j["step_time_s"]
            rows.append(row)
    args.out.write_text(json.dumps({"jobs": rows}, indent=1) + "\n")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
