"""High-level capture entry points: a module, a model spec, or a Hugging Face model."""

from __future__ import annotations

from typing import Any

from torch import nn
from torch._subclasses.fake_tensor import FakeTensorMode

from coplan.capture.convert import to_graph
from coplan.capture.trace import LossFn, OptimizerFactory, default_loss, default_optimizer, trace_step
from coplan.ir.types import Graph, GraphMeta
from coplan.models.spec import ModelSpec
from coplan.models.transformer import Transformer, example_batch


def capture_module(
    module: nn.Module,
    args: tuple[Any, ...],
    kwargs: dict[str, Any] | None = None,
    *,
    loss_fn: LossFn = default_loss,
    optimizer: OptimizerFactory = default_optimizer,
    name: str = "",
    batch: int = 0,
    seq: int = 0,
    source: str = "capture",
) -> Graph:
    """The IR of one training step of ``module``: ``loss_fn(module(*args, **kwargs))``, backward,
    and one ``optimizer`` step. Real tensors are replaced by fake ones; nothing is computed."""
    step = trace_step(module, args, kwargs, loss_fn=loss_fn, optimizer=optimizer)
    meta = GraphMeta(
        model=name or type(module).__name__,
        source=source,
        batch=batch,
        seq=seq,
        optimizer=step.optimizer,
        capture_s=step.seconds,
        block_container=step.block_container,
    )
    return to_graph(step, meta)


def capture_spec(
    spec: ModelSpec, batch: int = 1, seq: int | None = None, optimizer: OptimizerFactory = default_optimizer
) -> Graph:
    """Build the built-in model of ``spec`` with fake parameters and capture one training step."""
    s = spec.resolve_seq(seq)
    with FakeTensorMode(allow_non_fake_inputs=True):
        model = Transformer(spec)
        idx, targets = example_batch(spec, batch, s)
    return capture_module(model, (idx, targets), optimizer=optimizer, name=spec.name, batch=batch, seq=s)


def capture_hf(
    spec: ModelSpec, batch: int = 1, seq: int | None = None, optimizer: OptimizerFactory = default_optimizer
) -> Graph:
    """Capture the Hugging Face ``transformers`` model of ``spec`` (built from a config, no weights)."""
    from coplan.models.hf import hf_model

    s = spec.resolve_seq(seq)
    with FakeTensorMode(allow_non_fake_inputs=True):
        model = hf_model(spec)
        idx, targets = example_batch(spec, batch, s)
    model.train()
    return capture_module(
        model,
        (),
        {"input_ids": idx, "labels": targets},
        optimizer=optimizer,
        name=spec.name,
        batch=batch,
        seq=s,
        source="hf",
    )
