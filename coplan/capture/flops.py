"""Matrix FLOP formulas that ``torch.utils.flop_counter`` lacks, registered into its own registry.

PyTorch's registry counts the CUDA attention kernels but not the CPU flash-attention kernel that
``scaled_dot_product_attention`` dispatches to when a graph is traced on the CPU, so a CPU trace
would show attention as free. Registering the same formulas for the CPU kernels (once, at import)
makes both coplan's capture and ``FlopCounterMode`` count them, so the two keep agreeing.
"""

from __future__ import annotations

from typing import Any

import torch
from torch.utils.flop_counter import (
    flop_registry,
    register_flop_formula,
    sdpa_backward_flop_count,
    sdpa_flop_count,
)

aten = torch.ops.aten


def query_heads(query_shape: Any, key_shape: Any) -> tuple[int, ...]:
    """``key_shape`` with the query's head count: grouped-query attention's kernels broadcast each
    key/value head over its group, so the FLOPs are those of ``h_q`` full heads. PyTorch's formulas
    take GQA shapes only from 2.12 on (2.11's ``sdpa_flop_count`` asserts equal heads), and give
    the same count for the broadcast shape, so passing it keeps every supported version agreeing."""
    b, _, s, d = key_shape
    return (b, query_shape[1], s, d)


def _cpu_flash_fwd(
    query_shape: Any, key_shape: Any, value_shape: Any, *args: Any, out_shape: Any = None, **kwargs: Any
) -> int:
    return int(
        sdpa_flop_count(
            query_shape, query_heads(query_shape, key_shape), query_heads(query_shape, value_shape)
        )
    )


def _cpu_flash_bwd(
    grad_out_shape: Any,
    query_shape: Any,
    key_shape: Any,
    value_shape: Any,
    *args: Any,
    out_shape: Any = None,
    **kwargs: Any,
) -> int:
    kv = query_heads(query_shape, key_shape), query_heads(query_shape, value_shape)
    return int(sdpa_backward_flop_count(grad_out_shape, query_shape, *kv))


def register_missing_formulas() -> None:
    """Idempotent: a formula already present (registered by us or by a newer PyTorch) is kept."""
    for packet, fn in (
        (aten._scaled_dot_product_flash_attention_for_cpu, _cpu_flash_fwd),
        (aten._scaled_dot_product_flash_attention_for_cpu_backward, _cpu_flash_bwd),
    ):
        if packet not in flop_registry:
            register_flop_formula(packet)(fn)


register_missing_formulas()
