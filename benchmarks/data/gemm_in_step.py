"""GEMM rates inside a training step on a GPU, read from a kernel profile, beside the rates the cost
model prices the same GEMMs at:

    python benchmarks/data/gemm_in_step.py [benchmarks/results/gpu/profile_compile.txt] [--json OUT]

The profile is ``torch.profiler``'s table of one step (``key_averages().table``, CUDA time per
kernel name and call count) of GPT-2 124M under ``torch.compile``'s defaults on one H100 SXM
(``bench_gpu.py``, global batch 128 x 1024 as 2 microbatches of 64: every block GEMM runs 24
times a step). cuBLAS names its Hopper kernels by the operands' layouts, which tells the GEMM
classes apart (the call counts agree: four linear layers x 24 block passes = 96):

- ``..._bias_TNN``: the blocks' forward linears (the bias in the epilogue);
- ``..._NNN``: the blocks' input gradients and the LM head's (96 + 2 calls);
- ``..._NTN`` / ``..._NTT``: the blocks' weight gradients (split-K kernels among them);
- ``nvjet_sm90_tst_208x192_..._TNN``: the LM head's forward over the padded vocabulary;
- ``cutlass_80_tensorop_bf16_s16816gemm_relu_bf16...``: the LM head's weight gradient.

Each class's FLOPs come from the model's shapes; its rate is those FLOPs over its measured CUDA
time, as a fraction of the device's dense 16-bit peak. The priced rate is the cost model's
(``coplan.cost.explain.kernel_costs``) for the same GEMMs of the same run, on the cluster the run
was priced on. The table prints both and the ratio; nothing is fitted.
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
PROFILE = HERE.parent / "results" / "gpu" / "profile_compile.txt"
sys.path.insert(0, str(HERE.parent))

#: GPT-2 124M's block linears as (rows, output width, reduction) of the forward GEMM per token
#: row: c_attn, attn.c_proj, mlp.c_fc, mlp.c_proj (d_model 768, 4 x 768 MLP)
D, VOCAB_PADDED, TOKENS, PASSES = 768, 50304, 64 * 1024, 24
LINEARS = ((3 * D, D), (D, D), (4 * D, D), (D, 4 * D))  # (N, K) of each forward GEMM
BLOCK_GEMM_FLOPS = sum(2 * TOKENS * n * k for n, k in LINEARS)  # one pass of one block
HEAD_FLOPS = 2 * TOKENS * VOCAB_PADDED * D  # one LM-head GEMM of one microbatch

#: (class, kernel-name pattern, FLOPs of all its calls in the step, the cost model's GEMMs: the
#: op name's suffix and whether they are the LM head's (None: both))
CLASSES = (
    ("block forward", r"nvjet_sm90_tst_192x192.*_bias_TNN", PASSES * BLOCK_GEMM_FLOPS, ("linear", False)),
    (
        "input gradients (blocks + LM head)",
        r"nvjet_sm90.*_NNN$",
        PASSES * BLOCK_GEMM_FLOPS + 2 * HEAD_FLOPS,
        ("linear_bwd_input", None),
    ),
    (
        "block weight gradients",
        r"nvjet_sm90.*_NT[NT]$",
        PASSES * BLOCK_GEMM_FLOPS,
        ("linear_bwd_weight", False),
    ),
    ("LM head forward", r"nvjet_sm90_tst_208x192.*_TNN$", 2 * HEAD_FLOPS, ("linear", True)),
    (
        "LM head weight gradient",
        r"cutlass_80_tensorop_bf16_s16816gemm_relu",
        2 * HEAD_FLOPS,
        ("linear_bwd_weight", True),
    ),
)
ROW = re.compile(
    r"^\s*(?P<name>.+?)\s{2,}(?:\S+\s+){5}(?P<cuda>[0-9.]+)(?P<unit>ms|us)\s+\S+%\s+\S+\s+\S+\s+(?P<calls>\d+)\s*$"
)


def kernels(text: str) -> list[tuple[str, float, int]]:
    """(kernel name, self CUDA seconds, calls) of each row of a ``torch.profiler`` table."""
    out = []
    for line in text.splitlines():
        m = ROW.match(line)
        if m is None:
            continue
        scale = 1e-3 if m.group("unit") == "ms" else 1e-6
        out.append((m.group("name").strip(), float(m.group("cuda")) * scale, int(m.group("calls"))))
    return out


def measured(rows: list[tuple[str, float, int]]) -> dict[str, tuple[float, int]]:
    """Per class: (CUDA seconds, calls) of its kernels in the step."""
    got: dict[str, tuple[float, int]] = {}
    for cls, pattern, _, _ in CLASSES:
        hits = [(s, c) for name, s, c in rows if re.search(pattern, name)]
        got[cls] = (sum(s for s, _ in hits), sum(c for _, c in hits))
    return got


def priced(cluster: str = "dgx-h100") -> tuple[dict[str, float], float]:
    """Per class: the cost model's seconds for the same GEMMs of the step (``torch.compile``'s
    baseline of ``bench_gpu.py``, priced as ``coplan run --mode compile`` prices it), and the
    device's dense 16-bit peak."""
    from gpu_all import MODELS

    from coplan.apply.predict import make_context, plan_for, run_cluster
    from coplan.apply.run import RunRequest, priced_request
    from coplan.cost.explain import kernel_costs
    from coplan.hardware import load_cluster
    from coplan.models.spec import load_model_spec

    spec_name, _, seq = MODELS["cuda"]["gpt2-124m"]
    spec = load_model_spec(spec_name)
    hw = load_cluster(cluster)
    ctx = make_context(spec, run_cluster(hw, 1, "cuda"), 128, seq, "cuda")
    plan = plan_for(ctx, compute="bf16", microbatch=64)
    req = RunRequest(
        plan=plan, spec=spec, steps=1, nproc=1, global_batch=128, seq=seq, cluster=hw, device="cuda",
        mode="compile",
    )  # fmt: skip
    ctx, ran, _, _ = priced_request(req)
    est = ctx.price(ran)
    micro = est.config.num_microbatches
    rows = kernel_costs(ctx.model.profile_for(est.config), ctx.cluster, est.config, 0)
    out: dict[str, float] = {}
    for cls, _, _, (suffix, head) in CLASSES:
        picked = [
            r
            for r in rows
            if r.kind == "matmul"
            and r.name.rsplit(": ", 1)[-1] == suffix
            and (head is None or (r.part == "head") == head)
        ]
        out[cls] = micro * sum(r.total_s for r in picked)
    return out, est.peak_flops


def table(profile: Path, cluster: str = "dgx-h100") -> list[dict[str, Any]]:
    got = measured(kernels(profile.read_text()))
    price, peak = priced(cluster)
    out = []
    for cls, _, flops, _ in CLASSES:
        s, calls = got[cls]
        out.append(
            {
                "class": cls,
                "calls": calls,
                "measured_ms": s * 1e3,
                "priced_ms": price[cls] * 1e3,
                "tflop": flops / 1e12,
                "measured_of_peak": flops / s / peak if s else None,
                "priced_of_peak": flops / price[cls] / peak if price[cls] else None,
            }
        )
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("profile", nargs="?", type=Path, default=PROFILE)
    ap.add_argument("--cluster", default="dgx-h100")
    ap.add_argument("--json", type=Path)
    args = ap.parse_args()
    rows = table(args.profile, args.cluster)
    print(
        f"{'GEMM class':36s} {'calls':>5s} {'ms measured':>11s} {'priced':>8s} "
        f"{'of peak: measured':>18s} {'priced':>7s}"
    )
    for r in rows:
        print(
            f"{r['class']:36s} {r['calls']:5d} {r['measured_ms']:11.1f} {r['priced_ms']:8.1f} "
            f"{r['measured_of_peak']:18.3f} {r['priced_of_peak']:7.3f}"
        )
    m = sum(r["measured_ms"] for r in rows)
    p = sum(r["priced_ms"] for r in rows)
    print(f"{'all GEMMs above':36s} {'':5s} {m:11.1f} {p:8.1f}   priced / measured {p / m:.2f}")
    if args.json:
        args.json.write_text(json.dumps({"profile": str(args.profile.name), "rows": rows}, indent=1) + "\n")


if __name__ == "__main__":
    main()
