"""Where a plan's ops and tensors sit in the model, in words a person reads: module paths.

Plans name ops by their IR names (``layer_norm_4``, ``rms_norm_417``): unique, stable, and what
plan files and the JSON outputs keep. A table shows the module the op comes from instead, with
the reference block written for every block of its template: ``h[*].ln_1`` is the ``ln_1``
module of every block of the ``h`` list, ``model.layers[0-15].mlp.act`` the activation of the
first sixteen layers where those form one template. Ops outside the blocks keep their plain
path (``wte``, ``ln_f``).

Where the IR names a value after its module (the built-in models name ``h.0.mlp.gelu``,
``h.0.attn_residual``), that name says which op of the module it is; a captured graph names
values after its FX nodes (``addmm_2``), so an op that shares its module with others is told
apart by its kind and, among several of one kind, by its order (``h[*].mlp.mul[1]``).
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable, Mapping, Sequence
from itertools import pairwise

from coplan.ir.types import Graph, Op, Phase

#: values the built-in models name ``<module>.out``: the module's one result, named by its path
_PLAIN_OUTPUT = "out"


def _span(blocks: Sequence[int], total: int) -> str:
    """``[*]`` for every block, ``[3-9]`` for a run, ``[0,2,...,22]`` for a stride, else the list."""
    bs = sorted(blocks)
    if len(bs) == total and total > 1:
        return "[*]"
    if len(bs) == 1:
        return f".{bs[0]}"
    steps = {b - a for a, b in pairwise(bs)}
    if steps == {1}:
        return f"[{bs[0]}-{bs[-1]}]"
    if len(steps) == 1 and len(bs) > 3:
        return f"[{bs[0]},{bs[1]},...,{bs[-1]}]"
    head = ",".join(str(b) for b in bs[:4])
    return f"[{head}{',...' if len(bs) > 4 else ''}]"


def _kind(op: Op) -> str:
    """``aten.addmm.default`` -> ``addmm``; the built-in models' targets are already short."""
    parts = op.target.split(".")
    return parts[1] if parts[0] == "aten" and len(parts) > 1 else op.target


def _join(scope: str, tail: str) -> str:
    return f"{scope}.{tail}" if scope and tail else scope or tail


class Labels:
    """Module-path labels of the ops and tensors a plan can name (those of each template's
    reference block and those outside blocks)."""

    def __init__(
        self,
        graph: Graph,
        block_ops: Mapping[int, Sequence[Op]],
        outside: Sequence[Op],
        ref_of: Mapping[int, int],
    ) -> None:
        self.graph = graph
        container = graph.meta.block_container
        total = len(block_ops)
        self._ops: dict[str, str] = {}
        self._tensors: dict[str, str] = {}
        # op names and value names may coincide (a captured graph names both after the FX node)
        self._op_order: dict[str, int] = {}
        self._tensor_order: dict[str, int] = {}
        groups: list[tuple[Sequence[Op], str, str]] = [(outside, "", "")]
        for ref in sorted(set(ref_of.values())):
            prefix = f"{container}.{ref}" if container else ""
            span = _span([b for b, r in ref_of.items() if r == ref], total)
            groups.append((block_ops[ref], prefix, f"{container}{span}" if container else ""))
        for ops, prefix, scope in groups:
            self._label_group(ops, prefix, scope)

    def _scoped(self, path: str, prefix: str, scope: str) -> str:
        """A module path with the reference block's prefix written for its template."""
        if prefix and path == prefix:
            return scope
        if prefix and path.startswith(prefix + "."):
            return scope + path[len(prefix) :]
        return path

    def _label_group(self, ops: Sequence[Op], prefix: str, scope: str) -> None:
        tensors = self.graph.tensors
        shared = Counter((op.module_path, op.phase) for op in ops)
        same_kind = Counter((op.module_path, op.phase, _kind(op)) for op in ops)
        nth: Counter[tuple[str, Phase, str]] = Counter()
        first: dict[str, str] = {}
        for op in ops:
            path = op.module_path
            where = self._scoped(path, prefix, scope)
            out = tensors[op.outputs[0]].name if op.outputs else ""
            if path and out.startswith(path + "."):
                # the IR named the value after its module: that name says which op it is
                tail = out[len(path) + 1 :]
                label = _join(where, "" if tail == _PLAIN_OUTPUT else tail)
            else:
                key = (path, op.phase, _kind(op))
                label = where
                if shared[(path, op.phase)] > 1 or not path:
                    label = _join(where, _kind(op))
                    if same_kind[key] > 1:
                        label += f"[{nth[key]}]"
                        nth[key] += 1
            phase = "" if op.phase is Phase.FORWARD else f" ({op.phase.value})"
            first[op.name] = label + phase
            for k, t in enumerate(op.outputs):
                name = tensors[t].name
                if path and name.startswith(path + "."):
                    self._tensors[name] = _join(where, name[len(path) + 1 :])
                elif prefix and name.startswith(prefix + "."):
                    self._tensors[name] = self._scoped(name, prefix, scope)
                else:
                    nth_out = f" output {k}" if len(op.outputs) > 1 else ""
                    self._tensors[name] = label + nth_out + phase
                self._tensor_order[name] = t
        repeated = Counter(first.values())
        seen: Counter[str] = Counter()
        for op in ops:
            label = first[op.name]
            if repeated[label] > 1:  # never two ops under one label
                seen[label] += 1
                label = f"{label}#{seen[label]}"
            self._ops[op.name] = label
            self._op_order[op.name] = op.id

    def op(self, name: str) -> str:
        """Where op ``name`` is (the name itself when the plan's graph has no such op)."""
        return self._ops.get(name, name)

    def tensor(self, name: str) -> str:
        """Where the value ``name`` is computed (the name itself for inputs and unknown names)."""
        return self._tensors.get(name, name)

    def ops_in_order(self, names: Iterable[str]) -> list[str]:
        """Op names in the order the step runs them (unknown names last, by name)."""
        return _ordered(names, self._op_order)

    def tensors_in_order(self, names: Iterable[str]) -> list[str]:
        """Value names in the order the step computes them (unknown names last, by name)."""
        return _ordered(names, self._tensor_order)


def _ordered(names: Iterable[str], order: Mapping[str, int]) -> list[str]:
    return sorted(names, key=lambda n: (n not in order, order.get(n, 0), n))
