"""``coplan.backend(plan)``: a ``torch.compile`` backend that applies a plan.

    model = torch.compile(model, backend=coplan.backend(plan))

Dynamo hands each captured graph to the backend, which runs the plan's passes in a fixed order:

1. precision (``coplan.apply.precision``, numerics-changing): casts inserted into Dynamo's graph;
2. AOTAutograd traces forward + backward into one joint graph and cuts it with the plan's
   partitioner (``coplan.apply.partition``, numerics-preserving): the saved set is the plan's;
3. each half is compiled: executed op by op (eager kernels, what an unfused plan prices) or, when
   the plan fuses ops, by Inductor with its fusion constrained to the plan's groups
   (``coplan.apply.fusion``).

The backend keeps what it did (``Backend.report``) and measures, on every forward, the bytes the
forward returns for backward by kind (``Backend.last_saved``): the runtime's own tensors, by
storage, so a view and its base count once.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import fx

from coplan.apply.partition import ACTIVATION, INPUT, PARAM, Cut, Partitioner, saved_storages
from coplan.apply.precision import CastReport, apply_precision
from coplan.ir.types import Graph
from coplan.models.spec import ModelSpec
from coplan.plan.types import Plan


@dataclass
class Report:
    """What the backend did to every region it compiled."""

    regions: int = 0
    cuts: list[Cut] = field(default_factory=list)
    casts: list[CastReport] = field(default_factory=list)
    fusion: list[dict[str, Any]] = field(default_factory=list)

    @property
    def missing(self) -> tuple[str, ...]:
        """Planned saved tensors found in no compiled region (none when the whole model compiled)."""
        found = {n for c in self.cuts for n in (*c.saved, *c.recomputed)}
        return tuple(sorted({n for c in self.cuts for n in c.missing} - found))


class Backend:
    """A ``torch.compile`` backend applying ``plan`` to the model of ``spec``."""

    def __init__(self, plan: Plan, spec: ModelSpec | None = None, *, ir: Graph | None = None) -> None:
        from coplan.capture.synthetic import build_graph
        from coplan.models.spec import load_model_spec

        self.plan = plan
        self.spec = spec if spec is not None else load_model_spec(plan.model)
        # names and module paths do not depend on the batch: a batch of one keeps the build cheap
        self.ir = ir if ir is not None else build_graph(self.spec, 1, plan.seq)
        self.partitioner = Partitioner(self.ir, plan.remat.recompute)
        self.report = Report()
        # storages saved since ``reset_saved``, by kind: regions of one forward (graph breaks,
        # FSDP2's per-block regions) may save the same storage, which is counted once
        self._seen: dict[str, dict[int, int]] = {ACTIVATION: {}, PARAM: {}, INPUT: {}}

    # --- torch.compile's entry point -----------------------------------------------------------

    def __call__(self, gm: fx.GraphModule, example_inputs: list[Any]) -> Callable[..., Any]:
        from torch._dynamo.backends.common import aot_autograd

        self.report.regions += 1
        self.report.casts.append(apply_precision(gm, example_inputs, self.plan.precision, self.ir))
        own = [True] * sum(1 for _ in gm.parameters()) + [True] * sum(1 for _ in gm.buffers())
        # buffers (RoPE's tables) are model state, as parameters: what is saved of them or computed
        # from them alone is not an activation (the IR gives them the role BUFFER)
        state = [
            _is_param(x) or _is_buffer(p) for x, p in zip(example_inputs, _placeholders(gm), strict=False)
        ]
        self.partitioner.param_flags = own + state
        self.partitioner.float_flags = [False] * len(own) + [
            isinstance(x, torch.Tensor) and x.is_floating_point() and not s
            for x, s in zip(example_inputs, state, strict=False)
        ]
        first_cut = len(self.partitioner.cuts)
        seq: dict[int, int] = {}  # autograd seq_nr -> IR forward op, from this region's forward

        def fw_compiler(fw: fx.GraphModule, inputs: Sequence[Any]) -> Callable[..., Any]:
            cut = self.partitioner.cuts[first_cut] if len(self.partitioner.cuts) > first_cut else None
            run = self._compile(fw, inputs, "forward", seq)
            if cut is None:
                return run
            self.report.cuts.append(cut)

            def forward(args: list[Any]) -> Any:
                outs = run(args)
                saved_storages(outs, cut, self._seen)
                return outs

            forward._boxed_call = True  # type: ignore[attr-defined]
            return forward

        def bw_compiler(bw: fx.GraphModule, inputs: Sequence[Any]) -> Callable[..., Any]:
            return self._compile(bw, inputs, "backward", seq)

        compiled = aot_autograd(
            fw_compiler=fw_compiler,
            bw_compiler=bw_compiler,
            partition_fn=self.partitioner,
            keep_inference_input_mutations=True,
        )
        return compiled(gm, example_inputs)

    def _compile(
        self, gm: fx.GraphModule, inputs: Sequence[Any], phase: str, seq: dict[int, int]
    ) -> Callable[..., Any]:
        from coplan.apply.fusion import compile_graph

        run, info = compile_graph(gm, inputs, self.plan, self.ir, phase, seq)
        if info is not None:
            self.report.fusion.append(info)
        return run

    # --- measuring -----------------------------------------------------------------------------

    def reset_saved(self) -> None:
        """Start counting saved bytes afresh (before one microbatch's forward)."""
        self._seen = {ACTIVATION: {}, PARAM: {}, INPUT: {}}

    @property
    def other_storages(self) -> set[int]:
        """Storages saved since ``reset_saved`` that are parameters, their copies, or the batch."""
        return set(self._seen[PARAM]) | set(self._seen[INPUT])

    @property
    def last_saved(self) -> dict[str, int]:
        """Bytes saved for backward since ``reset_saved``, by kind (a storage counted once; one
        counted as a parameter or input is not an activation, whatever view reached it)."""
        other = self._seen[PARAM].keys() | self._seen[INPUT].keys()
        act = sum(b for p, b in self._seen[ACTIVATION].items() if p not in other)
        return {
            ACTIVATION: act,
            PARAM: sum(self._seen[PARAM].values()),
            INPUT: sum(self._seen[INPUT].values()),
        }


def _is_param(x: object) -> bool:
    return isinstance(x, torch.nn.Parameter)


def _placeholders(gm: fx.GraphModule) -> list[fx.Node]:
    return [n for n in gm.graph.nodes if n.op == "placeholder"]


def _is_buffer(node: fx.Node) -> bool:
    """Whether Dynamo lifted this graph input from a module's buffers (its source reads
    ``<module>._buffers[name]``), not a batch tensor or an activation handed in."""
    source = getattr(node.meta.get("grapharg"), "source", None)
    name = getattr(source, "name", None)
    name = name() if callable(name) else name  # a method before torch 2.10, a property after
    return isinstance(name, str) and "._buffers[" in name


def backend(plan: Plan, spec: ModelSpec | None = None) -> Backend:
    """The ``torch.compile`` backend applying ``plan`` (``spec``: the model's spec when it is not a
    preset named by ``plan.model``)."""
    return Backend(plan, spec)
