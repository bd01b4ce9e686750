"""A summary of a graph for people and for ``--json``: counts, FLOPs, parameters, saved bytes."""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass
from typing import Any

from coplan.ir.fingerprint import fingerprint
from coplan.ir.types import Graph, OpKind, Phase


@dataclass(frozen=True, slots=True)
class GraphSummary:
    model: str
    source: str
    batch: int
    seq: int
    optimizer: str
    params: int  # trainable parameters, tied weights once
    flops: int  # matrix-unit FLOPs per step (forward + backward), as FlopCounterMode counts them
    flops_by_phase: dict[str, int]
    vector_flops: int
    ops: int  # kernel-level ops, views included
    ops_by_phase: dict[str, int]
    ops_by_kind: dict[str, int]
    tensors: int
    activation_bytes: int  # forward activations kept for backward, each storage once
    blocks: int
    fingerprint: str
    capture_s: float

    def to_dict(self) -> dict[str, Any]:
        return {f: getattr(self, f) for f in self.__dataclass_fields__}


def summarize(graph: Graph) -> GraphSummary:
    by_phase = Counter(op.phase.value for op in graph.ops)
    by_kind = Counter(op.kind.value for op in graph.ops)
    return GraphSummary(
        model=graph.meta.model,
        source=graph.meta.source,
        batch=graph.meta.batch,
        seq=graph.meta.seq,
        optimizer=graph.meta.optimizer,
        params=graph.param_count,
        flops=graph.flops,
        flops_by_phase={p.value: f for p, f in graph.flops_by_phase().items()},
        vector_flops=sum(op.vector_flops for op in graph.ops),
        ops=len(graph.ops),
        ops_by_phase={p.value: by_phase.get(p.value, 0) for p in Phase},
        ops_by_kind={k.value: by_kind[k.value] for k in OpKind if by_kind.get(k.value)},
        tensors=len(graph.tensors),
        activation_bytes=graph.activation_bytes,
        blocks=len(graph.blocks),
        fingerprint=fingerprint(graph),
        capture_s=round(graph.meta.capture_s, 4),
    )
