"""Price a compiled step's kernels with coplan's kernel rules (``coplan.cost.kernels``).

Each kernel Inductor wrote becomes one ``Kernel`` of the cost model: a GEMM (extern ``mm``/``addmm``/
``bmm``) at the device's matrix rate with its shape derating, a fused attention call by the attention
rule, everything else a vector kernel (its bytes as Inductor counts them, its vector FLOPs by
coplan's per-op rules). A kernel's time is the rule's roofline plus its launch. The step's predicted
time is their sum: one device, one stream, kernels in order.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from coplan.cost.kernels import Rates, Scale, kernel_time
from coplan.cost.parts import REPL, Kernel
from coplan.hardware.device import DeviceSpec
from coplan.ir.oprules import rule_for
from coplan.ir.types import Phase

_PHASE = {"forward": Phase.FORWARD, "backward": Phase.BACKWARD, "optimizer": Phase.OPTIMIZER}
_DTYPE = {"float32": "fp32", "bfloat16": "bf16", "float16": "fp16"}
_GEMMS = ("mm", "addmm", "bmm", "baddbmm", "_scaled_mm")


def short(target: str) -> str:
    """``aten.addmm.default`` -> ``addmm``."""
    parts = target.split(".")
    return parts[1] if len(parts) >= 3 and parts[0] in ("aten", "prims") else parts[-1]


def pattern_name(node: dict[str, Any]) -> str:
    """The op a post-grad node came from, as a user wrote it: Inductor's ``original_aten`` (the
    aten op before decomposition: ``aten.native_layer_norm`` for a ``var_mean``), else its own."""
    if node.get("original_aten"):
        return str(node["original_aten"])
    t = node.get("target") or ""
    parts = t.split(".")
    return ".".join(parts[:2]) if len(parts) >= 3 and parts[0] in ("aten", "prims") else t


@dataclass(frozen=True, slots=True)
class Pricer:
    device: DeviceSpec
    rates: Rates
    scale: Scale

    @classmethod
    def of(cls, device: DeviceSpec, dtype: str) -> Pricer:
        """Rates for training in ``dtype`` (a torch dtype name) on ``device``. Kernel bytes are
        already bytes (Inductor counts them per buffer dtype), so every byte class weighs 1."""
        d = _DTYPE.get(dtype, "fp32")
        rates = Rates.of(device, d)
        ones = (1.0, 1.0, 1.0, 1.0, 1.0, 1.0)
        act = 2 if d in ("bf16", "fp16") else 4
        return cls(device, rates, Scale(tp=1, sp=False, weights=ones, act_bytes=act, flash=True, eager=False))

    def kernel(self, k: dict[str, Any], nodes: dict[str, dict[str, Any]], phase: str) -> Kernel:
        ph = _PHASE.get(phase.split("#")[0], Phase.FORWARD)
        if k["kind"] == "eager":  # a whole eager optimizer step (``fused_optimizer_kernel``)
            nb = (float(k["bytes"]), 0.0, 0.0, 0.0, 0.0, 0.0)
            return Kernel(ph, "vector", REPL, 0.0, float(k.get("vec_flops", 0.0)), nb)
        own = [nodes[n] for n in k["ops"] if n in nodes and nodes[n]["op"] == "call_function"]
        nbytes = (float(k["bytes"]), 0.0, 0.0, 0.0, 0.0, 0.0)
        gemm = next((n for n in own if short(n["target"]) in _GEMMS), None)
        attn = next(
            (n for n in own if "scaled_dot_product" in n["target"] and "backward" not in n["target"]), None
        )
        attn_bwd = next(
            (n for n in own if "scaled_dot_product" in n["target"] and "backward" in n["target"]), None
        )
        if k["kind"] in ("extern", "template") and gemm is not None and gemm.get("shape"):
            dims = _gemm_dims(gemm, nodes)
            flops = float(k["flops"]) or 2.0 * dims[0] * dims[1] * dims[2]
            return Kernel(ph, "matmul", REPL, flops, 0.0, nbytes, dims=dims)
        q = attn or attn_bwd
        if k["kind"] in ("extern", "fallback") and q is not None:
            shape = _first_input_shape(q, nodes)
            if shape is not None and len(shape) == 4:
                b, h, s, d = shape
                fwd = 4.0 * b * h * s * s * d
                flops = float(k["flops"]) or (fwd * 2.5 if attn_bwd is not None else fwd)
                # the cost model prices causal attention (half the score matrix): Inductor counts all
                return Kernel(ph, "attention", REPL, flops, 0.0, nbytes, attn=(b * h, s, s, d))
        vec = 0.0
        for n in own:
            if n["shape"] is None:
                continue
            rule = rule_for(short(n["target"]), pointwise=n["pointwise"], is_view=n["view"])
            ins = [
                (tuple(nodes[i]["shape"]), nodes[i]["itemsize"])
                for i in n["inputs"]
                if i in nodes and nodes[i]["shape"] is not None
            ]
            vec += rule.vector_flops(ins, [(tuple(n["shape"]), n["itemsize"])])
        return Kernel(ph, "vector", REPL, 0.0, vec, nbytes)

    def seconds(self, kernel: Kernel) -> float:
        return kernel_time(kernel, self.rates, self.scale)

    def merged(self, a: Kernel, b: Kernel, saved_bytes: float) -> Kernel:
        """One kernel doing the work of ``a`` and ``b`` without ``saved_bytes`` of traffic between
        them (the anchor's kind if either is a GEMM)."""
        base = a if a.kind != "vector" else b
        total = max(0.0, a.bytes[0] + b.bytes[0] - saved_bytes)
        return Kernel(
            base.phase,
            base.kind,
            REPL,
            a.mm_flops + b.mm_flops,
            a.vec_flops + b.vec_flops,
            (total, 0.0, 0.0, 0.0, 0.0, 0.0),
            dims=base.dims,
            attn=base.attn,
        )

    def saving(self, a: Kernel, b: Kernel, saved_bytes: float) -> float:
        return max(0.0, self.seconds(a) + self.seconds(b) - self.seconds(self.merged(a, b, saved_bytes)))


def _first_input_shape(n: dict[str, Any], nodes: dict[str, dict[str, Any]]) -> list[int] | None:
    for i in n["inputs"]:
        if i in nodes and nodes[i]["shape"] is not None:
            return list(nodes[i]["shape"])
    return None


def _gemm_dims(n: dict[str, Any], nodes: dict[str, dict[str, Any]]) -> tuple[int, int, int]:
    """(M, N, K) of a GEMM node: M x N its output (a batch folded into M), K the reduced dim."""
    out = list(n["shape"])
    m = math.prod(out[:-1]) if len(out) > 1 else 1
    nn_ = out[-1]
    ins = [nodes[i]["shape"] for i in n["inputs"] if i in nodes and nodes[i]["shape"]]
    kk = 1
    # the operand whose last dim is not N holds K last (mm(a, b): a is M x K)
    left = (
        ins[-2] if short(n["target"]) in ("addmm", "baddbmm") and len(ins) >= 3 else (ins[0] if ins else None)
    )
    if left:
        kk = left[-1]
    return max(1, int(m)), max(1, int(nn_)), max(1, int(kk))


#: bytes per parameter element an Adam(W) step moves, in units of the parameter's width: the
#: parameter read and written, its gradient read, both moments read and written
#: (``_fused_adamw_``: one pass over each of the four tensors of a parameter)
ADAM_PASSES = 7
#: vector FLOPs per element of an Adam(W) update (``coplan.ir.oprules``' ``fused_adam`` rule)
ADAM_FLOPS = 12


def fused_optimizer_kernel(elements: int, itemsize: int) -> dict[str, Any]:
    """The kernel-table row of an optimizer step that runs eagerly as one fused kernel (what
    ``torch.compile`` leaves of a fused AdamW): it is part of the step, so it is priced with it."""
    return {
        "name": "aten._fused_adamw_",
        "graph": "optimizer",
        "kind": "eager",
        "ops": [],
        "op": "aten._fused_adamw_.default",
        "members": [],
        "bytes": int(elements) * int(itemsize) * ADAM_PASSES,
        "flops": 0,
        "vec_flops": float(elements) * ADAM_FLOPS,
    }
