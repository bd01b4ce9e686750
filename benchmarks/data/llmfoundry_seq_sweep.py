"""llm-foundry's MPT-1B on one node of 8 GPUs at sequence 512 to 32,768, priced with the ``fsdp``
preset beside the measured step, on H100 and on A100 80GB:

    python benchmarks/data/llmfoundry_seq_sweep.py [--attention triton|flash2] [--json OUT]

The rows are llm-foundry's own benchmark tables (mosaicml/llm-foundry
``scripts/train/benchmarking/README.md`` at 5e85bd62d4, tables "H100 80GB BF16", lines 131-140,
and "A100 80GB with 1600 Gbps node-node interconnect (RoCE)", lines 195-201: model 1b, 8 GPUs,
FULL_SHARD, no activation checkpointing, amp_bf16 with the DEFAULT mixed precision): sequence
length, microbatch, gradient accumulation and tokens per second per GPU. Every other setting is the
128-GPU MPT-1B run's of ``published_stack_runs.json`` (the same sweep script, ``sweep.py``, and
recipe, ``mpt-1b.yaml``, with the sequence length and its learned position table as the row
says), so the rows differ from it and from each other in sequence length and batch alone, but for
the attention: these rows were made by ``sweep.sh`` at b2a43a147 (2023-10-19, where the tables were
added), which passes no ``--attn_impl``, so ``submit_benchmarks.py``'s default ``triton`` ran: MPT's
Triton FlashAttention (``llmfoundry/models/layers/flash_attn_triton.py``) on padded inputs, priced
as the device's ``triton`` kernel. One node: the network between nodes plays no part. The step time
is global batch x sequence / (tokens per second per GPU x 8).

Also printed, per GPU: least squares of the measured steps as ``a x (the priced step outside
attention) + b x (the priced attention kernels)``. Priced with FlashAttention-2's rates
(``--attention flash2``) this is where the device presets' ``triton`` rates come from: ``b`` is the
Triton kernel's time over FlashAttention-2's price.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))
sys.path.insert(0, str(HERE))

from llmfoundry_tables import base_run, table_run  # noqa: E402

#: (cluster preset, README line, sequence, microbatch, gradient accumulation, tokens/s per GPU)
ROWS: tuple[tuple[str, int, int, int, int, int], ...] = (
    ("dgx-h100", 140, 512, 56, 4, 52275),
    ("dgx-h100", 139, 1024, 18, 4, 48910),
    ("dgx-h100", 138, 2048, 14, 1, 45455),
    ("dgx-h100", 134, 4096, 7, 4, 38535),
    ("dgx-h100", 133, 8192, 3, 4, 29157),
    ("dgx-h100", 132, 16384, 2, 4, 19649),
    ("dgx-h100", 131, 32768, 1, 4, 12025),
    ("dgx-a100-80gb", 201, 512, 56, 4, 23148),
    ("dgx-a100-80gb", 200, 1024, 18, 4, 22112),
    ("dgx-a100-80gb", 199, 2048, 14, 4, 20513),
    ("dgx-a100-80gb", 198, 4096, 7, 4, 17807),
    ("dgx-a100-80gb", 197, 8192, 3, 4, 13814),
    ("dgx-a100-80gb", 196, 16384, 2, 4, 9956),
    ("dgx-a100-80gb", 195, 32768, 1, 4, 6275),
)
GPUS = 8


def runs(attention: str = "triton") -> list[dict[str, Any]]:
    """The rows as runs of ``published_stack_runs.json``'s shape, their attention priced as
    ``attention`` (MPT's Triton kernel on padded inputs, what ran; or another device kernel), built
    as ``llmfoundry_tables.table_run`` builds every row of the same tables."""
    base = base_run()
    return [
        table_run(base, cluster, line, "1b", seq, GPUS, mb, ga, tps, attention=attention)
        for cluster, line, seq, mb, ga, tps in ROWS
    ]


def table(attention: str = "triton") -> list[dict[str, Any]]:
    import bench_stacks as bs

    rows = []
    for r in runs(attention):
        stack = bs.stack_of(r)
        priced = bs.estimated(r, stack)
        predicted = priced[3].step_time_s
        _, attn, _, _ = bs.step_parts(r, stack, priced)
        measured = r["measured"]["step_time_s"]
        rows.append(
            {
                "id": r["id"],
                "cluster": r["cluster"],
                "seq": r["seq"],
                "measured_s": measured,
                "predicted_s": predicted,
                "attention_s": attn,
                "error": predicted / measured - 1,
            }
        )
    return rows


def split(rows: list[dict[str, Any]]) -> dict[str, tuple[float, float, float]]:
    """Per cluster, (a, b, largest relative residual) of measured ~ a x rest + b x attention
    (``bench_stacks.attention_split``)."""
    import numpy as np
    from bench_stacks import attention_split

    out = {}
    for cluster in dict.fromkeys(r["cluster"] for r in rows):
        mine = [r for r in rows if r["cluster"] == cluster]
        attn = np.array([r["attention_s"] for r in mine])
        a, b, residual = attention_split(
            np.array([r["predicted_s"] for r in mine]) - attn,
            attn,
            np.array([r["measured_s"] for r in mine]),
        )
        out[cluster] = (a, b, float(np.abs(residual).max()))
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument(
        "--attention", default="triton", help="the device kernel the rows' attention is priced as"
    )
    ap.add_argument("--json", type=Path)
    args = ap.parse_args()
    rows = table(args.attention)
    print(f"{'cluster':14s} {'sequence':>8s} {'step s measured':>16s} {'priced':>8s} {'error':>7s}")
    for r in rows:
        print(
            f"{r['cluster']:14s} {r['seq']:8d} {r['measured_s']:16.3f} {r['predicted_s']:8.3f} "
            f"{r['error'] * 100:+6.1f}%"
        )
    for cluster, (a, b, worst) in split(rows).items():
        print(
            f"{cluster}: measured = {a:.3f} x the rest + {b:.3f} x the attention priced, "
            f"residuals within {worst:.1%}"
        )
    if args.json:
        args.json.write_text(json.dumps(rows, indent=1) + "\n")


if __name__ == "__main__":
    main()
