"""Any group of ops priced as one kernel, under one configuration: what an exact fusion search
prices its candidate kernels with.

A step's time is a sum over its kernels (``estimate``), and one kernel's time depends only on the
ops it holds, the tensors crossing its boundary and the configuration's rates and scale, so the
kernels of every candidate partition of a block can be priced once each and summed. The numbers
here are the ones ``estimate`` charges for the same kernel (``profile._Ctx.kernel``, ``Rates``,
``Scale``, ``kernel_time``): a partition's sum is the block's kernel time that the full estimate
then re-prices exactly.
"""

from __future__ import annotations

from dataclasses import replace

from coplan.cost.config import TrainingConfig
from coplan.cost.fusion import readers
from coplan.cost.kernels import Rates, Scale, kernel_time, vector_compute
from coplan.cost.parts import Kernel, Precision, Vec
from coplan.cost.profile import _Ctx
from coplan.hardware.device import DeviceSpec
from coplan.ir.types import Graph, Phase


class KernelPrices:
    """Seconds of groups of ``graph``'s ops as generated kernels for one microbatch of ``config``
    on ``device`` (memoised per group)."""

    def __init__(
        self,
        graph: Graph,
        device: DeviceSpec,
        config: TrainingConfig,
        precision: Precision | None = None,
        shared: dict[str, object] | None = None,
    ) -> None:
        self.graph = graph
        # the kernels depend on the graph and the per-op dtypes only, not on the layout: a search
        # pricing many layouts of one graph passes one ``shared`` dict to every instance
        shared = {} if shared is None else shared
        if "ctx" not in shared:
            ctx = _Ctx(graph, precision if precision and precision[1] else None, {})
            ctx.compiled = True
            shared["ctx"], shared["kernels"] = ctx, {}
        self._ctx: _Ctx = shared["ctx"]  # type: ignore[assignment]
        self._kernels: dict[tuple[int, ...], Kernel] = shared["kernels"]  # type: ignore[assignment]
        self._device = device
        self._config = config
        self._scale = replace(Scale.of(config), eager=False)  # explicit groups: a compiled graph
        self._rates: dict[str, Rates] = {}
        self._times: dict[tuple[int, ...], float] = {}

    def rates(self, k: Kernel) -> Rates:
        dtype = k.dtype or self._config.dtype
        got = self._rates.get(dtype)
        if got is None:
            got = self._rates[dtype] = Rates.of(self._device, dtype, self._config.attention_kernel)
        return got

    def kernel(self, group: tuple[int, ...]) -> Kernel:
        got = self._kernels.get(group)
        if got is None:
            got = self._kernels[group] = self._ctx.kernel(group)
        return got

    def time(self, group: tuple[int, ...]) -> float:
        """Seconds of ``group`` (op ids, in graph order) as one kernel."""
        got = self._times.get(group)
        if got is None:
            k = self.kernel(group)
            got = self._times[group] = kernel_time(k, self.rates(k), self._scale)
        return got

    def without_writes(self, group: tuple[int, ...], vec: Vec) -> float:
        """Seconds ``group`` saves when it no longer writes the tensors of ``vec`` (a recomputed
        tensor whose forward readers are all inside it: ``Part.unwritten``)."""
        k = self.kernel(group)
        rest = tuple(max(0.0, a - b) for a, b in zip(k.bytes, vec, strict=True))
        return self.time(group) - kernel_time(replace(k, bytes=rest), self.rates(k), self._scale)  # type: ignore[arg-type]

    def written(self, tid: int) -> Vec:
        """The vector a kernel writes for tensor ``tid``."""
        return self._ctx.vec(self.graph.tensors[tid])

    def arithmetic(self, group: tuple[int, ...], op: int) -> float:
        """Seconds of re-running pointwise ``op`` of ``group`` inside the backward kernels that read
        its output (once per reader; no launch, no traffic), as ``estimate`` prices a recomputed
        pointwise producer under a compiled fusion plan."""
        k = self.kernel(group)
        if not k.vec_flops:
            return 0.0
        g = self.graph
        o = g.ops[op]
        bwd = {c for t in o.outputs for c in readers(g, t) if g.ops[c].phase is Phase.BACKWARD}
        share = o.vector_flops * max(1, len(bwd)) / k.vec_flops
        return vector_compute(k, self.rates(k), self._scale) * share
