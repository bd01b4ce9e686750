"""The allocations of training steps on one GPU, in the order PyTorch makes them, from the IR.

``coplan.cost.caching`` replays them through the caching allocator, which gives what the device
reserves beside what its tensors occupy. The trace follows the graph's ops in execution order
(the IR's kernels: a stack's own decompositions of an op are not separate allocations here):

- state: each parameter's shard and its optimizer state (``static_bytes``, per parameter), the
  parameters and master weights from the start, the Adam moments from the first optimizer step
  (``torch.optim.AdamW`` creates them lazily); Megatron's gradient buffers from the start, while
  PyTorch's gradients (FSDP's sharded ones, DDP's) are allocated by each backward and freed by
  ``zero_grad(set_to_none=True)`` after the step;
- forward: each op's outputs when it runs; a temporary freed after its last reader, a tensor kept
  for backward after its last backward reader; a recomputed block keeps only its input
  (``TrainingConfig.recompute``, ``recompute_layers``), a recompute set keeps the rest;
- backward: each block's recomputed tensors re-made when its backward starts, then the gradients;
- FSDP units (``fsdp_units``): before a unit's forward and backward its parameters are gathered
  into one buffer on the all-gather stream (FSDP2 then copies each parameter out on the compute
  stream and frees the buffer; FSDP1 computes on the buffer, whose free waits on the compute
  stream, about one unit), one unit prefetched; after its backward the gradients are copied into
  a reduce-scatter input in the reduce dtype (FSDP2: on the compute stream, kept until the next
  unit's reduction, or before PyTorch moved it there on its reduce-scatter stream,
  ``StackSpec.reduce_input``; FSDP1: on its post-backward stream) and the sharded gradient is
  made on the reduce-scatter stream, whose pool keeps its blocks once ``zero_grad`` frees them
  (``_Tracer.reduce``); the root unit (embedding, final norm, head) stays gathered from forward
  to the end of backward;
- the optimizer: PyTorch's multi-tensor AdamW (``foreach``) makes one fp32 list the size of the
  states it updates (``_foreach_sqrt`` of the second moments, torch/optim/adamw.py), freed after.

Two steps are traced: the first places the state; the second allocates its gradients among tensors
the first left cached, which is where a step's reserved peak settles.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

from coplan.cost.caching import AllocatorPeak, Event, replay
from coplan.cost.config import TrainingConfig
from coplan.cost.kernels import Scale
from coplan.cost.parts import TP, vdot
from coplan.cost.profile import tensor_vec
from coplan.cost.stages import fsdp_fp32_shard, per_stage, split_layers, static_bytes
from coplan.ir.types import Graph, Op, OpKind, Phase, Tensor, TensorRole

#: streams of the trace: compute, FSDP's all-gather, FSDP's reduce-scatter
COMPUTE, GATHER, SCATTER = 0, 1, 2


class _Tracer:
    """One GPU's allocations over steps of ``config``: the events, and what is live."""

    def __init__(
        self, graph: Graph, config: TrainingConfig, sharding: str, reduce_input: str = "compute"
    ) -> None:
        g = self.g = graph
        self.config = config
        self.sharding = sharding
        # FSDP2 keeps its reduce-scatter input on the compute stream until the next reduction
        self.retain_input = sharding == "fsdp2" and reduce_input == "compute"
        self.events: list[Event] = []
        self._handles = itertools.count()
        vec = tensor_vec(graph)
        weights = Scale.of(config).weights
        self.nbytes: Callable[[Tensor], float] = lambda t: vdot(vec(g.tensors[t.storage_id]), weights)
        self.d = config.shard_ranks
        self.fsdp = config.fsdp_units and config.zero >= 1 and self.d > 1
        # PyTorch's gradients are made by backward and dropped by zero_grad; Megatron's and
        # DeepSpeed's live in buffers allocated once
        self.per_step_grads = sharding in ("fsdp1", "fsdp2", "ddp")
        self.layers = first_stage_blocks(graph, config)
        last_stage = config.pp == 1
        first = next((o.id for o in g.ops if o.block is not None), len(g.ops))
        ops = [
            op
            for op in g.ops
            if op.kind is not OpKind.VIEW
            and op.phase is not Phase.OPTIMIZER
            and (
                (op.block is not None and op.block < self.layers)
                or (op.block is None and (last_stage or _before(op, first)))
            )
        ]
        self.fwd = [op for op in ops if op.phase is Phase.FORWARD]
        self.bwd = [op for op in ops if op.phase is Phase.BACKWARD]
        self.last_f: dict[int, int] = {}
        self.last_b: dict[int, int] = {}
        for op in self.fwd:
            for tid in op.inputs:
                self.last_f[g.tensors[tid].storage_id] = op.id
        for op in self.bwd:
            for tid in op.inputs:
                self.last_b[g.tensors[tid].storage_id] = op.id
        self.kept = _kept(g, self.fwd, config)
        # parameters by unit (a block; None: the root), as elements one GPU holds before ZeRO
        self.units: dict[int | None, dict[int, float]] = {}
        for op in self.fwd:
            for tid in op.inputs:
                t = g.tensors[tid]
                if t.role is TensorRole.PARAMETER and t.alias_of is None:
                    v = vec(t)
                    shard = config.tp if any(v[i] for i in range(TP, len(v), 2)) else 1
                    self.units.setdefault(op.block, {})[t.id] = t.numel / shard
        self.state = [static_bytes(n, config, self.d) for u in self.units.values() for n in u.values()]
        self.act = config.act_bytes
        self.reduce_bytes = 4 if config.grad_reduce_fp32 or not config.mixed else self.act
        # per microbatch in flight: storage id -> handle
        self.live: dict[int, dict[int, int]] = {}
        self.gathered: dict[int | None, list[int]] = {}
        self.grads: list[int] = []
        self.reduced: set[int | None] = set()  # FSDP units whose gradient shard this step holds
        self.made: set[int] = set()  # backward segments whose ``.grad`` this step holds
        self.reduce_input: int | None = None  # FSDP2's retained reduce-scatter input
        self.resharded: list[int] = []  # FSDP1's last freed unit buffer, pending its stream event
        self.flat_grad: int | None = None  # FSDP1's last flat gradient, pending its stream event

    def alloc(self, nbytes: float, stream: int = COMPUTE) -> int:
        h = next(self._handles)
        self.events.append((h, max(1, int(nbytes)), stream))
        return h

    def free(self, h: int) -> None:
        self.events.append((h, -1, 0))

    # --- FSDP units ------------------------------------------------------------------------------

    def gather(self, unit: int | None) -> None:
        if not self.fsdp or unit in self.gathered or unit not in self.units:
            return
        sizes = [n * self.act for n in self.units[unit].values()]
        flat = self.alloc(sum(sizes), GATHER)
        if self.sharding == "fsdp2":
            # FSDP2 copies each parameter out of the all-gather output (``foreach_all_gather_copy_out``)
            self.gathered[unit] = [self.alloc(s) for s in sizes]
            self.free(flat)
        else:
            self.gathered[unit] = [flat]

    def reshard(self, unit: int | None) -> None:
        """FSDP2 frees a unit's gathered parameters on the compute stream. FSDP1 frees its
        unsharded flat parameter, allocated on the all-gather stream, after
        ``record_stream(current_stream)`` (``FlatParamHandle._free_unsharded_flat_param`` in
        torch/distributed/fsdp/_flat_param.py): the block returns to the all-gather stream's pool
        only once the compute stream has run what was queued when it was freed, which the host,
        one prefetched unit ahead (``limit_all_gathers``), finds done about one unit later, so
        the next gather cannot take it."""
        handles = self.gathered.pop(unit, [])
        if self.sharding == "fsdp1":
            self.release_resharded()
            self.resharded = handles
            return
        for h in handles:
            self.free(h)

    def release_resharded(self) -> None:
        """FSDP1's last freed unit buffer, back in its pool."""
        for h in self.resharded:
            self.free(h)
        self.resharded = []

    def reduce(self, unit: int | None, produced: list[int]) -> None:
        """A unit's gradients into the reduce-scatter input, then its shard out.

        FSDP2 (torch/distributed/fsdp/_fully_shard/_fsdp_collectives.py ``foreach_reduce`` at
        v2.13.0) allocates the input on the compute stream, copies the gradients in and keeps the
        input until the next unit's reduction starts (``reduce_scatter_states``, at most
        ``reduce_scatter_max_input_buffers`` = 1, reclaimed in the next ``post_backward``).
        FSDP2 before pytorch/pytorch#129721 (``reduce_input="reduce-scatter"``) allocated it on
        the reduce-scatter stream and dropped it once reduced, as FSDP1 does its cast of the flat
        gradient to the reduce dtype on its post-backward stream (``_post_backward_hook``,
        ``_reduce_grad`` in torch/distributed/fsdp/_runtime_utils.py).
        All allocate the sharded gradient on that side stream (FSDP2: "the GPU sharded gradient
        is allocated in the RS stream"), where it stays as ``.grad`` until ``zero_grad``; its
        freed blocks then sit in that stream's pool, which the compute stream cannot use."""
        n = sum(self.units.get(unit, {}).values())
        if self.sharding == "fsdp1":
            self._reduce_flat(unit, produced, n)
            return
        retain = self.retain_input
        if retain:
            self.release_reduce_input()
        flat = self.alloc(n * self.reduce_bytes, COMPUTE if retain else SCATTER)
        for h in produced:
            self.free(h)
        self._shard(unit, n)
        if retain:
            self.reduce_input = flat
        else:
            self.free(flat)

    def _reduce_flat(self, unit: int | None, produced: list[int], n: float) -> None:
        """FSDP1: the backward of the unit's split concatenates its gradients into autograd's
        flat gradient (compute stream, parameter dtype); the post-backward stream casts that to
        the reduce dtype where they differ (its reduce-scatter's input, dropped after it) or
        reduce-scatters it as it is, and frees it after ``record_stream``
        (torch/distributed/fsdp/_runtime_utils.py ``_post_backward_hook``): it is held until that
        stream is done, as the resharded flat parameter is (``reshard``), about a unit later."""
        grad = self.alloc(n * self.act)
        for h in produced:
            self.free(h)
        cast = self.alloc(n * self.reduce_bytes, SCATTER) if self.reduce_bytes != self.act else None
        self._shard(unit, n)
        if cast is not None:
            self.free(cast)
        self.release_flat_grad()
        self.flat_grad = grad

    def _shard(self, unit: int | None, n: float) -> None:
        """The unit's fp32 gradient shard, made on the side stream by the step's first reduction
        of the unit (later microbatches accumulate into it)."""
        if unit not in self.reduced:
            self.reduced.add(unit)
            self.grads.append(self.alloc(n * 4 / self.d, SCATTER))

    def release_flat_grad(self) -> None:
        """FSDP1's last flat gradient, back in its pool."""
        if self.flat_grad is not None:
            self.free(self.flat_grad)
            self.flat_grad = None

    def release_reduce_input(self) -> None:
        """FSDP2's last reduce-scatter input, kept until the next reduction or the end of
        backward (``FSDPState._root_post_backward_final_callback`` clears them)."""
        if self.reduce_input is not None:
            self.free(self.reduce_input)
            self.reduce_input = None

    # --- the step --------------------------------------------------------------------------------

    def _make(self, live: dict[int, int], op: Op, role: TensorRole) -> None:
        for tid in op.outputs:
            t = self.g.tensors[tid]
            if t.alias_of is None and t.role is role and t.id not in live:
                nbytes = self.nbytes(t)
                if t.grad_of is not None and self.fsdp and self.config.mixed:
                    # FSDP computes with 16-bit parameters: their gradients come out in 16 bits
                    # and are cast in the reduce-scatter's copy-in
                    nbytes *= self.act / 4
                live[t.id] = self.alloc(nbytes)

    def forward(self, micro: int) -> None:
        live = self.live.setdefault(micro, {})
        self.gather(None)
        cur: int | None = -1
        for op in self.fwd:
            if op.block != cur:
                if cur is not None and cur >= 0 and self.config.zero >= 3 and cur != self.layers - 1:
                    self.reshard(cur)
                cur = op.block
                self.gather(cur)
                if cur is not None and cur + 1 < self.layers:
                    self.gather(cur + 1)  # one unit prefetched
            self._make(live, op, TensorRole.ACTIVATION)
            self._release(live, op, self.last_f, forward=True)

    def _release(self, live: dict[int, int], op: Op, last: dict[int, int], forward: bool) -> None:
        for tid in (*op.inputs, *op.outputs):
            sid = self.g.tensors[tid].storage_id
            if sid not in live or last.get(sid, -1) > op.id:
                continue
            if forward and self.kept.get(sid) and sid in self.last_b:
                continue  # kept for backward
            self.free(live.pop(sid))

    def recompute(self, live: dict[int, int], block: int) -> None:
        """Re-make what ``block`` recomputes before its backward, keeping what backward reads."""
        for op in self.fwd:
            if op.block != block:
                continue
            for tid in op.outputs:
                t = self.g.tensors[tid]
                if self.kept.get(t.id) is False and t.id not in live:
                    live[t.id] = self.alloc(self.nbytes(t))

    def backward(self, micro: int) -> None:
        live = self.live.pop(micro)
        cur: int | None = -1
        segment = 0  # runs of ops of one unit, in order: the head, each block, the embedding
        pgrads: list[int] = []
        for op in self.bwd:
            if op.block != cur:
                if cur != -1:
                    self._unit_done(cur, segment, pgrads)
                    pgrads = []
                    segment += 1
                cur = op.block
                self.gather(cur)
                if cur is not None:
                    if cur > 0:
                        self.gather(cur - 1)
                    self.recompute(live, cur)
            self._make(live, op, TensorRole.GRADIENT)
            for tid in op.outputs:
                if self.g.tensors[tid].grad_of is not None and tid in live:
                    pgrads.append(live.pop(tid))
            self._release(live, op, self.last_b, forward=False)
        if cur != -1:
            self._unit_done(cur, segment, pgrads)
        self.release_reduce_input()
        self.release_resharded()
        self.release_flat_grad()
        for h in live.values():
            self.free(h)

    def _unit_done(self, unit: int | None, segment: int, pgrads: list[int]) -> None:
        """After a unit's backward: FSDP reduces its gradients; PyTorch's other sharding keeps the
        step's first ones as ``.grad`` (later microbatches add into them); the rest are added into
        the stack's gradient buffers."""
        if self.fsdp and unit in self.units:
            self.reduce(unit, pgrads)
            if unit is not None:
                self.reshard(unit)
        elif self.per_step_grads and segment not in self.made:
            self.made.add(segment)
            self.grads.extend(pgrads)
        else:
            for h in pgrads:
                self.free(h)

    def _pieces(self) -> list[tuple[float, float, float]]:
        """(parameter, master weight, one Adam moment) bytes of each parameter (``static_bytes``:
        under PyTorch FSDP the fp32 shard is the parameter and the master at once)."""
        c = self.config
        master = c.mixed and c.master_weights and not fsdp_fp32_shard(c)
        out = []
        for w, _, o in self.state:
            if master:
                out.append((w, o / 3, o / 3))
            else:
                out.append((w, 0.0, o / 2))
        return out

    def run(self, steps: int) -> list[Event]:
        pieces = self._pieces()
        for w, m, _ in pieces:
            for nbytes in (w, m):
                if nbytes:
                    self.alloc(nbytes)
        if not self.per_step_grads:
            for _, gb, _ in self.state:
                self.alloc(gb)
        for step in range(steps):
            self.grads = []
            self.reduced = set()
            self.made = set()
            for group in _schedule(self.config):
                for phase, micro in group:
                    (self.forward if phase == "F" else self.backward)(micro)
            for unit in list(self.gathered):
                self.reshard(unit)
            if step == 0:  # AdamW makes its two moments at its first step
                for _, _, moment in pieces:
                    self.alloc(moment)
                    self.alloc(moment)
            if self.config.optimizer == "foreach":
                tmp = [self.alloc(moment) for _, _, moment in pieces]
                for h in tmp:
                    self.free(h)
            if self.per_step_grads:
                for h in self.grads:
                    self.free(h)
        return self.events


def first_stage_blocks(graph: Graph, config: TrainingConfig) -> int:
    """Blocks of pipeline stage 0, all its chunks, as the cost model splits them."""
    n = len({op.block for op in graph.ops if op.block is not None})
    return per_stage(split_layers(n, config.pp * config.vpp, config.stage_layers), config.pp, config.vpp)[0]


def _before(op: Op, first: int) -> bool:
    """An op outside the blocks that belongs to the first stage: the embedding and its gradient."""
    if op.phase is Phase.FORWARD:
        return op.id < first
    return op.forward_op is not None and op.forward_op < first


def _schedule(config: TrainingConfig) -> Iterator[list[tuple[str, int]]]:
    """Stage 0's microbatches: forward then backward of each without a pipeline; under 1F1B a
    warm-up of ``pp`` forwards, then one backward and one forward, then the rest backward."""
    m = config.num_microbatches
    if config.pp == 1:
        for i in range(m):
            yield [("F", i), ("B", i)]
        return
    warm = min(config.pp, m)
    yield [("F", i) for i in range(warm)]
    for i in range(m - warm):
        yield [("B", i), ("F", warm + i)]
    yield [("B", i) for i in range(m - warm, m)]


def _kept(g: Graph, fwd: list[Op], config: TrainingConfig) -> dict[int, bool]:
    """Each saved forward storage: True where it is kept for backward, False where its block
    recomputes it."""
    out: dict[int, bool] = {}
    blocks = sorted({op.block for op in fwd if op.block is not None})
    full = config.recompute == "full"
    n_full = len(blocks) if config.recompute_layers is None else config.recompute_layers
    names = config.recompute if isinstance(config.recompute, frozenset) else frozenset()
    per_block: dict[int, list[int]] = {}
    for op in fwd:
        if op.block is not None:
            per_block.setdefault(op.block, []).extend(op.outputs)
    # a recompute set names block 0's tensors; every block follows that template by position
    template = per_block.get(blocks[0], []) if blocks else []
    rec_pos = {i for i, tid in enumerate(template) if g.tensors[tid].name in names}
    for k, b in enumerate(blocks):
        for i, tid in enumerate(per_block[b]):
            t = g.tensors[tid]
            if t.alias_of is not None or not t.saved_for_backward:
                continue
            if full and k < n_full:
                # a checkpointed block keeps its input: the output the next block reads
                out[t.id] = any(g.ops[c].block != b for c in t.consumers if g.ops[c].phase is Phase.FORWARD)
            else:
                out[t.id] = i not in rec_pos
    for op in fwd:
        if op.block is None:
            for tid in op.outputs:
                if g.tensors[tid].alias_of is None and g.tensors[tid].saved_for_backward:
                    out[tid] = True
    return out


def step_events(
    graph: Graph, config: TrainingConfig, sharding: str, steps: int = 2, reduce_input: str = "compute"
) -> list[Event]:
    """The allocation events of ``steps`` training steps of ``config`` on the GPU of pipeline
    stage 0, under ``sharding`` (a ``StackSpec.sharding``), FSDP2's reduce-scatter input where
    ``reduce_input`` says (``StackSpec.reduce_input``)."""
    return _Tracer(graph, config, sharding, reduce_input).run(steps)


def allocator_peak(
    graph: Graph,
    config: TrainingConfig,
    sharding: str,
    *,
    expandable: bool,
    capacity: float = float("inf"),
    reduce_input: str = "compute",
) -> AllocatorPeak:
    """What the caching allocator holds at the peak of ``config``'s steps on one GPU."""
    events = step_events(graph, config, sharding, reduce_input=reduce_input)
    return replay(events, expandable=expandable, capacity=capacity)


@dataclass(frozen=True, slots=True)
class ReservedMemory:
    """What the caching allocator reserves on the most loaded GPU: the cost model's allocated peak
    plus what the replayed trace holds beyond its own allocated peak, at most the device.
    ``releases_cache``: the device would be exceeded, so the allocator frees its cached segments
    (``cudaFree``, synchronizing the device) and retries; the step still fits while its allocated
    peak does."""

    allocated_bytes: float
    overhead_bytes: float
    reserved_bytes: float
    capacity_bytes: float
    expandable_segments: bool
    releases_cache: bool

    def to_dict(self) -> dict[str, Any]:
        return {
            "reserved_bytes": int(self.reserved_bytes),
            "allocator_overhead_bytes": int(self.overhead_bytes),
            "expandable_segments": self.expandable_segments,
            "releases_cache": self.releases_cache,
        }


def reserved_memory(
    graph: Graph,
    config: TrainingConfig,
    sharding: str,
    allocated_bytes: float,
    capacity_bytes: float,
    *,
    expandable: bool,
    extra_fraction: float = 0.0,
    reduce_input: str = "compute",
) -> ReservedMemory:
    """The reserved peak of ``config`` (one microbatch's ``graph``) beside the cost model's
    ``allocated_bytes``, under ``sharding`` (a ``StackSpec.sharding``, FSDP2's reduce-scatter input
    where ``reduce_input`` says); ``extra_fraction`` of the allocated peak more
    (``StackSpec.reserved_fraction``)."""
    peak = allocator_peak(graph, config, sharding, expandable=expandable, reduce_input=reduce_input)
    overhead = peak.overhead_bytes + extra_fraction * allocated_bytes
    want = allocated_bytes + overhead
    return ReservedMemory(
        allocated_bytes=allocated_bytes,
        overhead_bytes=overhead,
        reserved_bytes=min(want, max(capacity_bytes, allocated_bytes)),
        capacity_bytes=capacity_bytes,
        expandable_segments=expandable,
        releases_cache=want > capacity_bytes >= allocated_bytes,
    )
