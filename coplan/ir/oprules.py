"""Per-op rules: what kind of kernel an aten op is, and its vector FLOPs and bytes moved.

Matrix-unit FLOPs are not computed here: capture takes them from ``torch.utils.flop_counter``'s
registry, so our totals are the same numbers ``FlopCounterMode`` reports. This module covers the
rest, with one registered rule per op family instead of an if-chain.

Vector FLOPs are per output element (or per input element for reductions) and are deliberately
simple counts (one per add/mul, a handful for transcendental activations): the cost model uses them
only to decide whether a non-matmul kernel is compute- or memory-bound, and those kernels are
memory-bound on every supported device by a wide margin.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

from coplan.ir.types import Op, OpKind

# (shape, dtype_bytes) of each tensor argument; storage bytes of the base for views.
TensorInfo = tuple[tuple[int, ...], int]


def numel(shape: Sequence[int]) -> int:
    n = 1
    for d in shape:
        n *= d
    return n


def _nbytes(t: TensorInfo) -> int:
    return numel(t[0]) * t[1]


@dataclass(frozen=True, slots=True)
class OpRule:
    kind: OpKind
    # vector FLOPs per element of the first output (elementwise) or first input (reductions)
    flops_per_element: float = 0.0
    per_input_element: bool = False
    # custom byte accounting: (inputs, outputs) -> (read, written); None: read all inputs once,
    # write all outputs
    bytes_fn: Callable[[Sequence[TensorInfo], Sequence[TensorInfo]], tuple[int, int]] | None = None

    def vector_flops(self, inputs: Sequence[TensorInfo], outputs: Sequence[TensorInfo]) -> int:
        if not self.flops_per_element:
            return 0
        ref = inputs if self.per_input_element else outputs
        if not ref:
            return 0
        return int(self.flops_per_element * numel(ref[0][0]))

    def bytes_moved(self, inputs: Sequence[TensorInfo], outputs: Sequence[TensorInfo]) -> tuple[int, int]:
        if self.kind is OpKind.VIEW:
            return 0, 0
        if self.bytes_fn is not None:
            return self.bytes_fn(inputs, outputs)
        return sum(_nbytes(t) for t in inputs), sum(_nbytes(t) for t in outputs)


_RULES: dict[str, OpRule] = {}


def register(*names: str, kind: OpKind, **kw: object) -> OpRule:
    """Register one rule for a family of aten op names (``OpOverloadPacket`` names, no namespace)."""
    rule = OpRule(kind=kind, **kw)  # type: ignore[arg-type]
    for n in names:
        if n in _RULES:
            raise ValueError(f"op rule for '{n}' registered twice")
        _RULES[n] = rule
    return rule


def rule_for(name: str, *, pointwise: bool = False, is_view: bool = False) -> OpRule:
    """The rule for an aten op name; unknown ops fall back on their aten tags."""
    base = name[:-1] if name.endswith("_") and name[:-1] in _RULES else name
    if base in _RULES:
        return _RULES[base]
    if is_view:
        return _VIEW
    if pointwise:
        return _POINTWISE
    return _OTHER


def _gather_bytes(inputs: Sequence[TensorInfo], outputs: Sequence[TensorInfo]) -> tuple[int, int]:
    # A gather reads the rows it produces plus its indices, not the whole table.
    out = sum(_nbytes(t) for t in outputs)
    idx = sum(_nbytes(t) for t in inputs[1:])
    return out + idx, out


def _scatter_bytes(inputs: Sequence[TensorInfo], outputs: Sequence[TensorInfo]) -> tuple[int, int]:
    # Dense scatter/accumulate: reads updates and indices, writes the whole destination.
    return sum(_nbytes(t) for t in inputs[1:]) + _nbytes(inputs[0]), sum(_nbytes(t) for t in outputs)


def _creation_bytes(inputs: Sequence[TensorInfo], outputs: Sequence[TensorInfo]) -> tuple[int, int]:
    return 0, sum(_nbytes(t) for t in outputs)


_VIEW = OpRule(OpKind.VIEW)
_POINTWISE = OpRule(OpKind.ELEMENTWISE, flops_per_element=1)
_OTHER = OpRule(OpKind.OTHER)

register("mm", "addmm", "bmm", "baddbmm", "matmul", "linear", "_scaled_mm", kind=OpKind.MATMUL)
register(
    "_scaled_dot_product_flash_attention",
    "_scaled_dot_product_flash_attention_for_cpu",
    "_scaled_dot_product_efficient_attention",
    "_scaled_dot_product_cudnn_attention",
    "_flash_attention_forward",
    "_efficient_attention_forward",
    "_scaled_dot_product_flash_attention_backward",
    "_scaled_dot_product_flash_attention_for_cpu_backward",
    "_scaled_dot_product_efficient_attention_backward",
    "_scaled_dot_product_cudnn_attention_backward",
    "_flash_attention_backward",
    "_efficient_attention_backward",
    kind=OpKind.ATTENTION,
    flops_per_element=0,
)
register(
    "view",
    "_unsafe_view",
    "reshape",
    "t",
    "transpose",
    "permute",
    "expand",
    "slice",
    "select",
    "split",
    "split_with_sizes",
    "chunk",
    "unbind",
    "squeeze",
    "unsqueeze",
    "as_strided",
    "alias",
    "detach",
    "unflatten",
    "flatten",
    "narrow",
    "diagonal",
    "view_as",
    "expand_as",
    "lift_fresh",
    kind=OpKind.VIEW,
)
register(
    "native_layer_norm", "_fused_rms_norm", "layer_norm", "rms_norm", kind=OpKind.NORM, flops_per_element=5
)
register("native_layer_norm_backward", "_fused_rms_norm_backward", kind=OpKind.NORM, flops_per_element=8)
register("_softmax", "_log_softmax", "softmax", "log_softmax", kind=OpKind.SOFTMAX, flops_per_element=5)
register("_softmax_backward_data", "_log_softmax_backward_data", kind=OpKind.SOFTMAX, flops_per_element=4)
register(
    "nll_loss_forward",
    "nll_loss_backward",
    "nll_loss2d_forward",
    "nll_loss2d_backward",
    kind=OpKind.LOSS,
    flops_per_element=1,
    per_input_element=True,
)
register("embedding", "index", "index_select", "gather", kind=OpKind.EMBEDDING, bytes_fn=_gather_bytes)
register(
    "embedding_dense_backward",
    "index_add",
    "index_put",
    "scatter",
    "scatter_add",
    "_index_put_impl",
    "index_copy",
    kind=OpKind.COPY,
    bytes_fn=_scatter_bytes,
)
register(
    "sum",
    "mean",
    "amax",
    "amin",
    "max",
    "min",
    "var",
    "var_mean",
    "std",
    "norm",
    "linalg_vector_norm",
    "prod",
    "argmax",
    "argmin",
    "any",
    "all",
    "logsumexp",
    kind=OpKind.REDUCTION,
    flops_per_element=1,
    per_input_element=True,
)
register("topk", "sort", kind=OpKind.REDUCTION, flops_per_element=4, per_input_element=True)
register(
    "clone",
    "contiguous",
    "_to_copy",
    "copy",
    "cat",
    "stack",
    "repeat",
    "repeat_interleave",
    "constant_pad_nd",
    "new_empty_strided",
    kind=OpKind.COPY,
)
register(
    "zeros",
    "ones",
    "full",
    "empty",
    "zeros_like",
    "ones_like",
    "full_like",
    "empty_like",
    "arange",
    "scalar_tensor",
    "lift_fresh_copy",
    "new_zeros",
    "new_ones",
    "new_full",
    "empty_strided",
    "fill",
    "zero",
    kind=OpKind.CREATION,
    bytes_fn=_creation_bytes,
)
register(
    "gelu",
    "gelu_backward",
    "silu",
    "silu_backward",
    "tanh",
    "tanh_backward",
    "sigmoid",
    "sigmoid_backward",
    "exp",
    "log",
    "erf",
    "sin",
    "cos",
    kind=OpKind.ELEMENTWISE,
    flops_per_element=8,
)
register(
    "sqrt",
    "rsqrt",
    "reciprocal",
    "div",
    "pow",
    "addcdiv",
    "addcmul",
    "lerp",
    kind=OpKind.ELEMENTWISE,
    flops_per_element=2,
)
register("fused_adam", "_fused_adam", "_fused_adamw", kind=OpKind.OPTIMIZER, flops_per_element=12)
# Dropout: a counter-based random number (Philox), a compare and a scale per element forward; the
# mask (one byte per element, ``bool``) times the scale backward.
register("native_dropout", kind=OpKind.ELEMENTWISE, flops_per_element=4)
register("native_dropout_backward", kind=OpKind.ELEMENTWISE, flops_per_element=2)


#: Position of ``is_causal`` among the positional arguments of PyTorch's attention ops (their ATen
#: schemas, aten/src/ATen/native/native_functions.yaml; tests/unit/test_attention_mask.py checks
#: them against the installed PyTorch's).
IS_CAUSAL_AT: dict[str, int] = {
    "_scaled_dot_product_flash_attention": 4,
    "_scaled_dot_product_flash_attention_for_cpu": 4,
    "_scaled_dot_product_efficient_attention": 6,
    "_scaled_dot_product_cudnn_attention": 6,
    "_flash_attention_forward": 8,
    "_scaled_dot_product_flash_attention_backward": 11,
    "_scaled_dot_product_flash_attention_for_cpu_backward": 7,
    "_scaled_dot_product_efficient_attention_backward": 11,
    "_scaled_dot_product_cudnn_attention_backward": 14,
    "_flash_attention_backward": 11,
}


def _positional(args: str) -> list[str]:
    """The positional arguments of an op's canonical argument text, lists kept whole."""
    text = args.partition(";")[0]
    out: list[str] = []
    cur: list[str] = []
    depth = 0
    for ch in text:
        if ch == "," and depth == 0:
            out.append("".join(cur))
            cur = []
            continue
        depth += ch == "["
        depth -= ch == "]"
        cur.append(ch)
    out.append("".join(cur))
    return out


def attention_cp(op: Op) -> int:
    """The context-parallel ranks one sequence of attention op ``op`` is split over: its ``cp=``
    keyword (the synthetic builder's), else 1. The op's shapes are one rank's share of the queries,
    keys and values; the rank's queries meet all of the sequence's keys and values."""
    for part in op.args.partition(";")[2].split(","):
        if part.startswith("cp="):
            return int(part.split("=", 1)[1])
    return 1


def attention_causal(op: Op) -> bool:
    """Whether an attention op applies a causal mask: a captured op's ``is_causal`` argument (by
    keyword, or at its schema's position, ``IS_CAUSAL_AT``); the synthetic builder's attention,
    which models decoders, and ops of unknown schema are causal."""
    for part in op.args.partition(";")[2].split(","):
        if part.startswith("is_causal="):
            return part.split("=", 1)[1] == "True"
    name = op.target.removeprefix("aten.").rsplit(".", 1)[0]
    at = IS_CAUSAL_AT.get(name)
    if at is None:
        return True
    pos = _positional(op.args)
    # a trailing default the call left out is PyTorch's default, False
    return at < len(pos) and pos[at] == "True"


#: Attention ops whose fourth positional argument is ``dropout_p`` (PyTorch's flash SDPA schema).
_DROPOUT_P_ARG3 = ("_scaled_dot_product_flash_attention", "_flash_attention_forward")


def attention_dropout(op: Op) -> float:
    """The dropout probability a forward attention op applies to its probabilities: the synthetic
    builder's ``dropout_p=`` argument, or the positional ``dropout_p`` of a captured flash SDPA."""
    positional, _, keywords = op.args.partition(";")
    for part in (*positional.split(","), *keywords.split(",")):
        if part.startswith("dropout_p="):
            return float(part.split("=", 1)[1])
    pos = positional.split(",")
    if len(pos) > 3 and any(name in op.target for name in _DROPOUT_P_ARG3):
        try:
            return float(pos[3])
        except ValueError:
            return 0.0
    return 0.0
