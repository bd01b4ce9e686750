"""Tensor-parallel communication overlapped with GEMMs, priced as Transformer Engine runs it.

With sequence parallelism each transformer block all-gathers its normalised input before the QKV
and FC1 GEMMs and reduce-scatters the outputs of the attention projection and FC2 (and the
reverse in backward). Megatron-Core's ``--tp-comm-overlap`` hands these to Transformer Engine's
userbuffers, which hides them behind the GEMMs they feed, but not for free: every overlap runs in
one of three ways, each with its own price (TE ``module/base.py`` ``initialize_ub`` and
``csrc/comm_gemm_overlap.h``, v1.8, Jul 2024, the release Megatron-Core r0.8 ran on):

- ``ring_exchange`` (the all-gathers into QKV/FC1 forward and into the projection/FC2 input
  gradients): the GEMM is split into TP chunks of ``M / TP`` rows, each computed while the next
  chunk arrives from the ring neighbour by copy engine. The chunks run on up to three compute
  streams (``_NUM_MAX_UB_STREAMS``), so the GPU sees ``min(3, TP)`` chunks at a time: at TP8 with
  4,096 tokens that is 1,536 rows where the unsplit GEMM had 4,096, and the device's GEMM shape
  derating prices what that costs. The last chunk can only start once the whole ring has passed.
- ``pipeline`` (the reduce-scatters after the projection and FC2 forward): the GEMM is split into
  ``num_splits`` chunks and each chunk's output is reduce-scattered by a communication kernel on
  ``num_sm`` SMs while the next chunk computes; the last chunk's reduce-scatter is exposed. With
  ``set_sm_margin`` the GEMM is launched on the remaining SMs; without it the two contend.
- ``bulk`` (the backward all-gather of the saved input for the weight gradient, during the input
  gradient GEMM, and the reduce-scatter of that input gradient, during the weight-gradient GEMM):
  one collective on ``num_sm`` SMs beside one whole GEMM.

What a pair costs is its time less the GEMM's own time (already in the block's compute): chunking
losses, SMs taken, and communication the GEMM is too short to cover. The defaults are TE's own
(``TE_DEFAULTS``); recipes that tune them (NeMo's ``ub_cfg_*.yaml``) pass their values
(``TrainingConfig.tp_overlap_cfg``). The input- and weight-gradient GEMMs are priced at their
forward GEMM's time (the same FLOPs over the same three sizes).

PyTorch's async TP (torchtitan's ``enable_async_tensor_parallel``: Inductor's micro-pipeline pass,
``torch/_inductor/fx_passes/micro_pipeline_tp.py``, over ``torch/distributed/_symmetric_memory``)
overlaps only what that pass matches (``async_tp_slots``), each fused pair a ring of copy-engine
copies beside ``TP`` chunks of the GEMM, priced one after another; every other collective stays
exposed.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass

from coplan.cost.parts import Kernel

#: Transformer Engine's overlap slots: (layer)_(pass).
UB_SLOTS: tuple[str, ...] = (
    "qkv_fprop",
    "fc1_fprop",
    "proj_dgrad",
    "fc2_dgrad",
    "proj_fprop",
    "fc2_fprop",
    "qkv_dgrad",
    "qkv_wgrad",
    "fc1_dgrad",
    "fc1_wgrad",
)
UB_METHODS: tuple[str, ...] = ("ring_exchange", "pipeline", "bulk")
#: A collective no GEMM hides (async TP's unmatched patterns); not a Transformer Engine method.
EXPOSED = "exposed"

#: Compute streams a split GEMM's chunks are spread over (TE ``_NUM_MAX_UB_STREAMS``).
COMPUTE_STREAMS = 3


@dataclass(frozen=True, slots=True)
class UbSlot:
    """How one slot overlaps: method, communication SMs, chunks (pipeline), SM margin."""

    method: str
    num_sm: int = 16
    num_splits: int = 4
    set_sm_margin: bool = False
    streams: int = COMPUTE_STREAMS  # compute streams a split GEMM's chunks run on

    def __post_init__(self) -> None:
        if self.method not in (*UB_METHODS, EXPOSED):
            raise ValueError(f"overlap method must be one of {', '.join(UB_METHODS)}, got {self.method!r}")
        if not isinstance(self.num_sm, int) or self.num_sm < 0:
            raise ValueError(f"num_sm must be a non-negative integer, got {self.num_sm!r}")
        if not isinstance(self.num_splits, int) or self.num_splits < (1 if self.method == "pipeline" else 0):
            raise ValueError(f"num_splits must be a positive integer for a pipeline, got {self.num_splits!r}")


def _te_counts(method: str) -> tuple[int, int]:
    """TE's (num_sm, num_splits) for a slot of ``method`` where a recipe gives only the method: one
    SM for the copy-engine ring, 16 for the others, 4 chunks for a pipeline (``initialize_ub``)."""
    return (1 if method == "ring_exchange" else 16), (4 if method == "pipeline" else 0)


def _default_method(slot: str) -> str:
    if slot in ("qkv_fprop", "fc1_fprop", "proj_dgrad", "fc2_dgrad"):
        return "ring_exchange"
    if slot in ("proj_fprop", "fc2_fprop"):
        return "pipeline"
    return "bulk"


def _te_slot(slot: str) -> UbSlot:
    method = _default_method(slot)
    return UbSlot(method, *_te_counts(method))


#: TE's configuration where a recipe gives none (``initialize_ub`` with ``ub_cfgs=None``).
TE_DEFAULTS: dict[str, UbSlot] = {s: _te_slot(s) for s in UB_SLOTS}

#: The forward pairs async TP's pass fuses whatever the precision: a GEMM feeding a reduce-scatter
#: (``fuse_matmul_reduce_scatter``: the scatter's input is one ``mm`` or ``_scaled_mm``).
_ASYNC_SCATTERS = ("proj_fprop", "fc2_fprop")
#: The all-gathers it fuses where the gathered tensor feeds the GEMMs directly
#: (``fuse_all_gather_matmul``: its consumers must be ``mm``/``_scaled_mm`` reading it as A): in 16
#: bits, and in fp8 where the shard is cast before the gather (tensorwise fp8 TP); with rowwise
#: scaling a cast sits between the gather and the GEMM, and nothing is fused.
_ASYNC_GATHERS = ("qkv_fprop", "fc1_fprop", "proj_dgrad", "fc2_dgrad")


def async_tp_slots(gathers_fused: bool) -> dict[str, UbSlot]:
    """How async TP runs each slot. A fused all-gather is a ring: the local shard's GEMM first, then each
    peer's shard copied by copy engine (``_pipelined_all_gather_and_consume``) and consumed, the steps
    alternating between two streams; a fused reduce-scatter computes each peer's chunk and lets the peer
    pull it (``_pipelined_produce_and_all2all``), the partial sums reduced by a kernel after
    (``async_tp_reduce_bytes``, at ``ASYNC_TP_REDUCE_PEAK`` of the HBM peak). The chunks' GEMMs are priced
    one after another, each at its own shape (``streams=1``): the two streams do not buy two chunks' rows
    at once. At Llama-3 70B's TP 8 FC1 shape on H100 (M 2,048, N 3,584, K 8,192; pytorch/pytorch#143160)
    the decomposed path took 354 us against 301 us for NCCL's all-gather and cuBLAS: eight 256-row GEMMs
    one after another price 358 us, two at once 269 us. Its faster variants (295 and 277 us there) run
    with ``TORCH_SYMM_MEM_ENABLE_NATIVE_ASYNC_TP`` set (pytorch/pytorch#142283) or for small M only, and
    torchtitan sets no such variable. The input gradients' reduce-scatters are never fused: each is a sum
    of GEMM outputs (Q, K and V; SwiGLU's gate and up), not one GEMM's, so they and the unmatched
    all-gathers are ``EXPOSED``. No SMs are held (copy engines); there is no backward re-gather for the
    weight gradient (the gathered input is saved or recomputed)."""
    out = {}
    for slot in UB_SLOTS:
        if slot in _ASYNC_SCATTERS or (gathers_fused and slot in _ASYNC_GATHERS):
            out[slot] = UbSlot("ring_exchange", num_sm=0, num_splits=0, streams=1)
        else:
            out[slot] = UbSlot(EXPOSED, num_sm=0, num_splits=0)
    return out


#: Fraction of the HBM peak the fused reduce-scatters' final reduction reaches: ``torch.sum`` over
#: the ``tp`` stacked partials is ATen's ``reduce_kernel``, instruction-bound for a reduced extent
#: of 2-8, which on H100 reached 23-43% of HBM peak (pytorch/pytorch#191803, which replaced it with
#: a Triton kernel reaching 82-88% at the same traffic); the middle of that range.
ASYNC_TP_REDUCE_PEAK = 0.33


def async_tp_reduce_bytes(exits: Sequence[float], tp: int, element_bytes: float) -> float:
    """Bytes one GPU's reduction kernels move after async TP's fused reduce-scatters of a block's
    forward (``_fused_matmul_reduce_scatter_impl``: ``torch.sum`` over the ``tp`` stacked partial
    chunks): each reads its GEMM's whole output and writes its shard."""
    return sum(n * element_bytes * (1 + 1 / tp) for n in exits)


def _slot(slot: str, method: str, num_sm: int, num_splits: int, set_sm_margin: bool) -> UbSlot:
    """One recipe entry, checked; errors name the slot."""
    if slot not in UB_SLOTS:
        raise ValueError(f"unknown overlap slot {slot!r} (expected one of {', '.join(UB_SLOTS)})")
    if method not in UB_METHODS:
        raise ValueError(f"{slot}: overlap method must be one of {', '.join(UB_METHODS)}, got {method!r}")
    try:
        return UbSlot(method, num_sm, num_splits, set_sm_margin)
    except ValueError as exc:
        raise ValueError(f"{slot}: {exc}") from None


def ub_slots(overrides: Iterable[tuple[str, str, int, int, bool]]) -> dict[str, UbSlot]:
    """TE's defaults with a recipe's ``(slot, method, num_sm, num_splits, set_sm_margin)`` entries."""
    out = dict(TE_DEFAULTS)
    for slot, method, sm, splits, margin in overrides:
        out[slot] = _slot(slot, method, sm, splits, bool(margin))
    return out


#: Seconds of a kernel priced with its row count changed (the caller's kernel rule).
ChunkTime = Callable[[Kernel, float], float]


def with_rows(k: Kernel, rows: float) -> Kernel:
    """GEMM ``k`` on ``rows`` of its ``M`` rows (a chunk): FLOPs and traffic in proportion."""
    m, n, kk = k.dims
    f = rows / m
    return dataclasses.replace(
        k,
        dims=(max(1, round(rows)), n, kk),
        mm_flops=k.mm_flops * f,
        vec_flops=k.vec_flops * f,
        vec_split=tuple(x * f for x in k.vec_split),
        bytes=tuple(b * f for b in k.bytes),  # type: ignore[arg-type]
    )


def _pair(slot: UbSlot, gemm: Kernel, t: float, comm: float, tp: int, sms: int, chunk: ChunkTime) -> float:
    """Seconds a GEMM of ``t`` seconds and its overlapped collective of ``comm`` seconds take
    beyond ``t``."""
    if slot.method == EXPOSED:
        return comm
    rows = float(gemm.dims[0])
    share = slot.num_sm / sms if sms > slot.num_sm else 0.0
    if slot.method == "bulk":
        # with a margin the GEMM runs on the SMs left; without, it loses the collective's SMs
        # while the collective runs
        margin = t / (1.0 - share)
        compute = margin if slot.set_sm_margin else t + min(comm, t) * share / (1.0 - share)
        return max(compute, comm) - t
    n = tp if slot.method == "ring_exchange" else slot.num_splits
    streams = min(slot.streams, n)
    compute = n / streams * chunk(gemm, rows * streams / n)
    if slot.set_sm_margin:
        compute /= 1.0 - share
    if slot.method == "ring_exchange":
        # ring steps run back to back on the copy engines; the last chunk starts after the last
        return max(compute, comm + chunk(gemm, rows / n)) - t
    if not slot.set_sm_margin:
        compute += min(comm, compute) * share / (1.0 - share)
    return max(compute, comm) + comm / n - t


def block_overlap(
    kernels: Sequence[Kernel],
    times: Sequence[float],
    entries: tuple[float, ...],
    exits: tuple[float, ...],
    gather: Callable[[float], float],
    scatter: Callable[[float], float],
    tp: int,
    sms: int,
    slots: dict[str, UbSlot],
    chunk: ChunkTime,
    relayout: Callable[[float, bool], float] | None = None,
) -> tuple[float, float] | None:
    """(forward, backward) seconds the block's overlapped TP collectives add, or None where the
    block is not Megatron's attention + MLP shape (QKV, attention, projection, FC1, FC2).

    ``entries``/``exits`` are the elements gathered into (QKV, FC1) and scattered out of
    (projection, FC2); ``gather``/``scatter`` price one collective of that many elements;
    ``relayout`` (elements, whether gathered) the copy a collective left unfused (``EXPOSED``)
    adds where the stack re-lays its tensor out around it (DTensor's sequence dimension)."""
    if len(entries) != 2 or len(exits) != 2:
        return None
    kinds = [k.kind for k in kernels]
    if "attention" not in kinds:
        return None
    at = kinds.index("attention")
    mms = [(i, k, t) for i, (k, t) in enumerate(zip(kernels, times, strict=True)) if k.kind == "matmul"]
    before = [(k, t) for i, k, t in mms if i < at]
    after = [(k, t) for i, k, t in mms if i > at]
    if not before or len(after) < 3:
        return None
    # QKV's GEMMs read one gathered input (same rows and depth), FC1's too and with one width
    # (SwiGLU's gate and up); an MoE layer's router and experts do not, and keep the older rule
    fc1s = after[1:-1]
    if len({(k.dims[0], k.dims[2]) for k, _ in before}) != 1 or len({k.dims for k, _ in fc1s}) != 1:
        return None
    qkv, proj, fc1, fc2 = _merge(before), after[0], _merge(after[1:-1]), after[-1]
    e_attn, e_mlp = entries
    x_attn, x_mlp = exits

    def pair(name: str, gemm: tuple[Kernel, float], comm: float) -> float:
        return _pair(slots[name], gemm[0], gemm[1], comm, tp, sms, chunk)

    def copy(name: str, n: float, gathered: bool) -> float:
        return relayout(n, gathered) if relayout is not None and slots[name].method == EXPOSED else 0.0

    fwd = (
        pair("qkv_fprop", qkv, gather(e_attn))
        + pair("fc1_fprop", fc1, gather(e_mlp))
        + pair("proj_fprop", proj, scatter(x_attn))
        + pair("fc2_fprop", fc2, scatter(x_mlp))
        + copy("qkv_fprop", e_attn, True)
        + copy("fc1_fprop", e_mlp, True)
        + copy("proj_fprop", x_attn, False)
        + copy("fc2_fprop", x_mlp, False)
    )
    bwd = pair("proj_dgrad", proj, gather(x_attn)) + pair("fc2_dgrad", fc2, gather(x_mlp))
    bwd += copy("proj_dgrad", x_attn, True) + copy("fc2_dgrad", x_mlp, True)
    for layer, gemm, n in (("qkv", qkv, e_attn), ("fc1", fc1, e_mlp)):
        dgrad = slots[f"{layer}_dgrad"]
        if dgrad.method == EXPOSED:
            # async TP: the input gradient's reduce-scatter shows whole; no re-gather
            bwd += scatter(n) + copy(f"{layer}_dgrad", n, False)
        elif dgrad.method == "bulk":
            bwd += pair(f"{layer}_dgrad", gemm, gather(n)) + pair(f"{layer}_wgrad", gemm, scatter(n))
        else:
            # the input gradient's reduce-scatter overlaps its own GEMM instead (TE moves it off
            # the weight gradient); the input is then gathered by NCCL beside the same GEMM
            bwd += pair(f"{layer}_dgrad", gemm, scatter(n)) + _pair(
                TE_DEFAULTS[f"{layer}_dgrad"], gemm[0], gemm[1], gather(n), tp, sms, chunk
            )
    return fwd, bwd


def _merge(gemms: Sequence[tuple[Kernel, float]]) -> tuple[Kernel, float]:
    """One GEMM for GEMMs reading the same gathered input (SwiGLU's gate and up projections, or
    separate Q, K and V): Megatron runs them as one, with their output widths summed."""
    if len(gemms) == 1:
        return gemms[0]
    first = gemms[0][0]
    m, _, k = first.dims
    merged = dataclasses.replace(
        first,
        dims=(m, sum(g.dims[1] for g, _ in gemms), k),
        mm_flops=sum(g.mm_flops for g, _ in gemms),
        vec_flops=sum(g.vec_flops for g, _ in gemms),
        vec_split=tuple(map(sum, zip(*(g.vec_split for g, _ in gemms), strict=True))),
        # (the shared input counted once per GEMM: these GEMMs are compute-bound)
        bytes=tuple(float(sum(b)) for b in zip(*(g.bytes for g, _ in gemms), strict=True)),  # type: ignore[arg-type]
    )
    return merged, sum(t for _, t in gemms)


#: Keys of a TE/NeMo userbuffers slot entry that do not change the price (``cga_size`` packs the
#: communication SMs, ``fp8_buf`` sets the buffer's dtype, ``use_ce`` is TE's default, ``atomic_gemm``
#: and ``aggregate`` are priced as the plain method).
_UNPRICED_KEYS = frozenset({"cga_size", "fp8_buf", "use_ce", "atomic_gemm", "aggregate", "is_reduce_scatter"})


def read_ub_cfg(data: object) -> tuple[tuple[str, str, int, int, bool], ...]:
    """A recipe's userbuffers settings (NeMo's ``ub_cfg_*.yaml`` or the same as JSON: slot ->
    {method, num_sm, num_splits, set_sm_margin, ...}) as ``TrainingConfig.tp_overlap_cfg`` entries.
    Raises ValueError naming the slot and key at fault."""
    if not isinstance(data, dict):
        raise ValueError(f"expected a mapping of overlap slots, got {type(data).__name__}")
    out = []
    for slot, entry in data.items():
        if not isinstance(entry, dict):
            raise ValueError(f"{slot}: expected a mapping, got {type(entry).__name__}")
        unknown = set(entry) - {"method", "num_sm", "num_splits", "set_sm_margin"} - _UNPRICED_KEYS
        if unknown:
            raise ValueError(f"{slot}: unknown key {sorted(unknown)[0]!r}")
        method = str(entry.get("method", _default_method(slot)))
        num_sm, num_splits = _te_counts(method)
        fields = {
            "num_sm": entry.get("num_sm", num_sm),
            "num_splits": entry.get("num_splits", num_splits),
            "set_sm_margin": entry.get("set_sm_margin", 0),
        }
        for key, value in fields.items():
            if (isinstance(value, bool) and key != "set_sm_margin") or not isinstance(value, int):
                raise ValueError(f"{slot}: {key} must be an integer, got {value!r}")
        got = _slot(slot, method, fields["num_sm"], fields["num_splits"], bool(fields["set_sm_margin"]))
        out.append((slot, got.method, got.num_sm, got.num_splits, got.set_sm_margin))
    return tuple(out)
