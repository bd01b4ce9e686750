"""Plan names -> nodes of real FX graphs.

A plan names the ops and tensors of the *synthetic* IR of its model (``coplan.capture.synthetic``):
``h.0.mlp.gelu`` is the output of the ``gelu`` op of module ``h.0.mlp``, decided for the reference
block and applied to every block by position. A graph traced by Dynamo and AOTAutograd names its
nodes differently (``gelu``, ``addmm_2``, ``getitem_7``) and those names change with every edit of
the model, so names are matched through what both sides agree on: the module path
(``node.meta["nn_module_stack"]``), the kind of op (an IR target and the aten or torch callables
that implement it), the order of such ops inside the module, and for multi-output ops the output
position (``native_layer_norm`` -> out, mean, rstd as the IR's ``layer_norm``).

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
    "rms_norm": frozenset({F.rms_norm}),
    "linear": frozenset({F.linear, torch._C._nn.linear, torch.matmul, "matmul"}),
    "attention": frozenset({F.scaled_dot_product_attention}),
    "gelu": frozenset({F.gelu, torch._C._nn.gelu}),
    "silu": frozenset({F.silu}),
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


def map_saved(graph: Graph, joint: fx.GraphModule, names: Iterable[str]) -> NameMap:
    """The joint-graph node of every IR tensor in ``names`` (those found; the rest in ``missing``).

    A region traced from the whole model names modules from the root; one traced from a block's
    own ``forward`` (FSDP2's per-block compilation) names them from the block: when the first finds
    nothing, the reference block's names are matched relative to the block.
    """
    wanted = set(names)
    ops = _forward_ops(graph)
    nodes = [n for n in joint.graph.nodes if _is_forward(n)]
    anchors = _match(ops, nodes, ATEN_ANCHORS, lambda n: n.target)
    relative = not anchors
    if relative:
        anchors = _match(relative_to_block(ops, block_prefix(graph)), nodes, ATEN_ANCHORS, lambda n: n.target)
    found: dict[str, fx.Node] = {}
    for op in ops:
        node = anchors.get(op.id)
        if node is None:
            continue
        outs = _anchor_outputs(node)
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


def map_ops(graph: Graph, gm: fx.GraphModule, names: Iterable[str]) -> dict[str, fx.Node]:
    """Torch-level (Dynamo graph) node of every IR *op* in ``names`` that this graph holds."""
    wanted = set(names)
    ops = [op for op in _forward_ops(graph) if op.target in TORCH_CALLS]
    # the IR's two loss ops are one cross_entropy call: pair each with the same node
    loss_ops = [op for op in ops if op.target in ("log_softmax", "nll_loss")]
    rest = [op for op in ops if op not in loss_ops]
    found = _match(rest, gm.graph.nodes, TORCH_CALLS, _torch_key)
    for target in ("log_softmax", "nll_loss"):
        found.update(
            _match([op for op in loss_ops if op.target == target], gm.graph.nodes, TORCH_CALLS, _torch_key)
        )
    return {graph.ops[i].name: n for i, n in found.items() if graph.ops[i].name in wanted}


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
