"""fp8 GEMMs and torchao's float8 linears at LLaMA-70B's tensor-parallel shapes: measured by torchao's
developers on one H100, beside what the cost model prices for the same work.

    python benchmarks/data/float8_linear_check.py [--device h100-sxm] [--json OUT]

Two published microbenchmarks of the same four GEMM shapes (M = 16,384 token rows of LLaMA-70B's
fused QKV, attention output, fused gate/up and down projections at TP 8: ``(M, K, N)`` below):

- ``meta-pytorch/float8_experimental#100`` (2023-09-19, ``benchmarks/bench_matmul.py``): one
  forward GEMM through cuBLASLt, bf16 against fp8 (``torch._scaled_mm``), milliseconds per call;
- ``pytorch/ao#2185`` (2025-05-08, torchao's ``benchmarks/float8/bench_linear_float8.py``): one
  compiled linear, forward and backward (three GEMMs and every cast), bf16 against
  ``Float8Linear`` with row-wise scales as torchao then ran them (its backward through cuBLAS's
  tensor-wise kernel with unit scales and a rescale kernel, ``torchao/float8/float8_ops.py``
  ``addmm_float8_unwrapped``; the PR measures the CUTLASS row-wise kernel "nearly identical"),
  fast accumulation on, milliseconds per forward and backward.

The priced side applies the cost model's GEMM rule to each GEMM (the device's rate for the dtype,
its shape derating ``coplan.cost.kernels.shape_factor`` and the memory roofline, as ``_matmul``
prices a library GEMM) and, for the float8 linear, the row-wise casts and rescales
``coplan.cost.fp8.rowwise_bytes`` counts, at the device's memory rate. Nothing is fitted: the
device preset's rates are the ones chosen on Megatron-LM's runs at scale (``devices.json``).

Also printed: the priced cost of a float8 linear over its bf16 one at the narrowest projections
torchtitan converted in its June 2025 async-TP benchmark (``wk`` / ``wv``, 8 KV heads of 128 over
TP 8: 128 columns), which pytorch/torchtitan#1207 found "approx 40%" slower in float8 than in bf16.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from coplan.cost.fp8 import rowwise_bytes
from coplan.cost.kernels import Rates, shape_factor
from coplan.cost.parts import QuantGemm
from coplan.hardware import get_device

#: (name, (M, K, N) of the forward GEMM, float8_experimental#100 bf16 / fp8 ms,
#: pytorch/ao#2185 bf16 / float8 row-wise linear ms)
SHAPES: tuple[tuple[str, tuple[int, int, int], tuple[float, float], tuple[float, float]], ...] = (
    ("attn.wqkv", (16384, 8192, 1280), (0.622, 0.244), (1.954, 1.757)),
    ("attn.w0", (16384, 1024, 8192), (0.499, 0.257), (1.701, 1.193)),
    ("ffn.w13", (16384, 8192, 7168), (3.445, 1.470), (9.871, 5.707)),
    ("ffn.w2", (16384, 3584, 8192), (1.628, 0.700), (5.192, 3.034)),
)
#: torchtitan's separate K and V projections under TP 8 (one GPU's share), with the token rows of
#: its June 2025 runs (local batch 16 x 8,192 for 70B, 12 x 8,192 for 8B): (name, (M, K, N))
NARROW: tuple[tuple[str, tuple[int, int, int]], ...] = (
    ("70B TP8 wk", (16 * 8192, 8192, 128)),
    ("8B TP8 wk", (12 * 8192, 4096, 128)),
)


def gemm_s(rates: Rates, m: int, n: int, k: int, in_bytes: int) -> float:
    """One GEMM (output M x N, reduction K) by the cost model's library-GEMM rule: FLOPs at the
    shape-derated rate, or its operands and bf16 output at the memory rate, whichever is longer."""
    compute = 2.0 * m * n * k / (rates.mm_flops * shape_factor((m, n, k), rates.half_dim))
    memory = (in_bytes * (m * k + k * n) + 2 * m * n) / rates.bandwidth
    return max(compute, memory) + rates.launch_s


def linear_s(bf16: Rates, fp8: Rates | None, m: int, k: int, n: int) -> float:
    """A linear's forward and backward: the forward GEMM, the input gradient (M x K over N) and the
    weight gradient (N x K over M); in float8 (``fp8``) each at the fp8 rate, plus the row-wise
    recipe's casts and rescales (``rowwise_bytes``) as kernels at the memory rate."""
    shapes = ((m, n, k), (m, k, n), (n, k, m))
    if fp8 is None:
        return sum(gemm_s(bf16, *s, in_bytes=2) for s in shapes)
    gemm = QuantGemm(
        input_key=0,
        input_elems=m * k,
        output_elems=m * n,
        weight_elems=k * n,
        row_parallel=False,
        from_norm=False,
        dtype="",
    )
    fwd, bwd, nf, nb = rowwise_bytes([gemm], 1)
    casts = (fwd + bwd) / bf16.bandwidth + (nf + nb) * bf16.launch_s
    return sum(gemm_s(fp8, *s, in_bytes=1) for s in shapes) + casts


def table(device_name: str = "h100-sxm") -> dict[str, Any]:
    device = get_device(device_name)
    bf16, fp8 = Rates.of(device, "bf16"), Rates.of(device, "fp8")
    rows = []
    for name, (m, k, n), (mm_b, mm_f), (lin_b, lin_f) in SHAPES:
        p_mm_b, p_mm_f = gemm_s(bf16, m, n, k, 2) * 1e3, gemm_s(fp8, m, n, k, 1) * 1e3
        p_lin_b, p_lin_f = linear_s(bf16, None, m, k, n) * 1e3, linear_s(bf16, fp8, m, k, n) * 1e3
        rows.append(
            {
                "name": name,
                "mkn": [m, k, n],
                "gemm_bf16_ms": [mm_b, p_mm_b],
                "gemm_fp8_ms": [mm_f, p_mm_f],
                "gemm_speedup": [mm_b / mm_f, p_mm_b / p_mm_f],
                "linear_bf16_ms": [lin_b, p_lin_b],
                "linear_float8_ms": [lin_f, p_lin_f],
                "linear_speedup": [lin_b / lin_f, p_lin_b / p_lin_f],
            }
        )
    narrow = [
        {
            "name": name,
            "mkn": [m, k, n],
            "float8_over_bf16": linear_s(bf16, fp8, m, k, n) / linear_s(bf16, None, m, k, n),
        }
        for name, (m, k, n) in NARROW
    ]
    return {"device": device_name, "rows": rows, "narrow": narrow}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--device", default="h100-sxm", help="device preset to price on (default h100-sxm)")
    ap.add_argument("--json", type=Path, default=None, help="also write the table as JSON")
    args = ap.parse_args()
    out = table(args.device)
    print(f"priced on {out['device']}; each cell measured / priced (ms, or measured / priced speedup)")
    print(
        f"{'linear':10s} {'(M, K, N)':>22s} {'bf16 GEMM':>14s} {'fp8 GEMM':>14s} {'speedup':>11s}"
        f" {'bf16 linear':>14s} {'float8 linear':>14s} {'speedup':>11s}"
    )
    for r in out["rows"]:
        cells = [r[key] for key in ("gemm_bf16_ms", "gemm_fp8_ms")]
        sp = r["gemm_speedup"]
        lin = [r[key] for key in ("linear_bf16_ms", "linear_float8_ms")]
        lsp = r["linear_speedup"]
        print(
            f"{r['name']:10s} {tuple(r['mkn'])!s:>22s} "
            + " ".join(f"{a:6.3f}/{b:6.3f}" for a, b in cells)
            + f" {sp[0]:5.2f}/{sp[1]:4.2f} "
            + " ".join(f"{a:6.3f}/{b:6.3f}" for a, b in lin)
            + f" {lsp[0]:5.2f}/{lsp[1]:4.2f}"
        )
    for r in out["narrow"]:
        print(
            f"{r['name']:10s} {tuple(r['mkn'])!s:>22s} float8 linear priced at "
            f"{r['float8_over_bf16']:.2f}x its bf16 time (measured ~1.4x, pytorch/torchtitan#1207)"
        )
    if args.json:
        args.json.write_text(json.dumps(out, indent=1) + "\n")


if __name__ == "__main__":
    main()
