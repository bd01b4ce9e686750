"""Where a PyTorch-native training step's GPU time goes, kernel class by kernel class, beside what
coplan prices for the same step: the probe of the torchtitan and FSDP stacks' per-GPU compute gap
(docs/stacks.md: those runs price 10-30% too fast, H100 more than A100, more without activation
checkpointing), for a lent GPU:

    python benchmarks/data/h100_step_probe.py > benchmarks/data/h100_step_probe.json
    python benchmarks/data/h100_step_probe.py --dry-run      # coplan's side only, no GPU

A LLaMA-3 8B-shaped stack (``--layers`` blocks of d 4096, 32 heads, 8 key/value heads, SwiGLU 14336,
untied 128,256 vocabulary), written as torchtitan's Llama computes it: RMSNorm in fp32
(``x.float()``, ``pow``, ``mean``, ``rsqrt``, ``type_as``, weight), RoPE through
``view_as_complex``, key/value heads repeated for SDPA (``repeat_kv``), causal
``F.scaled_dot_product_attention``, ``F.silu(w1(x)) * w3(x)``, the loss on ``logits.float()``.
Parameters in bf16 (FSDP2's compute dtype), one microbatch forward and backward, eager and with
each block compiled (torchtitan's ``apply_compile``; embedding, final norm, head and loss eager).

For each mode: torch.profiler's CUDA kernel time summed by class (GEMM, attention, Triton-generated,
other elementwise and reductions, copies), the step's wall time (CUDA events, median), the time the
GPU ran no kernel within it, the host's time to issue one step and the kernels it launches, and
peak memory, beside coplan's listing of the same step's kernels (``coplan.cost.explain``) under the
``torchtitan`` / ``torchtitan-compile`` presets on the device's preset, per class, and its estimate.
The class that misses most is where the stacks' gap lives. The last lines are a short table.
"""

from __future__ import annotations

import argparse
import json
import sys

import torch
import torch.nn.functional as F
from h100_microbench import timed  # this folder's: the same CUDA-event timing as the microbenchmarks
from torch import nn

from coplan.cost import CostModel, TrainingConfig, load_stack
from coplan.cost.explain import kernel_costs
from coplan.hardware import load_cluster
from coplan.models.spec import ModelSpec

CLASSES = ("gemm", "attention", "triton", "elementwise", "copy")


def spec_of(layers: int, seq: int) -> ModelSpec:
    return ModelSpec(
        name=f"llama3-8b-{layers}l",
        n_layers=layers,
        d_model=4096,
        n_heads=32,
        n_kv_heads=8,
        ffn_hidden=14336,
        vocab_size=128256,
        seq_len=seq,
        activation="swiglu",
        norm="rmsnorm",
        position="rope",
        tied_embeddings=False,
        bias=False,
        rope_theta=500000.0,
    )


class RMSNorm(nn.Module):
    def __init__(self, d: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(d))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = x.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + 1e-5)
        return h.type_as(x) * self.weight


def rope_table(head_dim: int, seq: int, theta: float) -> torch.Tensor:
    freqs = 1.0 / (theta ** (torch.arange(0, head_dim, 2).float() / head_dim))
    angles = torch.outer(torch.arange(seq).float(), freqs)
    return torch.polar(torch.ones_like(angles), angles)


def rotate(x: torch.Tensor, table: torch.Tensor) -> torch.Tensor:
    xc = torch.view_as_complex(x.float().reshape(*x.shape[:-1], -1, 2))
    out = torch.view_as_real(xc * table[: x.shape[1]].view(1, x.shape[1], 1, -1)).flatten(3)
    return out.type_as(x)


class Block(nn.Module):
    def __init__(self, s: ModelSpec) -> None:
        super().__init__()
        self.h, self.kv, self.hd = s.n_heads, s.kv_heads, s.d_model // s.n_heads
        self.attention_norm, self.ffn_norm = RMSNorm(s.d_model), RMSNorm(s.d_model)
        self.wq = nn.Linear(s.d_model, s.d_model, bias=False)
        self.wk = nn.Linear(s.d_model, self.kv * self.hd, bias=False)
        self.wv = nn.Linear(s.d_model, self.kv * self.hd, bias=False)
        self.wo = nn.Linear(s.d_model, s.d_model, bias=False)
        self.w1 = nn.Linear(s.d_model, s.ffn, bias=False)
        self.w3 = nn.Linear(s.d_model, s.ffn, bias=False)
        self.w2 = nn.Linear(s.ffn, s.d_model, bias=False)

    def forward(self, x: torch.Tensor, table: torch.Tensor) -> torch.Tensor:
        b, t, _ = x.shape
        h = self.attention_norm(x)
        q = rotate(self.wq(h).view(b, t, self.h, self.hd), table)
        k = rotate(self.wk(h).view(b, t, self.kv, self.hd), table)
        v = self.wv(h).view(b, t, self.kv, self.hd)
        rep = self.h // self.kv  # the key/value heads repeated for SDPA, as a copy
        k = k[:, :, :, None, :].expand(b, t, self.kv, rep, self.hd).reshape(b, t, self.h, self.hd)
        v = v[:, :, :, None, :].expand(b, t, self.kv, rep, self.hd).reshape(b, t, self.h, self.hd)
        y = F.scaled_dot_product_attention(
            q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=True
        )
        x = x + self.wo(y.transpose(1, 2).contiguous().view(b, t, -1))
        h = self.ffn_norm(x)
        return x + self.w2(F.silu(self.w1(h)) * self.w3(h))


class Llama(nn.Module):
    def __init__(self, s: ModelSpec) -> None:
        super().__init__()
        self.tok_embeddings = nn.Embedding(s.vocab_size, s.d_model)
        self.layers = nn.ModuleList(Block(s) for _ in range(s.n_layers))
        self.norm = RMSNorm(s.d_model)
        self.output = nn.Linear(s.d_model, s.vocab_size, bias=False)
        # complex, so kept out of ``.to(dtype)`` (a buffer would be cast to real): moved by ``place``
        self.table = rope_table(s.d_model // s.n_heads, s.seq_len, s.rope_theta)

    def place(self, device: torch.device, dtype: torch.dtype) -> Llama:
        self.to(device, dtype)
        self.table = self.table.to(device)
        return self

    def forward(self, idx: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        x = self.tok_embeddings(idx)
        for layer in self.layers:
            x = layer(x, self.table)
        logits = self.output(self.norm(x))
        return F.cross_entropy(logits.flatten(0, 1).float(), targets.flatten(0, 1))


def kernel_class(name: str) -> str:
    n = name.lower()
    if "flash" in n or "fmha" in n or "attention" in n or "sdpa" in n:
        return "attention"
    if n.startswith("triton"):
        return "triton"
    if any(s in n for s in ("gemm", "xmma", "cutlass", "nvjet", "s16816", "wgmma")):
        return "gemm"
    if "copy" in n or "memcpy" in n or "memset" in n:
        return "copy"
    return "elementwise"


def measured(spec: ModelSpec, mb: int, compiled: bool, steps: int) -> dict:
    torch.manual_seed(0)
    dev = torch.device("cuda")
    model = Llama(spec).place(dev, torch.bfloat16)
    if compiled:
        for i, layer in enumerate(model.layers):
            model.layers[i] = torch.compile(layer, fullgraph=True)
    idx = torch.randint(0, spec.vocab_size, (mb, spec.seq_len), device=dev)
    tgt = torch.randint(0, spec.vocab_size, (mb, spec.seq_len), device=dev)

    def step() -> None:
        model.zero_grad(set_to_none=True)
        model(idx, tgt).backward()

    for _ in range(3):  # warm-up (and compilation)
        step()
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    step_s = timed(step, repeat=steps, warmup=0)  # warmed up above
    peak = torch.cuda.max_memory_allocated()
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(steps):
            step()
        torch.cuda.synchronize()
    by_class = dict.fromkeys(CLASSES, 0.0)
    kernels: dict[str, float] = {}
    for evt in prof.key_averages():
        us = getattr(evt, "self_device_time_total", None) or getattr(evt, "self_cuda_time_total", 0.0)
        if not us or evt.key.startswith("ProfilerStep"):
            continue
        by_class[kernel_class(evt.key)] += us / 1e6 / steps
        kernels[evt.key] = kernels.get(evt.key, 0.0) + us / 1e6 / steps
    top = sorted(kernels.items(), key=lambda kv: -kv[1])[:25]
    # the host's side: time to issue one step without waiting for the GPU (an eager step whose
    # host time exceeds its kernels' is launch-bound, which the wall time alone cannot tell)
    import time

    torch.cuda.synchronize()
    t0 = time.perf_counter()
    step()
    issue_s = time.perf_counter() - t0
    torch.cuda.synchronize()
    launches = sum(e.count for e in prof.key_averages() if (getattr(e, "self_device_time_total", 0) or 0) > 0)
    return {
        "step_s": step_s,
        # wall time the GPU ran no kernel: host-bound gaps, synchronisations
        "gpu_idle_s": max(0.0, step_s - sum(by_class.values())),
        "host_issue_s": issue_s,
        "kernels_per_step": launches / steps,
        "peak_bytes": peak,
        "by_class_s": by_class,
        "top_kernels_s": top,
        "device": torch.cuda.get_device_name(),
    }


def predicted(spec: ModelSpec, mb: int, compiled: bool, cluster_name: str) -> dict:
    stack = load_stack("torchtitan-compile" if compiled else "torchtitan")
    config = stack.configure(TrainingConfig(microbatch=mb, global_batch=mb, seq=spec.seq_len))
    if compiled:
        config = config.with_(eager_loss=True)  # the probe compiles the blocks only
    cluster = load_cluster(cluster_name, 1)
    cm = CostModel(spec=spec)
    est = cm.estimate(cluster, config)
    by_class = dict.fromkeys(CLASSES, 0.0)
    for row in kernel_costs(cm.profile_for(config), cluster, config):
        if row.kind == "matmul":
            cls = "gemm"
        elif row.kind == "attention":
            cls = "attention"
        else:  # generated code beside compiled blocks; ATen's kernels elsewhere
            cls = "triton" if compiled and row.part.startswith("block") else "elementwise"
        by_class[cls] += row.total_s
    st = est.stages[0]
    return {
        "compute_s": st.forward_s + st.backward_s,
        "by_class_s": by_class,
        "peak_bytes": est.memory.peak_bytes,
        "cluster": cluster_name,
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--seq", type=int, default=8192)
    ap.add_argument("--mb", type=int, default=1)
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--cluster", default=None, help="coplan preset to price on [default: by device name]")
    ap.add_argument("--dry-run", action="store_true", help="coplan's prices only (no GPU)")
    ap.add_argument("--modes", default="eager,compiled", help="which steps, in order [default: both]")
    ap.add_argument(
        "--partial", default=None, help="rewrite this file after each mode (a cut-short call keeps those)"
    )
    args = ap.parse_args()
    spec = spec_of(args.layers, args.seq)
    cluster = args.cluster
    if cluster is None:
        name = torch.cuda.get_device_name() if torch.cuda.is_available() else "H100"
        cluster = "dgx-h200" if "H200" in name else "dgx-a100-80gb" if "A100" in name else "dgx-h100"
    out = []
    modes = [m.strip() for m in args.modes.split(",") if m.strip()]
    bad = [m for m in modes if m not in ("eager", "compiled")]
    if bad:
        raise SystemExit(f"--modes: unknown mode {bad[0]!r} (eager, compiled)")
    for compiled in (m == "compiled" for m in modes):
        row = {"mode": "compiled blocks" if compiled else "eager", "layers": args.layers, "seq": args.seq}
        row["predicted"] = predicted(spec, args.mb, compiled, cluster)
        if not args.dry_run:
            row["measured"] = measured(spec, args.mb, compiled, args.steps)
        out.append(row)
        if args.partial:
            with open(args.partial, "w") as f:
                json.dump(out, f, indent=1)
    json.dump(out, sys.stdout, indent=1)
    print()
    print(f"{'mode':16} {'class':12} {'measured ms':>12} {'predicted ms':>13}", file=sys.stderr)
    for row in out:
        got = row.get("measured", {}).get("by_class_s", {})
        for cls in CLASSES:
            m = got.get(cls)
            p = row["predicted"]["by_class_s"][cls]
            ms = f"{m * 1e3:12.2f}" if m is not None else f"{'-':>12}"
            print(f"{row['mode']:16} {cls:12} {ms} {p * 1e3:13.2f}", file=sys.stderr)
        step = row.get("measured", {}).get("step_s")
        step_txt = f"{step * 1e3:.1f}" if step is not None else "-"
        got_m = row.get("measured", {})
        idle = got_m.get("gpu_idle_s")
        extra = (
            f", GPU idle {idle * 1e3:.1f} ms, host issue {got_m['host_issue_s'] * 1e3:.1f} ms for "
            f"{got_m['kernels_per_step']:.0f} kernels"
            if idle is not None
            else ""
        )
        print(
            f"{row['mode']:16} step ms measured {step_txt}, "
            f"priced compute {row['predicted']['compute_s'] * 1e3:.1f}{extra}",
            file=sys.stderr,
        )


if __name__ == "__main__":
    main()
