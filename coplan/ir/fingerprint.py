"""A stable fingerprint of a graph: the same for the same model captured twice or in another process,
different after any change of op, shape, dtype or edge.

Names are left out (they are labels, not meaning), and so are derived costs and capture metadata;
everything that defines the computation is in: each op's target, arguments, phase, edges, forward
link, module path and block, and each tensor's shape, dtype, role, aliasing and saved flag.
"""

from __future__ import annotations

import hashlib

from coplan.ir.types import Graph


def _op_line(op_fields: tuple[object, ...]) -> bytes:
    return repr(op_fields).encode()


def fingerprint(graph: Graph, length: int = 16) -> str:
    """Hex digest (sha256) of the graph's canonical form, truncated to ``length`` characters."""
    h = hashlib.sha256()
    h.update(b"coplan-ir-v1\n")
    for t in graph.tensors:
        h.update(
            _op_line(
                (
                    "T",
                    t.shape,
                    t.dtype,
                    t.role.value,
                    t.alias_of,
                    t.grad_of,
                    t.updates,
                    t.saved_for_backward,
                    t.param_name,
                )
            )
        )
    for op in graph.ops:
        h.update(
            _op_line(
                (
                    "O",
                    op.target,
                    op.kind.value,
                    op.phase.value,
                    op.inputs,
                    op.outputs,
                    op.args,
                    op.forward_op,
                    op.module_path,
                    op.block,
                )
            )
        )
    h.update(repr(("out", graph.outputs)).encode())
    return h.hexdigest()[:length]
