"""``coplan inspect`` on real models: wall time, what it found, and whether two runs agree.

    python benchmarks/bench_inspect.py [--out benchmarks/results/inspect.json]

Each case runs ``coplan inspect --json`` twice as a fresh process, as a user would: first with an
empty Inductor cache folder (every kernel compiled by the C++ compiler), then again with that
folder warm. Reported per run: wall-clock seconds of the whole command (Python start, import,
compile, one warm-up and three timed steps), the compile's own seconds, kernels, fallbacks, unfused
patterns, predicted and measured step time, and whether the two runs' fingerprints are equal (they
must be: same program, same compiler). Prints the Markdown table of docs/inspect.md.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
CASES = [
    ("GPT-2 124M", "gpt2-124m"),
    ("LLaMA-style 124M (RMSNorm, SwiGLU, RoPE, GQA)", str(ROOT / "benchmarks/data/llama-style-124m.json")),
]


def _inspect(model: str, db: Path, cache: Path) -> tuple[float, dict]:
    env = {**os.environ, "TORCHINDUCTOR_CACHE_DIR": str(cache)}
    t0 = time.perf_counter()
    done = subprocess.run(
        [sys.executable, "-m", "coplan.cli", "inspect", "--model", model, "--json", "--db", str(db)],
        capture_output=True,
        text=True,
        env=env,
        check=False,
    )
    wall = time.perf_counter() - t0
    if done.returncode != 0:
        raise SystemExit(f"coplan inspect --model {model} failed: {done.stderr.strip()}")
    return wall, json.loads(done.stdout)


def _row(label: str, run: str, wall: float, rec: dict) -> dict:
    top = rec["unfused"][0] if rec["unfused"] else None
    return {
        "case": label,
        "run": run,
        "wall_s": round(wall, 1),
        "compile_s": round(rec["compile_s"], 1),
        "kernels": rec["kernels"],
        "graph_breaks": len(rec["graph_breaks"]),
        "fallbacks": sum(f["count"] for f in rec["fallbacks"]),
        "unfused_patterns": len(rec["unfused"]),
        "unfused_instances": sum(u["count"] for u in rec["unfused"]),
        "unfused_saving_s": sum(u["predicted_saving_s"] for u in rec["unfused"]),
        "costliest_unfused": None if top is None else f"{' -> '.join(top['ops'])} ({top['graph']})",
        "predicted_step_s": rec["predicted_step_s"],
        "measured_step_s": rec["measured"]["step_s"] if rec["measured"] else None,
        "fingerprint": rec["fingerprint"],
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, default=ROOT / "benchmarks/results/inspect.json")
    args = ap.parse_args()
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for label, model in CASES:
            cache = Path(tmp) / f"cache-{len(rows)}"
            db = Path(tmp) / "history.sqlite"
            for run in ("cold cache", "warm cache"):
                wall, rec = _inspect(model, db, cache)
                rows.append(_row(label, run, wall, rec))
                print(f"{label}, {run}: {wall:.1f} s", file=sys.stderr)
            rows[-1]["same_fingerprint_as_cold"] = rows[-1]["fingerprint"] == rows[-2]["fingerprint"]
    import torch

    result = {
        "machine": f"{platform.machine()}, {os.cpu_count()} cores, torch {torch.__version__}",
        "rows": rows,
    }
    args.out.write_text(json.dumps(result, indent=1) + "\n")
    print(
        "| case | Inductor cache | wall s | compile s | kernels | fallbacks | unfused (patterns / instances) "
        "| predicted step | measured step |"
    )
    print("|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        measured = "-" if r["measured_step_s"] is None else f"{r['measured_step_s'] * 1e3:.0f} ms"
        print(
            f"| {r['case']} | {r['run']} | {r['wall_s']} | {r['compile_s']} | {r['kernels']} "
            f"| {r['fallbacks']} "
            f"| {r['unfused_patterns']} / {r['unfused_instances']} | {r['predicted_step_s'] * 1e3:.0f} ms "
            f"| {measured} |"
        )


if __name__ == "__main__":
    main()
