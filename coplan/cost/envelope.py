"""Whether a priced configuration lies inside what the cost model was validated on.

The envelope is data (``envelope.json`` beside this module, built by ``benchmarks/build_envelope.py``
from the published runs and their priced errors): a stack is validated on a device where at least 10
of its published runs there are priced within a mean absolute step-time error of 10% (the accuracy
bar); today that is the ``megatron`` stack on A100 80GB and H100 and the ``torchtitan-compile``
stack on Meta's H100. Each validated stack's runs bound each dimension for that stack (another
stack's runs do not: torchtitan's ZeRO-3 at 256 GPUs says nothing of Megatron's), and every
validated run together for a stack with none:
the devices and the dtypes run on each, the largest TP / PP / VPP / DP / GPU count, the ZeRO stages
with the largest GPU count each reached, the highest MFU the model predicts for them per dtype
(``Estimate.mfu``: the 16-bit dense peak), the sequence and model-size ranges, whether any ran FSDP's
hybrid sharding (``hsdp``), the recompute modes and the kernels (Megatron's fusion) the runs were
priced with. A configuration
beyond any bound is extrapolated, and ``validated`` says which part.

Only MFU *above* the validated maximum is flagged: an optimistic price is what a search exploits,
while a low MFU comes with small models or short sequences, which their own ranges flag.

Inside or not, a configuration at ``SCALE_CAUTION_DOUBLINGS`` doublings or more above the median GPU
count of the runs it is compared with carries a caution (``Validated.cautions``): the scale trend
the published series show (``scale_trend`` in ``envelope.json``, from ``bench_published.py``:
error moving by a fixed number of points per doubling of the GPUs within one configuration) times
its doublings, what the price likely misses.

``nearest`` names up to three published runs of the same stack (of the validated runs when the stack
has none) by the distance ``sqrt(sum((log2 a - log2 b)^2))`` over GPUs, parameters, sequence, TP, PP,
VPP and DP (without parameters and sequence for a traced graph), plus 1 for each of a different dtype,
ZeRO stage and device; ties go to the lower id.
"""

from __future__ import annotations

import heapq
import json
import math
import statistics
from collections.abc import Mapping
from dataclasses import dataclass, replace
from functools import cache
from importlib import resources
from typing import Any

from coplan.cost.config import TrainingConfig
from coplan.cost.results import Estimate
from coplan.errors import SpecError
from coplan.models.spec import ModelSpec

#: The layout degrees the envelope bounds, as the messages name them.
_DEGREES: tuple[tuple[str, str], ...] = (
    ("tp", "TP"),
    ("pp", "PP"),
    ("vpp", "VPP"),
    ("cp", "CP"),
    ("dp", "DP"),
)
#: Log-scale coordinates of the nearest-run distance.
_AXES: tuple[str, ...] = ("gpus", "params", "seq", "tp", "pp", "vpp", "dp")
_LAYOUT_AXES: tuple[str, ...] = ("gpus", "tp", "pp", "vpp", "dp")
NEAREST = 3
#: the published runs' name for a stack's checkpointing policy where it differs from the stack's:
#: torchtitan's per-op policy is ``partial`` in the data (``published_stack_runs.json``'s
#: assumptions: "recompute 'partial' means the per-op policy in stack_settings")
POLICY_MODES = {"selective-op": "partial"}


@dataclass(frozen=True, slots=True)
class Validated:
    """A configuration against the validated envelope: ``inside`` when nothing is ``extrapolated``
    (human-readable, one line per dimension outside); ``nearest``: ids of the closest published runs."""

    inside: bool
    nearest: tuple[str, ...]
    extrapolated: tuple[str, ...]
    #: what qualifies the price inside or outside the envelope (``SCALE_CAUTION_DOUBLINGS``); not
    #: in ``to_dict``, whose keys stay those above (the CLI gives them as a key of their own)
    cautions: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        if self.inside != (not self.extrapolated):
            raise SpecError("validated", "inside", "must be true exactly when nothing is extrapolated")
        if len(self.nearest) > NEAREST:
            raise SpecError("validated", "nearest", f"at most {NEAREST} runs, got {len(self.nearest)}")

    def to_dict(self) -> dict[str, Any]:
        return {"inside": self.inside, "nearest": list(self.nearest), "extrapolated": list(self.extrapolated)}


@dataclass(frozen=True, slots=True)
class _Run:
    id: str
    stack: str
    device: str
    dtype: str
    zero: int
    validated: bool
    logs: tuple[float, ...]  # over _AXES
    layout_logs: tuple[float, ...]  # over _LAYOUT_AXES


@dataclass(frozen=True, slots=True)
class _Envelope:
    stacks: dict[str, dict[str, dict[str, Any]]]
    bounds: dict[str, Any]  # every validated run's; ``stack_bounds``: each validated stack's own
    stack_bounds: dict[str, dict[str, Any]]
    by_stack: dict[str, tuple[_Run, ...]]
    validated_runs: tuple[_Run, ...]
    bar: float
    min_runs: int
    scale_trend: dict[str, Any] | None = None


#: Doublings of the GPUs above the median of the runs a configuration is compared with beyond which
#: the measured scale trend (``scale_trend`` in ``envelope.json``) is named as a caution: one, so a
#: plan at twice the runs' usual scale or more hears how steps slowed with scale beyond their price.
SCALE_CAUTION_DOUBLINGS = 1.0


@cache
def _load() -> _Envelope:
    """The packaged envelope, read once per process."""
    data = json.loads(resources.files("coplan.cost").joinpath("envelope.json").read_text())
    stacks = data["stacks"]
    runs = tuple(
        _Run(
            id=r["id"],
            stack=r["stack"],
            device=r["device"],
            dtype=r["dtype"],
            zero=r["zero"],
            validated=stacks[r["stack"]][r["device"]]["validated"],
            logs=tuple(math.log2(r[a]) for a in _AXES),
            layout_logs=tuple(math.log2(r[a]) for a in _LAYOUT_AXES),
        )
        for r in data["runs"]
    )
    by_stack = {s: tuple(r for r in runs if r.stack == s) for s in stacks}
    return _Envelope(
        stacks=stacks,
        bounds=data["envelope"],
        stack_bounds=data.get("by_stack", {}),
        by_stack=by_stack,
        validated_runs=tuple(r for r in runs if r.validated),
        bar=data["bar_mean_abs_error"],
        min_runs=data["min_runs"],
        scale_trend=data.get("scale_trend"),
    )


def _count(n: float) -> str:
    """A parameter count as people write it (1.7B, 530B, 1.2T)."""
    for unit, scale in (("T", 1e12), ("B", 1e9), ("M", 1e6)):
        if n >= scale:
            return f"{n / scale:.3g}{unit}"
    return f"{n:,.0f}"


def _stack_note(env: _Envelope, stack: str) -> str | None:
    if stack in env.bounds["stacks"]:
        return None
    pairs = env.stacks.get(stack)
    if not pairs:
        return f"stack {stack}: no published runs validate it"
    errs = [e for p in pairs.values() for e in p["error_range"]]
    n = sum(p["runs"] for p in pairs.values())
    lo, hi = min(errs), max(errs)
    if hi < 0:
        how = f"priced {-hi:.0%}-{-lo:.0%} fast"
    elif lo > 0:
        how = f"priced {lo:.0%}-{hi:.0%} slow"
    else:
        how = f"priced {lo:+.0%} to {hi:+.0%}"
    return f"stack {stack}: {how} on its {n} published runs (not validated)"


def _device_notes(env: _Envelope, stack: str, devices: list[str], dtype: str) -> list[str]:
    notes = []
    known = env.bounds["devices"]
    for device in devices:
        if device not in known:
            note = f"device {device} outside {'/'.join(known)}"
            pair = env.stacks.get(stack, {}).get(device)
            if pair is not None:
                why = (
                    f"mean error {pair['mean_abs_error']:.0%}"
                    if pair["mean_abs_error"] > env.bar
                    else f"fewer than {env.min_runs} runs"
                )
                note += f" ({pair['runs']} published {stack} runs on it, {why})"
            notes.append(note)
        elif dtype not in env.bounds["dtypes"][device]:
            on = [d for d, kinds in env.bounds["dtypes"].items() if dtype in kinds]
            where = (
                f"validated {dtype} runs are on {'/'.join(on)}" if on else f"no validated run uses {dtype}"
            )
            notes.append(f"{dtype} on {device}: {where}")
    return notes


def _layout_notes(env: _Envelope, values: dict[str, Any], zero: int) -> list[str]:
    notes = []
    top = env.bounds["max"]
    for key, label in _DEGREES:
        if values[key] > top[key]:
            notes.append(f"{label} {values[key]:,} > {top[key]:,} (largest validated)")
    gpus = values["gpus"]
    if gpus > top["gpus"]:
        notes.append(f"{gpus:,} GPUs > {top['gpus']:,} (largest validated)")
    shard = values.get("fsdp_shard")
    if shard is not None and not env.bounds["hsdp"]:
        notes.append(f"hybrid sharding (FSDP within groups of {shard}): no validated run uses it")
    reach = env.bounds["zero"].get(str(zero))
    if reach is None:
        notes.append(f"ZeRO-{zero}: no validated run uses it")
    elif gpus > reach:
        notes.append(f"ZeRO-{zero} at {gpus:,} GPUs: validated runs reach ZeRO-{zero} only up to {reach:,}")
    return notes


def _model_notes(env: _Envelope, params: int, seq: int, moe: bool, causal: bool = True) -> list[str]:
    notes = []
    lo, hi = env.bounds["params"]
    if params < lo:
        notes.append(f"model {_count(params)} parameters below the smallest validated ({_count(lo)})")
    elif params > hi:
        notes.append(f"model {_count(params)} parameters above the largest validated ({_count(hi)})")
    slo, shi = env.bounds["seq"]
    if seq < slo:
        notes.append(f"sequence {seq:,} below the shortest validated ({slo:,})")
    elif seq > shi:
        notes.append(f"sequence {seq:,} above the longest validated ({shi:,})")
    if moe and not env.bounds["moe"]:
        notes.append("mixture of experts: the validated runs are all dense")
    if not causal:
        notes.append("bidirectional attention (an encoder): the validated runs are all decoders")
    return notes


def _kernel_notes(
    env: _Envelope,
    cfg: TrainingConfig,
    kernels: str | None = None,
    policies: Mapping[frozenset[str], str] | None = None,
) -> list[str]:
    """The kernels and recomputation the step is priced with, against those of the validated runs:
    planned fusion groups and per-tensor recompute sets are priced by paths no published run checked.
    ``kernels`` names the kernel set a plan's groups are exactly (Megatron-LM's, given as groups by
    a stack that runs other options too), which is judged by its name; ``policies`` names the
    recompute sets that are a stack's checkpointing policy (torchtitan's per-op set), each judged
    as the published runs of that policy (``POLICY_MODES``)."""
    notes = []
    kinds = env.bounds["fusion"]
    named = cfg.fusion if isinstance(cfg.fusion, str) else kernels
    if named is None:
        notes.append(
            f"fusion: {len(cfg.fusion)} planned kernel groups (validated runs: {'/'.join(kinds)} kernels)"
        )
    elif named not in kinds:
        notes.append(f"fusion {named}: validated runs are priced with {'/'.join(kinds)} kernels")
    modes = env.bounds["recompute"]
    chosen = cfg.recompute_per_stage if cfg.recompute_per_stage is not None else (cfg.recompute,)
    by_set = {frozenset(s): POLICY_MODES.get(p, p) for s, p in (policies or {}).items()}
    chosen = tuple(m if isinstance(m, str) else by_set.get(frozenset(m), m) for m in chosen)
    sets = [m for m in chosen if not isinstance(m, str)]
    if sets:
        notes.append(f"recompute: chosen tensor sets (validated runs recompute {'/'.join(modes)})")
    for mode in sorted({m for m in chosen if isinstance(m, str) and m not in modes}):
        notes.append(f"recompute {mode}: validated runs recompute {'/'.join(modes)}")
    return notes


def _mfu_note(env: _Envelope, mfu: float, dtype: str) -> str | None:
    tops = env.bounds["mfu_max"]
    if not tops:
        return None
    top = tops.get(dtype, max(tops.values()))
    if mfu <= top:
        return None
    which = f"validated {dtype} runs" if dtype in tops else "validated runs"
    return f"MFU {mfu:.2f} above the {top:.2f} the {which} reach"


def _nearest(
    env: _Envelope, stack: str, point: tuple[float, ...], dtype: str, zero: int, device: str, model: bool
) -> tuple[str, ...]:
    pool = env.by_stack.get(stack) or env.validated_runs
    scored = []
    for r in pool:
        dist = math.dist(point, r.logs if model else r.layout_logs)
        scored.append((dist + (r.dtype != dtype) + (r.zero != zero) + (r.device != device), r.id))
    return tuple(run_id for _, run_id in heapq.nsmallest(NEAREST, scored))


def validated(
    estimate: Estimate,
    spec: ModelSpec | None,
    stack: str = "megatron",
    kernels: str | None = None,
    policies: Mapping[frozenset[str], str] | None = None,
) -> Validated:
    """``estimate`` (of ``spec`` under the ``stack`` preset's name) against the validated envelope.

    ``spec`` is None for a model known only as a traced graph (``CostModel.spec``): its size and
    shape are not compared, it is marked extrapolated as such, and nearest runs go by layout alone.
    ``kernels``: the named kernel set a plan's fusion groups are exactly, if any
    (``coplan.plan.capabilities.named_fusion``); ``policies``: recompute sets that are the stack's
    checkpointing policies, by policy name (``coplan.plan.context.policy_sets`` inverted, or the
    per-op set ``coplan estimate --recompute selective-op`` prices).
    """
    env = _load()
    own = env.stack_bounds.get(stack)
    if own is not None:  # a validated stack is measured against its own runs
        env = replace(env, bounds=own)
    cfg = estimate.config
    devices = sorted({s.device for s in estimate.stages})
    values: dict[str, Any] = {"gpus": estimate.gpus, "tp": cfg.tp, "pp": cfg.pp, "vpp": cfg.vpp, "cp": cfg.cp}
    values |= {"dp": cfg.dp, "fsdp_shard": cfg.hybrid_group}
    notes: list[str] = []
    stack_note = _stack_note(env, stack)
    if stack_note:
        notes.append(stack_note)
    notes += _device_notes(env, stack, devices, cfg.dtype)
    notes += _layout_notes(env, values, cfg.zero)
    notes += _kernel_notes(env, cfg, kernels, policies)
    if spec is None:
        notes.append("model: a traced graph, where the validated runs are transformer specs")
    else:
        values["params"] = spec.param_count()
        values["seq"] = cfg.seq if cfg.seq is not None else spec.seq_len
        notes += _model_notes(env, values["params"], values["seq"], spec.is_moe, spec.causal)
    mfu_note = _mfu_note(env, estimate.mfu, cfg.dtype)
    if mfu_note:
        notes.append(mfu_note)
    axes = _AXES if spec is not None else _LAYOUT_AXES
    point = tuple(math.log2(max(values[a], 1)) for a in axes)
    nearest = _nearest(env, stack, point, cfg.dtype, cfg.zero, "+".join(devices), spec is not None)
    cautions = _scale_caution(env, stack, estimate.gpus)
    return Validated(inside=not notes, nearest=nearest, extrapolated=tuple(notes), cautions=cautions)


def _scale_caution(env: _Envelope, stack: str, gpus: int) -> tuple[str, ...]:
    """The measured scale trend, for ``gpus`` at least ``SCALE_CAUTION_DOUBLINGS`` doublings above
    the median GPU count of the validated runs it is compared with (the stack's own where it has
    them): within one configuration on several GPU counts the published steps slowed with scale
    beyond their price, so a price this far above the runs' usual scale is likely optimistic by
    about the trend times the doublings."""
    trend = env.scale_trend
    own = [r for r in env.by_stack.get(stack, ()) if r.validated] or list(env.validated_runs)
    if not trend or not own or trend["per_doubling"] >= 0:
        return ()
    median = 2 ** statistics.median(r.logs[0] for r in own)
    doublings = math.log2(gpus / median) if gpus > 0 else 0.0
    if doublings < SCALE_CAUTION_DOUBLINGS:
        return ()
    slope = -trend["per_doubling"]
    return (
        f"scale: {gpus:,} GPUs, {doublings:.1f} doublings above the validated runs' median "
        f"({median:,.0f}); within one configuration published steps slowed {slope * 100:.2f} points "
        f"per doubling beyond their price ({trend['more_negative']} of {trend['series']} series), so "
        f"this step is likely about {slope * doublings:.0%} slower than priced",
    )
