"""Helpers shared by the ``coplan.apply`` tests (not a test module)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch
from torch import fx

import coplan
from coplan.apply.step import batches, build
from coplan.models.spec import ModelSpec
from coplan.plan.types import Plan


def _not_a_parameter(t: torch.Tensor) -> bool:
    return not (t.is_leaf and t.requires_grad)


def compiled_step(
    spec: ModelSpec,
    plan: Plan,
    batch: int,
    seq: int,
    keep: Callable[[torch.Tensor], bool] = _not_a_parameter,
) -> tuple[dict[str, int], list, Any, Any, Any]:
    """One step of ``spec`` compiled with coplan's backend under ``plan``: (what the compiled
    forward saved, by kind; (shape, dtype) of every tensor autograd saved that ``keep`` accepts,
    by default all but parameters; the model; the backend; the (inputs, targets) batch). The
    backward has run, so the model holds its gradients."""
    torch._dynamo.reset()
    model = build(spec, 0)
    be = coplan.backend(plan, spec)
    compiled = torch.compile(model, backend=be)
    idx, tgt = batches(spec, batch, seq, 1, 0)[0]
    be.reset_saved()
    shapes: list[tuple[tuple[int, ...], torch.dtype]] = []

    def pack(t: torch.Tensor) -> torch.Tensor:
        if keep(t):
            shapes.append((tuple(t.shape), t.dtype))
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        loss = compiled(idx, tgt)
    saved = dict(be.last_saved)
    loss.backward()
    return saved, shapes, model, be, (idx, tgt)


def spied_step(
    spec: ModelSpec,
    plan: Plan,
    batch: int,
    seq: int,
    seen: Callable[[fx.GraphModule, str], None],
    compile_kernels: bool = False,
) -> Any:
    """One training step of ``spec`` compiled with coplan's backend under ``plan``, with a spy in
    place of Inductor: ``seen(graph, phase)`` gets each graph the backend hands Inductor (its plan
    ops labelled). With ``compile_kernels`` Inductor still compiles it; without, the graph runs
    eagerly (no compile). Returns the backend (its report and IR)."""
    from functorch.compile import make_boxed_func

    from coplan.apply import fusion

    inductor = fusion._inductor

    def spy(gm, inputs, groups, phase, gemm_epilogues=False):  # type: ignore[no-untyped-def]
        seen(gm, phase)
        if compile_kernels:
            return inductor(gm, inputs, groups, phase, gemm_epilogues)
        return make_boxed_func(gm), {"phase": phase, "honoured": [], "not_honoured": [], "groups_planned": 0}

    torch._dynamo.reset()
    be = coplan.backend(plan, spec)
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(fusion, "_inductor", spy)
        model = torch.compile(build(spec, 0), backend=be)
        idx, tgt = batches(spec, batch, seq, 1, 0)[0]
        model(idx, tgt).backward()
    return be
