"""The IR's invariants, written as a list of named rules and run after every transformation in tests.

``check(graph)`` returns every violation found (empty list: valid); ``validate(graph)`` raises a
``GraphError`` naming the first few. Rules are registered with ``@rule`` so a new invariant is one
function, and a rule can be skipped by name where a caller knowingly builds a partial graph.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass

from coplan.errors import GraphError
from coplan.ir.types import Graph, Op, OpKind, Phase, TensorRole


@dataclass(frozen=True, slots=True)
class Violation:
    rule: str
    message: str

    def __str__(self) -> str:
        return f"[{self.rule}] {self.message}"


Rule = Callable[[Graph], Iterator[str]]
RULES: dict[str, Rule] = {}


def rule(fn: Rule) -> Rule:
    RULES[fn.__name__] = fn
    return fn


_INPUT_ROLES = {
    TensorRole.PARAMETER,
    TensorRole.BUFFER,
    TensorRole.INPUT,
    TensorRole.OPTIMIZER_STATE,
    TensorRole.CONSTANT,
}
_PHASE_ORDER = {Phase.FORWARD: 0, Phase.BACKWARD: 1, Phase.OPTIMIZER: 2}


@rule
def edges(g: Graph) -> Iterator[str]:
    """Every edge names a real tensor; producer/consumer links agree with the ops' inputs/outputs."""
    n = len(g.tensors)
    produced: dict[int, int] = {}
    consumed: dict[int, set[int]] = defaultdict(set)
    for op in g.ops:
        for t in (*op.inputs, *op.outputs):
            if not 0 <= t < n:
                yield f"op {op.name} refers to tensor {t}, not in the graph"
                return
        for t in op.outputs:
            if t in produced:
                first = g.ops[produced[t]].name
                yield f"tensor {g.tensors[t].name} is produced by both {first} and {op.name}"
            produced[t] = op.id
        for t in op.inputs:
            consumed[t].add(op.id)
    for tensor in g.tensors:
        if tensor.producer != produced.get(tensor.id):
            actual = produced.get(tensor.id)
            yield f"tensor {tensor.name}: producer {tensor.producer} but produced by {actual}"
        readers = consumed.get(tensor.id, set())
        if set(tensor.consumers) != readers:
            yield f"tensor {tensor.name}: consumers {sorted(tensor.consumers)} but read by {sorted(readers)}"
        if tensor.producer is None and tensor.role not in _INPUT_ROLES:
            yield f"tensor {tensor.name}: a graph input with role {tensor.role.value}"


@rule
def acyclic(g: Graph) -> Iterator[str]:
    """Ops are listed in a topological order, which also proves the graph has no cycle."""
    for op in g.ops:
        for t in op.inputs:
            p = g.tensors[t].producer if 0 <= t < len(g.tensors) else None
            if p is not None and p >= op.id:
                later = g.ops[p].name
                name = g.tensors[t].name
                yield f"op {op.name} reads {name}, produced later by {later} (cycle or bad order)"


@rule
def phases(g: Graph) -> Iterator[str]:
    """Forward ops come before backward ops, which come before optimizer ops."""
    last = 0
    for op in g.ops:
        rank = _PHASE_ORDER[op.phase]
        if rank < last:
            yield f"op {op.name} ({op.phase.value}) comes after a later phase"
            return
        last = rank


@rule
def backward_links(g: Graph) -> Iterator[str]:
    """Every backward op names the forward op whose gradient it computes."""
    for op in g.ops_in(Phase.BACKWARD):
        if op.forward_op is None:
            yield f"backward op {op.name} is not linked to a forward op"
        elif not 0 <= op.forward_op < len(g.ops) or g.ops[op.forward_op].phase is not Phase.FORWARD:
            yield f"backward op {op.name} links to {op.forward_op}, which is not a forward op"


@rule
def aliasing(g: Graph) -> Iterator[str]:
    """A view points at the root of its storage, and an update at a value it may replace."""
    for t in g.tensors:
        if t.alias_of is not None:
            if not 0 <= t.alias_of < len(g.tensors):
                yield f"tensor {t.name} aliases missing tensor {t.alias_of}"
            elif g.tensors[t.alias_of].alias_of is not None:
                yield f"tensor {t.name} aliases {g.tensors[t.alias_of].name}, itself a view"
        if t.grad_of is None:
            continue
        if not 0 <= t.grad_of < len(g.tensors) or g.tensors[t.grad_of].role is not TensorRole.PARAMETER:
            yield f"tensor {t.name} is the gradient of {t.grad_of}, which is not a parameter"
        elif g.tensors[t.grad_of].shape != t.shape:
            yield f"gradient {t.name} has shape {t.shape}, its parameter {g.tensors[t.grad_of].shape}"


@rule
def saved_flags(g: Graph) -> Iterator[str]:
    """Values marked saved for backward come from the forward phase and are read by a backward op."""
    for t in g.tensors:
        if not t.saved_for_backward:
            continue
        if t.producer is not None and g.ops[t.producer].phase is not Phase.FORWARD:
            yield f"tensor {t.name} is marked saved but produced in {g.ops[t.producer].phase.value}"
        if not any(g.ops[c].phase is Phase.BACKWARD for c in t.consumers):
            yield f"tensor {t.name} is marked saved but no backward op reads it"


def _broadcast(shapes: Iterable[tuple[int, ...]]) -> tuple[int, ...] | None:
    out: list[int] = []
    for shape in shapes:
        for i, d in enumerate(reversed(shape)):
            if i == len(out):
                out.append(d)
            elif out[i] == 1:
                out[i] = d
            elif d not in (1, out[i]):
                return None
    return tuple(reversed(out))


_MATMUL_SHAPES: dict[str, Callable[[list[tuple[int, ...]]], tuple[int, ...] | None]] = {
    "aten.mm.default": lambda s: (s[0][0], s[1][1]) if s[0][1] == s[1][0] else None,
    "aten.addmm.default": lambda s: (s[1][0], s[2][1]) if s[1][1] == s[2][0] else None,
    "aten.bmm.default": lambda s: (
        (s[0][0], s[0][1], s[1][2]) if s[0][0] == s[1][0] and s[0][2] == s[1][1] else None
    ),
}


@rule
def shapes(g: Graph) -> Iterator[str]:
    """Output shapes follow from input shapes for matmuls and for pointwise ops (broadcasting);
    a view never spans more elements than its storage unless it broadcasts."""
    for op in g.ops:
        ins = [g.tensors[t].shape for t in op.inputs]
        outs = [g.tensors[t].shape for t in op.outputs]
        fn = _MATMUL_SHAPES.get(op.target)
        if fn is not None and ins and outs:
            try:
                expect = fn(ins)
            except IndexError:
                expect = None
            if expect != outs[0]:
                yield f"op {op.name} ({op.target}): inputs {ins} cannot give output {outs[0]}"
        elif (
            op.kind is OpKind.ELEMENTWISE
            and op.target.startswith("aten.")
            and ins
            and outs
            and (_broadcast(ins) is None or _broadcast([*ins, outs[0]]) != outs[0])
        ):
            yield f"op {op.name} ({op.target}): inputs {ins} do not broadcast to output {outs[0]}"
        for t in op.outputs:
            tt = g.tensors[t]
            if (
                tt.alias_of is not None
                and tt.numel > g.tensors[tt.alias_of].numel
                and "expand" not in op.target
            ):
                yield f"view {tt.name} has {tt.numel} elements, its storage {g.tensors[tt.alias_of].numel}"


def _relative_path(path: str, block: int, prefix: str) -> str:
    """The module path inside its block: after "<container>.<block>", or, where the graph does not
    name its container, after the first path component equal to the block number."""
    if prefix and path.startswith(prefix):
        return path[len(prefix) :]
    parts = path.split(".")
    return ".".join(parts[parts.index(str(block)) + 1 :]) if str(block) in parts else path


def _block_signature(g: Graph, ops: Iterable[Op], block: int, prefix: str) -> list[tuple[object, ...]]:
    sig: list[tuple[object, ...]] = []
    for op in ops:
        rel = _relative_path(op.module_path, block, prefix)
        sig.append(
            (
                op.phase.value,
                op.target,
                rel,
                tuple(g.tensors[t].shape for t in op.inputs),
                tuple(g.tensors[t].shape for t in op.outputs),
            )
        )
    return sig


@rule
def blocks(g: Graph) -> Iterator[str]:
    """Blocks are numbered 0..n-1 and every block has the same ops (targets, shapes, relative module
    paths, in order), so a decision made for one block applies to all."""
    ids = g.blocks
    if not ids:
        return
    if ids != tuple(range(len(ids))):
        yield f"blocks are numbered {ids[:5]}..., not 0..{len(ids) - 1}"
        return
    by_block: dict[int, list[Op]] = defaultdict(list)
    for op in g.ops:
        if op.block is not None:
            by_block[op.block].append(op)
    container = g.meta.block_container
    ref = _block_signature(g, by_block[0], 0, f"{container}.0" if container else "")
    for b in ids[1:]:
        sig = _block_signature(g, by_block[b], b, f"{container}.{b}" if container else "")
        if sig != ref:
            where = next(
                (i for i, (x, y) in enumerate(zip(sig, ref, strict=False)) if x != y), min(len(sig), len(ref))
            )
            yield (f"block {b} differs from block 0 at its op {where} ({len(sig)} ops against {len(ref)})")


# Rules that check references themselves; the others assume every reference is in range.
_REFERENCE_RULES = ("edges", "aliasing")


def _references_in_range(g: Graph) -> bool:
    n = len(g.tensors)
    refs = [t for op in g.ops for t in (*op.inputs, *op.outputs)]
    refs += [r for t in g.tensors for r in (t.alias_of, t.grad_of, t.updates) if r is not None]
    return all(0 <= r < n for r in refs)


def check(graph: Graph, skip: Iterable[str] = ()) -> list[Violation]:
    """All violations of the registered rules, except those named in ``skip``. A graph with a
    dangling reference is reported by the reference rules alone, since the others cannot run."""
    skipped = set(skip)
    unknown = skipped - RULES.keys()
    if unknown:
        raise ValueError(f"unknown checker rules: {sorted(unknown)}")
    names = [n for n in RULES if n not in skipped]
    if not _references_in_range(graph):
        names = [n for n in names if n in _REFERENCE_RULES]
    return [Violation(name, msg) for name in names for msg in RULES[name](graph)]


def validate(graph: Graph, skip: Iterable[str] = ()) -> Graph:
    """Return ``graph`` if it satisfies every invariant, else raise ``GraphError``."""
    found = check(graph, skip)
    if found:
        more = f" (and {len(found) - 3} more)" if len(found) > 3 else ""
        raise GraphError("invalid graph: " + "; ".join(str(v) for v in found[:3]) + more)
    return graph
