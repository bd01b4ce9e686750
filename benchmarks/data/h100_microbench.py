# ruff: noqa: B023  (closures are called inside the loop iteration that defines them)
"""Microbenchmarks on one H100 for the cost model's H100 numbers (run on a lent GPU).

    python benchmarks/data/h100_microbench.py > benchmarks/data/h100_microbench.json

Measures, in bf16, with CUDA events (median of repeats after warm-up):
- GEMM throughput at the shapes of the published H100 runs' layers and at square sizes;
- memory bandwidth of a large device-to-device copy;
- flash attention (PyTorch SDPA, flash backend, causal) forward and forward + backward, with and
  without dropout on the probabilities;
- Megatron-LM's unfused vocabulary-parallel cross-entropy sequence (float, max, sub, exp, sum,
  div; mul and cast back) on 4096 x 131072 logits, against its byte count.
"""

from __future__ import annotations

import json
import statistics

import torch
import torch.nn.functional as F


def timed(fn, repeat: int = 20, warmup: int = 5) -> float:
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(repeat):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        fn()
        b.record()
        torch.cuda.synchronize()
        times.append(a.elapsed_time(b) / 1e3)
    return statistics.median(times)


def gemms() -> list[dict]:
    shapes = [(2048, 2048, 2048), (4096, 4096, 4096), (8192, 8192, 8192)]
    # (M tokens, N, K) of the 1.7B, 7.1B (TP 2), 32B (TP 8) megatron24 layers, seq 4096, mb 1
    shapes += [(4096, 6144, 2048), (4096, 8192, 2048), (4096, 2048, 8192), (4096, 2048, 2048)]
    shapes += [(4096, 6144, 4096), (4096, 8192, 4096), (4096, 4096, 8192), (4096, 4096, 2048)]
    shapes += [(4096, 2688, 7168), (4096, 3584, 7168), (4096, 7168, 3584), (4096, 7168, 896)]
    shapes += [(4096, 131072, 2048)]
    out = []
    for m, n, k in shapes:
        x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
        w = torch.randn(k, n, device="cuda", dtype=torch.bfloat16)
        t = timed(lambda: x @ w)
        out.append({"m": m, "n": n, "k": k, "s": t, "tflops": 2 * m * n * k / t / 1e12})
    return out


def bandwidth() -> dict:
    x = torch.empty(2**30, device="cuda", dtype=torch.uint8)
    y = torch.empty_like(x)
    t = timed(lambda: y.copy_(x))
    return {"bytes": 2 * x.numel(), "s": t, "gbps": 2 * x.numel() / t / 1e9}


def attention() -> list[dict]:
    out = []
    for b, h, s, d in [(1, 16, 4096, 128), (1, 32, 4096, 128), (1, 8, 4096, 128)]:
        q, k, v = (
            torch.randn(b, h, s, d, device="cuda", dtype=torch.bfloat16, requires_grad=True) for _ in range(3)
        )
        for p in (0.0, 0.1):
            with torch.nn.attention.sdpa_kernel(torch.nn.attention.SDPBackend.FLASH_ATTENTION):
                fwd = timed(lambda: F.scaled_dot_product_attention(q, k, v, dropout_p=p, is_causal=True))
                go = torch.randn(b, h, s, d, device="cuda", dtype=torch.bfloat16)

                def step() -> None:
                    o = F.scaled_dot_product_attention(q, k, v, dropout_p=p, is_causal=True)
                    o.backward(go)

                both = timed(step)
            flops = 4 * b * h * s * s * d / 2  # causal half
            out.append(
                {
                    "b": b,
                    "h": h,
                    "s": s,
                    "d": d,
                    "dropout": p,
                    "fwd_s": fwd,
                    "fwd_bwd_s": both,
                    "fwd_tflops": flops / fwd / 1e12,
                    "bwd_tflops": 2 * flops / (both - fwd) / 1e12,
                }
            )
    return out


def unfused_attention() -> list[dict]:
    """Megatron-LM's 2021 attention core: baddbmm (QK^T, scaled), causal softmax, dropout, bmm;
    forward and forward + backward, fp16, with and without dropout on the probabilities."""
    out = []
    for b, a, s, d in [(16, 24, 2048, 96), (2, 10, 2048, 128), (4, 16, 2048, 128)]:
        q, k, v = (
            torch.randn(b * a, s, d, device="cuda", dtype=torch.float16, requires_grad=True) for _ in range(3)
        )
        mask = torch.ones(s, s, device="cuda", dtype=torch.bool).triu(1)
        for p in (0.0, 0.1):

            def fwd():
                scores = torch.baddbmm(
                    torch.empty(b * a, s, s, device="cuda", dtype=torch.float16),
                    q,
                    k.transpose(1, 2),
                    beta=0.0,
                    alpha=d**-0.5,
                )
                probs = torch.softmax(scores.masked_fill_(mask, -10000.0), dim=-1)
                probs = F.dropout(probs, p=p, training=True)
                return torch.bmm(probs, v)

            go = torch.randn(b * a, s, d, device="cuda", dtype=torch.float16)
            tf = timed(fwd, repeat=10)
            tb = timed(lambda: fwd().backward(go), repeat=10)
            out.append(
                {
                    "b": b,
                    "a": a,
                    "s": s,
                    "d": d,
                    "dropout": p,
                    "fwd_s": tf,
                    "fwd_bwd_s": tb,
                    "score_bytes": 2 * b * a * s * s,
                }
            )
    return out


def cross_entropy() -> dict:
    t, v = 4096, 131072
    logits = torch.randn(t, v, device="cuda", dtype=torch.bfloat16)
    target = torch.randint(0, v, (t,), device="cuda")
    grad_out = torch.ones(t, device="cuda")

    def megatron() -> None:
        x = logits.float()
        mx = torch.max(x, dim=-1)[0]
        x -= mx.unsqueeze(-1)
        pred = x[torch.arange(t, device="cuda"), target].clone()
        torch.exp(x, out=x)
        se = x.sum(dim=-1)
        _ = torch.log(se) - pred
        x.div_(se.unsqueeze(-1))
        x[torch.arange(t, device="cuda"), target] -= 1.0
        x.mul_(grad_out.unsqueeze(-1))
        _ = x.to(torch.bfloat16)

    s = timed(megatron, repeat=10)
    return {"tokens": t, "vocab": v, "s": s, "model_bytes": 52 * t * v, "gbps_equiv": 52 * t * v / s / 1e9}


if __name__ == "__main__":
    dev = torch.cuda.get_device_properties(0)
    print(
        json.dumps(
            {
                "device": dev.name,
                "sms": dev.multi_processor_count,
                "torch": torch.__version__,
                "gemm": gemms(),
                "copy": bandwidth(),
                "attention": attention(),
                "unfused_attention": unfused_attention(),
                "cross_entropy": cross_entropy(),
            },
            indent=1,
        )
    )
