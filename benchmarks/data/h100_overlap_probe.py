# ruff: noqa: B023  (closures are called inside the loop iteration that defines them)
"""Probes of the two assumptions behind coplan's pricing of Transformer Engine's TP overlap
(coplan/cost/tp_overlap.py), for a lent GPU:

    python benchmarks/data/h100_overlap_probe.py > benchmarks/data/h100_overlap_probe.json

1. Split GEMMs (TE's ring exchange and pipelined reduce-scatter): a GEMM of M rows run as n chunks
   of M/n rows, on one stream and spread over three streams as TE spreads them
   (``_NUM_MAX_UB_STREAMS``). coplan prices ``n / s * T(M * s / n)`` with ``s = min(3, n)``.
2. SMs taken by a communication kernel (TE's bulk and pipelined overlaps run their collectives on
   ``num_sm`` SMs): a GEMM beside a copy kernel of k thread blocks, one per SM, that streams memory
   for about as long as the GEMM. coplan prices the GEMM slower by ``k / (SMs - k)`` for as long as
   the collective runs (TE's overlaps), and an NCCL collective's neighbour as running at
   ``1 - k / SMs`` of its rate while it runs (``coplan/cost/contention.py``): both are printed.

Each record carries the measured seconds and what coplan's H100 preset predicts for the same case,
so the gap can be read directly. Needs CUDA and Triton (shipped with PyTorch's CUDA
wheels).
"""

from __future__ import annotations

import json
import sys

import torch
from h100_microbench import timed  # this folder's: the same CUDA-event timing as the microbenchmarks

from coplan.cost.contention import run_beside

#: (M tokens, N, K) of forward GEMMs TE splits: QKV and FC1 of the 177B model at TP8 (mb 1, seq
#: 4096), the same at TP4, Nemotron-8B's at TP2 (mb 4); the projection and FC2 for the pipelined
#: reduce-scatter (4 splits)
SPLIT_CASES = [
    ("qkv tp8", 4096, 4608, 12288, 8),
    ("fc1 tp8", 4096, 6144, 12288, 8),
    ("qkv tp4", 4096, 9216, 12288, 4),
    ("fc1 tp2", 16384, 8192, 4096, 2),
    ("proj tp8 (pipeline, 4 splits)", 4096, 12288, 1536, 4),
    ("fc2 tp8 (pipeline, 4 splits)", 4096, 12288, 6144, 4),
]


def predicted(m: float, n: int, k: int) -> float:
    """coplan's H100 price of a bf16 GEMM (launch included)."""
    from coplan.cost.kernels import Rates, Scale, kernel_time
    from coplan.cost.parts import Kernel
    from coplan.hardware import load_cluster
    from coplan.ir.types import Phase

    device = load_cluster("dgx-h100", 8).groups[0].device
    rows = max(1, round(m))
    kern = Kernel(Phase.FORWARD, "matmul", 0, 2.0 * rows * n * k, 0.0, (0.0,) * 6, dims=(rows, n, k))
    return kernel_time(kern, Rates.of(device, "bf16"), Scale(1, False, (2.0,) * 6, 2, True))


def split_gemms() -> list[dict]:
    streams = [torch.cuda.Stream() for _ in range(3)]
    out = []
    for name, m, n, k, chunks in SPLIT_CASES:
        x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
        w = torch.randn(k, n, device="cuda", dtype=torch.bfloat16)
        y = torch.empty(m, n, device="cuda", dtype=torch.bfloat16)
        parts = list(zip(x.chunk(chunks), y.chunk(chunks), strict=True))
        whole = timed(lambda: torch.matmul(x, w, out=y))

        def one_stream() -> None:
            for xi, yi in parts:
                torch.matmul(xi, w, out=yi)

        def three_streams() -> None:
            main = torch.cuda.current_stream()
            for i, (xi, yi) in enumerate(parts):
                s = streams[i % 3]
                s.wait_stream(main)
                with torch.cuda.stream(s):
                    torch.matmul(xi, w, out=yi)
            for s in streams:
                main.wait_stream(s)

        s = min(3, chunks)
        out.append(
            {
                "case": name,
                "m": m,
                "n": n,
                "k": k,
                "chunks": chunks,
                "whole_s": whole,
                "one_stream_s": timed(one_stream),
                "three_streams_s": timed(three_streams),
                "predicted_whole_s": predicted(m, n, k),
                "predicted_split_s": chunks / s * predicted(m * s / chunks, n, k),
            }
        )
    return out


def sm_sharing(sms: int) -> list[dict]:
    import triton
    import triton.language as tl

    @triton.jit
    def stream_copy(src, dst, n_per_block, iters, BLOCK: tl.constexpr):
        # one block per SM, streaming its own slice over and over: an SM-resident collective's
        # footprint (its SMs and its memory traffic), without a second GPU
        base = tl.program_id(0) * n_per_block
        for _ in range(iters):
            for off in range(0, n_per_block, BLOCK):
                idx = base + off + tl.arange(0, BLOCK)
                tl.store(dst + idx, tl.load(src + idx))

    m, n, k = 4096, 12288, 6144  # the 177B model's FC2 at TP8, forward
    x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
    w = torch.randn(k, n, device="cuda", dtype=torch.bfloat16)
    per_block = 1 << 20
    src = torch.randn(per_block * 32, device="cuda", dtype=torch.bfloat16)
    dst = torch.empty_like(src)
    gemm = timed(lambda: x @ w)
    side = torch.cuda.Stream()
    out = []
    for blocks in (2, 4, 8, 16, 24, 32):

        def copy(iters: int) -> None:
            stream_copy[(blocks,)](src, dst, per_block, iters, BLOCK=1024)

        one = timed(lambda: copy(1))
        iters = max(1, round(gemm / one))  # about as long as the GEMM on its own

        def both() -> None:
            main = torch.cuda.current_stream()
            side.wait_stream(main)
            with torch.cuda.stream(side):
                copy(iters)
            x @ w
            main.wait_stream(side)

        comm = timed(lambda: copy(iters))
        out.append(
            {
                "blocks": blocks,
                "gemm_s": gemm,
                "copy_alone_s": comm,
                "together_s": timed(both),
                # coplan (no SM margin): the GEMM loses the k SMs while the collective runs
                "predicted_together_s": max(gemm + min(comm, gemm) * blocks / (sms - blocks), comm),
                # NCCL collectives beside compute (coplan/cost/contention.py): the GEMM runs at
                # 1 - k / SMs of its rate while the copy runs, at its full rate after
                "predicted_contention_s": max(run_beside(0.0, gemm, comm, blocks / sms), comm),
            }
        )
    return out


def main() -> None:
    if not torch.cuda.is_available():
        sys.exit("error: needs a CUDA GPU")
    props = torch.cuda.get_device_properties(0)
    result = {
        "device": props.name,
        "sms": props.multi_processor_count,
        "torch": torch.__version__,
        "split_gemms": split_gemms(),
        "sm_sharing": sm_sharing(props.multi_processor_count),
    }
    print(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
