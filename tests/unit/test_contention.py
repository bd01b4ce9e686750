"""Compute beside an overlapped collective runs on the SMs the collective leaves (``cost/contention.py``)."""

from __future__ import annotations

import pytest

from coplan.cost import CostModel, TrainingConfig
from coplan.cost.comm import Group
from coplan.cost.contention import run_beside, run_beside_each, slowdown, sm_share
from coplan.cost.zero import fsdp_schedule, zero3_exposed
from coplan.hardware import load_cluster
from coplan.hardware._fields import FieldError
from coplan.hardware.cluster import ClusterSpec, InterconnectLevel, NodeGroup
from coplan.models.spec import PRESETS


def test_run_beside_exact() -> None:
    # no collective in flight: the compute's own time
    assert run_beside(1.0, 2.0, 0.5, 0.25) == pytest.approx(3.0)
    # a collective busy for the whole compute: all of it at 3/4 of the rate
    assert run_beside(0.0, 3.0, 10.0, 0.25) == pytest.approx(4.0)
    # busy for the first second: 0.75 s of work done, the other 2.25 s at full rate
    assert run_beside(0.0, 3.0, 1.0, 0.25) == pytest.approx(3.25)
    assert run_beside(0.0, 3.0, 1.0, 0.0) == pytest.approx(3.0)


def test_slowdown_exact() -> None:
    # 1 s of collectives beside 4 s of compute at a quarter of the SMs: 0.25 s more
    assert slowdown(4.0, 1.0, 0.25) == pytest.approx(0.25)
    # collectives outlasting the compute: all of it runs at 3/4, 4 s -> 5.333 s
    assert slowdown(4.0, 10.0, 0.25) == pytest.approx(4.0 / 3.0)
    assert slowdown(4.0, 1.0, 0.0) == 0.0
    assert slowdown(0.0, 1.0, 0.25) == 0.0


def test_fsdp_schedule_with_share() -> None:
    # 1 unit, gathers 2: gather [0,1], forward [1,7] alone, gather for backward [7,8], backward
    # [8,20] beside nothing, reduce-scatter [20,21]: 3 s past compute, whatever the share
    assert fsdp_schedule(1, 1.0, 1.0, 6.0, 12.0, share=0.5) == pytest.approx(3.0)
    # 2 units, forward 2 x 3 s, backward 2 x 6 s, collectives of 1 s, share 1/2.
    # forward: gather 0 [0,1]; unit 0 computes from 1 beside gather 1 [1,2]: 0.5 s of work in
    # the first second, then 2.5 s -> ends at 4.5; unit 1 [4.5,7.5]. Backward: gather 1 [7.5,8.5],
    # unit 1 from 8.5 beside gather 0 [8.5,9.5] -> 0.5 + 5.5 -> ends 15; its reduce-scatter
    # [15,16] beside unit 0 (from 15): ends 16 + 5.5 = 21.5; last reduce-scatter [21.5,22.5].
    # Compute alone is 6 + 12 = 18: 4.5 s beyond it
    assert fsdp_schedule(2, 1.0, 1.0, 6.0, 12.0, share=0.5) == pytest.approx(4.5)
    assert fsdp_schedule(2, 1.0, 1.0, 6.0, 12.0) == pytest.approx(3.0)


def test_run_beside_each_adds_the_shares_of_collectives_in_flight() -> None:
    # [0,1] beside both (1/4 of the rate): 0.25 s; [1,2] beside the second (1/2): 0.5 s; the other
    # 2.25 s alone
    assert run_beside_each(0.0, 3.0, ((1.0, 0.25), (2.0, 0.5))) == pytest.approx(4.25)
    # one collective: as run_beside
    for args in ((1.0, 2.0, 0.5, 0.25), (0.0, 3.0, 10.0, 0.25), (0.0, 3.0, 1.0, 0.25)):
        start, work, until, share = args
        assert run_beside_each(start, work, ((until, share),)) == pytest.approx(run_beside(*args))
    assert run_beside_each(0.0, 3.0, ()) == pytest.approx(3.0)


def test_fsdp_schedule_prices_each_groups_share() -> None:
    # 2 units without resharding, forward 2 x 3 s, backward 2 x 6 s, collectives of 1 s inside
    # the node holding no SMs, and a 4 s all-reduce across the replicas after each reduce-scatter.
    # Backward: unit 1 [7,13], its reduce-scatter [13,14], its all-reduce [14,18]; unit 0 from 13
    # at half rate beside the all-reduce until 18 (2.5 s of work), then 3.5 s alone -> 21.5; its
    # reduce-scatter [21.5,22.5] and all-reduce [22.5,26.5]: 8.5 s past the 18 s of compute
    assert fsdp_schedule(
        2, 1.0, 1.0, 6.0, 12.0, gathers=1, replicate=4.0, share=0.0, replicate_share=0.5
    ) == pytest.approx(8.5)
    # an all-reduce holding no SMs: unit 0 [13,19], reduce-scatter [19,20], all-reduce [20,24]
    assert fsdp_schedule(
        2, 1.0, 1.0, 6.0, 12.0, gathers=1, replicate=4.0, share=0.0, replicate_share=0.0
    ) == pytest.approx(6.0)


def test_zero3_exposed_share() -> None:
    cluster = load_cluster("dgx-h100", 8)
    g = Group.of(cluster, 8, 1, 1.0)
    p, units = 1e9, 10
    gather, scatter = g.all_gather(p / units * 2), g.reduce_scatter(p / units * 2)
    hidden = units * (2 * gather + scatter) - (gather + scatter)
    base = zero3_exposed(g, p, units, 2, 2, 1e3)
    slowed = zero3_exposed(g, p, units, 2, 2, 1e3, share=0.2)
    assert base == pytest.approx(gather + scatter)
    assert slowed - base == pytest.approx(0.2 * hidden)


def test_comm_sms_of_groups() -> None:
    cluster = load_cluster("dgx-h100", 64)
    h100 = cluster.groups[0].device
    node = Group.of(cluster, 8, 1, 1.0)
    assert node.nodes == 1 and node.comm_sms == 24
    assert sm_share(node, h100) == pytest.approx(24 / 132)
    # a ring over every GPU of 8 nodes drives all 8 NICs: 16 channels
    assert Group.of(cluster, 64, 1, 1.0).comm_sms == 16
    # data parallelism beside TP 8: one GPU per node, one NIC: 2 channels
    assert Group.of(cluster, 8, 8, 1.0).comm_sms == 2
    # TP 2: four GPUs per node in each data-parallel group
    assert Group.of(cluster, 32, 2, 1.0).comm_sms == 8
    assert sm_share(Group.of(cluster, 1, 1, 1.0), h100) == 0.0


def test_comm_sms_round_trips_and_validates() -> None:
    level = InterconnectLevel("nvlink", 450e9, 3e-6, "switch", "node", 0.8, comm_sms=24)
    assert InterconnectLevel.from_dict(level.to_dict()) == level
    assert "comm_sms" not in InterconnectLevel("nvlink", 450e9, 3e-6, "switch", "node").to_dict()
    with pytest.raises(FieldError, match="comm_sms"):
        InterconnectLevel("nvlink", 450e9, 3e-6, "switch", "node", comm_sms=-1)


def _fsdp_step(cluster: ClusterSpec) -> float:
    config = TrainingConfig(
        tp=1,
        pp=1,
        dp=cluster.num_devices,
        microbatch=2,
        global_batch=2 * cluster.num_devices,
        seq=2048,
        zero=3,
        dtype="bf16",
    )
    return CostModel(spec=PRESETS["llama2-7b"]).estimate(cluster, config).step_time_s


def test_fsdp_step_pays_for_the_collectives_sms() -> None:
    """The same FSDP step on a node whose NVLink collectives take no SMs is faster, by no more
    than the SM share of the collectives' time."""
    cluster = load_cluster("dgx-h100", 8)
    group = cluster.groups[0]
    free = ClusterSpec(
        "free-collectives",
        (
            NodeGroup(
                group.device,
                group.devices_per_node,
                group.nodes,
                InterconnectLevel("nvlink", 450e9, 3e-6, "switch", "node", 0.8),
            ),
        ),
        cluster.inter_node,
    )
    slow, fast = _fsdp_step(cluster), _fsdp_step(free)
    assert slow > fast
    assert slow - fast < 24 / 132 * slow


def test_registered_buffers_hold_fewer_sms() -> None:
    """Megatron-Core's ``nccl_ub`` table: 5 SMs inside NVLink, 16 across NVLink and IB, 4 over IB."""
    cluster = load_cluster("dgx-h100", 64)
    h100 = cluster.groups[0].device
    assert sm_share(Group.of(cluster, 8, 1, 1.0), h100, registered=True) == pytest.approx(5 / 132)
    assert sm_share(Group.of(cluster, 64, 1, 1.0), h100, registered=True) == pytest.approx(16 / 132)
    # one GPU per node: NCCL's own 2 channels are already fewer than the table's 4
    assert sm_share(Group.of(cluster, 8, 8, 1.0), h100, registered=True) == pytest.approx(2 / 132)
    model = CostModel(spec=PRESETS["llama2-7b"])
    one = load_cluster("dgx-h100", 8)
    base = TrainingConfig(dp=8, microbatch=1, global_batch=64, seq=4096, zero=3, dtype="bf16")
    plain = model.estimate(one, base).step_time_s
    registered = model.estimate(one, base.with_(nccl_ub=True)).step_time_s
    assert registered < plain
    assert base.with_(nccl_ub=True).to_dict()["nccl_ub"] is True
    assert "nccl_ub" not in base.to_dict()
