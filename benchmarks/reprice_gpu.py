"""The baselines of a recorded GPU benchmark (``bench_gpu.py all``'s ``bench_gpu.json``) priced
again by the cost model as it stands, beside what was measured and what was predicted when they ran.

    python benchmarks/reprice_gpu.py [benchmarks/results/gpu/bench_gpu.json] [--json OUT]

Each eager and ``torch.compile`` run is priced as ``coplan run --mode eager|compile`` prices it
(``coplan.apply.run.priced_request``): the run's model, batch, microbatch and sequence, on the
cluster the record names in ``priced_as``, with the AdamW form the run built (its record's
``optimizer``, or ``RAN_AS``), with no GPU needed. The plans' own runs are left out:
their plans are files made by the planner of the time, which a later planner need not reproduce. Prints
each run's step time measured, predicted then and now, its allocated peak measured and priced now,
and each model's eager / compiled step-time ratio measured and priced (the points between them).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

HERE = Path(__file__).parent
sys.path.insert(0, str(HERE))

from gpu_all import MODELS  # noqa: E402

from coplan.apply.predict import make_context, plan_for, run_cluster  # noqa: E402
from coplan.apply.run import RunRequest, priced_request  # noqa: E402
from coplan.hardware import load_cluster  # noqa: E402
from coplan.models.spec import load_model_spec  # noqa: E402

RECORD = HERE / "results" / "gpu" / "bench_gpu.json"
BASELINES = ("eager", "compile")
#: The AdamW form a model's recorded baselines built, where their records predate the runs'
#: ``optimizer`` field: GPT-2's H200 runs were made by the runner of commit 2def4a4, which built
#: every run's AdamW with ``foreach=False`` (``coplan/apply/train.py`` there), the per-parameter
#: loop; Llama 3.2 1B's, made after the runner took PyTorch's default for baselines, the
#: multi-tensor form its runner prices today.
RAN_AS = {"gpt2-124m": "for-loop"}


def reprice(record: dict[str, Any]) -> dict[str, Any]:
    """Per model: each baseline run's figures and the eager / compiled ratios by batch."""
    out: dict[str, Any] = {"device": record["device"], "torch": record["torch"], "models": {}}
    for model, got in record["models"].items():
        spec_name, _, seq = MODELS["cuda"][model]
        spec = load_model_spec(spec_name)
        cluster = load_cluster(record["priced_as"][model])
        runs: dict[str, Any] = {}
        for key, r in got["runs"].items():
            mode, _, batch_kind = key.partition("@")
            if mode not in BASELINES or "step_time_s" not in r:
                continue
            ctx = make_context(spec, run_cluster(cluster, 1, "cuda"), r["batch"], seq, "cuda")
            plan = plan_for(ctx, compute="bf16", microbatch=r["microbatch"])
            req = RunRequest(
                plan=plan, spec=spec, steps=1, nproc=1, global_batch=r["batch"], seq=seq,
                cluster=cluster, device="cuda", mode=mode,
            )  # fmt: skip
            _, _, pred, _ = priced_request(req, optimizer=r.get("optimizer", RAN_AS.get(model)))
            runs[key] = {
                "batch": batch_kind,
                "microbatches": r["batch"] // r["microbatch"],
                "measured_s": r["step_time_s"],
                "predicted_then_s": r["predicted_step_time_s"],
                "predicted_s": pred.step_time_s,
                "error": pred.step_time_s / r["step_time_s"] - 1,
                # CUDA's allocator peak (``torch.cuda.max_memory_allocated``) against the allocated
                # peak the cost model prices
                "measured_peak_bytes": r["peak_bytes"],
                "predicted_peak_bytes": pred.peak_bytes,
                "peak_error": pred.peak_bytes / r["peak_bytes"] - 1,
            }
        ratios = {}
        for batch_kind in ("tight", "loose"):
            e, c = runs.get(f"eager@{batch_kind}"), runs.get(f"compile@{batch_kind}")
            if e and c:
                measured = e["measured_s"] / c["measured_s"]
                priced = e["predicted_s"] / c["predicted_s"]
                then = e["predicted_then_s"] / c["predicted_then_s"]
                ratios[batch_kind] = {"measured": measured, "priced": priced, "priced_then": then}
        out["models"][model] = {"runs": runs, "eager_over_compiled": ratios}
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("record", nargs="?", type=Path, default=RECORD)
    ap.add_argument("--json", type=Path, default=HERE / "results" / "gpu_repriced.json")
    args = ap.parse_args()
    got = reprice(json.loads(args.record.read_text()))
    print(f"{got['device']}, torch {got['torch']}: step ms measured, predicted then, now (error)")
    for model, m in got["models"].items():
        for key, r in m["runs"].items():
            print(
                f"  {model:<12} {key:<14} {r['measured_s'] * 1e3:7.1f} {r['predicted_then_s'] * 1e3:7.1f} "
                f"{r['predicted_s'] * 1e3:7.1f} ({r['error']:+.1%}); "
                f"peak {r['measured_peak_bytes'] / 2**30:.1f} GiB, "
                f"priced {r['predicted_peak_bytes'] / 2**30:.1f} ({r['peak_error']:+.1%}), "
                f"{r['microbatches']} microbatch{'es' if r['microbatches'] > 1 else ''}"
            )
        for batch_kind, x in m["eager_over_compiled"].items():
            print(
                f"  {model:<12} eager/compiled at the {batch_kind} batch: measured {x['measured']:.3f}, "
                f"priced {x['priced']:.3f} ({100 * (x['priced'] - x['measured']):+.1f} points; "
                f"then {100 * (x['priced_then'] - x['measured']):+.1f})"
            )
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps(got, indent=1) + "\n")


if __name__ == "__main__":
    main()
