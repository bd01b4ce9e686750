"""Helpers shared by the ``coplan.apply`` tests (not a test module)."""

from __future__ import annotations

from typing import Any

import torch

import coplan
from coplan.apply.train import batches, build
from coplan.models.spec import ModelSpec
from coplan.plan.types import Plan


def compiled_step(
    spec: ModelSpec, plan: Plan, batch: int, seq: int
) -> tuple[dict[str, int], list, Any, Any, Any]:
    """One step of ``spec`` compiled with coplan's backend under ``plan``: (what the compiled
    forward saved, by kind; (shape, dtype) of every tensor autograd saved; the model; the backend;
    the (inputs, targets) batch). The backward has run, so the model holds its gradients."""
    torch._dynamo.reset()
    model = build(spec, 0)
    be = coplan.backend(plan, spec)
    compiled = torch.compile(model, backend=be)
    idx, tgt = batches(spec, batch, seq, 1, 0)[0]
    be.reset_saved()
    shapes: list[tuple[tuple[int, ...], torch.dtype]] = []

    def pack(t: torch.Tensor) -> torch.Tensor:
        if not (t.is_leaf and t.requires_grad):
            shapes.append((tuple(t.shape), t.dtype))
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        loss = compiled(idx, tgt)
    saved = dict(be.last_saved)
    loss.backward()
    return saved, shapes, model, be, (idx, tgt)
