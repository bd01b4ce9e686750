"""Plan names -> nodes of real FX graphs.

A plan names the ops and tensors of the *synthetic* IR of its model (``coplan.capture.synthetic``):
``h.0.mlp.gelu`` is the output of the ``gelu`` op of module ``h.0.mlp``, decided for the reference
block and applied to every block by position. A graph traced by Dynamo and AOTAutograd names its
nodes differently (``gelu``, ``addmm_2``, ``getitem_7``) and those names change with every edit of
the model, so names are matched through what both sides agree on: the module path
(``node.meta["nn_module_stack"]``), the kind of op (an IR target and the aten or torch callables
that implement it), the order of such ops inside the module, and for multi-output ops the output
position (``native_layer_norm`` -> out, mean, rstd as the IR's ``layer_norm``).

Some IR ops are no single call: RoPE is a module of slices, multiplies, a concatenation and an add
(applied to q and to k), and an RMSNorm that PyTorch decomposes (its CPU kernel is the composite
``pow, mean, add, rsqrt, mul, mul``) has no anchor in the joint graph. Such an op is the *region* of
its module's nodes (``COMPOSITES``), and its outputs are the region's exits: the nodes whose values
are read outside the module, in order (RoPE: the rotated q, then k), plus, for RMSNorm, the
normalized input and ``rsqrt`` that its backward reads.

Two levels are matched: the *aten* level (AOTAutograd's joint graph, where the partitioner chooses
what to save) and the *torch* level (Dynamo's graph, where the precision pass inserts casts).
"""

from __future__ import annotations

import operator
import re
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, replace

import torch
import torch.nn.functional as F
from torch import fx

from coplan.apply.vocab import LOG_SOFTMAX_OPS, NLL_OPS
from coplan.errors import CoplanError
from coplan.ir.types import Graph, Op, Phase, TensorRole

aten = torch.ops.aten


class MappingError(CoplanError):
    """A plan name that has no node in the real graph (the model is not the one planned for)."""


def _overloads(*packets: object) -> frozenset[object]:
    out: set[object] = set()
    for p in packets:
        out.add(p)
        for name in getattr(p, "overloads", lambda: [])():
            out.add(getattr(p, name))
    return frozenset(out)


#: IR op target -> the aten ops that implement it in AOTAutograd's joint graph (the "anchor" whose
#: outputs are the IR op's outputs, in order; a multi-output anchor is read through getitem nodes).
ATEN_ANCHORS: dict[str, frozenset[object]] = {
    "layer_norm": _overloads(aten.native_layer_norm),
    "rms_norm": _overloads(aten._fused_rms_norm),
    "linear": _overloads(aten.addmm, aten.mm, aten.bmm),
    "attention": _overloads(
        aten._scaled_dot_product_flash_attention_for_cpu,
        aten._scaled_dot_product_flash_attention,
        aten._scaled_dot_product_efficient_attention,
        aten._scaled_dot_product_cudnn_attention,
    ),
    "gelu": _overloads(aten.gelu),
    "silu": _overloads(aten.silu),
    "relu": _overloads(aten.relu),
    "square": _overloads(aten.pow),  # torch.square decomposes to pow(x, 2)
    "mul": _overloads(aten.mul),
    "add": _overloads(aten.add),
    "embedding": _overloads(aten.embedding),
    "arange": _overloads(aten.arange),
    # tensor parallelism computes the loss vocabulary-parallel (``coplan.apply.vocab``)
    "log_softmax": _overloads(aten._log_softmax) | LOG_SOFTMAX_OPS,
    "nll_loss": _overloads(aten.nll_loss_forward) | NLL_OPS,
}

#: IR op target -> the torch-level callables of Dynamo's graph (``call_function`` targets or
#: ``call_method`` names). The loss is one ``cross_entropy`` call for the IR's two loss ops.
TORCH_CALLS: dict[str, frozenset[object]] = {
    "layer_norm": frozenset({F.layer_norm, torch.layer_norm}),
    "rms_norm": frozenset({F.rms_norm, torch.rms_norm}),  # Dynamo records nn.RMSNorm as torch.rms_norm
    "linear": frozenset({F.linear, torch._C._nn.linear, torch.matmul, "matmul"}),
    "attention": frozenset({F.scaled_dot_product_attention}),
    "gelu": frozenset({F.gelu, torch._C._nn.gelu}),
    "silu": frozenset({F.silu}),
    "relu": frozenset({F.relu, torch.relu}),
    "square": frozenset({torch.square, "square"}),
    "mul": frozenset({operator.mul, torch.mul, "mul"}),
    "add": frozenset({operator.add, torch.add, "add"}),
    "embedding": frozenset({F.embedding, torch.embedding}),
    "log_softmax": frozenset({F.cross_entropy, F.log_softmax}) | LOG_SOFTMAX_OPS,
    "nll_loss": frozenset({F.cross_entropy, F.nll_loss}) | NLL_OPS,
}

_PREFIX = re.compile(r"^L\['self'\]\.?|^L__self__\.?")
#: Path segments the model does not have: wrapper modules (DDP, torch.compile, FSDP1, activation
#: checkpointing) and a bound method standing in for ``forward`` (tensor parallelism's local
#: attention reaches its submodules through ``forward.__self__``).
_WRAPPERS = frozenset(
    {"module", "_orig_mod", "_fsdp_wrapped_module", "_checkpoint_wrapped_module", "forward", "__self__"}
)


def module_path(node: fx.Node) -> str:
    """The innermost module a node was traced in, as a dotted path of the model ("" at the root)."""
    stack = node.meta.get("nn_module_stack")
    if not stack:
        return ""
    fqn = list(stack.values())[-1][0]
    path = _PREFIX.sub("", str(fqn))
    path = re.sub(r"\[(\d+)\]", r".\1", path).replace("['", ".").replace("']", "")
    return ".".join(s for s in path.split(".") if s and s not in _WRAPPERS)


def _in_module(path: str, ir_path: str) -> bool:
    if not ir_path:
        return path == ""
    return path == ir_path or path.endswith("." + ir_path)


def _is_forward(node: fx.Node) -> bool:
    return node.meta.get("partitioner_tag") != "is_backward"


def _anchor_outputs(node: fx.Node) -> list[fx.Node]:
    """The output nodes of an anchor: its getitems by index, or the node itself."""
    items = [u for u in node.users if u.op == "call_function" and u.target is operator.getitem]
    if not items:
        return [node]
    by_index: dict[int, fx.Node] = {}
    for u in items:
        idx = u.args[1]
        if isinstance(idx, int):
            by_index.setdefault(idx, u)
    return [by_index[i] for i in sorted(by_index)]


#: key in ``node.meta["custom"]`` marking a cast the precision pass put around an overridden op
#: (to its dtype and back to the compute dtype): not part of the op, so never one of its outputs
PLAN_CAST = "coplan_plan_cast"


def is_plan_cast(node: fx.Node) -> bool:
    return bool((node.meta.get("custom") or {}).get(PLAN_CAST))


def _region(nodes: Sequence[fx.Node], path: str) -> list[fx.Node]:
    """The call nodes traced inside module ``path`` (itself, not its submodules), in graph order."""
    return [
        n
        for n in nodes
        if n.op in ("call_function", "call_method")
        and _in_module(module_path(n), path)
        and not is_plan_cast(n)
    ]


def _exits(region: Sequence[fx.Node]) -> list[fx.Node]:
    """Nodes of ``region`` whose values a forward node outside it reads (the op's outputs)."""
    inside = set(region)
    return [n for n in region if any(u not in inside and _is_forward(u) for u in n.users)]


def _rope_outputs(region: Sequence[fx.Node], n_out: int) -> list[fx.Node] | None:
    # rotate-half RoPE applied to q, then to k: each application's result leaves the module
    exits = _exits(region)
    return exits if len(exits) == n_out else None


def _rms_norm_outputs(region: Sequence[fx.Node], n_out: int) -> list[fx.Node] | None:
    # PyTorch's composite rms_norm: rstd = rsqrt(mean(x^2) + eps), normed = (x * rstd) in x's
    # dtype, out = normed * weight; the IR's outputs are (out, normed, rstd)
    exits = _exits(region)
    rsqrt = [n for n in region if _packet(n.target) is aten.rsqrt]
    muls = [n for n in region if _packet(n.target) is aten.mul]
    if len(exits) != 1 or len(rsqrt) != 1 or not muls or n_out != 3:
        return None
    normed = muls[-1].args[0]
    # the weight may be applied in fp32 to a 16-bit normed (``precision.rms_norm``): the value
    # kept is the narrow one the upcast reads
    while isinstance(normed, fx.Node) and _is_upcast(normed):
        normed = normed.args[0]
    if not isinstance(normed, fx.Node) or normed not in region:
        return None
    return [exits[0], normed, rsqrt[0]]


def _is_upcast(node: fx.Node) -> bool:
    """A conversion to a wider floating dtype (bf16 -> fp32) of one tensor."""
    if _packet(node.target) not in (aten._to_copy, torch.ops.prims.convert_element_type) or not node.args:
        return False
    src = node.args[0]
    a = src.meta.get("val") if isinstance(src, fx.Node) else None
    b = node.meta.get("val")
    if not (isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor)):
        return False
    return a.is_floating_point() and b.is_floating_point() and b.element_size() > a.element_size()


def _packet(target: object) -> object:
    return getattr(target, "overloadpacket", target)


#: IR op target -> how its outputs are found among its module's joint-graph nodes, where no anchor
#: implements it (``ATEN_ANCHORS`` is tried first: a fused ``_fused_rms_norm`` is an anchor)
COMPOSITES: dict[str, Callable[[Sequence[fx.Node], int], list[fx.Node] | None]] = {
    "rope": _rope_outputs,
    "rms_norm": _rms_norm_outputs,
}
#: IR op targets that are a whole module at the torch level too (Dynamo records RoPE call by call)
TORCH_COMPOSITES = frozenset({"rope"})


@dataclass(frozen=True, slots=True)
class NameMap:
    """IR tensor names (every block) -> joint-graph nodes, and the names that found none."""

    nodes: dict[str, fx.Node]
    missing: tuple[str, ...]


def _forward_ops(graph: Graph) -> list[Op]:
    return [op for op in graph.ops if op.phase is Phase.FORWARD]


def _match(
    ir_ops: Sequence[Op],
    fx_nodes: Iterable[fx.Node],
    table: dict[str, frozenset[object]],
    key: Callable[[fx.Node], object],
) -> dict[int, fx.Node]:
    """IR op id -> FX anchor node, pairing ops of one (module, target family) in order.

    Only modules whose ops are all present are paired: a compiled region holding part of the
    model (a graph break, one pipeline stage) matches the modules it has and no others.
    """
    by_key: dict[tuple[str, str], list[Op]] = {}
    for op in ir_ops:
        if op.target in table:
            by_key.setdefault((op.module_path, op.target), []).append(op)
    nodes = [n for n in fx_nodes if n.op in ("call_function", "call_method")]
    out: dict[int, fx.Node] = {}
    for (path, target), ops in by_key.items():
        family = table[target]
        cands = [n for n in nodes if _in_module(module_path(n), path) and key(n) in family]
        # a region holding part of a module (a graph break inside it) or a module applied twice
        # (not the planned model) pairs nothing: its names are reported as missing
        if len(cands) == len(ops):
            out.update({op.id: n for op, n in zip(ops, cands, strict=True)})
    return out


def block_prefix(graph: Graph) -> str:
    """The module path of the reference block (``h.0``): the longest common dotted prefix of its ops."""
    paths = [op.module_path.split(".") for op in graph.ops if op.block == 0 and op.module_path]
    if not paths:
        return ""
    common = paths[0]
    for p in paths[1:]:
        n = 0
        while n < min(len(common), len(p)) and common[n] == p[n]:
            n += 1
        common = common[:n]
    return ".".join(common)


def relative_to_block(ops: Sequence[Op], prefix: str) -> list[Op]:
    """The reference block's ops with module paths relative to the block (``h.0.ln_1`` -> ``ln_1``):
    how a region compiled from ``Block.forward`` (FSDP2 compiles per block) names its modules."""
    out = []
    for op in ops:
        if op.block != 0:
            continue
        path = op.module_path
        rel = "" if path == prefix else path[len(prefix) + 1 :] if path.startswith(prefix + ".") else path
        out.append(replace(op, module_path=rel))
    return out


def _composites(
    ir_ops: Sequence[Op], fx_nodes: Sequence[fx.Node], table: Iterable[str], outputs: bool
) -> dict[int, list[fx.Node]]:
    """IR op id -> its module's nodes (``outputs=False``) or its outputs (``outputs=True``, through
    ``COMPOSITES``), for ops of a target in ``table`` that are their module's only op of that target."""
    by_key: dict[tuple[str, str], list[Op]] = {}
    for op in ir_ops:
        if op.target in table:
            by_key.setdefault((op.module_path, op.target), []).append(op)
    out: dict[int, list[fx.Node]] = {}
    for (path, target), ops in by_key.items():
        region = _region(fx_nodes, path) if len(ops) == 1 and path else []
        if not region:
            continue
        found = COMPOSITES[target](region, len(ops[0].outputs)) if outputs else region
        if found:
            out[ops[0].id] = found
    return out


def _op_outputs(ir_ops: Sequence[Op], fx_nodes: Sequence[fx.Node]) -> dict[int, list[fx.Node]]:
    """IR op id -> the joint-graph nodes of its outputs, in order: an anchor's, else a composite's."""
    anchors = _match(ir_ops, fx_nodes, ATEN_ANCHORS, lambda n: n.target)
    out = {i: _anchor_outputs(n) for i, n in anchors.items()}
    rest = [op for op in ir_ops if op.id not in anchors]
    out.update(_composites(rest, fx_nodes, COMPOSITES, outputs=True))
    return out


def map_saved(graph: Graph, joint: fx.GraphModule, names: Iterable[str]) -> NameMap:
    """The joint-graph node of every IR tensor in ``names`` (those found; the rest in ``missing``).

    A region traced from the whole model names modules from the root; one traced from a block's
    own ``forward`` (FSDP2's per-block compilation) names them from the block: when the first finds
    nothing, the reference block's names are matched relative to the block.
    """
    wanted = set(names)
    ops = _forward_ops(graph)
    nodes = [n for n in joint.graph.nodes if _is_forward(n)]
    outputs = _op_outputs(ops, nodes)
    relative = not outputs
    if relative:
        outputs = _op_outputs(relative_to_block(ops, block_prefix(graph)), nodes)
    found: dict[str, fx.Node] = {}
    for op in ops:
        outs = outputs.get(op.id)
        if outs is None:
            continue
        for i, tid in enumerate(op.outputs):
            name = graph.tensors[tid].name
            if name in wanted and i < len(outs):
                found[name] = outs[i]
    missing = wanted - set(found)
    if relative and found:
        # one block's region stands for every block of its template: their names are not missing
        in_blocks = {graph.tensors[t].name for op in ops if op.block is not None for t in op.outputs}
        missing -= in_blocks
    return NameMap(found, tuple(sorted(missing)))


def _torch_key(node: fx.Node) -> object:
    return node.target


@dataclass(frozen=True, slots=True)
class OpNodes:
    """The Dynamo-graph nodes of one IR op: one call (``nodes == exits``), or the calls of its
    module for a composite (``TORCH_COMPOSITES``), whose ``exits`` are the values it outputs."""

    nodes: tuple[fx.Node, ...]
    exits: tuple[fx.Node, ...]

    @property
    def entries(self) -> list[tuple[fx.Node, int]]:
        """(node, argument position) of every positional argument read from outside the op."""
        inside = set(self.nodes)
        return [
            (n, i)
            for n in self.nodes
            for i, a in enumerate(n.args)
            if isinstance(a, fx.Node) and a not in inside
        ]


def map_ops(graph: Graph, gm: fx.GraphModule, names: Iterable[str]) -> dict[str, OpNodes]:
    """Torch-level (Dynamo graph) nodes of every IR *op* in ``names`` that this graph holds."""
    wanted = set(names)
    fwd = _forward_ops(graph)
    ops = [op for op in fwd if op.target in TORCH_CALLS]
    # the IR's two loss ops are one cross_entropy call: pair each with the same node
    loss_ops = [op for op in ops if op.target in ("log_softmax", "nll_loss")]
    rest = [op for op in ops if op not in loss_ops]
    found = _match(rest, gm.graph.nodes, TORCH_CALLS, _torch_key)
    for target in ("log_softmax", "nll_loss"):
        found.update(
            _match([op for op in loss_ops if op.target == target], gm.graph.nodes, TORCH_CALLS, _torch_key)
        )
    out = {graph.ops[i].name: OpNodes((n,), (n,)) for i, n in found.items()}
    regions = _composites(fwd, list(gm.graph.nodes), TORCH_COMPOSITES, outputs=False)
    for i, region in regions.items():
        exits = _exits(region)
        if len(exits) == len(graph.ops[i].outputs):
            out[graph.ops[i].name] = OpNodes(tuple(region), tuple(exits))
    return {name: v for name, v in out.items() if name in wanted}


def saved_tensor_names(graph: Graph) -> list[str]:
    """Every activation the IR keeps for backward (all blocks and outside them), in graph order."""
    out = []
    for t in graph.tensors:
        if t.saved_for_backward and t.role is TensorRole.ACTIVATION:
            out.append(t.name)
    return out


def per_block(graph: Graph, names: Iterable[str]) -> set[str]:
    """Reference-block tensor names -> the same positions in every block of its template.

    Blocks of one template have the same ops in the same order, so the ``k``-th saved tensor of
    block 0 and of block ``b`` are the same decision. Names outside blocks map to themselves.
    """
    wanted = set(names)
    saved_by_block: dict[int, list[str]] = {}
    block_of: dict[str, int] = {}
    for op in _forward_ops(graph):
        if op.block is None:
            continue
        for tid in op.outputs:
            t = graph.tensors[tid]
            if t.saved_for_backward:
                saved_by_block.setdefault(op.block, []).append(t.name)
                block_of[t.name] = op.block
    ref_blocks = {block_of[n] for n in wanted if n in block_of}
    out = {n for n in wanted if n not in block_of}
    for ref in ref_blocks:
        ref_names = saved_by_block[ref]
        positions = [i for i, n in enumerate(ref_names) if n in wanted]
        for names_b in saved_by_block.values():
            if len(names_b) == len(ref_names):
                out.update(names_b[i] for i in positions)
    return out
