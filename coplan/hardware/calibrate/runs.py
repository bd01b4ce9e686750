"""Calibrating a device profile from measured training runs (``coplan run --record runs.jsonl``).

The microbenchmarks (``coplan calibrate --device``) time kernels one at a time; a training step
adds what they do not see: the dispatch of hundreds of small kernels, caches shared by a
sequence of different kernels, processes sharing one CPU. Each recorded run is a plan, the job
(model, batch, sequence, processes, device) and its measured step time. The cost model prices
each run again under a device changed by three factors, each a rate of the machine:

- ``gemm``: the achievable rate of matrix work (GEMMs and fused attention), every dtype;
- ``vector``: the achievable rate of everything else (elementwise, reductions, norms, softmax:
  vector FLOP/s and memory bandwidth together, as small kernels are bound by either);
- ``launch``: the fixed cost of each kernel (``kernel_launch_s``);
- ``link``: the cost of each collective and pipeline send between the processes (the latency and
  the inverse bandwidth of the node's link together): what a framework adds around the wire on
  the way (FSDP2's copy-in/copy-out and hooks, DTensor's dispatch, gloo's emulation of
  reduce-scatter) is paid per collective. Only runs of several processes see it.

and the factors minimise ``sum_i log(predicted_i / measured_i)^2`` (relative errors: a 10 ms step
weighs as much as a 1 s one) plus a weak prior ``(PRIOR * log factor)^2`` that keeps a factor the
runs cannot tell apart (no run is bound by it) at the profile's value. Leave-one-out
cross-validation (each run predicted by the factors fitted to the others) says whether the fit
generalises to runs it has not seen.

A factor goes into the device's ``efficiency`` entries (the data-sheet peaks stay) unless that
would take an efficiency above 1, where the data-sheet value is scaled instead and the source says
so: the profile written is the device the fit priced with.
"""

from __future__ import annotations

import json
import math
from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import numpy as np

from coplan.errors import CoplanError, SpecError
from coplan.fileio import read_text
from coplan.hardware.cluster import ClusterSpec, InterconnectLevel
from coplan.hardware.device import DeviceSpec

#: Weight of the prior pulling each log factor to 0 (the profile's own value), against residuals
#: of one log step time per run: a factor no run is sensitive to stays put, one the runs
#: determine moves freely (a factor of 10 costs as much as one run predicted 5% off).
PRIOR = 0.02
FACTORS: tuple[str, ...] = ("gemm", "vector", "launch", "link")
#: Efficiency kinds each factor scales (``coplan.hardware.device.EFFICIENCY_KINDS``).
_KINDS = {
    "gemm": ("matmul", "attention", "attention_backward"),
    "vector": ("vector", "memory", "first_touch"),
}


class RunsError(CoplanError):
    """Run records that cannot be read or used (exit code 2)."""


@dataclass(frozen=True, slots=True)
class Scales:
    """Factors on the device's rates: ``gemm`` and ``vector`` multiply rates, ``launch`` the
    per-kernel time, ``link`` the time of every transfer over the node's link."""

    gemm: float = 1.0
    vector: float = 1.0
    launch: float = 1.0
    link: float = 1.0

    @classmethod
    def of(cls, logs: Sequence[float] | np.ndarray) -> Scales:
        return cls(*(math.exp(float(v)) for v in logs))

    def to_dict(self) -> dict[str, float]:
        return {"gemm": self.gemm, "vector": self.vector, "launch": self.launch, "link": self.link}


@dataclass(frozen=True, slots=True)
class RunRecord:
    """One recorded run: line ``line`` of its file."""

    line: int
    spec: Any  # ModelSpec
    plan: Any  # Plan (what was applied; a baseline's priced plan comes from ``mode``)
    nproc: int
    device: str
    device_name: str
    mode: str
    global_batch: int
    seq: int
    step_time_s: float
    cluster: ClusterSpec | None  # the profile the run was priced with, when recorded

    @property
    def label(self) -> str:
        p = self.plan
        rec = len(p.remat.all_names)
        return (
            f"line {self.line}: {self.spec.name} {p.parallel.describe()} {p.precision.compute} "
            f"{'recompute ' + str(rec) if rec else 'no recompute'}"
            f"{'' if self.mode == 'plan' else ' ' + self.mode}"
        )


# --- reading ----------------------------------------------------------------------------------------


def read_runs(path: str | Path) -> tuple[list[RunRecord], list[str]]:
    """The usable records of a JSONL file and notes on the lines skipped (a run without a measured
    step time). ``RunsError`` names the file and line of anything malformed."""
    p = Path(path)
    try:
        text = read_text(p, f"--runs {p}")
    except SpecError as e:
        raise RunsError(str(e)) from None
    records: list[RunRecord] = []
    notes: list[str] = []
    for i, raw in enumerate(text.splitlines(), start=1):
        if not raw.strip():
            continue
        try:
            data = json.loads(raw)
        except json.JSONDecodeError as e:
            raise RunsError(f"{p}:{i}: not JSON ({e.msg} at column {e.colno})") from None
        rec = _record(data, f"{p}:{i}", i)
        if rec is None:
            notes.append(f"{p}:{i}: no measured step time (a run of fewer than 2 steps?), skipped")
        else:
            records.append(rec)
    if not records:
        raise RunsError(f"{p}: no run with a measured step time (record some with coplan run --record)")
    return records, notes


def _record(data: object, where: str, line: int) -> RunRecord | None:
    from coplan.models.spec import ModelSpec, load_model_spec
    from coplan.plan.types import Plan

    if not isinstance(data, dict):
        raise RunsError(f"{where}: expected a JSON object, got {type(data).__name__}")

    def need(key: str, kind: type | tuple[type, ...]) -> Any:
        if key not in data:
            raise RunsError(f"{where}: missing {key!r}")
        value = data[key]
        if not isinstance(value, kind) or isinstance(value, bool):
            raise RunsError(f"{where}: {key!r} has the wrong type ({type(value).__name__})")
        return value

    try:
        model = need("model", (dict, str))
        spec = ModelSpec.from_dict(model, where) if isinstance(model, dict) else load_model_spec(model)
        plan = Plan.from_dict(need("plan", dict), where)
        cluster = data.get("cluster_spec")
        base = ClusterSpec.from_dict(cluster, where, path="cluster_spec") if cluster is not None else None
    except CoplanError as e:
        raise RunsError(f"{where}: {e}" if not str(e).startswith(where) else str(e)) from None
    measured = need("measured", dict)
    step = measured.get("step_time_s")
    if step is None:
        return None
    if not isinstance(step, int | float) or isinstance(step, bool) or not math.isfinite(step) or step <= 0:
        raise RunsError(f"{where}: 'measured.step_time_s' must be a positive number, got {step!r}")
    nproc, batch, seq = need("nproc", int), need("global_batch", int), need("seq", int)
    if min(nproc, batch, seq) < 1:
        raise RunsError(f"{where}: nproc, global_batch and seq must be positive")
    device = need("device", str)
    return RunRecord(
        line=line,
        spec=spec,
        plan=plan,
        nproc=nproc,
        device=device,
        device_name=str(data.get("device_name") or device),
        mode=str(data.get("mode") or "plan"),
        global_batch=batch,
        seq=seq,
        step_time_s=float(step),
        cluster=base,
    )


def base_cluster(records: Sequence[RunRecord], given: ClusterSpec | None, path: str | Path) -> ClusterSpec:
    """The profile to start from: ``given`` (``--cluster``), else the one every record names; the
    records must all come from one device."""
    kinds = sorted({(r.device, r.device_name) for r in records})
    if len(kinds) > 1:
        where = "; ".join(
            f"{d} {n!r} (line {next(r.line for r in records if (r.device, r.device_name) == (d, n))})"
            for d, n in kinds
        )
        raise RunsError(f"{path}: runs from several devices ({where}): calibrate one device at a time")
    if given is not None:
        return given
    recorded = {json.dumps(r.cluster.to_dict(), sort_keys=True) for r in records if r.cluster is not None}
    if len(recorded) == 1 and all(r.cluster is not None for r in records):
        cluster = records[0].cluster
        assert cluster is not None
        return cluster
    why = (
        "do not record the profile they were priced with"
        if not recorded
        else "were priced with several profiles"
    )
    raise RunsError(f"{path}: the runs {why}: name the profile to calibrate with --cluster")


# --- the device a set of factors describes ----------------------------------------------------------


def scaled_device(device: DeviceSpec, s: Scales) -> DeviceSpec:
    """``device`` with its matrix rates times ``s.gemm``, its vector and memory rates times
    ``s.vector`` and its per-kernel cost times ``s.launch``; the rates through the efficiencies
    where they stay within (0, 1], through the data-sheet values otherwise."""
    eff = dict(device.efficiency)
    peaks, vector, bandwidth = dict(device.peak_flops), device.vector_flops, device.memory_bandwidth
    raised: list[str] = []
    for factor, value in (("gemm", s.gemm), ("vector", s.vector)):
        kinds = _KINDS[factor]
        keys = [k for k in eff if k.split(".", 1)[0] in kinds]
        base = kinds[0]
        if base not in eff:  # an absent entry is 1.0 (or falls back to one that is scaled)
            keys.append(base)
            eff[base] = 1.0
        if factor == "vector" and "memory" not in eff:
            keys.append("memory")
            eff["memory"] = 1.0
        if max(eff[k] for k in keys) * value <= 1.0:
            for k in keys:
                eff[k] *= value
            continue
        raised.append(factor)
        if factor == "gemm":
            peaks = {d: v * value for d, v in peaks.items()}
        else:
            vector, bandwidth = vector * value, bandwidth * value
    note = f"; runs fit {', '.join(f'{k} x{v:.3g}' for k, v in s.to_dict().items())}"
    if raised:
        note += f" ({' and '.join(raised)} above the data sheet: its values scaled)"
    return replace(
        device,
        peak_flops=peaks,
        vector_flops=vector,
        memory_bandwidth=bandwidth,
        kernel_launch_s=device.kernel_launch_s * s.launch,
        efficiency=eff,
        source=device.source + note,
    )


def scaled_cluster(cluster: ClusterSpec, s: Scales, name: str | None = None) -> ClusterSpec:
    """``cluster`` with scaled devices and, by ``s.link``, slower (or faster) node links."""

    def link(lvl: InterconnectLevel) -> InterconnectLevel:
        return replace(lvl, bandwidth=lvl.bandwidth / s.link, latency_s=lvl.latency_s * s.link)

    groups = tuple(
        replace(g, device=scaled_device(g.device, s), intra_node=link(g.intra_node)) for g in cluster.groups
    )
    return replace(cluster, name=name or cluster.name, groups=groups)


# --- pricing the runs -------------------------------------------------------------------------------


@dataclass
class _Priced:
    """One record, ready to be priced on any cluster (its cost model and configuration built once)."""

    record: RunRecord
    model: Any  # CostModel
    config: Any  # TrainingConfig

    def step_time(self, cluster: ClusterSpec) -> float:
        from coplan.apply.predict import run_cluster

        c = run_cluster(cluster, self.record.nproc, self.record.device)
        return float(self.model.estimate(c, self.config).step_time_s)


def prepare(records: Sequence[RunRecord], cluster: ClusterSpec) -> list[_Priced]:
    """The cost model's view of every record on ``cluster`` (``RunsError`` for a plan it cannot
    price on it: another world size, an unknown layout)."""
    from coplan.apply.predict import baseline_plan, make_context, run_cluster

    out = []
    models: dict[Any, Any] = {}
    for r in records:
        ctx = make_context(r.spec, run_cluster(cluster, r.nproc, r.device), r.global_batch, r.seq, r.device)
        ctx.model = models.setdefault(r.spec, ctx.model)  # one cost model (and its graphs) per model
        try:
            plan = baseline_plan(r.plan, ctx, r.mode) if r.mode != "plan" else r.plan
            config = ctx.config_of(plan)
            ctx.price(plan)
        except CoplanError as e:
            raise RunsError(f"{r.label}: cannot be priced on {cluster.name}: {e}") from None
        out.append(_Priced(r, ctx.model, config))
    return out


@dataclass(frozen=True, slots=True)
class RunsFit:
    """Fitted factors and how well the cost model predicts the runs before and after."""

    scales: Scales
    before_s: tuple[float, ...]  # predicted step time per run, the profile as given
    after_s: tuple[float, ...]  # ... with the fitted factors
    measured_s: tuple[float, ...]
    loo_before: float = math.nan  # rms log error of held-out predictions (leave-one-out)
    loo_after: float = math.nan
    loo_after_s: tuple[float, ...] = field(default_factory=tuple)

    @property
    def rms_before(self) -> float:
        return rms_log_error(self.before_s, self.measured_s)

    @property
    def rms_after(self) -> float:
        return rms_log_error(self.after_s, self.measured_s)


def rms_log_error(predicted: Sequence[float], measured: Sequence[float]) -> float:
    """``exp(rms(log(predicted / measured))) - 1``: the typical relative error."""
    logs = [math.log(p / m) for p, m in zip(predicted, measured, strict=True)]
    return math.exp(math.sqrt(sum(v * v for v in logs) / len(logs))) - 1.0 if logs else math.nan


#: Starting points (log factors): the launch factor and the rates trade off (a step is their
#: sum), so the fit starts from a few splits and keeps the best.
STARTS: tuple[tuple[float, ...], ...] = ((0.0, 0.0, 0.0, 0.0), (0.0, 0.0, 1.0, 0.0), (-1.0, -1.0, 0.0, 0.0))


def _fit(
    priced: Sequence[_Priced], cluster: ClusterSpec, starts: Sequence[Sequence[float]] = STARTS
) -> Scales:
    from coplan.hardware.calibrate.fit import least_squares

    measured = np.log([p.record.step_time_s for p in priced])

    def residuals(x: np.ndarray) -> np.ndarray:
        c = scaled_cluster(cluster, Scales.of(x))
        got = np.log([max(p.step_time(c), 1e-30) for p in priced])
        return np.concatenate([got - measured, PRIOR * x])

    best, best_cost = np.zeros(len(FACTORS)), math.inf
    for start in starts:
        x = least_squares(residuals, start)
        r = residuals(x)
        if float(r @ r) < best_cost:
            best, best_cost = x, float(r @ r)
    return Scales.of(best)


def fit_runs(records: Sequence[RunRecord], cluster: ClusterSpec, *, cross_validate: bool = True) -> RunsFit:
    """Fit ``Scales`` to ``records`` starting from ``cluster``; with ``cross_validate`` (and at
    least 3 runs) also the leave-one-out error before and after."""
    priced = prepare(records, cluster)
    scales = _fit(priced, cluster)
    fitted = scaled_cluster(cluster, scales)
    measured = tuple(r.step_time_s for r in records)
    before = tuple(p.step_time(cluster) for p in priced)
    after = tuple(p.step_time(fitted) for p in priced)
    out = RunsFit(scales, before, after, measured)
    if not cross_validate or len(priced) < 3:
        return out
    held: list[float] = []
    start = [math.log(v) for v in scales.to_dict().values()]  # near every held-out fit's optimum
    for i, p in enumerate(priced):
        rest = [q for j, q in enumerate(priced) if j != i]
        held.append(p.step_time(scaled_cluster(cluster, _fit(rest, cluster, [start]))))
    return replace(
        out,
        loo_before=rms_log_error(before, measured),
        loo_after=rms_log_error(held, measured),
        loo_after_s=tuple(held),
    )


def fitted_profile(cluster: ClusterSpec, fit: RunsFit, source: str) -> ClusterSpec:
    """The cluster to write: ``cluster``'s devices with the fitted factors (what the fit priced)."""
    name = f"{cluster.name}+runs"
    out = scaled_cluster(cluster, fit.scales, name)
    return replace(out, source=f"{cluster.source}; {source}" if cluster.source else source)


def write_cluster(cluster: ClusterSpec, path: str | Path) -> Path:
    out = Path(path).expanduser()
    try:
        out.write_text(json.dumps(cluster.to_dict(), indent=2) + "\n", encoding="utf-8")
    except OSError as err:
        raise RunsError(f"cannot write {out}: {err.strerror or err}") from None
    return out
