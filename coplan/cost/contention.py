"""Compute slowed by the collectives it overlaps.

An overlapped collective is not free: NCCL runs each channel as one thread block that holds its SM
for the whole collective and never shares it with a compute kernel (NVIDIA/nccl issue #689, the
maintainer: "NCCL CTAs won't share an SM with compute kernels"; on a DGX with 8 NICs "it would use
16 SMs"), so a GEMM or attention kernel launched beside it runs on the SMs left. Transformer Engine's
tensor-parallel overlap prices the same effect for its own communication SMs (``tp_overlap.py``);
this module prices it for the NCCL collectives the data-parallel schedules hide behind compute:
FSDP's and ZeRO-3's per-unit all-gathers and reduce-scatters, and the bucketed gradient reduction
and parameter gathers of DDP and ZeRO-1/2.

While a collective runs, compute progresses at ``1 - share`` of its rate (the shares of collectives
of different groups in flight at once adding up: ``run_beside_each``), ``share`` the collective's
SMs over the device's (``InterconnectLevel.comm_sms`` of the level the group's ring crosses:
NCCL logs 24 collective channels inside an 8-GPU NVSwitch node and 16 once the ring crosses the
nodes' NICs, the cluster presets' sources). Memory-bound kernels lose about as much to the
collective's own HBM traffic (each byte on the link is written to and read from memory at least
once more: NVIDIA/nccl issue #1428), which this one share stands for. It is a lower bound on what
was measured: an H100 GEMM of exactly one wave of 132 thread blocks took nearly twice as long beside
a 24-block all-gather (its last blocks wait for a second wave: NVIDIA developer forum, "Compute-
communication overlap causes severe GEMM performance degradation because of tail effect"), and
across GPT and LLaMA training on A100s and H100s overlapped compute ran 18.9% slower on average
(Agrawal et al. 2025, arXiv 2507.03114), close to 24 of 132 SMs (18.2%).
"""

from __future__ import annotations

from collections.abc import Sequence

from coplan.cost.comm import Group
from coplan.hardware.device import DeviceSpec

#: No collective takes more than this share of a device's compute units (a guard for odd files:
#: compute beside a collective always progresses).
MAX_SHARE = 0.9


#: SMs an all-gather or reduce-scatter holds on registered buffers (Megatron-Core's ``nccl_ub``),
#: the larger of the two, by the group's communication domain: inside an NVLink domain, across
#: NVLink and the network, over the network alone (one GPU per node). From the option's docstring
#: (NVIDIA/Megatron-LM megatron/core/distributed/distributed_data_parallel_config.py, ``nccl_ub``:
#: "SM usage of AG/RS" without SHARP: NVL 4 / 5, NVL+IB 16 / 16, IB 1 / 4).
REGISTERED_SMS = {"nvl": 5, "nvl+ib": 16, "ib": 4}


def sm_share(group: Group, device: DeviceSpec, registered: bool = False) -> float:
    """Share of ``device``'s compute a collective over ``group`` occupies while it runs (0 where
    either count is unknown or the group is one device); ``registered``: on NCCL-registered
    buffers (``REGISTERED_SMS``)."""
    if group.size <= 1 or not device.compute_units:
        return 0.0
    sms = group.comm_sms
    if registered and sms:
        domain = "nvl" if group.nodes <= 1 else ("nvl+ib" if group.local > 1 else "ib")
        sms = min(sms, REGISTERED_SMS[domain])
    return min(MAX_SHARE, sms / device.compute_units)


def run_beside(start: float, work: float, busy_until: float, share: float) -> float:
    """When compute of ``work`` seconds (alone) that starts at ``start`` ends, while a collective
    occupies ``share`` of the device until ``busy_until``."""
    if share <= 0.0 or busy_until <= start:
        return start + work
    rate = 1.0 - share
    if (busy_until - start) * rate >= work:
        return start + work / rate
    return busy_until + work - (busy_until - start) * rate


def run_beside_each(start: float, work: float, busy: Sequence[tuple[float, float]]) -> float:
    """When compute of ``work`` seconds (alone) that starts at ``start`` ends, beside collectives
    on streams of their own, each ``(until, share)`` holding ``share`` of the device until
    ``until``: while several run, their shares add (their channels hold SMs of their own)."""
    t, left = start, work
    for until in sorted({u for u, sh in busy if u > start and sh > 0.0}):
        rate = 1.0 - min(MAX_SHARE, sum(sh for u, sh in busy if u >= until and sh > 0.0))
        if (until - t) * rate >= left:
            return t + left / rate
        left -= (until - t) * rate
        t = until
    return t + left


def slowdown(compute: float, hidden: float, share: float) -> float:
    """Extra seconds ``compute`` takes when ``hidden`` seconds of collectives run beside it: the
    overlapped compute runs at ``1 - share``; once the collectives outlast it, all of it does."""
    if share <= 0.0 or hidden <= 0.0 or compute <= 0.0:
        return 0.0
    return min(share * hidden, compute * share / (1.0 - share))
