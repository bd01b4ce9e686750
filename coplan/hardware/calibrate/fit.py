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
from dataclasses import dataclass, field, replace
from typing import Any

import numpy as np

from coplan.hardware.cluster import InterconnectLevel
from coplan.hardware.device import VECTOR_FAMILIES
from coplan.hardware.tiling import AttentionTiling

#: What each microbenchmark kind measures, in fit order.
KINDS: tuple[str, ...] = ("launch", "host_op", "vector", "first_touch", "matmul", "attention", "collective")


@dataclass(frozen=True, slots=True)
class Measurement:
    """One timed microbenchmark: what it computes and how long it took (median seconds per call).

    ``flops`` are matrix FLOPs as ``torch.utils.flop_counter`` counts them (what capture records),
    ``vec_flops`` vector FLOPs by coplan's op rules, ``bytes`` the bytes read and written.
    ``dims`` is (M, N, K) for a GEMM, (batch * heads, q, k, head dim) for attention, and
    (processes,) for a collective. ``phase`` is "backward" for attention gradients. ``family`` is
    the vector family (``VECTOR_FAMILIES``) of a vector kernel; ``layout`` a GEMM's operand layout
    ("nn", "nt", "tn": which operand is a transposed view). A ``first_touch`` measurement writes
    ``bytes`` of newly allocated storage. ``fitted`` is the calibrated model's time for the same work
    (0 until fitted).
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
    family: str = "elementwise"
    layout: str = ""

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
            "family": self.family,
            "layout": self.layout,
            "fitted": self.used,
        }


# --- the model each microbenchmark is priced with ---------------------------------------------------


@dataclass(frozen=True, slots=True)
class Params:
    """The fitted quantities, as the cost model's ``Rates`` would hold them (achievable rates)."""

    peaks: dict[str, float]  # dtype -> data-sheet matrix peak FLOP/s (not fitted)
    mm_flops: dict[str, float]  # dtype -> achievable matrix FLOP/s before shape derating
    attention: dict[str, float]  # dtype -> fused attention's fraction of that dtype's peak
    vec_flops: float  # non-matrix FLOP/s of work without a family rate (``vec_rates``)
    bandwidth: float
    half_dim: float
    launch_s: float
    link_bandwidth: float = 0.0  # achievable link bytes/s (link bandwidth x network efficiency)
    link_latency_s: float = 0.0
    vec_rates: dict[str, float] = field(default_factory=dict)  # "<family>.<dtype>" -> FLOP/s
    attention_backward: dict[str, float] = field(default_factory=dict)  # dtype -> ...; else attention
    first_touch: float = 0.0  # bytes/s of page-faulting fresh storage in (0: not measured)
    cache_bytes: float = 0.0  # fresh tensors at least this large pay first_touch
    # the attention kernel's tiling (``coplan.hardware.tiling``; None: the roofline alone) and the
    # fitted seconds per tile, "<phase>.<dtype>" -> s
    attn_tiling: AttentionTiling | None = None
    attn_tile_s: dict[str, float] = field(default_factory=dict)
    # fixed seconds per GEMM call beyond the launch, per dtype (fitted where ``fit_calls``: a CPU)
    mm_call_s: dict[str, float] = field(default_factory=dict)
    fit_calls: bool = False
    # fraction of the GEMM rate reached with a transposed left operand, per dtype (absent: 1)
    mm_tn: dict[str, float] = field(default_factory=dict)
    host_op_s: float = 0.0  # host seconds of an op that launches no kernel (a view), eager
    # the device's attention occupancy derating (forward, backward; not fitted, kept so the fitted
    # attention efficiency is the one the written device's kernel rule expects)
    attn_par_half: tuple[float, float] = (0.0, 0.0)


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
    family = tuple(p.vec_rates.get(f"{f}.{m.dtype}", p.vec_flops) for f in VECTOR_FAMILIES)
    rates = Rates(
        mm_flops=p.mm_flops.get(m.dtype, 0.0) or max(p.mm_flops.values(), default=1.0),
        attn_flops=p.peaks.get(m.dtype, 0.0) * p.attention.get(m.dtype, 1.0),
        attn_bwd_flops=p.peaks.get(m.dtype, 0.0) * p.attention_backward.get(m.dtype, 0.0),
        vec_flops=p.vec_flops,
        bandwidth=p.bandwidth,
        half_dim=p.half_dim,
        launch_s=p.launch_s,
        vec_rates=family if p.vec_rates else (),
        # the device written keeps attention per dtype, which derates the head dimension too
        attn_head_half=p.half_dim,
        first_touch=p.first_touch,
        cache_bytes=p.cache_bytes,
        attn_tiling=p.attn_tiling,
        attn_tile_s=p.attn_tile_s.get(f"forward.{m.dtype}", 0.0),
        attn_bwd_tile_s=p.attn_tile_s.get(f"backward.{m.dtype}", 0.0),
        mm_call_s=p.mm_call_s.get(m.dtype, 0.0),
        mm_tn=p.mm_tn.get(m.dtype, 1.0),
        host_op_s=p.host_op_s,
        attn_par_half=p.attn_par_half[0],
        attn_bwd_par_half=p.attn_par_half[1],
    )
    # bytes are already bytes: every slot weighs 1; one device, no tensor parallelism, flash attention
    return kernel_time(_kernel(m), rates, Scale(1, False, (1.0, 1.0, 1.0, 1.0, 1.0, 1.0), 4, True))


def _kernel(m: Measurement) -> Any:
    from coplan.cost.parts import Kernel
    from coplan.ir.types import Phase

    phase = Phase.BACKWARD if m.phase == "backward" else Phase.FORWARD
    data = (0.0, 0.0, 0.0, 0.0, float(m.bytes), 0.0)
    if m.kind == "matmul":
        dims = (*tuple(m.dims), 1, 1, 1)
        return Kernel(
            phase, "matmul", 0, m.flops, 0.0, data, dims=(dims[0], dims[1], dims[2]), tn=m.layout == "tn"
        )
    if m.kind == "attention":
        a = (*tuple(m.dims), 1, 1, 1, 1)
        return Kernel(phase, "attention", 0, m.flops, 0.0, data, attn=(a[0], a[1], a[2], a[3]))
    if m.kind == "host_op":
        return Kernel(phase, "free", 0, 0.0, 0.0, data)
    split = tuple(m.vec_flops if f == m.family else 0.0 for f in VECTOR_FAMILIES)
    fresh = (data,) if m.kind == "first_touch" else ()
    return Kernel(phase, "vector", 0, 0.0, m.vec_flops, data, vec_split=split, fresh=fresh)


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
        # a trial step far off (a rate exp(-800) = 0.0) prices as infinitely bad, so the solver
        # backs off, instead of dividing by zero (noisy timings on a busy machine got it there)
        try:
            p = make(x)
            return np.log([max(predict(m, p), 1e-30) for m in ms]) - measured
        except (ZeroDivisionError, OverflowError):
            return np.full(len(ms), 1e6)

    return res


def fit_vector(ms: Sequence[Measurement], base: Params) -> Params:
    """Achievable memory bandwidth, and a FLOP rate per vector family and dtype, from non-matrix
    kernels (launch fixed). The op rules count a few FLOPs per element whatever the op: a sum, a
    norm and a tanh-GELU differ several-fold in time per counted FLOP, and a 16-bit op converts
    every element to fp32 and back, so one rate for all of them cannot fit.

    Started from several points around the measurements' own rates: where one term never binds,
    its gradient is zero and a single start could not move it. The elementwise rate of the widest
    dtype becomes ``vec_flops``, the rate of work without a family."""
    ms = [m for m in ms if m.kind == "vector" and m.used]
    if not ms:
        return base
    keys = sorted({f"{m.family}.{m.dtype}" for m in ms})

    def make(x: np.ndarray) -> Params:
        rates = {k: math.exp(v) for k, v in zip(keys, x[1:], strict=True)}
        return replace(base, bandwidth=math.exp(x[0]), vec_rates=rates, vec_flops=_plain(rates, base))

    res = _log_residuals(ms, make)
    bw = math.log(max(m.bytes / m.seconds for m in ms))
    # each family's fastest probe: a lower bound on its rate (it ignores launch and memory time)
    top = [math.log(max(m.vec_flops / m.seconds for m in ms if f"{m.family}.{m.dtype}" == k)) for k in keys]
    starts = [[bw + a, *(v + b for v in top)] for a in (-0.5, 0.0) for b in (0.0, 0.5, 1.5)]
    return make(_best(res, starts))


def _plain(rates: dict[str, float], base: Params) -> float:
    for dtype in ("fp32", *sorted(base.peaks)):
        if f"elementwise.{dtype}" in rates:
            return rates[f"elementwise.{dtype}"]
    return base.vec_flops


def fit_first_touch(ms: Sequence[Measurement], base: Params) -> Params:
    """The rate at which fresh storage larger than the cache is page-faulted in (bandwidth fixed):
    the time of writing newly allocated tensors beyond what their bytes cost at that bandwidth."""
    ms = [m for m in ms if m.kind == "first_touch" and m.used]
    if not ms:
        return base

    def make(x: np.ndarray) -> Params:
        return replace(base, first_touch=math.exp(x[0]))

    extra = [max(m.seconds - m.bytes / base.bandwidth - base.launch_s, 1e-9) for m in ms]
    start = math.log(max(1.0, statistics.median(m.bytes / e for m, e in zip(ms, extra, strict=True))))
    return make(least_squares(_log_residuals(ms, make), [start]))


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
    fixed), with ``base.fit_calls`` a fixed cost per GEMM call per dtype, and for each dtype with
    weight-gradient-layout measurements ("tn") the fraction of the rate that layout reaches. The
    half-dimension is started from several values: the fit is not convex in it."""
    ms = [m for m in ms if m.kind == "matmul" and m.used]
    if not ms:
        return base
    dtypes = sorted({m.dtype for m in ms})
    tns = sorted({m.dtype for m in ms if m.layout == "tn"} & {m.dtype for m in ms if m.layout != "tn"})
    n, c = len(dtypes), len(dtypes) if base.fit_calls else 0

    def make(x: np.ndarray) -> Params:
        rates = {**base.mm_flops, **{d: math.exp(v) for d, v in zip(dtypes, x[:n], strict=True)}}
        p = replace(base, mm_flops=rates, half_dim=math.exp(x[n]))
        if c:
            calls = {d: math.exp(v) for d, v in zip(dtypes, x[n + 1 : n + 1 + c], strict=True)}
            p = replace(p, mm_call_s={**base.mm_call_s, **calls})
        if tns:
            tn = {d: math.exp(v) for d, v in zip(tns, x[n + 1 + c :], strict=True)}
            p = replace(p, mm_tn={**base.mm_tn, **tn})
        return p

    res = _log_residuals(ms, make)
    peaks = [math.log(base.mm_flops.get(d) or 1e12) for d in dtypes]
    halves = (1.0, 8.0, 64.0, 512.0)
    same = [0.0] * len(tns)  # the transposed layout starts at the other layouts' rate
    if not base.fit_calls:
        return make(_best(res, ([*peaks, math.log(h), *same] for h in halves)))
    calls = (1e-7, 3e-6, 3e-5)
    return make(_best(res, ([*peaks, math.log(h), *[math.log(c)] * n, *same] for h in halves for c in calls)))


def fit_attention(ms: Sequence[Measurement], base: Params) -> Params:
    """Fused attention's fraction of each dtype's matrix peak, forward and backward kernels apart
    (``efficiency.attention.<dtype>``, ``efficiency.attention_backward.<dtype>``). Per dtype: a CPU's
    flash kernel runs fp32 and bf16 at about the same speed, while their peaks differ 2x; per phase:
    the gradient kernel is another implementation (on a CPU its bf16 GEMMs take a slower path).

    Without a tiling, the shape derating over query, key and head dimensions (by the matmul
    half-dimension, fixed) carries the shape dependence. With one (``base.attn_tiling``), the
    fraction and a cost per tile are fitted together: ``FLOPs / rate + tiles * tile_s``."""
    ms = [m for m in ms if m.kind == "attention" and m.used]
    p = base
    for dtype in sorted({m.dtype for m in ms}):
        for backward in (False, True):
            mine = [m for m in ms if m.dtype == dtype and (m.phase == "backward") == backward]
            if not mine:
                continue
            key = f"{'backward' if backward else 'forward'}.{dtype}"

            def make(
                x: np.ndarray, dtype: str = dtype, backward: bool = backward, p: Params = p, key: str = key
            ) -> Params:
                if len(x) > 1:
                    p = replace(p, attn_tile_s={**p.attn_tile_s, key: math.exp(x[1])})
                if backward:
                    return replace(p, attention_backward={**p.attention_backward, dtype: math.exp(x[0])})
                return replace(p, attention={**p.attention, dtype: math.exp(x[0])})

            start = [math.log(base.attention.get(dtype, 0.5))]
            if p.attn_tiling is not None:
                start = _tiled_start(mine, make)
            p = make(least_squares(_log_residuals(mine, make), start))
    return p


def _tiled_start(ms: Sequence[Measurement], make: Callable[[np.ndarray], Params]) -> list[float]:
    """A starting point for the tiled fit: the time is linear in (1 / rate, tile_s), so a
    relative linear least squares over the two terms (each measured one at unit value) gives it."""
    unit_rate = [predict(m, make(np.array([0.0, -80.0]))) for m in ms]  # fraction 1, no tile cost
    tiles = [predict(m, make(np.array([80.0, 0.0]))) for m in ms]  # 1 s per tile, ~no FLOP time
    a = np.array([[u / m.seconds, t / m.seconds] for u, t, m in zip(unit_rate, tiles, ms, strict=True)])
    coef, *_ = np.linalg.lstsq(a, np.ones(len(ms)), rcond=None)
    inv_fraction, tile_s = (max(float(c), 1e-12) for c in coef)
    return [math.log(1.0 / inv_fraction), math.log(tile_s)]


def fit_link(ms: Sequence[Measurement], base: Params) -> Params:
    """Latency and bandwidth of the link collectives ran over (ring bandwidth, tree latency)."""
    ms = [m for m in ms if m.kind == "collective" and m.used]
    if not ms:
        return base

    def make(x: np.ndarray) -> Params:
        return replace(base, link_bandwidth=math.exp(x[0]), link_latency_s=math.exp(x[1]))

    x0 = [math.log(base.link_bandwidth or 1e9), math.log(base.link_latency_s or 1e-5)]
    return make(least_squares(_log_residuals(ms, make), x0))


def _median_used(ms: Sequence[Measurement], kind: str) -> float | None:
    times = [m.seconds for m in ms if m.kind == kind and m.used]
    return statistics.median(times) if times else None


def fit_launch(ms: Sequence[Measurement]) -> float | None:
    """The per-kernel launch cost: the median of the autograd-chain measurements (seconds per
    kernel); the bare-dispatch measurement is reported but not fitted."""
    return _median_used(ms, "launch")


def fit_host_op(ms: Sequence[Measurement]) -> float | None:
    """The host's cost of a view: the median of the view-chain measurements (seconds per op)."""
    return _median_used(ms, "host_op")


def fit(ms: Sequence[Measurement], start: Params) -> Params:
    """All stages in order; each stage's fixed inputs come from the stages before it."""
    p = start
    launch = fit_launch(ms)
    if launch is not None:
        p = replace(p, launch_s=launch)
    host = fit_host_op(ms)
    if host is not None:
        p = replace(p, host_op_s=host)
    p = fit_vector(ms, p)
    p = fit_first_touch(ms, p)
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
