"""Trace one real training step (forward, backward, optimizer update) into an FX graph, without memory.

The step is traced with ``make_fx`` under a ``FakeTensorMode``: parameters, optimizer state and the
batch are fake tensors, so a 70B model traces on a laptop. Autograd runs for real during tracing,
which records the backward ops exactly as the engine issues them (the same mechanism AOTAutograd
uses for its joint graph), and the optimizer's own ``step()`` is traced as ``torch.compile`` traces
it. Three annotations are attached to every node through ``torch.fx.traceback``:

- ``custom["phase"]``: forward / backward / optimizer, from where in the step the node was issued;
- ``custom["module"]``: the module path whose ``forward`` issued the node (forward hooks);
- ``seq_nr`` (forward nodes, set by FX) and ``custom["grad_fn_seq"]`` (backward nodes, set by
  hooks on the autograd graph): equal for a forward node and the backward nodes of the autograd
  function it created, which is how backward ops are linked to their forward op.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any
from unittest import mock

import torch
import torch.fx.traceback as fxt
from torch import nn
from torch._subclasses.fake_tensor import FakeTensor, FakeTensorMode
from torch.fx.experimental.proxy_tensor import make_fx
from torch.utils._pytree import tree_flatten, tree_map

from coplan.errors import CaptureError

OptimizerFactory = Callable[[list[torch.Tensor]], torch.optim.Optimizer]
LossFn = Callable[[Any], torch.Tensor]


def default_optimizer(params: list[torch.Tensor]) -> torch.optim.Optimizer:
    """AdamW as GPT-2/LLaMA recipes train it; per-tensor (not foreach) so every update op has one
    parameter, and so one module path and block."""
    return torch.optim.AdamW(params, lr=3e-4, betas=(0.9, 0.95), weight_decay=0.1, foreach=False)


def default_loss(output: Any) -> torch.Tensor:
    """The module's loss: a scalar output, a ``.loss`` attribute (Hugging Face), or a tuple's head."""
    if isinstance(output, torch.Tensor):
        if output.dim() != 0:
            raise CaptureError(
                f"the model returned a tensor of shape {tuple(output.shape)}, not a scalar loss; pass loss_fn"
            )
        return output
    loss = getattr(output, "loss", None)
    if isinstance(loss, torch.Tensor):
        return loss
    if isinstance(output, tuple | list) and output and isinstance(output[0], torch.Tensor):
        return default_loss(output[0])
    raise CaptureError(
        f"cannot find a loss in the model's output of type {type(output).__name__}; pass loss_fn"
    )


@dataclass(frozen=True, slots=True)
class TracedStep:
    """The traced FX graph plus what each placeholder is."""

    gm: torch.fx.GraphModule
    param_names: tuple[str, ...]  # one per distinct parameter storage, in placeholder order
    buffer_names: tuple[str, ...]
    state_keys: tuple[tuple[int, str], ...]  # (param index, state key) per optimizer-state placeholder
    n_inputs: int
    module_paths: tuple[str, ...]  # every named module, for block detection
    block_container: str
    optimizer: str
    seconds: float


def _traceable(opt: torch.optim.Optimizer) -> torch.optim.Optimizer:
    # The capturable variant keeps the step counter and bias corrections on the device as tensors
    # (the form CUDA graphs and torch.compile use); the default form reads them back to Python
    # floats, which fake tensors cannot provide. The update math is the same.
    for group in opt.param_groups:
        if "capturable" in group:
            group["capturable"] = True
    return opt


@contextlib.contextmanager
def _optimizer_tracing() -> Iterator[None]:
    # Optimizers read their step counter with .item() unless they are being compiled; traced with
    # fake tensors there is no value to read, so trace them the way torch.compile does.
    with mock.patch("torch.compiler.is_compiling", return_value=True):
        yield


class _AnnotationStack:
    """Annotations entered by one hook and left by its partner (pre/post hooks of a module or of an
    autograd function); whatever is still entered when tracing ends is left, and hooks removed."""

    def __init__(self) -> None:
        self.entered: list[contextlib.AbstractContextManager[Any]] = []
        self.handles: list[Any] = []

    def push(self, annotation: dict[str, Any]) -> None:
        cm = fxt.annotate(annotation)
        cm.__enter__()
        self.entered.append(cm)

    def pop(self, *_args: Any) -> None:
        if self.entered:
            self.entered.pop().__exit__(None, None, None)

    def close(self) -> None:
        for h in self.handles:
            h.remove()
        while self.entered:
            self.pop()


@contextlib.contextmanager
def _module_annotations(module: nn.Module) -> Iterator[None]:
    """Annotate every node with the path of the innermost module whose forward issued it."""
    stack = _AnnotationStack()
    for path, sub in module.named_modules():
        if path:
            enter = lambda _m, _a, p=path: stack.push({"module": p})  # noqa: E731
            stack.handles.append(sub.register_forward_pre_hook(enter))
            stack.handles.append(sub.register_forward_hook(stack.pop))
    try:
        yield
    finally:
        stack.close()


@contextlib.contextmanager
def _grad_fn_annotations(loss: torch.Tensor) -> Iterator[None]:
    """Annotate every backward node with the sequence number of the autograd function executing it.

    Nodes the engine issues between functions (gradient accumulation for a value used twice) get
    no annotation, so they are not mistaken for part of whichever function ran last.
    """
    stack = _AnnotationStack()
    seen: set[torch.autograd.graph.Node] = set()
    todo: list[torch.autograd.graph.Node | None] = [loss.grad_fn]
    while todo:
        fn = todo.pop()
        if fn is None or fn in seen:
            continue
        seen.add(fn)
        seq = fn._sequence_nr()
        stack.handles.append(fn.register_prehook(lambda _g, s=seq: stack.push({"grad_fn_seq": s})))
        stack.handles.append(fn.register_hook(stack.pop))
        todo.extend(nxt for nxt, _ in fn.next_functions)
    try:
        yield
    finally:
        stack.close()


def find_block_container(module: nn.Module) -> str:
    """The module path of the repeated-layer list: the ``ModuleList``/``Sequential`` of two or more
    children of one class holding the most parameters ("h", "model.layers")."""
    best, best_params = "", 0
    for path, sub in module.named_modules():
        if not isinstance(sub, nn.ModuleList | nn.Sequential) or len(sub) < 2:
            continue
        children = list(sub.children())
        if len({type(c) for c in children}) != 1:
            continue
        n = sum(p.numel() for p in sub.parameters())
        if n > best_params:
            best, best_params = path, n
    return best


def _fake_mode_for(tensors: Sequence[torch.Tensor]) -> FakeTensorMode:
    for t in tensors:
        if isinstance(t, FakeTensor):
            return t.fake_mode
    return FakeTensorMode(allow_non_fake_inputs=True)


def trace_step(
    module: nn.Module,
    args: tuple[Any, ...],
    kwargs: dict[str, Any] | None = None,
    *,
    loss_fn: LossFn = default_loss,
    optimizer: OptimizerFactory = default_optimizer,
) -> TracedStep:
    """Trace ``loss_fn(module(*args, **kwargs))``, its gradients and one optimizer step."""
    kwargs = kwargs or {}
    t0 = time.perf_counter()
    named_params = [(n, p) for n, p in module.named_parameters() if p.requires_grad]
    named_buffers = list(module.named_buffers())
    flat_inputs, _ = tree_flatten((args, kwargs))
    tensors = [p for _, p in named_params] + [b for _, b in named_buffers]
    tensors += [x for x in flat_inputs if isinstance(x, torch.Tensor)]
    fake_mode = _fake_mode_for(tensors)

    def fake(t: Any) -> Any:
        if not isinstance(t, torch.Tensor) or isinstance(t, FakeTensor):
            return t
        return fake_mode.from_tensor(t)

    params = [fake(p).detach().requires_grad_(True) for _, p in named_params]
    buffers = [fake(b) for _, b in named_buffers]
    f_args, f_kwargs = tree_map(fake, (args, kwargs))
    param_names = tuple(n for n, _ in named_params)
    buffer_names = tuple(n for n, _ in named_buffers)

    # One untraced step on stand-in tensors tells which state the optimizer keeps per parameter,
    # so the traced step can start from a warm state (as every step but the first does).
    with fake_mode:
        probe = [torch.empty_like(p) for p in params]
        try:
            probe_opt = _traceable(optimizer(probe))
        except Exception as e:
            raise CaptureError(f"cannot build the optimizer: {e}") from None
        for p in probe:
            p.grad = torch.zeros_like(p)
        with _optimizer_tracing(), torch.no_grad():
            probe_opt.step()
        state_keys: list[tuple[int, str]] = []
        state_vals: list[torch.Tensor] = []
        for i, p in enumerate(probe):
            for key, val in sorted(probe_opt.state[p].items()):
                if isinstance(val, torch.Tensor):
                    state_keys.append((i, key))
                    state_vals.append(torch.empty_like(val))
    opt_name = type(probe_opt).__name__
    static_state = [
        {k: v for k, v in probe_opt.state[p].items() if not isinstance(v, torch.Tensor)} for p in probe
    ]

    def step(
        p_in: list[torch.Tensor],
        b_in: list[torch.Tensor],
        s_in: list[torch.Tensor],
        a_in: tuple[Any, ...],
        k_in: dict[str, Any],
    ) -> Any:
        state = dict(zip(param_names, p_in, strict=True)) | dict(zip(buffer_names, b_in, strict=True))
        with fxt.annotate({"phase": "forward"}), _module_annotations(module):
            out = torch.func.functional_call(module, state, a_in, k_in, tie_weights=True)
            loss = loss_fn(out)
        if not isinstance(loss, torch.Tensor) or loss.dim() != 0 or not loss.requires_grad:
            raise CaptureError("the loss must be a scalar tensor that depends on the parameters")
        with fxt.annotate({"phase": "backward"}), _grad_fn_annotations(loss):
            grads = torch.autograd.grad(loss, p_in, allow_unused=True)
        with fxt.annotate({"phase": "optimizer"}), _optimizer_tracing(), torch.no_grad():
            live = [p.detach() for p in p_in]
            opt = _traceable(optimizer(live))
            for p, g in zip(live, grads, strict=True):
                p.grad = g
            per_param: list[dict[str, Any]] = [dict(s) for s in static_state]
            for (i, key), val in zip(state_keys, s_in, strict=True):
                per_param[i][key] = val
            for p, st in zip(live, per_param, strict=True):
                if st:
                    opt.state[p] = st
            opt.step()
        new_state = [opt.state[live[i]][key] for i, key in state_keys]
        # Gradients are returned only so conversion can tell which value is which parameter's
        # gradient; they are not outputs of the step (the optimizer consumes them).
        return loss.detach(), live, new_state, list(grads)

    inputs = (params, buffers, state_vals, tuple(f_args), dict(f_kwargs))
    try:
        with fxt.preserve_node_meta():
            gm = make_fx(step, tracing_mode="fake")(*inputs)
    except CaptureError:
        raise
    except Exception as e:
        msg = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise CaptureError(f"tracing {type(module).__name__} failed: {type(e).__name__}: {msg}") from e
    gm.graph.eliminate_dead_code()
    n_inputs = len(tree_flatten((f_args, f_kwargs))[0])
    return TracedStep(
        gm=gm,
        param_names=param_names,
        buffer_names=buffer_names,
        state_keys=tuple(state_keys),
        n_inputs=n_inputs,
        module_paths=tuple(n for n, _ in module.named_modules()),
        block_container=find_block_container(module),
        optimizer=opt_name,
        seconds=time.perf_counter() - t0,
    )
