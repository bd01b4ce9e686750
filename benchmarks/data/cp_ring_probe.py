"""One rank's ring attention under PyTorch's context parallelism, kernel by kernel on one GPU, beside
what coplan prices for it: the probe of torchtitan's context-parallel rows, whose attention runs
1.5-1.7x its price from CP 4 on (docs/stacks.md, "Context parallelism beyond two ranks"), for a
lent GPU:

    python benchmarks/data/cp_ring_probe.py --seq 262144 --cp 8 > cp_ring_probe.json
    python benchmarks/data/cp_ring_probe.py --seq 262144 --cp 8 --dry-run   # coplan's side, no GPU

PyTorch's ``context_parallel`` (``torch/distributed/tensor/experimental/_attention.py``,
``_templated_ring_attention`` and its backward, load balancing on, as torchtitan runs it) gives
each rank two chunks of the sequence and runs one flash-attention call per ring step: the first on
its own keys with the causal mask, then ``rank`` steps with all its queries against the first half
of another rank's keys and ``cp - 1 - rank`` steps with the second half of its queries against all
of another rank's keys, each output merged into an fp32 accumulator (``_SDPAMerger``), and in
backward the step's gradients added into fp32 buffers. No collective runs here: the keys of the
other ranks are tensors of the same shapes, so what is timed is the rank's kernels alone (the
FLOPs of every rank are the same, ``ring_steps``). Llama-3 8B's attention: 32 query heads, the
8 key/value heads repeated for SDPA (``repeat_kv``), head dimension 128, one sequence.

Per step: the flash kernels forward and backward (CUDA events, median), their TFLOP/s on the
counted FLOPs (4 x heads x head dim x queries x keys, half of it under the causal mask), and the
merges; then the totals beside coplan's attention kernels of one block of the same rank under the
``torchtitan-compile`` preset (``coplan.cost.explain.kernel_costs``). Whether the kernels
themselves run slower than priced at these shapes, or the time goes to the ring around them, is
what the totals say.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import NamedTuple

sys.path.insert(0, str(Path(__file__).parent))  # this folder's probes, run or loaded by path

from h100_step_probe import spec_of  # the same LLaMA-3 8B-shaped blocks

from coplan.cost import CostModel, TrainingConfig, load_stack
from coplan.cost.explain import kernel_costs
from coplan.hardware import load_cluster

HEADS, HEAD_DIM = 32, 128  # spec_of's query heads (its 8 key/value heads repeated) and head size


class Step(NamedTuple):
    """One ring step's flash-attention call: query and key lengths, the causal mask or none, and
    whether only the second half of the queries takes part (the merge updates half the output)."""

    queries: int
    keys: int
    causal: bool
    partial: bool


def ring_steps(cp: int, rank: int, local: int) -> list[Step]:
    """The flash-attention calls of ``rank`` of ``cp`` holding ``local`` tokens, in ring order, as
    ``_templated_ring_attention`` makes them with load balancing (``_is_causal_behavior``)."""
    if not 0 <= rank < cp or local % 2:
        raise ValueError(f"rank {rank} of {cp} with {local} local tokens (an even count)")
    steps = [Step(local, local, True, False)]
    for i in range(1, cp):
        if i <= rank:  # all the queries, the first half of the other rank's keys
            steps.append(Step(local, local // 2, False, False))
        else:  # the second half of the queries, all the other rank's keys
            steps.append(Step(local // 2, local, False, True))
    return steps


def step_flops(step: Step, heads: int = HEADS, head_dim: int = HEAD_DIM) -> float:
    """Forward FLOPs of one call as coplan counts attention: two GEMMs over the score matrix, half
    of it under the causal mask (backward is 2.5 times this)."""
    return 4.0 * heads * head_dim * step.queries * step.keys * (0.5 if step.causal else 1.0)


def priced(seq: int, cp: int, cluster_name: str) -> dict[str, object]:
    """coplan's attention kernels of one block on one rank of ``cp`` (forward and backward seconds)."""
    stack = load_stack("torchtitan-compile")
    config = stack.configure(TrainingConfig(cp=cp, microbatch=1, global_batch=1, seq=seq))
    cluster = load_cluster(cluster_name, cp)
    cm = CostModel(spec=spec_of(1, seq))
    out = {"forward_s": 0.0, "backward_s": 0.0}
    for row in kernel_costs(cm.profile_for(config), cluster, config):
        if row.kind == "attention" and row.part.startswith("block"):
            out[f"{row.phase}_s"] += row.total_s
    return out | {"cluster": cluster_name, "stack": stack.name}


def measured(steps: list[Step], repeat: int) -> list[dict[str, float]]:  # pragma: no cover - a GPU
    import torch
    import torch.nn.functional as F
    from h100_microbench import timed  # this folder's CUDA-event timing
    from torch.nn.attention import SDPBackend, sdpa_kernel

    dev, bf16 = "cuda", torch.bfloat16
    local = steps[0].queries
    out32 = torch.zeros(1, HEADS, local, HEAD_DIM, device=dev)
    lse = torch.zeros(1, HEADS, local, 1, device=dev)
    rows = []
    for step in steps:
        q = torch.randn(1, HEADS, step.queries, HEAD_DIM, device=dev, dtype=bf16, requires_grad=True)
        k = torch.randn(1, HEADS, step.keys, HEAD_DIM, device=dev, dtype=bf16, requires_grad=True)
        v = torch.randn_like(k, requires_grad=True)
        grad = torch.randn(1, HEADS, step.queries, HEAD_DIM, device=dev, dtype=bf16)

        def forward(q=q, k=k, v=v, step=step):
            with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
                return F.scaled_dot_product_attention(q, k, v, is_causal=step.causal)

        def both(forward=forward, grad=grad):
            forward().backward(grad)

        fwd_s = timed(forward, repeat)
        bwd_s = max(0.0, timed(both, repeat) - fwd_s)
        half = slice(local // 2, None) if step.partial else slice(None)
        block = torch.randn(1, HEADS, step.queries, HEAD_DIM, device=dev, dtype=bf16)
        block_lse = torch.randn(1, HEADS, step.queries, 1, device=dev)

        def merge(block=block, block_lse=block_lse, half=half, partial=step.partial):
            # _SDPAMerger._merge_one: fp32, and _partial_update's cat for a half-query step
            o, s = out32[:, :, half], lse[:, :, half]
            o = o - torch.sigmoid(block_lse - s) * (o - block.float())
            s = s - F.logsigmoid(s - block_lse)
            if partial:
                torch.cat([out32[:, :, : local // 2], o], dim=2)
                torch.cat([lse[:, :, : local // 2], s], dim=2)

        flops = step_flops(step)
        rows.append(
            {
                **step._asdict(),
                "forward_s": fwd_s,
                "backward_s": bwd_s,
                "merge_s": timed(merge, repeat),
                "forward_tflops": flops / fwd_s / 1e12 if fwd_s else 0.0,
                "backward_tflops": 2.5 * flops / bwd_s / 1e12 if bwd_s else 0.0,
            }
        )
        del q, k, v, grad
        torch.cuda.empty_cache()
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seq", type=int, default=262144, help="tokens of the sequence over all ranks")
    ap.add_argument("--cp", type=int, default=8)
    ap.add_argument("--rank", type=int, default=0, help="the rank emulated (all do the same FLOPs)")
    ap.add_argument("--repeat", type=int, default=5)
    ap.add_argument("--cluster", default="grand-teton-h100", help="coplan preset to price on")
    ap.add_argument("--dry-run", action="store_true", help="the steps and coplan's prices only (no GPU)")
    args = ap.parse_args()
    if args.seq % (2 * args.cp):
        sys.exit(f"error: --seq {args.seq} must divide into 2 x --cp {args.cp} chunks")
    try:
        steps = ring_steps(args.cp, args.rank, args.seq // args.cp)
    except ValueError as e:
        sys.exit(f"error: {e}")
    out: dict[str, object] = {
        "seq": args.seq,
        "cp": args.cp,
        "rank": args.rank,
        "steps": [s._asdict() | {"forward_flops": step_flops(s)} for s in steps],
        "forward_flops": sum(step_flops(s) for s in steps),
        "priced": priced(args.seq, args.cp, args.cluster),
    }
    if not args.dry_run:  # pragma: no cover - a GPU
        import torch

        rows = measured(steps, args.repeat)
        out["steps"] = rows
        out["device"] = torch.cuda.get_device_name()
        out["measured"] = {key: sum(r[key] for r in rows) for key in ("forward_s", "backward_s", "merge_s")}
    print(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
