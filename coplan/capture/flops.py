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


def _cpu_flash_fwd(
    query_shape: Any, key_shape: Any, value_shape: Any, *args: Any, out_shape: Any = None, **kwargs: Any
) -> int:
    return int(sdpa_flop_count(query_shape, key_shape, value_shape))


def _cpu_flash_bwd(
    grad_out_shape: Any,
    query_shape: Any,
    key_shape: Any,
    value_shape: Any,
    *args: Any,
    out_shape: Any = None,
    **kwargs: Any,
) -> int:
    return int(sdpa_backward_flop_count(grad_out_shape, query_shape, key_shape, value_shape))


def register_missing_formulas() -> None:
    """Idempotent: a formula already present (registered by us or by a newer PyTorch) is kept."""
    for packet, fn in (
        (aten._scaled_dot_product_flash_attention_for_cpu, _cpu_flash_fwd),
        (aten._scaled_dot_product_flash_attention_for_cpu_backward, _cpu_flash_bwd),
    ):
        if packet not in flop_registry:
            register_flop_formula(packet)(fn)


register_missing_formulas()
