"""The calibration's model and fit: each microbenchmark priced as the cost model would price it,
and least-squares fits of the device's rates to the measured times.

Every fit minimises ``log(predicted) - log(measured)`` (relative errors: a 10 us kernel weighs as
much as a 10 ms one) with a small Levenberg-Marquardt solver, in stages whose fixed inputs come
from the stages before (see ``fit``).
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, replace
from typing import Any

import numpy as np

from coplan.hardware.cluster import InterconnectLevel

#: What each microbenchmark kind measures, in fit order.
KINDS: tuple[str, ...] = ("launch", "vector", "matmul", "attention", "collective")


@dataclass(frozen=True, slots=True)
class Measurement:
    """One timed microbenchmark: what it computes and how long it took (median seconds per call).

    ``flops`` are matrix FLOPs as ``torch.utils.flop_counter`` counts them (what capture records),
    ``vec_flops`` vector FLOPs by coplan's op rules, ``bytes`` the bytes read and written.
    ``dims`` is (M, N, K) for a GEMM, (batch * heads, q, k, head dim) for attention, and
    (processes,) for a collective. ``phase`` is "backward" for attention gradients. ``fitted`` is
    the calibrated model's time for the same work (0 until fitted).
    """

    kind: str
    name: str
    dtype: str
    seconds: float
    flops: float = 0.0
    vec_flops: float = 0.0
    bytes: float = 0.0
    dims: tuple[int, ...] = ()
    phase: str = "forward"
    fitted: float = 0.0
    used: bool = True  # False: reported for comparison, not fitted (bare dispatch)

    @property
    def error(self) -> float:
        """Relative error of the fitted time (fitted / measured - 1)."""
        return self.fitted / self.seconds - 1.0 if self.seconds > 0 else 0.0

    def to_dict(self) -> dict[str, Any]:
        return {
            "kind": self.kind,
            "name": self.name,
            "dtype": self.dtype,
            "seconds": self.seconds,
            "fitted_s": self.fitted,
            "error": self.error,
            "flops": self.flops,
            "vec_flops": self.vec_flops,
            "bytes": self.bytes,
            "dims": list(self.dims),
            "phase": self.phase,
            "fitted": self.used,
        }


# --- the model each microbenchmark is priced with ---------------------------------------------------


@dataclass(frozen=True, slots=True)
class Params:
    """The fitted quantities, as the cost model's ``Rates`` would hold them (achievable rates)."""

    peaks: dict[str, float]  # dtype -> data-sheet matrix peak FLOP/s (not fitted)
    mm_flops: dict[str, float]  # dtype -> achievable matrix FLOP/s before shape derating
    attention: float  # fused attention's fraction of each dtype's peak (one for all, as the device keeps)
    vec_flops: float
    bandwidth: float
    half_dim: float
    launch_s: float
    link_bandwidth: float = 0.0  # achievable link bytes/s (link bandwidth x network efficiency)
    link_latency_s: float = 0.0


def predict(m: Measurement, p: Params) -> float:
    """The cost model's time for measurement ``m`` under ``p``: the kernel rules of
    ``coplan.cost.kernels`` and the ring formulas of ``coplan.cost.comm``, inlined on plain numbers."""
    from coplan.cost.comm import Group
    from coplan.cost.kernels import Rates, Scale, kernel_time

    if m.kind == "collective":
        n = m.dims[0] if m.dims else 2
        level = InterconnectLevel(
            "link", max(p.link_bandwidth, 1e-30), max(p.link_latency_s, 0.0), "switch", "node"
        )
        group = Group(n, n, 1, level, None, 1.0)
        return group.all_reduce(m.bytes) if m.name.startswith("all_reduce") else group.all_gather(m.bytes)
    rates = Rates(
        mm_flops=p.mm_flops.get(m.dtype, 0.0) or max(p.mm_flops.values(), default=1.0),
        attn_flops=p.peaks.get(m.dtype, 0.0) * p.attention,
        vec_flops=p.vec_flops,
        bandwidth=p.bandwidth,
        half_dim=p.half_dim,
        launch_s=p.launch_s,
    )
    # bytes are already bytes: every slot weighs 1; one device, no tensor parallelism, flash attention
    return kernel_time(_kernel(m), rates, Scale(1, False, (1.0, 1.0, 1.0, 1.0, 1.0, 1.0), 4, True))


def _kernel(m: Measurement) -> Any:
    from coplan.cost.profile import Kernel
    from coplan.ir.types import Phase

    phase = Phase.BACKWARD if m.phase == "backward" else Phase.FORWARD
    data = (0.0, 0.0, 0.0, 0.0, float(m.bytes), 0.0)
    if m.kind == "matmul":
        dims = (*tuple(m.dims), 1, 1, 1)
        return Kernel(phase, "matmul", 0, m.flops, 0.0, data, dims=(dims[0], dims[1], dims[2]))
    if m.kind == "attention":
        a = (*tuple(m.dims), 1, 1, 1, 1)
        return Kernel(phase, "attention", 0, m.flops, 0.0, data, attn=(a[0], a[1], a[2], a[3]))
    return Kernel(phase, "vector", 0, 0.0, m.vec_flops, data)


# --- least squares ----------------------------------------------------------------------------------


def least_squares(
    residuals: Callable[[np.ndarray], np.ndarray], x0: Sequence[float], *, max_iter: int = 200
) -> np.ndarray:
    """Levenberg-Marquardt on ``sum(residuals(x) ** 2)`` with a central-difference Jacobian.

    Small and dependency-free (numpy only); the problems here have at most a handful of parameters.
    """
    x = np.asarray(x0, dtype=float)
    r = residuals(x)
    cost = float(r @ r)
    lam = 1e-3
    for _ in range(max_iter):
        if cost < 1e-30:
            break
        jac = np.empty((r.size, x.size))
        for j in range(x.size):
            h = 1e-6 * max(1.0, abs(x[j]))
            e = np.zeros_like(x)
            e[j] = h
            jac[:, j] = (residuals(x + e) - residuals(x - e)) / (2 * h)
        grad, normal = jac.T @ r, jac.T @ jac
        diag = np.diag(normal).copy() + 1e-12
        while True:
            step = np.linalg.solve(normal + lam * np.diag(diag), -grad)
            r_new = residuals(x + step)
            cost_new = float(r_new @ r_new)
            if cost_new < cost:
                x, r, cost = x + step, r_new, cost_new
                lam = max(lam * 0.3, 1e-12)
                break
            lam *= 10.0
            if lam > 1e12:
                return x
        if float(np.max(np.abs(step))) < 1e-12 * (1.0 + float(np.max(np.abs(x)))):
            break
    return x


def _log_residuals(
    ms: Sequence[Measurement], make: Callable[[np.ndarray], Params]
) -> Callable[[np.ndarray], np.ndarray]:
    measured = np.log([m.seconds for m in ms])

    def res(x: np.ndarray) -> np.ndarray:
        p = make(x)
        return np.log([max(predict(m, p), 1e-30) for m in ms]) - measured

    return res


def fit_vector(ms: Sequence[Measurement], base: Params) -> Params:
    """Achievable memory bandwidth and vector FLOP/s from non-matrix kernels (launch fixed).

    Started from several points around the measurements' own median rates: where one term never
    binds, its gradient is zero and a single start could not move it."""
    ms = [m for m in ms if m.kind == "vector" and m.used]
    if not ms:
        return base

    def make(x: np.ndarray) -> Params:
        return replace(base, bandwidth=math.exp(x[0]), vec_flops=math.exp(x[1]))

    res = _log_residuals(ms, make)
    bw = math.log(statistics.median(m.bytes / m.seconds for m in ms))
    vf = math.log(statistics.median(m.vec_flops / m.seconds for m in ms))
    starts = [(math.log(base.bandwidth), math.log(base.vec_flops))]
    starts += [(bw + a, vf + b) for a in (-1.0, 0.0, 1.0) for b in (-1.0, 0.0, 1.0)]
    return make(_best(res, starts))


def _best(res: Callable[[np.ndarray], np.ndarray], starts: Iterable[Sequence[float]]) -> np.ndarray:
    """The lowest-cost least-squares solution over several starting points."""
    best, best_cost = None, math.inf
    for start in starts:
        x = least_squares(res, start)
        r = res(x)
        if float(r @ r) < best_cost:
            best, best_cost = x, float(r @ r)
    assert best is not None
    return best


def fit_matmul(ms: Sequence[Measurement], base: Params) -> Params:
    """Achievable matrix FLOP/s per dtype and the shared shape half-dimension (launch and memory
    fixed). The half-dimension is started from several values: the fit is not convex in it."""
    ms = [m for m in ms if m.kind == "matmul" and m.used]
    if not ms:
        return base
    dtypes = sorted({m.dtype for m in ms})

    def make(x: np.ndarray) -> Params:
        rates = {**base.mm_flops, **{d: math.exp(v) for d, v in zip(dtypes, x[:-1], strict=True)}}
        return replace(base, mm_flops=rates, half_dim=math.exp(x[-1]))

    res = _log_residuals(ms, make)
    peaks = [math.log(base.mm_flops.get(d) or 1e12) for d in dtypes]
    return make(_best(res, ([*peaks, math.log(h)] for h in (1.0, 8.0, 64.0, 512.0))))


def fit_attention(ms: Sequence[Measurement], base: Params) -> Params:
    """Fused attention's fraction of the matrix peak, one for every dtype as ``efficiency.attention``
    is (shape derating by the matmul half-dimension, fixed)."""
    ms = [m for m in ms if m.kind == "attention" and m.used]
    if not ms:
        return base

    def make(x: np.ndarray) -> Params:
        return replace(base, attention=math.exp(x[0]))

    return make(least_squares(_log_residuals(ms, make), [math.log(base.attention)]))


def fit_link(ms: Sequence[Measurement], base: Params) -> Params:
    """Latency and bandwidth of the link collectives ran over (ring bandwidth, tree latency)."""
    ms = [m for m in ms if m.kind == "collective" and m.used]
    if not ms:
        return base

    def make(x: np.ndarray) -> Params:
        return replace(base, link_bandwidth=math.exp(x[0]), link_latency_s=math.exp(x[1]))

    x0 = [math.log(base.link_bandwidth or 1e9), math.log(base.link_latency_s or 1e-5)]
    return make(least_squares(_log_residuals(ms, make), x0))


def fit_launch(ms: Sequence[Measurement]) -> float | None:
    """The per-kernel launch cost: the median of the autograd-chain measurements (seconds per
    kernel); the bare-dispatch measurement is reported but not fitted."""
    chain = [m.seconds for m in ms if m.kind == "launch" and m.used]
    return statistics.median(chain) if chain else None


def fit(ms: Sequence[Measurement], start: Params) -> Params:
    """All stages in order; each stage's fixed inputs come from the stages before it."""
    p = start
    launch = fit_launch(ms)
    if launch is not None:
        p = replace(p, launch_s=launch)
    p = fit_vector(ms, p)
    p = fit_matmul(ms, p)
    p = fit_attention(ms, p)
    return fit_link(ms, p)


def rms_residuals(ms: Iterable[Measurement]) -> dict[str, float]:
    """Per kind: ``exp(rms(log(fitted / measured))) - 1``, the typical relative error."""
    out: dict[str, float] = {}
    for kind in KINDS:
        logs = [
            math.log(m.fitted / m.seconds)
            for m in ms
            if m.kind == kind and m.used and m.fitted > 0 and m.seconds > 0
        ]
        if logs:
            out[kind] = math.exp(math.sqrt(sum(v * v for v in logs) / len(logs))) - 1.0
    return out
