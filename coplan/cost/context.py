"""Context parallelism's ring attention: what one rank's attention waits for.

Under context parallelism over ``cp`` ranks each rank holds ``seq / cp`` tokens of every sequence
(two of ``2 cp`` chunks, which balances a causal mask), so every op of the step but attention runs
on its own tokens (the graph of one rank: ``coplan.capture.synthetic.build_graph(cp=...)``), and
attention meets every rank's keys and values, which travel around a ring. Transformer Engine's
``AttnFuncWithCPAndKVP2P`` (``transformer_engine/pytorch/attention.py``; what Megatron-Core's
``TEDotProductAttention`` runs under ``--context-parallel-size`` with ``cp_comm_type`` "p2p", its
default) runs ``cp`` steps forward: step ``i`` computes the local queries against the key/value
chunk received at step ``i - 1`` while it sends that chunk on and receives the next, so each of the
``cp - 1`` transfers hides behind one step's attention; backward passes the keys and values
around again and their gradients with them, twice the bytes a step.

PyTorch's ``context_parallel``, which torchtitan's ``context_parallel_degree`` runs, moves the same
chunks another way by default (``torch/distributed/tensor/experimental/_context_parallel/
_attention.py`` at v2.13.0, ``_ContextParallelOptions``: ``rotate_method`` ALL_GATHER,
``convert_to_f32`` True; ``TrainingConfig.cp_exchange`` "allgather", ``torch_ring``): forward
all-gathers every rank's keys and values at once beside the first step, and merges each step's
output into an fp32 running output (``_SDPAMerger``); backward all-gathers them again, passes the
key/value gradients around the ring in fp32, a transfer a step and the last one after the loop,
and accumulates the query and key/value gradients in fp32.

What shows is what a step's transfer outlasts its step of attention, ``cp - 1`` times each way
(``ring_exposed``); the transfers run between neighbouring ranks ``tp`` apart (Megatron-Core's
rank order puts the context-parallel ranks right after the tensor-parallel ones), inside a node
while ``tp x cp`` fits one.
"""

from __future__ import annotations

from collections.abc import Callable

from coplan.ir.types import Graph, Op


def kv_elements(graph: Graph, op: Op) -> tuple[float, int]:
    """(elements of the keys plus values, key/value heads) one forward attention op reads: its key
    and value tensors, or, where it reads slices of the fused QKV projection (the synthetic
    builder's learned-position model), that projection's share of them."""
    ins = [graph.tensors[t] for t in dict.fromkeys(op.inputs)]
    out = graph.tensors[op.outputs[0]]
    if len(out.shape) != 4:
        return 0.0, 1
    heads, head_dim = out.shape[1], out.shape[3]
    four_d = [t for t in ins if len(t.shape) == 4]
    if len(four_d) >= 2:
        k = four_d[1]
        return 2.0 * k.numel, k.shape[1]
    fused = max(ins, key=lambda t: t.numel)
    width = fused.shape[-1]
    kv_width = (width - heads * head_dim) / 2
    return 2.0 * fused.numel * kv_width / width, max(1, round(kv_width / head_dim))


def ring_exposed(attention_s: float, transfer_s: float, cp: int) -> float:
    """Seconds ``cp - 1`` ring transfers of ``transfer_s`` each add to ``attention_s`` of attention
    split into ``cp`` equal steps, each transfer beside one step."""
    if cp <= 1:
        return 0.0
    return (cp - 1) * max(0.0, transfer_s - attention_s / cp)


def allgather_exposed(attention_s: float, transfer_s: float, cp: int) -> float:
    """Seconds an all-gather of ``cp`` chunks (``cp - 1`` chunk transfers of ``transfer_s`` into
    each rank) adds to ``attention_s`` of attention split into ``cp`` steps, all of it beside the
    first step."""
    if cp <= 1:
        return 0.0
    return max(0.0, (cp - 1) * transfer_s - attention_s / cp)


#: Bytes a rank moves per element of its attention output (``q``) and of its keys plus values
#: (``kv``) outside the attention kernels, in PyTorch's ``context_parallel`` with fp32 merging, for
#: the rank that runs every step on its whole queries (the last: the steps' load balancing runs
#: the others' later steps on half of them). Forward: each step's output cast to fp32 (read 2,
#: write 4), the later steps' merge ``out - sigmoid(lse_i - lse) * (out - out_i)`` (three fp32
#: passes of two reads and a write: 32), the result cast back (6), and the keys and values
#: concatenated for the exchange at each step but the last (read and write 2 each). Backward: the
#: fp32 gradients zeroed (4 each), every step's gradients added into them in fp32 (read 2, read and
#: write 4: 10 each), the key/value gradients concatenated in fp32 for the ring (8 a step), the
#: keys and values concatenated for it (4, each step but the last), and both cast back (6 each).
#: Where Inductor compiles the blocks (dynamo traces the ring's Python into the block's graph), a
#: later step's cast and merge are one generated kernel: the step's 16-bit output and the fp32
#: running output read, the running output written (``forward_q_step_compiled``).
TORCH_CP_BYTES = {
    "forward_q_first": 6.0 + 6.0,  # step 0's cast and the final cast back
    "forward_q_step": 6.0 + 32.0,  # each later step's cast and merge
    "forward_q_step_compiled": 2.0 + 4.0 + 4.0,
    "forward_kv_step": 4.0,  # each step but the last
    "backward_q_once": 4.0 + 6.0,
    "backward_q_step": 10.0,
    "backward_kv_once": 4.0 + 6.0,
    "backward_kv_step": 10.0 + 8.0,
    "backward_kv_step_but_last": 4.0,
}


def torch_ring(
    attention: tuple[float, float],
    kv_transfer: Callable[[float], float],
    kv_bytes: float,
    act_bytes: float,
    q_elements: float,
    kv_elements: float,
    bandwidth: float,
    cp: int,
    compiled: bool = False,
) -> tuple[float, float]:
    """(forward, backward) seconds PyTorch's ``context_parallel`` adds to a block's attention of
    ``attention`` = (forward, backward) seconds split into ``cp`` steps: the exposed exchanges of
    ``kv_bytes`` of keys and values (``kv_transfer`` prices one chunk's transfer) and the fp32
    merging passes over ``q_elements`` output and ``kv_elements`` key/value elements at
    ``bandwidth`` bytes/s (``TORCH_CP_BYTES``; ``compiled``: each merge one generated kernel)."""
    if cp <= 1:
        return 0.0, 0.0
    fwd_s, bwd_s = attention
    b = TORCH_CP_BYTES
    later = cp - 1
    merge = b["forward_q_step_compiled"] if compiled else b["forward_q_step"]
    fwd_bytes = q_elements * (b["forward_q_first"] + later * merge)
    fwd_bytes += kv_elements * later * b["forward_kv_step"]
    bwd_bytes = q_elements * (b["backward_q_once"] + cp * b["backward_q_step"])
    bwd_bytes += kv_elements * (
        b["backward_kv_once"] + cp * b["backward_kv_step"] + later * b["backward_kv_step_but_last"]
    )
    gather = kv_transfer(kv_bytes)
    grads = kv_transfer(kv_bytes * 4.0 / act_bytes)  # the key/value gradients, in fp32
    forward = allgather_exposed(fwd_s, gather, cp) + fwd_bytes / bandwidth
    backward = allgather_exposed(bwd_s, gather, cp) + ring_exposed(bwd_s, grads, cp) + grads
    return forward, backward + bwd_bytes / bandwidth
