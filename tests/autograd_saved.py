"""What eager autograd saves for backward, measured with ``torch.autograd.graph.saved_tensors_hooks``:
shared by the capture tier (the captured saved set against autograd's) and the unit tier (the
priced saved bytes of stacks' blocks against autograd's)."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import torch


@contextmanager
def saved_storages(skip: set[int]) -> Iterator[dict[int, int]]:
    """The bytes of each storage autograd packs for backward inside the block, by data pointer;
    storages in ``skip`` (parameters, inputs: it may grow inside the block) left out."""
    seen: dict[int, int] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        st = t.untyped_storage()
        if st.data_ptr() not in skip:
            seen[st.data_ptr()] = st.nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        yield seen
