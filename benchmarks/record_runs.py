"""Record measured training steps of a LLaMA-style model under several plans, as a user would.

    python benchmarks/record_runs.py [--out benchmarks/results/llama_runs.jsonl] [--steps 5]

For ``llama-tiny`` (RMSNorm, SwiGLU, rotary positions, grouped-query attention) on this machine's
CPU, one process, at two global batches: plans made by ``coplan plan --stack coplan`` with
several strategies and memory budgets (so that they differ in kernels and recomputation), each
trained with ``coplan run --record`` (the plan's kernel groups compiled by Inductor). The records
are what ``benchmarks/costnet_measured.py`` judges the cost models against, beside the small GPT
runs of ``bench_apply.py``. The file is rewritten.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
COPLAN = [sys.executable, "-m", "coplan.cli"]
#: (global batch, strategy, memory budget in GiB or None)
PLANS = (
    (16, "joint", None),
    (16, "sequential", None),
    (16, "joint", 0.004),
    (16, "hierarchical", None),
    (32, "joint", None),
    (32, "sequential", None),
    (32, "joint", 0.008),
    (32, "learned", None),
)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results" / "llama_runs.jsonl")
    ap.add_argument("--steps", type=int, default=5)
    args = ap.parse_args()
    args.out.unlink(missing_ok=True)
    with tempfile.TemporaryDirectory() as tmp:
        for i, (batch, strategy, budget) in enumerate(PLANS):
            plan = Path(tmp) / f"plan{i}.json"
            job = ["--model", "llama-tiny", "--global-batch", str(batch), "--seq", "64"]
            cmd = [*COPLAN, "plan", *job, "--cluster", "cpu", "--gpus", "1", "--stack", "coplan"]
            cmd += ["--strategy", strategy, "--out", str(plan), "--json"]
            if budget is not None:
                cmd += ["--memory-budget-gb", str(budget)]
            got = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT)
            if got.returncode != 0:
                print(f"plan {i} ({strategy}, budget {budget}): {got.stderr.strip()}", flush=True)
                continue
            run = [*COPLAN, "run", "--model", "llama-tiny", "--plan", str(plan), "--steps", str(args.steps)]
            run += ["--record", str(args.out), "--json"]
            done = subprocess.run(run, capture_output=True, text=True, cwd=ROOT)
            if done.returncode != 0:
                print(f"run {i}: {done.stderr.strip()}", flush=True)
                continue
            res = json.loads(done.stdout)
            print(
                f"batch {batch:3d} {strategy:13s} budget {budget}: measured "
                f"{res['measured']['step_time_s'] * 1e3:7.1f} ms, predicted "
                f"{res['predicted']['step_time_s'] * 1e3:7.1f} ms",
                flush=True,
            )
    print(f"runs -> {args.out}")


if __name__ == "__main__":
    main()
