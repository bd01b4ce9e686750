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
around again and their gradients with them, twice the bytes a step. PyTorch's ring attention,
which torchtitan's ``context_parallel_degree`` runs
(``torch/distributed/tensor/experimental/_attention.py``), moves the same chunks.

What shows is what a step's transfer outlasts its step of attention, ``cp - 1`` times each way
(``ring_exposed``); the transfers run between neighbouring ranks ``tp`` apart (Megatron-Core's
rank order puts the context-parallel ranks right after the tensor-parallel ones), inside a node
while ``tp x cp`` fits one.
"""

from __future__ import annotations

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
