"""ZeRO-3 / FSDP parameter sharding: the per-layer collectives of one microbatch and their memory.

ZeRO-3 (DeepSpeed stage 3, PyTorch FSDP with ``reshard_after_forward``, Megatron-FSDP) shards the
parameters over the data-parallel ranks and rebuilds each layer's (each FSDP unit's) weights just
before use: one all-gather per unit in forward, another in backward (the gathered copy is freed
after forward), and one reduce-scatter of the unit's gradients after its backward, every
microbatch (Rajbhandari et al. 2020, arXiv 1910.02054, Sec. 5.3: 3x the data-parallel volume of
plain data parallelism; Zhao et al. 2023, arXiv 2304.11277, Sec. 3.3-3.4: per-unit all-gather and
reduce-scatter, prefetching the next unit's all-gather while the current unit computes).

So, per microbatch:

- the collectives are issued per unit, each paying its own latency (NCCL's all-gather and
  reduce-scatter are rings: ``n - 1`` latency steps, ``comm.Group``), which a whole-model
  estimate of one collective misses at large data-parallel degree. DeepSpeed issues them per
  module that owns parameters (``PartitionedParameterCoordinator.fetch_sub_module`` gathers one
  submodule's parameters together, deepspeed/runtime/zero/partitioned_param_coordinator.py at
  v0.7.0), and before v0.5.6 one per parameter tensor, handing ``torch.distributed.all_gather``
  and ``reduce_scatter`` one tensor per rank (partition_parameters.py ``_allgather_param`` and
  ``_reduce_scatter_gradient`` at 5d721e092, 2021-04): PyTorch's ProcessGroupNCCL gathers into
  a flat buffer and copies each rank's piece out with its own ``copy_`` (reduce-scatter copies
  each in), ``n`` launched copies per collective moving the whole tensor once more, into a
  gathered tensor DeepSpeed allocated with ``torch.zeros`` (a pass of its own). Each gather also began with
  ``torch.cuda.synchronize()``, so nothing overlapped: "the async version is not async at all,
  because each all_gather calls torch.cuda.synchronize()" (microsoft/DeepSpeed#1188, which
  removed it in v0.5.6, 2021-10-31; ``tensor-list`` hides none of it);
- prefetching overlaps unit ``i + 1``'s all-gather with unit ``i``'s compute, and the
  reduce-scatter of unit ``i`` with the backward of unit ``i - 1``; what compute cannot cover shows,
  and the first unit's all-gather (nothing to hide behind at the start of forward) and the last
  unit's reduce-scatter (after the last backward) always show;
- DeepSpeed hooks every module's forward and backward, and a checkpointed block's recompute runs
  its modules' forwards again: each module is gathered for the recompute and, once its forward
  ends, released unless the module trace uses it again within ``stage3_max_reuse_distance``
  parameter elements (``recompute_regathered``), so all but the modules last in a large block are
  gathered a third time for their backward. FSDP gathers a unit around the checkpointed block and
  the recompute runs inside it: two gathers either way;
- memory holds, beyond the 1/d shards, the gathered weights of the unit in use and of the one
  prefetched, and one unit's unsharded gradients before their reduce-scatter (FSDP's default
  ``limit_all_gathers`` keeps at most two units gathered, Zhao et al. Sec. 3.4).

Under a pipeline a stack may keep the units gathered through the step instead
(``TrainingConfig.fsdp_pipeline`` "step", torchtitan's): one gather per unit a step, the
gradients accumulated unsharded and reduce-scattered once after the stage's last backward
(``pipelined_fsdp``), the stage's parameters and gradients held whole meanwhile.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

from coplan.cost.comm import Group
from coplan.cost.contention import run_beside, run_beside_each, slowdown, sm_share

if TYPE_CHECKING:
    from coplan.cost.config import TrainingConfig
    from coplan.hardware.cluster import ClusterSpec
    from coplan.hardware.device import DeviceSpec

#: DeepSpeed ZeRO-3 keeps a module's gathered parameters after its forward where the module trace
#: reads them again within this many parameter elements: ``stage3_max_reuse_distance``, default
#: 1e9 (deepspeed/runtime/zero/config.py ``max_reuse_distance``, "Do not release a parameter if it
#: will be reused within this threshold of parameters"; constants.py at 5d721e092, 2021, the same).
DEEPSPEED_REUSE_DISTANCE = 1e9


def recompute_regathered(sizes: Sequence[float], reuse_distance: float = DEEPSPEED_REUSE_DISTANCE) -> float:
    """Parameter elements of one checkpointed block that DeepSpeed ZeRO-3 gathers again for the
    backward after gathering them for the block's recompute, of modules holding ``sizes`` elements
    each on this GPU, in forward order.

    The recompute re-runs the block's forward, whose module hooks gather each module and release
    it after its forward (deepspeed/runtime/zero/parameter_offload.py ``_post_forward_module_hook``
    -> ``release_sub_module``; stage3.py ``post_sub_module_forward_function`` at 5d721e092;
    microsoft/DeepSpeed#4784: the recompute's forward calls ``pre_sub_module_forward_function``).
    Release keeps what the trace reads again before ``reuse_distance`` elements of other uses
    (partitioned_param_coordinator.py ``__params_to_release``; stage3.py ``_keep_for_later``):
    between module ``j``'s recomputed forward and its backward the trace holds the recomputed
    forwards of the modules after it and then their backwards, twice their elements. The last
    module is always kept; in a block of billions of elements the rest are gathered a third time."""
    regathered = after = 0.0
    for n in reversed(sizes):
        if 2 * after >= reuse_distance:
            regathered += n
        after += n
    return regathered


def zero3_exposed(
    group: Group,
    p_local: float,
    units: int,
    param_bytes: float,
    grad_bytes: float,
    compute: float,
    gathers: float = 2,
    share: float = 0.0,
    copy_s: float = 0.0,
    copy_bandwidth: float = 0.0,
) -> float:
    """Seconds of ZeRO-3 communication one microbatch cannot hide behind ``compute`` seconds of
    its own forward and backward, for ``p_local`` parameters (this GPU's tensor-parallel share,
    before the data-parallel sharding) split evenly into ``units`` collectives of each kind (the
    layers, or the modules or tensors a stack gathers one by one: ``TrainingConfig.zero3_gather``).
    ``gathers`` all-gathers per unit: 2 for ZeRO-3 (forward and backward), 1 for FSDP without
    resharding after forward, more where a recompute gathers some again (on average per unit).
    ``copy_s``: seconds each collective spends launching the copies of its per-rank tensors in
    or out beside the collective itself; ``copy_bandwidth`` (bytes per
    second, 0: none) the device memory those copies move through: a gather's output zero-filled
    before it and copied once more after it (three passes of the gathered bytes), a
    reduce-scatter's input copied once before it (two passes). The hidden collectives take
    ``share`` of the device from the compute beside them (``contention.py``): that compute's
    extra time counts here too."""
    if group.size <= 1 or p_local <= 0:
        return 0.0
    units = max(1, units)
    per_unit = p_local / units
    gather = group.all_gather(per_unit * param_bytes) + copy_s
    scatter = group.reduce_scatter(per_unit * grad_bytes) + copy_s
    if copy_bandwidth > 0:
        gather += 3 * per_unit * param_bytes / copy_bandwidth
        scatter += 2 * per_unit * grad_bytes / copy_bandwidth
    total = units * (gathers * gather + scatter)
    edges = gather + scatter  # the first unit's gather and the last unit's reduce-scatter
    extra = slowdown(compute, total - edges, share)
    return edges + extra + max(0.0, total - edges - compute - extra)


def fsdp_transient(
    block_params: float,
    root_params: float,
    units: int,
    param_bytes: float,
    grad_bytes: float,
    flat: bool = False,
) -> float:
    """Bytes PyTorch FSDP holds beyond the shards at the peak, with the blocks as units and the rest
    of the model (embedding, final norm, head) as the root unit: the root's gathered parameters,
    all-gathered at the start of forward and kept until its post-backward at the end of backward
    (torch/distributed/fsdp/_fully_shard/_fsdp_state.py ``_lazy_init`` at v2.13.0 cf30153c4c:
    "For the root, do not reshard after forward"; FSDP1 keeps its root unsharded after forward
    too), the block computed and the one prefetched
    (FSDP2 prefetches one unit, FSDP1's ``limit_all_gathers`` allows two in flight) in the
    parameter dtype, and one block's unsharded gradients in the reduce dtype before their
    reduce-scatter.

    ``flat``: FSDP1's flat parameters, whose frees wait on another stream's work
    (torch/distributed/fsdp/_flat_param.py ``_free_unsharded_flat_param``:
    ``_no_dispatch_record_stream``): a block freed so stays held (the caching allocator's active
    memory, which no other tensor can take) until that stream has run what was queued, about one
    unit later with the host a unit ahead, so one more unit is gathered than FSDP2 holds: the
    unsharded flat parameter of the unit resharded last (``coplan.cost.steptrace`` replays it).
    """
    per_unit = block_params / max(1, units)
    held = param_bytes if flat else 0.0
    return root_params * param_bytes + per_unit * (2 * param_bytes + grad_bytes + held)


def fsdp_copies(
    block_params: float,
    root_params: float,
    units: int,
    gathers: int,
    param_bytes: float,
    grad_in_bytes: float,
    grad_bytes: float,
    bandwidth: float,
    launch_s: float,
) -> float:
    """Seconds of one microbatch's copies FSDP2 makes around its collectives on the compute
    stream (torch/distributed/fsdp/_fully_shard/_fsdp_collectives.py at v2.13.0): after each
    all-gather, ``foreach_all_gather_copy_out`` copies the gathered buffer into the unit's
    parameters (``split_with_sizes_copy``, waiting on the gather's event: every gathered byte
    read and written once more), and before each reduce-scatter ``foreach_reduce`` copies the
    unit's gradients into the reduce-scatter buffer, cast to the reduce dtype (``chunk_cat``,
    issued on the current stream before the collective's stream waits for it). The blocks are
    gathered ``gathers`` times a microbatch, the root unit once (it is not resharded after
    forward). Memory-bound at ``bandwidth``; one launch per copy. FSDP1 gathers into its flat
    parameter's own buffer and reduce-scatters the flat gradient, copying neither."""
    gathered = gathers * block_params + root_params
    moved = 2 * gathered * param_bytes + (block_params + root_params) * (grad_in_bytes + grad_bytes)
    copies = (gathers + 1) * max(1, units) + 2
    return moved / bandwidth + copies * launch_s


def pipelined_fsdp(
    units: int,
    gather: float,
    scatter: float,
    replicate: float,
    root: tuple[float, float, float],
    forward: float,
    share: float,
) -> tuple[float, float]:
    """(Seconds a stage's first forward of a step waits for its gathers, seconds of its gradient
    reduction) where FSDP's units stay gathered through a pipeline step
    (``TrainingConfig.fsdp_pipeline`` "step"): ``units`` equal units gathering (``gather``),
    reduce-scattering (``scatter``) and, under HYBRID_SHARD, all-reducing their shard across the
    replicas (``replicate``) once a step, and the root unit's three (``root``).

    The first microbatch's forward gathers the root and then each unit, one prefetched ahead, as
    a microbatch without a pipeline does (``fsdp_schedule``'s forward); the later microbatches
    find them gathered. After the stage's last backward the pipeline stage runs every unit's
    post-backward at once (torch/distributed/pipelining/stage.py ``perform_reduce_grad``), so
    the reduce-scatters follow one another on the group's stream with no compute to hide behind,
    each all-reduce across the replicas once its reduce-scatter is done, and the compute stream
    waits for the last (FSDP2's ``_root_post_backward_final_callback``, at v2.13.0)."""
    root_gather, root_scatter, root_replicate = root
    first = root_gather + fsdp_schedule(units, gather, 0.0, forward, 0.0, gathers=1, share=share)
    comm = repl = 0.0
    for rs, ar in [(scatter, replicate)] * max(0, units) + [(root_scatter, root_replicate)]:
        comm += rs
        if ar:
            repl = max(repl, comm) + ar
    return first, max(comm, repl)


def zero3_transient(p_local: float, units: int, param_bytes: float, grad_bytes: float) -> float:
    """Bytes ZeRO-3 holds beyond the shards: two gathered units and one unit of unsharded
    gradients."""
    per_unit = p_local / max(1, units)
    return per_unit * (2 * param_bytes + grad_bytes)


def fsdp_schedule(
    units: int,
    gather: float,
    scatter: float,
    forward: float,
    backward: float,
    gathers: int = 2,
    replicate: float = 0.0,
    share: float = 0.0,
    replicate_share: float | None = None,
) -> float:
    """Seconds one microbatch of PyTorch FSDP takes beyond its compute, from the schedule itself:
    ``units`` equal units, each all-gathering its parameters (``gather`` seconds) before its
    forward (``forward / units`` seconds of compute) and, with ``gathers`` 2
    (``reshard_after_forward``), again before its backward (``backward / units``), and
    reduce-scattering its gradients (``scatter``) after its backward; with HYBRID_SHARD each
    reduce-scatter is followed by an all-reduce of the shard across the replicas (``replicate``).

    The collectives of one process group run one after another in the order they are issued
    (ProcessGroupNCCL runs them on one NCCL stream per device); the all-reduce across replicas
    runs on its own group's stream once its reduce-scatter is done. FSDP prefetches one unit:
    unit ``i + 1``'s all-gather is issued when unit ``i`` starts computing (FSDP2's implicit
    forward prefetch and its backward prefetch, torch/distributed/fsdp/_fully_shard/
    _fsdp_param_group.py at v2.13.0; FSDP1's ``BACKWARD_PRE`` with ``limit_all_gathers``: at most
    two units gathered), and a unit computes once its all-gather is done. In backward the order
    on the group is the prefetched all-gather of unit ``i - 1``, then unit ``i``'s reduce-scatter
    once its backward ends. So the first all-gather and the last reduce-scatter always show, and
    a unit whose collectives outlast its neighbour's compute stalls the next one. A unit's compute
    runs on ``1 - share`` of the device while a collective of the group it overlaps is in flight,
    less ``replicate_share`` (None: ``share``) more while the replicas' all-reduce is
    (``contention.run_beside_each``): the two groups' collectives hold SMs each, and an
    all-reduce across nodes with one GPU of each holds far fewer than a gather inside the node."""
    if units <= 0:
        return 0.0
    rshare = share if replicate_share is None else replicate_share
    f, b = forward / units, backward / units
    comm = 0.0  # when the group's stream is free
    # forward: the first unit's all-gather is issued at the start, each next one when the
    # previous unit starts computing
    done = comm = gather
    compute_end = 0.0
    for i in range(units):
        start = max(compute_end, done)
        if i + 1 < units:
            done = comm = max(comm, start) + gather
        compute_end = run_beside(start, f, comm, share)
    # backward, in reverse unit order
    if gathers >= 2:
        done = comm = max(comm, compute_end) + gather
    else:
        done = compute_end
    repl = 0.0  # when the replicas' all-reduce stream is free
    for i in range(units):
        start = max(compute_end, done)
        if gathers >= 2 and i + 1 < units:
            done = comm = max(comm, start) + gather
        compute_end = run_beside_each(start, b, ((comm, share), (repl, rshare)))
        comm = max(comm, compute_end) + scatter
        if replicate:
            repl = max(repl, comm) + replicate
        if gathers < 2:
            done = compute_end
    end = max(comm, repl, compute_end)
    return end - (forward + backward)


@dataclass(frozen=True, slots=True)
class UnitCollectives:
    """Seconds of one FSDP unit's collectives over its sharding group (all-gather of its
    parameters, reduce-scatter of its gradients, and under HYBRID_SHARD the all-reduce of the
    gradient shard across the replicas), the root unit's three (every parameter no block owns:
    embedding, final norm, head), and the shares of the device each group's collectives hold
    (``contention.sm_share``)."""

    gather: float
    scatter: float
    replicate: float
    root_gather: float
    root_scatter: float
    root_replicate: float
    share: float
    replicate_share: float

    @classmethod
    def of(
        cls,
        cluster: ClusterSpec,
        config: TrainingConfig,
        net: float,
        device: DeviceSpec,
        blocks: float,
        root: float,
        units: int,
        param_bytes: float,
        grad_bytes: float,
    ) -> UnitCollectives:
        """``units`` equal units of ``blocks`` parameters on this GPU and a root of ``root``,
        gathered in ``param_bytes`` and reduced in ``grad_bytes`` a parameter; the sharding group
        is ``config.shard_ranks`` ranks, the replicas the rest of the data-parallel ranks."""
        shard = config.shard_ranks
        group = Group.of(cluster, shard, config.tp, net)
        replicas = Group.of(cluster, config.dp_cp // shard, config.tp * shard, net)
        per_unit = blocks / max(1, units)
        repl = replicas.size > 1
        ub = config.nccl_ub
        return cls(
            gather=group.all_gather(per_unit * param_bytes),
            scatter=group.reduce_scatter(per_unit * grad_bytes),
            replicate=replicas.all_reduce(per_unit * grad_bytes / shard) if repl else 0.0,
            root_gather=group.all_gather(root * param_bytes),
            root_scatter=group.reduce_scatter(root * grad_bytes),
            root_replicate=replicas.all_reduce(root * grad_bytes / shard) if repl else 0.0,
            share=sm_share(group, device, ub),
            replicate_share=sm_share(replicas, device, ub) if repl else 0.0,
        )


def fsdp_comm(c: UnitCollectives, units: int, fwd: float, bwd: float, gathers: int) -> float:
    """Seconds of one microbatch's FSDP collectives that compute does not hide, as the per-unit
    schedule runs them (``fsdp_schedule``): the blocks' units, and the root unit's all-gather
    before the first block (the root is not resharded after forward) and its reduce-scatter after
    the last. With a sharding group smaller than the data-parallel ranks (HYBRID_SHARD) the
    collectives stay in the group and each unit's gradient shard is all-reduced across the
    replicas. Compute beside a collective runs on the SMs the collective leaves (``contention.py``;
    each group's own share while its collectives run)."""
    edges = c.root_gather + c.root_scatter + c.root_replicate
    return edges + fsdp_schedule(
        units, c.gather, c.scatter, fwd, bwd, gathers, c.replicate, c.share, c.replicate_share
    )


def fsdp_step(c: UnitCollectives, units: int, fwd: float) -> tuple[float, float]:
    """(Seconds a stage's first forward waits for its gathers, seconds of its gradient reduction)
    once a step, where FSDP's units stay gathered through a pipeline step (``pipelined_fsdp``)."""
    root = (c.root_gather, c.root_scatter, c.root_replicate)
    return pipelined_fsdp(units, c.gather, c.scatter, c.replicate, root, fwd, c.share)
