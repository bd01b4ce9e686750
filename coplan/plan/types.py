"""A plan: the four decisions coplan makes for one training job, as one immutable, versioned value.

Vocabulary (fixed across ``coplan.plan``, ``coplan.passes`` and ``coplan.search``):

- decisions inside a transformer block are made once per *block template* and name the ops and
  tensors of the template's reference block (its first block: ``h.0.mlp.gelu``); every block of the
  template follows it by position. Ops outside blocks (embedding, final norm, LM head, loss) are
  named as they are;
- **fusion** is a partition of ops into kernels: ``groups`` lists the multi-op kernels by op name;
  every op not listed is a kernel of its own (views launch nothing);
- **remat** is the set of saved forward tensors recomputed in backward instead of kept, per
  pipeline stage when stages differ (the first stage holds the most in-flight microbatches);
- **parallel** is the device layout, microbatching and sharding;
- **precision** is the dtype of every op: ``compute`` for matmul-class ops, overrides per op name
  (``fp32`` keeps a numerically sensitive op in full precision), plus master weights, loss scaling
  and fp8 scaling;

A plan's ``fingerprint`` is a hash of its decisions (not of how it was found), so two strategies
that reach the same plan report the same fingerprint.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field, fields, replace
from typing import Any

from coplan.cost.config import DTYPES, OP_DTYPES
from coplan.errors import SpecError

PLAN_VERSION = 2
#: plan versions this coplan reads: 1 has no ``fusion.duplicated`` (read as empty)
READABLE_VERSIONS = (1, 2)
#: the cost model's precisions, so a plan and the configuration it becomes accept the same ones
COMPUTE_DTYPES: tuple[str, ...] = DTYPES
#: what data-parallel gradient reduction may run in: fp32, or 16 bits
GRAD_REDUCE_DTYPES: tuple[str, ...] = ("fp32", "bf16", "fp16")


class PlanError(SpecError):
    """A plan file or value that cannot be used (exit code 2)."""

    def __init__(self, field: str | None, message: str, source: str = "plan") -> None:
        super().__init__(source, field, message)


def _positive(name: str, v: object) -> None:
    if isinstance(v, bool) or not isinstance(v, int) or v < 1:
        raise PlanError(name, f"must be a positive integer, got {v!r}")


@dataclass(frozen=True, slots=True, kw_only=True)
class ParallelPlan:
    """Device layout and batching. ``tp * cp * pp * dp`` is the GPU count (``cp``: context-parallel
    ranks sharing each sequence, ``coplan.cost.context``); ``stage_layers`` (one count per model
    chunk, ``pp * vpp`` of them) is the layers each pipeline chunk holds (None: even);
    ``fsdp_shard``: with ZeRO 2 or 3 run as FSDP units, the state is sharded within groups of this
    many of the ``dp x cp`` ranks and replicated across the groups (HSDP: FSDP's ``HYBRID_SHARD``,
    torchtitan's ``data_parallel_shard_degree`` beside ``data_parallel_replicate_degree``; None:
    sharded over all of them)."""

    tp: int = 1
    pp: int = 1
    dp: int = 1
    vpp: int = 1
    cp: int = 1
    sequence_parallel: bool = False
    zero: int = 0
    microbatch: int = 1
    stage_layers: tuple[int, ...] | None = None
    fsdp_shard: int | None = None

    def __post_init__(self) -> None:
        for name in ("tp", "pp", "dp", "vpp", "cp", "microbatch"):
            _positive(f"parallel.{name}", getattr(self, name))
        if self.zero not in (0, 1, 2, 3) or isinstance(self.zero, bool):
            raise PlanError("parallel.zero", f"must be 0, 1, 2 or 3, got {self.zero!r}")
        if self.fsdp_shard is not None:
            _positive("parallel.fsdp_shard", self.fsdp_shard)
            ranks = self.dp * self.cp
            if ranks % self.fsdp_shard or self.fsdp_shard == ranks:
                raise PlanError(
                    "parallel.fsdp_shard",
                    f"must divide dp x cp ({ranks}) into two or more groups, got {self.fsdp_shard}",
                )
            if self.zero < 2:
                raise PlanError(
                    "parallel.fsdp_shard", f"shards FSDP units: needs ZeRO 2 or 3, got {self.zero}"
                )
        if not isinstance(self.sequence_parallel, bool):
            raise PlanError(
                "parallel.sequence_parallel", f"must be true or false, got {self.sequence_parallel!r}"
            )
        if self.stage_layers is not None:
            try:
                layers = tuple(int(n) for n in self.stage_layers)
            except (TypeError, ValueError, OverflowError):
                raise PlanError(
                    "parallel.stage_layers", f"must list layer counts, got {self.stage_layers!r}"
                ) from None
            object.__setattr__(self, "stage_layers", layers)

    @property
    def gpus(self) -> int:
        return self.tp * self.cp * self.pp * self.dp

    def describe(self) -> str:
        bits = [f"TP{self.tp}", f"PP{self.pp}", f"DP{self.dp}"] + ([f"CP{self.cp}"] if self.cp > 1 else [])
        if self.vpp > 1:
            bits.append(f"VPP{self.vpp}")
        if self.sequence_parallel:
            bits.append("SP")
        if self.zero:
            bits.append(f"ZeRO-{self.zero}")
        if self.fsdp_shard is not None:
            bits.append(f"HSDP{self.fsdp_shard}")
        bits.append(f"mb{self.microbatch}")
        if self.stage_layers is not None:
            bits.append("layers " + "/".join(str(n) for n in self.stage_layers))
        return " ".join(bits)


@dataclass(frozen=True, slots=True, kw_only=True)
class FusionPlan:
    """Kernels: ``groups`` of op names fused into one kernel each (every other op alone).

    ``recompute_in_backward`` names recomputed forward ops that run inside the backward kernel
    reading them (Inductor's min-cut partitioner does this for cheap pointwise ops): they cost
    their arithmetic but no launch and no extra memory traffic. ``duplicated`` names pointwise ops
    computed inside the kernel of every op that reads them instead of in a kernel of their own
    (XLA's producer duplication): each copy costs the op's arithmetic and reads its inputs, and
    its output is never written unless kept for backward. A duplicated op is in no group. ``label``
    says where the groups came from ("eager", "megatron", "greedy", "joint"); it is not part of
    the decision.
    """

    groups: tuple[tuple[str, ...], ...] = ()
    recompute_in_backward: frozenset[str] = frozenset()
    label: str = "eager"
    duplicated: frozenset[str] = frozenset()

    def __post_init__(self) -> None:
        groups = tuple(tuple(str(n) for n in g) for g in self.groups)
        seen: set[str] = set()
        for g in groups:
            if len(g) < 2:
                raise PlanError("fusion.groups", f"a group needs at least two ops, got {list(g)}")
            for n in g:
                if n in seen:
                    raise PlanError("fusion.groups", f"op {n!r} is in two groups")
                seen.add(n)
        # canonical order: ops inside a group and groups by first op keep fingerprints stable
        object.__setattr__(self, "groups", tuple(sorted(tuple(sorted(g)) for g in groups)))
        object.__setattr__(
            self, "recompute_in_backward", frozenset(str(n) for n in self.recompute_in_backward)
        )
        dup = frozenset(str(n) for n in self.duplicated)
        both = sorted(dup & seen)
        if both:
            raise PlanError("fusion.duplicated", f"op {both[0]!r} is duplicated and in a group")
        object.__setattr__(self, "duplicated", dup)

    @property
    def fused_ops(self) -> int:
        return sum(len(g) for g in self.groups)


@dataclass(frozen=True, slots=True, kw_only=True)
class RematPlan:
    """Saved tensors recomputed instead of kept: ``recompute`` for every stage, or ``per_stage``
    (one set per pipeline stage) when stages differ. ``layers``: with full recomputation, only the
    first ``layers`` blocks of each model chunk recompute and the others keep what they save
    (``TrainingConfig.recompute_layers``; None: every block)."""

    recompute: frozenset[str] = frozenset()
    per_stage: tuple[frozenset[str], ...] | None = None
    layers: int | None = None

    def __post_init__(self) -> None:
        object.__setattr__(self, "recompute", frozenset(str(n) for n in self.recompute))
        if self.layers is not None:
            _positive("remat.layers", self.layers)
        if self.per_stage is not None:
            object.__setattr__(self, "per_stage", tuple(frozenset(str(n) for n in s) for s in self.per_stage))

    def for_stage(self, stage: int) -> frozenset[str]:
        if self.per_stage is None:
            return self.recompute
        return self.per_stage[stage]

    @property
    def all_names(self) -> frozenset[str]:
        out = set(self.recompute)
        for s in self.per_stage or ():
            out |= s
        return frozenset(out)


@dataclass(frozen=True, slots=True, kw_only=True)
class PrecisionPlan:
    """Dtypes: ``compute`` for matmul-class ops, ``ops`` overrides by op name (``"fp32"`` keeps an
    op in full precision; ``"bf16"`` lowers a sensitive op under a tolerance rule), fp32 master
    weights, dynamic loss scaling (fp16), per-tensor fp8 scaling (fp8)."""

    compute: str = "fp32"
    ops: tuple[tuple[str, str], ...] = ()
    master_weights: bool = True
    loss_scaling: bool = False
    fp8_scaling: str = ""
    #: the dtype gradients are reduced (and accumulated) in across data-parallel ranks: fp32, or
    #: the 16-bit compute dtype (Megatron-Core --grad-reduce-in-bf16, torchtitan
    #: mixed_precision_reduce, FSDP MixedPrecision.reduce_dtype)
    grad_reduce: str = "fp32"
    #: under fp8, the GEMMs' weights are kept (and gathered) in fp8 themselves (Megatron
    #: --fp8-param-gather, NeMo fp8_params, torchtitan's float8 all-gather)
    fp8_params: bool = False

    def __post_init__(self) -> None:
        if self.compute not in COMPUTE_DTYPES:
            raise PlanError(
                "precision.compute", f"must be one of {', '.join(COMPUTE_DTYPES)}, got {self.compute!r}"
            )
        ops = tuple(sorted((str(n), str(d)) for n, d in dict(self.ops).items()))
        for n, d in ops:
            if d not in OP_DTYPES:
                raise PlanError(
                    "precision.ops", f"op {n!r}: dtype must be one of {', '.join(OP_DTYPES)}, got {d!r}"
                )
        object.__setattr__(self, "ops", ops)
        if self.compute == "fp16" and not self.loss_scaling:
            raise PlanError("precision.loss_scaling", "fp16 training needs loss scaling")
        if self.compute == "fp8" and self.fp8_scaling != "per-tensor":
            object.__setattr__(self, "fp8_scaling", "per-tensor")
        if self.grad_reduce not in GRAD_REDUCE_DTYPES:
            raise PlanError(
                "precision.grad_reduce",
                f"must be one of {', '.join(GRAD_REDUCE_DTYPES)}, got {self.grad_reduce!r}",
            )
        if self.grad_reduce != "fp32" and self.compute in ("fp32", "tf32"):
            raise PlanError("precision.grad_reduce", f"a {self.compute} step reduces its gradients in fp32")
        if self.fp8_params and self.compute != "fp8":
            raise PlanError("precision.fp8_params", f"needs compute fp8, got {self.compute!r}")

    @property
    def overrides(self) -> dict[str, str]:
        return dict(self.ops)


@dataclass(frozen=True, slots=True, kw_only=True)
class Plan:
    """One complete plan for a model on a cluster. ``model`` and ``graph`` (the graph fingerprint)
    tie it to the model it was made for; ``gpus`` to the world size."""

    model: str
    graph: str
    cluster: str
    gpus: int
    global_batch: int
    seq: int
    parallel: ParallelPlan = field(default_factory=ParallelPlan)
    fusion: FusionPlan = field(default_factory=FusionPlan)
    remat: RematPlan = field(default_factory=RematPlan)
    precision: PrecisionPlan = field(default_factory=PrecisionPlan)
    flash_attention: bool = True
    version: int = PLAN_VERSION

    def __post_init__(self) -> None:
        _positive("gpus", self.gpus)
        _positive("global_batch", self.global_batch)
        _positive("seq", self.seq)
        if isinstance(self.version, bool) or self.version not in READABLE_VERSIONS:
            versions = " and ".join(str(v) for v in READABLE_VERSIONS)
            raise PlanError("version", f"this coplan reads plan versions {versions}, got {self.version!r}")
        # a plan read from an older version is this version's plan from then on
        object.__setattr__(self, "version", PLAN_VERSION)

    def with_(self, **changes: Any) -> Plan:
        return replace(self, **changes)

    # --- serialisation -------------------------------------------------------------------------

    def decisions(self) -> dict[str, Any]:
        """The four decisions as plain data (what the fingerprint hashes)."""
        p, f, r, c = self.parallel, self.fusion, self.remat, self.precision
        return {
            "parallel": {
                "tp": p.tp,
                "pp": p.pp,
                "dp": p.dp,
                "vpp": p.vpp,
                "sequence_parallel": p.sequence_parallel,
                "zero": p.zero,
                "microbatch": p.microbatch,
                "stage_layers": list(p.stage_layers) if p.stage_layers is not None else None,
                # only where used, so plans without context parallelism keep their fingerprint
                **({"cp": p.cp} if p.cp > 1 else {}),
                **({"fsdp_shard": p.fsdp_shard} if p.fsdp_shard is not None else {}),
            },
            "fusion": {
                "groups": [list(g) for g in f.groups],
                "recompute_in_backward": sorted(f.recompute_in_backward),
                # only where used, so plans without duplication keep their fingerprint
                **({"duplicated": sorted(f.duplicated)} if f.duplicated else {}),
                # a stack's own kernel set named instead of groups is a decision of its own, as is
                # handing the step to the stack's compiler (torch.compile on) instead of none
                **({"kernels": f.label} if f.label in ("megatron", "compiled") and not f.groups else {}),
            },
            "remat": {
                "recompute": sorted(r.recompute),
                "per_stage": [sorted(s) for s in r.per_stage] if r.per_stage is not None else None,
                # only where used, so plans recomputing every block keep their fingerprint
                **({"layers": r.layers} if r.layers is not None else {}),
            },
            "precision": {
                "compute": c.compute,
                "ops": {n: d for n, d in c.ops},
                "master_weights": c.master_weights,
                "loss_scaling": c.loss_scaling,
                "fp8_scaling": c.fp8_scaling,
                # only where not the default, so plans from before these keys keep their fingerprint
                **({"grad_reduce": c.grad_reduce} if c.grad_reduce != "fp32" else {}),
                **({"fp8_params": True} if c.fp8_params else {}),
            },
            "flash_attention": self.flash_attention,
        }

    @property
    def fingerprint(self) -> str:
        body = {
            "model": self.model,
            "graph": self.graph,
            "gpus": self.gpus,
            "global_batch": self.global_batch,
            "seq": self.seq,
            **self.decisions(),
        }
        blob = json.dumps(body, sort_keys=True, separators=(",", ":"))
        return hashlib.sha256(blob.encode()).hexdigest()[:16]

    def to_dict(self) -> dict[str, Any]:
        d = {
            "version": self.version,
            "model": self.model,
            "graph": self.graph,
            "cluster": self.cluster,
            "gpus": self.gpus,
            "global_batch": self.global_batch,
            "seq": self.seq,
            **self.decisions(),
            "fingerprint": self.fingerprint,
        }
        d["fusion"]["label"] = self.fusion.label
        return d

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), indent=2)

    @classmethod
    def from_dict(cls, data: Mapping[str, Any], source: str = "plan") -> Plan:
        if not isinstance(data, Mapping):
            raise PlanError(None, "expected a JSON object", source)
        try:
            par = _section(data, "parallel")
            fus = _section(data, "fusion")
            rem = _section(data, "remat")
            pre = _section(data, "precision")
            per_stage = rem.get("per_stage")
            ops = pre.get("ops", {})
            if not isinstance(ops, Mapping):
                raise PlanError("precision.ops", "must be an object of op name to dtype")
            plan = cls(
                version=data.get("version", PLAN_VERSION),
                model=str(data["model"]),
                graph=str(data.get("graph", "")),
                cluster=str(data.get("cluster", "")),
                gpus=data["gpus"],
                global_batch=data["global_batch"],
                seq=data["seq"],
                parallel=ParallelPlan(**_known("parallel", par, ParallelPlan)),
                fusion=FusionPlan(
                    groups=tuple(
                        _names("fusion.groups", g) for g in _list("fusion.groups", fus.get("groups", ()))
                    ),
                    recompute_in_backward=frozenset(
                        _names("fusion.recompute_in_backward", fus.get("recompute_in_backward", ()))
                    ),
                    label=str(fus.get("label", "custom")),
                    duplicated=frozenset(_names("fusion.duplicated", fus.get("duplicated", ()))),
                ),
                remat=RematPlan(
                    recompute=frozenset(_names("remat.recompute", rem.get("recompute", ()))),
                    per_stage=tuple(
                        frozenset(_names("remat.per_stage", s)) for s in _list("remat.per_stage", per_stage)
                    )
                    if per_stage is not None
                    else None,
                    layers=rem.get("layers"),
                ),
                precision=PrecisionPlan(
                    compute=pre.get("compute", "fp32"),
                    ops=tuple(ops.items()),
                    master_weights=_flag(pre, "master_weights", True, "precision."),
                    loss_scaling=_flag(pre, "loss_scaling", False, "precision."),
                    fp8_scaling=str(pre.get("fp8_scaling", "")),
                    grad_reduce=str(pre.get("grad_reduce", "fp32")),
                    fp8_params=_flag(pre, "fp8_params", False, "precision."),
                ),
                flash_attention=_flag(data, "flash_attention", True),
            )
        except KeyError as e:
            raise PlanError(str(e.args[0]), "missing", source) from None
        except (TypeError, ValueError) as e:
            # an error text may quote an edited value; a one-line error stays one line
            raise PlanError(None, f"malformed plan: {e}".replace("\n", "\\n"), source) from None
        except PlanError as e:
            raise PlanError(e.field, e.reason, source) from None
        stated = data.get("fingerprint")
        if stated is not None and stated != plan.fingerprint:
            raise PlanError(
                "fingerprint",
                f"{stated} does not match the plan's decisions ({plan.fingerprint}): edited by hand?",
                source,
            )
        return plan

    @classmethod
    def load(cls, path: str) -> Plan:
        from coplan.fileio import read_text

        try:
            data = json.loads(read_text(path))
        except SpecError as e:
            raise PlanError(None, e.reason, path) from None
        except json.JSONDecodeError as e:
            raise PlanError(None, f"not valid JSON (line {e.lineno}: {e.msg})", path) from None
        return cls.from_dict(data, source=path)


def _section(data: Mapping[str, Any], key: str) -> Mapping[str, Any]:
    """One decision's object (absent or null: every default)."""
    v = data.get(key)
    if v is None:
        return {}
    if not isinstance(v, Mapping):
        raise PlanError(key, f"must be an object, got {type(v).__name__}")
    return v


def _flag(data: Mapping[str, Any], key: str, default: bool, prefix: str = "") -> bool:
    """A JSON true/false (``bool("false")`` would read a quoted "false" as true)."""
    v = data.get(key, default)
    if not isinstance(v, bool):
        raise PlanError(prefix + key, f"must be true or false, got {v!r}")
    return v


def _list(field: str, v: object) -> list[Any] | tuple[Any, ...]:
    if not isinstance(v, list | tuple):
        raise PlanError(field, f"must be a list, got {type(v).__name__}")
    return v


def _names(field: str, v: object) -> tuple[str, ...]:
    """A list of op or tensor names (a bare string would otherwise be read as its characters)."""
    items = _list(field, v)
    if not all(isinstance(n, str) for n in items):
        raise PlanError(field, f"must be a list of names, got {v!r}")
    return tuple(items)


def names(items: Iterable[str]) -> str:
    """A short human list of names (first five)."""
    xs = sorted(items)
    head = ", ".join(xs[:5])
    return head + (f" (+{len(xs) - 5} more)" if len(xs) > 5 else "")


def _known(section: str, values: Mapping[str, Any], kind: type) -> dict[str, Any]:
    """``values`` when every key is a field of the dataclass ``kind``; else the unknown key named."""
    allowed = {f.name for f in fields(kind)}
    for key in values:
        if key not in allowed:
            raise PlanError(
                f"{section}.{key!r}", f"unknown field; expected one of: {', '.join(sorted(allowed))}"
            )
    return dict(values)
