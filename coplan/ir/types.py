"""The training-graph IR: one training step (forward + backward + optimizer) as immutable values.

Vocabulary (fixed across coplan):
- a *tensor* is one SSA value; an in-place update produces a new tensor that ``updates`` the old one
  and shares its storage (``alias_of``);
- ``nbytes`` is the size of that value, ``storage_bytes`` the size of the buffer it lives in
  (views have ``nbytes`` of their extent but no storage of their own);
- ``flops`` are matrix-unit FLOPs (matmul, attention: what ``torch.utils.flop_counter`` counts, the
  full score matrix for attention; MFU counts a causal attention's half, ``coplan.cost.parts``);
  ``vector_flops`` are the elementwise and reduction arithmetic of an op;
- bytes are bytes (not GiB), per step, for the whole (unsharded) model.
"""

from __future__ import annotations

import enum
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field, fields
from math import prod

from coplan.errors import GraphError

DTYPE_BYTES: dict[str, int] = {
    "float64": 8,
    "float32": 4,
    "tf32": 4,
    "bfloat16": 2,
    "float16": 2,
    "float8_e4m3fn": 1,
    "float8_e5m2": 1,
    "int64": 8,
    "int32": 4,
    "int16": 2,
    "int8": 1,
    "uint8": 1,
    "bool": 1,
    "complex64": 8,
}


def dtype_bytes(dtype: str) -> int:
    try:
        return DTYPE_BYTES[dtype]
    except KeyError:
        raise GraphError(f"unknown dtype '{dtype}'") from None


class Phase(enum.StrEnum):
    FORWARD = "forward"
    BACKWARD = "backward"
    OPTIMIZER = "optimizer"


class TensorRole(enum.StrEnum):
    PARAMETER = "parameter"  # trainable weight (also its updated version after the optimizer)
    BUFFER = "buffer"  # non-trainable module state (RoPE tables, masks)
    INPUT = "input"  # batch data: token ids, targets
    ACTIVATION = "activation"  # produced by a forward op
    GRADIENT = "gradient"  # produced by a backward op (parameter gradients have ``grad_of``)
    OPTIMIZER_STATE = "optimizer_state"  # moments, step counters (inputs and their updates)
    OPTIMIZER_TEMP = "optimizer_temp"  # intermediates of the update
    CONSTANT = "constant"  # literals materialized by the graph (``full``, ``arange`` of fixed size)


class OpKind(enum.StrEnum):
    MATMUL = "matmul"
    ATTENTION = "attention"
    ELEMENTWISE = "elementwise"
    REDUCTION = "reduction"
    NORM = "norm"
    SOFTMAX = "softmax"
    LOSS = "loss"
    EMBEDDING = "embedding"
    VIEW = "view"  # no data movement: reshape, transpose, slice, expand
    COPY = "copy"  # data movement only: contiguous, cat, index, scatter
    CREATION = "creation"  # zeros, full, arange
    OPTIMIZER = "optimizer"  # fused optimizer update (synthetic graphs)
    COLLECTIVE = "collective"
    OTHER = "other"


#: Op kinds with no reduction and no library kernel: pointwise math, copies, views and tensor
#: creation. A code generator can put them into any kernel's prologue or epilogue (the planner's
#: fusion rules), and Inductor's min-cut partitioner counts them cheap to recompute
#: (``coplan.cost.remat.inductor_recomputes``)
POINTWISE_KINDS = frozenset({OpKind.ELEMENTWISE, OpKind.COPY, OpKind.VIEW, OpKind.CREATION})


@dataclass(frozen=True, slots=True)
class Tensor:
    """One SSA value of the step. ``producer`` is None for graph inputs."""

    id: int
    name: str
    shape: tuple[int, ...]
    dtype: str
    role: TensorRole
    producer: int | None = None
    consumers: tuple[int, ...] = ()
    saved_for_backward: bool = False  # a forward value read by a backward op
    alias_of: int | None = None  # the tensor whose storage this one views (root, never a view)
    grad_of: int | None = None  # for parameter gradients: the parameter tensor
    updates: int | None = None  # for optimizer outputs: the input tensor this value replaces
    param_name: str = ""  # parameters, buffers: the module attribute path ("h.0.attn.c_attn.weight")

    def __post_init__(self) -> None:
        if any(d < 0 for d in self.shape):
            raise GraphError(f"tensor {self.name}: negative dimension in shape {self.shape}")
        dtype_bytes(self.dtype)
        if self.alias_of == self.id:
            raise GraphError(f"tensor {self.name}: aliases itself")

    @property
    def numel(self) -> int:
        return prod(self.shape)

    @property
    def nbytes(self) -> int:
        return self.numel * dtype_bytes(self.dtype)

    @property
    def storage_id(self) -> int:
        """The tensor that owns the buffer this value lives in."""
        return self.id if self.alias_of is None else self.alias_of


@dataclass(frozen=True, slots=True)
class Op:
    """One kernel-level operation (an aten op in captured graphs)."""

    id: int
    name: str
    target: str  # "aten.mm.default", or a synthetic op name such as "linear_fwd"
    kind: OpKind
    inputs: tuple[int, ...]
    outputs: tuple[int, ...]
    phase: Phase
    flops: int = 0
    vector_flops: int = 0
    bytes_read: int = 0
    bytes_written: int = 0
    forward_op: int | None = None  # for backward ops: the forward op whose gradient this computes
    module_path: str = ""  # "h.3.mlp.c_fc"; "" for the top-level module
    block: int | None = None  # index of the repeated block (transformer layer), None outside blocks
    args: str = ""  # non-tensor arguments, canonical text (dims, scalars): part of the fingerprint

    def __post_init__(self) -> None:
        if self.flops < 0 or self.vector_flops < 0 or self.bytes_read < 0 or self.bytes_written < 0:
            raise GraphError(f"op {self.name}: negative cost")
        if self.forward_op is not None and self.phase is not Phase.BACKWARD:
            raise GraphError(f"op {self.name}: only backward ops link to a forward op")


@dataclass(frozen=True, slots=True)
class GraphMeta:
    """Where a graph came from; not part of its fingerprint (batch and sequence are in the shapes)."""

    model: str = ""
    source: str = ""  # "capture" | "synthetic" | "hf"
    batch: int = 0
    seq: int = 0
    optimizer: str = ""
    capture_s: float = 0.0
    block_container: str = ""  # module path of the repeated-block list ("h", "model.layers")


@dataclass(frozen=True, slots=True)
class Graph:
    """A whole training step. Ops are in a valid execution (topological) order; ids index the tuples."""

    ops: tuple[Op, ...]
    tensors: tuple[Tensor, ...]
    meta: GraphMeta = field(default_factory=GraphMeta)
    outputs: tuple[int, ...] = ()  # tensors that outlive the step: loss, updated parameters and state

    def __post_init__(self) -> None:
        for i, op in enumerate(self.ops):
            if op.id != i:
                raise GraphError(f"op {op.name}: id {op.id} at position {i}")
        for i, t in enumerate(self.tensors):
            if t.id != i:
                raise GraphError(f"tensor {t.name}: id {t.id} at position {i}")
        for o in self.outputs:
            if not 0 <= o < len(self.tensors):
                raise GraphError(f"graph output {o} is not a tensor of the graph")

    # Derived views are computed on demand (slots leave no __dict__ to cache in); callers that
    # need one repeatedly keep the result.

    def ops_in(self, phase: Phase) -> Iterator[Op]:
        return (op for op in self.ops if op.phase is phase)

    def tensors_with(self, role: TensorRole) -> Iterator[Tensor]:
        return (t for t in self.tensors if t.role is role)

    @property
    def parameters(self) -> tuple[Tensor, ...]:
        """Trainable parameters as graph inputs (one per distinct storage: tied weights count once)."""
        return tuple(t for t in self.tensors if t.role is TensorRole.PARAMETER and t.producer is None)

    @property
    def param_count(self) -> int:
        return sum(t.numel for t in self.parameters)

    @property
    def flops(self) -> int:
        return sum(op.flops for op in self.ops)

    def flops_by_phase(self) -> dict[Phase, int]:
        out = dict.fromkeys(Phase, 0)
        for op in self.ops:
            out[op.phase] += op.flops
        return out

    def saved_tensors(self) -> tuple[Tensor, ...]:
        return tuple(t for t in self.tensors if t.saved_for_backward)

    @property
    def activation_bytes(self) -> int:
        """Bytes of forward activations kept for backward, counting each storage once.

        Parameters, buffers and batch inputs are excluded: they live in memory whatever the
        schedule. A saved view counts its base's storage, as autograd keeps the whole buffer alive.
        """
        storages: dict[int, int] = {}
        for t in self.tensors:
            if not t.saved_for_backward:
                continue
            base = self.tensors[t.storage_id]
            if base.role is TensorRole.ACTIVATION:
                storages[base.id] = base.nbytes
        return sum(storages.values())

    @property
    def blocks(self) -> tuple[int, ...]:
        return tuple(sorted({op.block for op in self.ops if op.block is not None}))

    def block_ops(self, block: int) -> tuple[Op, ...]:
        return tuple(op for op in self.ops if op.block == block)

    def producer(self, tensor: Tensor | int) -> Op | None:
        t = self.tensors[tensor] if isinstance(tensor, int) else tensor
        return None if t.producer is None else self.ops[t.producer]

    def input_tensors(self, op: Op) -> tuple[Tensor, ...]:
        return tuple(self.tensors[i] for i in op.inputs)

    def output_tensors(self, op: Op) -> tuple[Tensor, ...]:
        return tuple(self.tensors[i] for i in op.outputs)


def relink(
    ops: Iterable[Op], tensors: Iterable[Tensor], meta: GraphMeta, outputs: tuple[int, ...] = ()
) -> Graph:
    """Build a graph from ops and tensors whose ``producer``/``consumers`` fields may be stale.

    Producer and consumer links are recomputed from the ops' inputs and outputs, so a builder only
    states each op's edges once.
    """
    ops_t = tuple(ops)
    tensors_l = list(tensors)
    producers: dict[int, int] = {}
    consumers: dict[int, list[int]] = {}
    for op in ops_t:
        for t in op.outputs:
            producers[t] = op.id
        for t in dict.fromkeys(op.inputs):
            consumers.setdefault(t, []).append(op.id)
    fixed = []
    for tensor in tensors_l:
        p = producers.get(tensor.id)
        c = tuple(consumers.get(tensor.id, ()))
        if p != tensor.producer or c != tensor.consumers:
            tensor = with_links(tensor, p, c)
        fixed.append(tensor)
    return Graph(ops=ops_t, tensors=tuple(fixed), meta=meta, outputs=outputs)


_TENSOR_FIELDS = tuple(f.name for f in fields(Tensor))


def with_links(tensor: Tensor, producer: int | None, consumers: tuple[int, ...]) -> Tensor:
    """``tensor`` with other producer and consumer links: ``dataclasses.replace`` without re-running
    the checks of fields that did not change (a 70B graph relinks ~13,000 tensors per build, and
    ``replace`` made a third of the build's time)."""
    new = object.__new__(Tensor)
    for name in _TENSOR_FIELDS:
        object.__setattr__(new, name, getattr(tensor, name))
    object.__setattr__(new, "producer", producer)
    object.__setattr__(new, "consumers", consumers)
    return new


__all__ = [
    "DTYPE_BYTES",
    "POINTWISE_KINDS",
    "Graph",
    "GraphMeta",
    "Op",
    "OpKind",
    "Phase",
    "Tensor",
    "TensorRole",
    "dtype_bytes",
    "relink",
]
