"""Compile and run one training step with ``torch.compile`` under the observers, then time it.

The step is what a PyTorch user compiles: the module under ``torch.compile`` (Dynamo captures the
forward, AOTAutograd derives the backward, Inductor compiles both) and the optimizer's ``step``
under ``torch.compile`` (PyTorch's recommended way to compile an optimizer; its few graph breaks
around the step's hooks are PyTorch's own and are reported as such).
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from coplan.errors import CoplanError
from coplan.inspect.observe import Collector, observe

LossFn = Callable[[Any], torch.Tensor]


class CompileError(CoplanError):
    """``torch.compile`` failed on the step; the message names the stage that raised."""

    exit_code = 1


def default_loss(output: Any) -> torch.Tensor:
    """The output itself when it is a scalar (a model returning its loss), else its mean; the
    ``loss`` of a ``transformers`` output."""
    if hasattr(output, "loss") and output.loss is not None:
        return output.loss
    if isinstance(output, tuple | list):
        output = output[0]
    if not isinstance(output, torch.Tensor):
        raise CompileError(f"the model returned {type(output).__name__}, not a tensor; pass loss_fn=")
    return output if output.dim() == 0 else output.float().mean()


#: AdamW implementations by name: ``fused`` (one kernel for all parameters; torchtitan's default,
#: ``optimizer.implementation = "fused"`` in its job config), ``foreach`` (multi-tensor ops, which
#: Inductor turns into its own kernels) and ``for-loop`` (PyTorch's per-parameter update, unrolled
#: by Dynamo). The last two show Inductor's optimizer kernels; they also take it the longest to
#: compile (GPT-2 124M on 2 CPU cores: about 50 and 60 s against 4 s fused).
OPTIMIZERS: dict[str, dict[str, Any]] = {
    "fused": {"fused": True},
    "foreach": {"foreach": True},
    "for-loop": {"foreach": False},
}


def adamw(kind: str = "fused") -> Callable[[list[torch.nn.Parameter]], torch.optim.Optimizer]:
    kw = OPTIMIZERS[kind]
    return lambda params: torch.optim.AdamW(params, lr=1e-4, **kw)


default_optimizer = adamw("fused")


@dataclass(frozen=True, slots=True)
class StepRun:
    collector: Collector
    compile_s: float
    samples: tuple[float, ...]  # seconds of each timed step after the compiled one
    loss: float
    optimizer: dict[str, Any]  # {"name", "implementation", "compiled"}


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def run_step(
    module: nn.Module,
    args: tuple[Any, ...],
    kwargs: Mapping[str, Any] | None = None,
    *,
    loss_fn: LossFn = default_loss,
    optimizer: Callable[[list[torch.nn.Parameter]], torch.optim.Optimizer] | None = None,
    steps: int = 3,
    inductor_config: Mapping[str, Any] | None = None,
) -> StepRun:
    """Compile ``module``'s training step, run it once (the compiling step), then ``steps`` more
    timed. ``inductor_config`` patches ``torch._inductor.config`` for this compile only."""
    from torch._inductor import config as ic

    kwargs = dict(kwargs or {})
    params = [p for p in module.parameters() if p.requires_grad]
    if not params:
        raise CompileError("the module has no trainable parameters")
    device = params[0].device
    opt = (optimizer or default_optimizer)(params)
    col = Collector()
    torch._dynamo.reset()
    try:
        patch = ic.patch(dict(inductor_config or {}))
    except (AttributeError, KeyError, TypeError) as err:
        raise CompileError(f"inductor_config: {err}") from None
    module.train()
    with patch, observe(col) as backend:
        compiled = torch.compile(module, backend=backend)
        # torch.optim's fused implementations are not traced (``torch.compiler.disable`` on
        # ``_fused_adam``: "don't trace into fused optimizer"): compiling their step would only
        # record Dynamo skipping it, so a fused optimizer runs as the one eager kernel it is
        fused = bool(opt.defaults.get("fused"))
        opt_step = opt.step if fused else torch.compile(opt.step, backend=backend)
        implementation = "fused" if fused else ("foreach" if opt.defaults.get("foreach") else "for-loop")
        opt_info = {
            "name": type(opt).__name__,
            "implementation": implementation,
            "compiled": not fused,
            # what an eager fused step reads and writes: every trainable element, at its width
            "elements": sum(p.numel() for p in params),
            "itemsize": params[0].element_size(),
        }

        def one() -> float:
            col.section = "model"
            opt.zero_grad(set_to_none=True)
            loss = loss_fn(compiled(*args, **kwargs))
            loss.backward()
            col.section = "optimizer"
            opt_step()
            return float(loss.detach())

        started = time.perf_counter()
        try:
            loss = one()
            _sync(device)
        except CoplanError:
            raise
        except Exception as err:
            first = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
            raise CompileError(f"torch.compile failed: {type(err).__name__}: {first}") from err
        compile_s = time.perf_counter() - started
        col.add("timed")  # compiles after this are recompilations of the step
        if steps:
            one()  # the first call after compiling still warms caches (allocator, guards): untimed
            _sync(device)
        samples = []
        for _ in range(steps):
            t0 = time.perf_counter()
            loss = one()
            _sync(device)
            samples.append(time.perf_counter() - t0)
    return StepRun(col, compile_s, tuple(samples), loss, opt_info)


def median(samples: tuple[float, ...]) -> float | None:
    return statistics.median(samples) if samples else None
