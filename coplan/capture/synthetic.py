"""Build the IR of a training step straight from a ``ModelSpec``, without tracing.

The graph is coarser than a captured one (one op per module-level kernel: a linear, a norm, the
attention kernel, rather than every aten view) but it is the same IR, and it agrees with the
capture of the built-in model of the same spec on what the planner prices: matrix FLOPs (taken
from ``torch.utils.flop_counter``'s formulas, as capture does), parameters (same names and shapes),
and the activations kept for backward (same tensors, shapes and dtypes). A test holds it to that.
It builds a 1T-parameter, 128-layer model in well under a second, which capture cannot.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field, replace
from typing import Any

from torch.utils.flop_counter import sdpa_backward_flop_count, sdpa_flop_count

from coplan.capture.flops import query_heads
from coplan.errors import SpecError
from coplan.ir.saved import mark_saved
from coplan.ir.types import Graph, GraphMeta, Op, OpKind, Phase, Tensor, TensorRole, dtype_bytes, relink
from coplan.models.spec import ModelSpec

F32, I64 = "float32", "int64"
Shape = tuple[int, ...]


def _mm(m: int, k: int, n: int) -> int:
    return 2 * m * k * n


@dataclass
class _Builder:
    """Accumulates ops and tensors; ids are positions, links are filled in by ``relink``."""

    dtype: str
    ops: list[Op] = field(default_factory=list)
    tensors: list[Tensor] = field(default_factory=list)
    grad_of_param: dict[int, int] = field(default_factory=dict)
    params: list[int] = field(default_factory=list)
    outputs: list[int] = field(default_factory=list)

    def tensor(self, name: str, shape: Shape, role: TensorRole, dtype: str | None = None, **kw: Any) -> int:
        tid = len(self.tensors)
        self.tensors.append(
            Tensor(id=tid, name=name, shape=shape, dtype=dtype or self.dtype, role=role, **kw)
        )
        return tid

    def param(self, name: str, shape: Shape) -> int:
        tid = self.tensor(name, shape, TensorRole.PARAMETER, param_name=name)
        self.params.append(tid)
        return tid

    def op(
        self,
        target: str,
        kind: OpKind,
        phase: Phase,
        inputs: list[int],
        outs: list[tuple[str, Shape, str]],
        module: str,
        block: int | None,
        flops: int = 0,
        fwd: int | None = None,
        vector_per_elem: float = 1.0,
        read: int | None = None,
        args: str = "",
    ) -> list[int]:
        role = {
            Phase.FORWARD: TensorRole.ACTIVATION,
            Phase.BACKWARD: TensorRole.GRADIENT,
            Phase.OPTIMIZER: TensorRole.OPTIMIZER_TEMP,
        }[phase]
        out_ids = [self.tensor(n, s, role, d) for n, s, d in outs]
        written = sum(self.tensors[t].nbytes for t in out_ids)
        if read is None:
            read = sum(self.tensors[t].nbytes for t in dict.fromkeys(inputs))
        vec = (
            0
            if kind in (OpKind.MATMUL, OpKind.ATTENTION)
            else int(vector_per_elem * max((self.tensors[t].numel for t in out_ids), default=0))
        )
        self.ops.append(
            Op(
                id=len(self.ops),
                name=f"{target}_{len(self.ops)}",
                target=target,
                kind=kind,
                inputs=tuple(inputs),
                outputs=tuple(out_ids),
                phase=phase,
                flops=flops,
                vector_flops=vec,
                bytes_read=read,
                bytes_written=written,
                forward_op=fwd,
                module_path=module,
                block=block,
                args=args,
            )
        )
        return out_ids


@dataclass
class _Fwd:
    """What a forward module hands its backward: the op to link to and the tensors it reads."""

    op: int
    saved: list[int]
    params: list[int] = field(default_factory=list)


class _Model:
    """Emits forward ops in order, records what each needs for backward, then emits backward in
    reverse order. One instance builds one graph."""

    def __init__(self, spec: ModelSpec, batch: int, seq: int, dtype: str, cp: int = 1) -> None:
        self.s, self.b, self.t, self.cp = spec, batch, seq, cp
        self.n = batch * seq
        self.g = _Builder(dtype)
        self.dt = dtype
        self.tape: list[tuple[str, _Fwd, dict[str, object]]] = []

    # forward building blocks -------------------------------------------------------------------

    def linear(
        self,
        x: int,
        m: int,
        k: int,
        n: int,
        module: str,
        block: int | None,
        bias: bool,
        weight: int | None = None,
    ) -> int:
        w = weight if weight is not None else self.g.param(f"{module}.weight", (n, k))
        ins = [x, w]
        ps = [w]
        if bias:
            bb = self.g.param(f"{module}.bias", (n,))
            ins.append(bb)
            ps.append(bb)
        (y,) = self.g.op(
            "linear",
            OpKind.MATMUL,
            Phase.FORWARD,
            ins,
            [(f"{module}.out", (m, n), self.dt)],
            module,
            block,
            flops=_mm(m, k, n),
        )
        self.tape.append(
            (
                "linear",
                _Fwd(len(self.g.ops) - 1, [x], ps),
                {"flops": _mm(m, k, n), "module": module, "block": block},
            )
        )
        return y

    def norm(self, x: int, module: str, block: int | None) -> int:
        d, shape = self.s.d_model, (self.b, self.t, self.s.d_model)
        stat = (self.b, self.t, 1)
        w = self.g.param(f"{module}.weight", (d,))
        ps = [w]
        if self.s.norm == "layernorm":
            ins = [x, w]
            if self.s.bias:
                ps.append(self.g.param(f"{module}.bias", (d,)))
                ins.append(ps[-1])
            y, mean, rstd = self.g.op(
                "layer_norm",
                OpKind.NORM,
                Phase.FORWARD,
                ins,
                [
                    (f"{module}.out", shape, self.dt),
                    (f"{module}.mean", stat, F32),
                    (f"{module}.rstd", stat, F32),
                ],
                module,
                block,
                vector_per_elem=5,
                args=f"eps={self.s.norm_eps!r}",
            )
            saved = [x, mean, rstd]
        else:
            # RMSNorm as eager PyTorch runs it: rstd, x * rstd (kept for the weight gradient), * w.
            y, normed, rstd = self.g.op(
                "rms_norm",
                OpKind.NORM,
                Phase.FORWARD,
                [x, w],
                [
                    (f"{module}.out", shape, self.dt),
                    (f"{module}.normed", shape, self.dt),
                    (f"{module}.rstd", stat, F32),
                ],
                module,
                block,
                vector_per_elem=4,
                args=f"eps={self.s.norm_eps!r}",
            )
            saved = [x, normed, rstd]
        self.tape.append(("norm", _Fwd(len(self.g.ops) - 1, saved, ps), {"module": module, "block": block}))
        return y

    def pointwise(
        self,
        target: str,
        ins: list[int],
        shape: Shape,
        module: str,
        block: int | None,
        saved: list[int],
        per_elem: float = 1.0,
        dtype: str | None = None,
        label: str | None = None,
    ) -> int:
        # ``label`` names the output when a module has two ops of one kind (the residual adds),
        # so tensor names stay unique per block: plans and recompute sets refer to them by name
        (y,) = self.g.op(
            target,
            OpKind.ELEMENTWISE,
            Phase.FORWARD,
            ins,
            [(f"{module}.{label or target}", shape, dtype or self.dt)],
            module,
            block,
            vector_per_elem=per_elem,
        )
        self.tape.append(
            (
                "add" if target == "add" else "pointwise",
                _Fwd(len(self.g.ops) - 1, saved),
                {"module": module, "block": block},
            )
        )
        return y

    def dropout(self, x: int, p: float, module: str, block: int | None, label: str) -> int:
        """Dropout as PyTorch's ``native_dropout`` runs it: the kept values scaled by 1/(1-p) and a
        one-byte boolean mask, which backward reads (``native_dropout_backward``: grad * mask *
        scale). Megatron-LM fuses it with the bias and the residual add (bias-dropout-add), which
        the cost model's fusion groups reproduce; Korthikanti et al. 2022 (arXiv 2205.05198, Sec. 4)
        count the mask as one byte per element of the activation memory."""
        shape = self.g.tensors[x].shape
        y, _mask = self.g.op(
            "dropout",
            OpKind.ELEMENTWISE,
            Phase.FORWARD,
            [x],
            [(f"{module}.{label}", shape, self.dt), (f"{module}.{label}_mask", shape, "bool")],
            module,
            block,
            # a counter-based random number (Philox), a compare and a scale per element
            vector_per_elem=4,
            args=f"p={p!r}",
        )
        self.tape.append(
            ("pointwise", _Fwd(len(self.g.ops) - 1, [_mask]), {"module": module, "block": block})
        )
        return y

    def attention(self, x: int, i: int) -> int:
        s, b, t = self.s, self.b, self.t
        h, kvh, hd = s.n_heads, s.kv_heads, s.head_dim
        mod = f"h.{i}.attn"
        qkv = self.linear(x, self.n, s.d_model, s.d_model + 2 * kvh * hd, f"{mod}.c_attn", i, s.bias)
        q_shape, k_shape = (b, h, t, hd), (b, kvh, t, hd)
        q = k = v = qkv  # q, k, v are views of the fused projection
        if s.position == "rope":
            cos = self.g.tensor(
                f"{mod}.rotary.cos", (s.seq_len, hd), TensorRole.BUFFER, F32, param_name=f"{mod}.rotary.cos"
            )
            sin = self.g.tensor(
                f"{mod}.rotary.sin", (s.seq_len, hd), TensorRole.BUFFER, F32, param_name=f"{mod}.rotary.sin"
            )
            q, k = self.g.op(
                "rope",
                OpKind.ELEMENTWISE,
                Phase.FORWARD,
                [qkv, cos, sin],
                [(f"{mod}.q", q_shape, self.dt), (f"{mod}.k", k_shape, self.dt)],
                f"{mod}.rotary",
                i,
                vector_per_elem=6,
                args=f"theta={s.rope_theta!r}",
            )
            self.tape.append(
                ("rope", _Fwd(len(self.g.ops) - 1, [cos, sin]), {"module": f"{mod}.rotary", "block": i})
            )
        kq = query_heads(q_shape, k_shape)
        fl = sdpa_flop_count(q_shape, kq, kq)
        outs = [(f"{mod}.out", q_shape, self.dt), (f"{mod}.lse", (b, h, t), F32)]
        p = s.attention_dropout
        if p:
            # dropout on the attention probabilities inside the fused kernel: the forward keeps the
            # random generator's (seed, offset), from which backward regenerates the mask, as
            # PyTorch's _scaled_dot_product_flash_attention returns philox_seed and philox_offset
            outs.append((f"{mod}.rng_state", (2,), I64))
        res = self.g.op(
            "attention",
            OpKind.ATTENTION,
            Phase.FORWARD,
            list(dict.fromkeys([q, k, v])),
            outs,
            mod,
            i,
            flops=fl,
            args=(f"dropout_p={p!r}" if p else "") + _mask_args(s, self.cp),
        )
        out = res[0]
        self.tape.append(
            (
                "attention",
                _Fwd(len(self.g.ops) - 1, list(dict.fromkeys([q, k, v, *res]))),
                {"module": mod, "block": i, "q": q_shape, "k": k_shape},
            )
        )
        return self.linear(out, self.n, s.d_model, s.d_model, f"{mod}.c_proj", i, s.bias)

    def mlp(self, x: int, i: int) -> int:
        s, n, mod = self.s, self.n, f"h.{i}.mlp"
        shape = (self.b, self.t, s.ffn)
        if s.activation == "swiglu":
            gate = self.linear(x, n, s.d_model, s.ffn, f"{mod}.c_gate", i, s.bias)
            act = self.pointwise("silu", [gate], shape, mod, i, [gate], per_elem=8)
            up = self.linear(x, n, s.d_model, s.ffn, f"{mod}.c_fc", i, s.bias)
            h = self.pointwise("mul", [act, up], shape, mod, i, [act, up])
        else:
            up = self.linear(x, n, s.d_model, s.ffn, f"{mod}.c_fc", i, s.bias)
            h = self.ungated(up, shape, mod, i)
        return self.linear(h, n, s.ffn, s.d_model, f"{mod}.c_proj", i, s.bias)

    def ungated(self, x: int, shape: Shape, mod: str, i: int) -> int:
        """tanh-GELU (backward reads its input), or squared ReLU as PyTorch runs it: ``relu``, whose
        backward reads its output, then ``square`` (``pow(x, 2)``), whose backward reads that same
        output, so one tensor of the hidden size is kept either way."""
        if self.s.activation != "relu2":
            return self.pointwise("gelu", [x], shape, mod, i, [x], per_elem=8)
        r = self.pointwise("relu", [x], shape, mod, i, [])
        self.tape[-1][1].saved.append(r)
        return self.pointwise("square", [r], shape, mod, i, [r])

    def moe(self, x: int, i: int) -> int:
        s, n, mod = self.s, self.n, f"h.{i}.mlp"
        e, k, d, f = s.n_experts, s.top_k, s.d_model, s.ffn
        c = s.expert_capacity(n)
        logits = self.linear(x, n, d, e, f"{mod}.router", i, False)
        probs = self.pointwise("softmax", [logits], (n, e), mod, i, [], per_elem=5, dtype=F32)
        self.tape[-1][1].saved.append(probs)  # softmax backward reads its output
        top_w, top_i = self.g.op(
            "topk",
            OpKind.REDUCTION,
            Phase.FORWARD,
            [probs],
            [(f"{mod}.top_w", (n, k), F32), (f"{mod}.top_i", (n, k), I64)],
            mod,
            i,
        )
        self.tape.append(("plain", _Fwd(len(self.g.ops) - 1, [top_i]), {"module": mod, "block": i}))
        total = self.pointwise("sum", [top_w], (n, 1), mod, i, [], dtype=F32)
        norm_w = self.pointwise("div", [top_w, total], (n, k), mod, i, [top_w, total], dtype=self.dt)
        weights = self.pointwise("scatter", [norm_w, top_i], (n, e), mod, i, [top_i])
        slot_w, slot_i = self.g.op(
            "topk",
            OpKind.REDUCTION,
            Phase.FORWARD,
            [weights],
            [(f"{mod}.slot_w", (e, c), self.dt), (f"{mod}.slot_i", (e, c), I64)],
            mod,
            i,
        )
        self.tape.append(("plain", _Fwd(len(self.g.ops) - 1, [slot_i]), {"module": mod, "block": i}))
        xe = self.pointwise("gather", [x, slot_i], (e, c, d), mod, i, [slot_i], per_elem=0)

        def bias(name: str, n: int) -> int | None:
            return self.g.param(f"{mod}.{name}", (e, 1, n)) if s.bias else None

        w_fc = self.g.param(f"{mod}.w_fc", (e, d, f))
        hid = self._bmm(xe, w_fc, (e, c, f), mod, i, _mm(e * c, d, f), bias("b_fc", f))
        if s.activation == "swiglu":
            w_gate = self.g.param(f"{mod}.w_gate", (e, d, f))
            gate = self._bmm(xe, w_gate, (e, c, f), mod, i, _mm(e * c, d, f), bias("b_gate", f))
            act = self.pointwise("silu", [gate], (e, c, f), mod, i, [gate], per_elem=8)
            hid = self.pointwise("mul", [act, hid], (e, c, f), mod, i, [act, hid])
        else:
            hid = self.ungated(hid, (e, c, f), mod, i)
        w_proj = self.g.param(f"{mod}.w_proj", (e, f, d))
        ye = self._bmm(hid, w_proj, (e, c, d), mod, i, _mm(e * c, f, d), bias("b_proj", d))
        ye = self.pointwise("mul", [ye, slot_w], (e, c, d), mod, i, [ye, slot_w])
        return self.pointwise("index_add", [ye, slot_i], (self.b, self.t, d), mod, i, [slot_i], per_elem=1)

    def _bmm(self, a: int, w: int, out: Shape, module: str, block: int, flops: int, bias: int | None) -> int:
        # A bias add is folded into the matmul: the activation it leaves has the matmul's shape, so
        # what backward keeps is the same number of bytes either way.
        params = [w] if bias is None else [w, bias]
        (y,) = self.g.op(
            "bmm",
            OpKind.MATMUL,
            Phase.FORWARD,
            [a, *params],
            [(f"{module}.bmm", out, self.dt)],
            module,
            block,
            flops=flops,
        )
        self.tape.append(
            (
                "bmm",
                _Fwd(len(self.g.ops) - 1, [a], params),
                {"module": module, "block": block, "flops": flops},
            )
        )
        return y

    # the whole step ----------------------------------------------------------------------------

    def build(self) -> Graph:
        s, g, b, t = self.s, self.g, self.b, self.t
        idx = g.tensor("input0", (b, t), TensorRole.INPUT, I64)
        targets = g.tensor("input1", (b, t), TensorRole.INPUT, I64)
        wte = g.param("wte.weight", (s.vocab_size, s.d_model))
        shape = (b, t, s.d_model)
        x = self._embedding(idx, wte, "wte", shape, saved=[idx])
        if s.position == "learned":
            wpe = g.param("wpe.weight", (s.seq_len, s.d_model))
            (pos,) = g.op("arange", OpKind.CREATION, Phase.FORWARD, [], [("arange", (t,), I64)], "", None)
            pe = self._embedding(pos, wpe, "wpe", (t, s.d_model), saved=[pos])
            x = self.pointwise("add", [x, pe], shape, "", None, [])
        pd = s.hidden_dropout
        if pd:
            # Megatron's embedding applies the hidden dropout to the summed embeddings
            x = self.dropout(x, pd, "", None, "embedding_dropout")
        for i in range(s.n_layers):
            a = self.attention(self.norm(x, f"h.{i}.ln_1", i), i)
            if pd:  # on the block's replicated residual path (after the row-parallel reduction)
                a = self.dropout(a, pd, f"h.{i}", i, "attn_dropout")
            x = self.pointwise("add", [x, a], shape, f"h.{i}", i, [], label="attn_residual")
            m = (
                self.moe(self.norm(x, f"h.{i}.ln_2", i), i)
                if s.is_moe
                else self.mlp(self.norm(x, f"h.{i}.ln_2", i), i)
            )
            if pd:
                m = self.dropout(m, pd, f"h.{i}", i, "mlp_dropout")
            x = self.pointwise("add", [x, m], shape, f"h.{i}", i, [], label="mlp_residual")
        x = self.norm(x, "ln_f", None)
        head_w = wte if s.tied_embeddings else None
        logits = self.linear(x, self.n, s.d_model, s.vocab_size, "lm_head", None, False, weight=head_w)
        if head_w is None:
            head_w = g.params[-1]
        logp = self.pointwise("log_softmax", [logits], (self.n, s.vocab_size), "", None, [], per_elem=5)
        self.tape[-1][1].saved.append(logp)
        loss, total = g.op(
            "nll_loss",
            OpKind.LOSS,
            Phase.FORWARD,
            [logp, targets],
            [("loss", (), F32), ("total_weight", (), F32)],
            "",
            None,
        )
        self.tape.append(("plain", _Fwd(len(g.ops) - 1, [targets, total]), {"module": "", "block": None}))
        g.outputs.append(loss)
        self._backward()
        self._optimizer()
        return relink(g.ops, g.tensors, GraphMeta(), tuple(g.outputs))

    def _embedding(self, idx: int, w: int, module: str, shape: Shape, saved: list[int]) -> int:
        out = self.g.tensors[w].nbytes // self.g.tensors[w].shape[0] * (self.g.tensors[idx].numel)
        (y,) = self.g.op(
            "embedding",
            OpKind.EMBEDDING,
            Phase.FORWARD,
            [w, idx],
            [(f"{module}.out", shape, self.dt)],
            module,
            None,
            read=out + self.g.tensors[idx].nbytes,
            vector_per_elem=0,
        )
        self.tape.append(
            ("embedding", _Fwd(len(self.g.ops) - 1, saved, [w]), {"module": module, "block": None})
        )
        return y

    def _backward(self) -> None:
        """Reverse-mode over the tape, as autograd runs it: each forward module's backward reads the
        gradient of its output and what the forward recorded as needed, and produces gradients for
        its floating-point activation inputs and its parameters. A value used twice gets its
        gradients summed by an add, as the engine does."""
        g = self.g
        loss = g.outputs[0]
        (seed,) = g.op(
            "ones_like",
            OpKind.CREATION,
            Phase.BACKWARD,
            [loss],
            [("loss.grad", (), F32)],
            "",
            None,
            fwd=g.ops[-1].id,
        )
        self.grad: dict[int, int] = {loss: seed}
        for kind, fwd, info in reversed(self.tape):
            fop = g.ops[fwd.op]
            gy = self.grad.get(fop.outputs[0])
            if gy is None:
                continue
            module, blk = str(info["module"]), info["block"]
            block = blk if isinstance(blk, int) else None
            diff = [
                t
                for t in dict.fromkeys(fop.inputs)
                if g.tensors[t].role is TensorRole.ACTIVATION and g.tensors[t].dtype != I64
            ]
            if kind == "add":  # the gradient passes through unchanged to both operands
                for x in diff:
                    self._accumulate(x, gy, fwd.op)
                continue
            if kind in ("linear", "bmm"):
                # Both gradients of a matmul cost what its forward did: dX = dY W, dW = dY^T X.
                fl = int(info["flops"])  # type: ignore[call-overload]
                x = fwd.saved[0]
                (gx,) = g.op(
                    f"{kind}_bwd_input",
                    OpKind.MATMUL,
                    Phase.BACKWARD,
                    [gy, fwd.params[0]],
                    [(f"{module}.grad_in", g.tensors[x].shape, self.dt)],
                    module,
                    block,
                    flops=fl,
                    fwd=fwd.op,
                )
                outs = [(f"{g.tensors[p].name}.grad", g.tensors[p].shape, self.dt) for p in fwd.params]
                self._param_grads(
                    fwd.params,
                    g.op(
                        f"{kind}_bwd_weight",
                        OpKind.MATMUL,
                        Phase.BACKWARD,
                        [gy, x],
                        outs,
                        module,
                        block,
                        flops=fl,
                        fwd=fwd.op,
                    ),
                )
                self._accumulate(x, gx, fwd.op)
                continue
            flops = 0
            if kind == "attention":
                q, k = info["q"], info["k"]
                kq = query_heads(q, k)
                flops = sdpa_backward_flop_count(q, q, kq, kq)
            outs = [(f"{g.tensors[x].name}.grad", g.tensors[x].shape, self.dt) for x in diff]
            outs += [(f"{g.tensors[p].name}.grad", g.tensors[p].shape, self.dt) for p in fwd.params]
            target = {"attention": "attention_bwd", "norm": "norm_bwd", "embedding": "embedding_bwd"}.get(
                kind, f"{fop.target}_bwd"
            )
            op_kind = OpKind.COPY if kind == "embedding" else fop.kind
            extra = fwd.params[:1] if kind == "norm" else []
            grads = g.op(
                target,
                op_kind,
                Phase.BACKWARD,
                [gy, *fwd.saved, *extra],
                outs,
                module,
                block,
                flops=flops,
                fwd=fwd.op,
                vector_per_elem=8 if kind == "norm" else 1,
                args=_mask_args(self.s, self.cp) if kind == "attention" else "",
            )
            self._param_grads(fwd.params, grads[len(diff) :])
            for x, gx in zip(diff, grads, strict=False):
                self._accumulate(x, gx, fwd.op)

    def _accumulate(self, x: int, gx: int, fwd: int) -> None:
        g = self.g
        prev = self.grad.get(x)
        if prev is None:
            self.grad[x] = gx
            return
        # Attributed like the engine's accumulation in capture: to the op whose gradient just arrived.
        src = g.ops[fwd]
        (s,) = g.op(
            "add",
            OpKind.ELEMENTWISE,
            Phase.BACKWARD,
            [prev, gx],
            [(f"{g.tensors[x].name}.grad_sum", g.tensors[x].shape, self.dt)],
            src.module_path,
            src.block,
            fwd=fwd,
        )
        self.grad[x] = s

    def _param_grads(self, params: list[int], grads: list[int]) -> None:
        g = self.g
        for p, gr in zip(params, grads, strict=True):
            prev = g.grad_of_param.get(p)
            if prev is not None:  # a shared weight (tied embeddings): sum the two gradients
                fwd = g.ops[g.tensors[gr].producer or len(g.ops) - 1].forward_op
                (gr,) = g.op(
                    "add",
                    OpKind.ELEMENTWISE,
                    Phase.BACKWARD,
                    [prev, gr],
                    [(f"{g.tensors[p].name}.grad_sum", g.tensors[p].shape, self.dt)],
                    g.ops[-1].module_path,
                    None,
                    fwd=fwd,
                )
            g.grad_of_param[p] = gr

    def _optimizer(self) -> None:
        """AdamW as one fused update per parameter: reads param, grad, two moments and the step."""
        g = self.g
        for p in g.params:
            pt = g.tensors[p]
            gr = g.grad_of_param[p]
            g.tensors[gr] = replace(g.tensors[gr], grad_of=p)
            module = pt.name.rsplit(".", 1)[0] if "." in pt.name else ""
            block = _block_of(module)
            m = g.tensor(f"{pt.name}.exp_avg", pt.shape, TensorRole.OPTIMIZER_STATE, param_name=pt.name)
            v = g.tensor(f"{pt.name}.exp_avg_sq", pt.shape, TensorRole.OPTIMIZER_STATE, param_name=pt.name)
            st = g.tensor(f"{pt.name}.step", (), TensorRole.OPTIMIZER_STATE, F32, param_name=pt.name)
            outs = g.op(
                "adamw",
                OpKind.OPTIMIZER,
                Phase.OPTIMIZER,
                [p, gr, m, v, st],
                [
                    (pt.name, pt.shape, pt.dtype),
                    (f"{pt.name}.exp_avg", pt.shape, pt.dtype),
                    (f"{pt.name}.exp_avg_sq", pt.shape, pt.dtype),
                    (f"{pt.name}.step", (), F32),
                ],
                module,
                block,
                vector_per_elem=12,
            )
            for src, dst, role in zip(
                (p, m, v, st), outs, (TensorRole.PARAMETER,) + (TensorRole.OPTIMIZER_STATE,) * 3, strict=True
            ):
                g.tensors[dst] = replace(g.tensors[dst], role=role, alias_of=src, updates=src)
            g.outputs.extend(outs)


def _mask_args(spec: ModelSpec, cp: int = 1) -> str:
    """An encoder's attention ops carry ``is_causal=False`` as a keyword, as a captured SDPA does
    (``coplan.ir.oprules.attention_causal``); a decoder's carry nothing, causal by default. Under
    context parallelism (``cp`` > 1) they carry ``cp=N``: the rank's queries meet every rank's
    keys and values (``coplan.ir.oprules.attention_cp``)."""
    kw = ([] if spec.causal else ["is_causal=False"]) + ([f"cp={cp}"] if cp > 1 else [])
    return ";" + ",".join(kw) if kw else ""


def _block_of(module: str) -> int | None:
    parts = module.split(".")
    return int(parts[1]) if len(parts) > 1 and parts[0] == "h" and parts[1].isdigit() else None


def build_graph(
    spec: ModelSpec, batch: int = 1, seq: int | None = None, dtype: str = "float32", cp: int = 1
) -> Graph:
    """The IR of one AdamW training step of ``spec``'s built-in model, built without tracing.
    ``cp`` > 1: the step of one context-parallel rank, ``seq`` its share of each sequence (its
    attention ops say how many ranks share it)."""
    s = spec.resolve_seq(seq)
    if batch <= 0:
        raise SpecError(f"model '{spec.name}'", "batch", f"must be positive, got {batch}")
    dtype_bytes(dtype)
    t0 = time.perf_counter()
    graph = _Model(spec, batch, s, dtype, cp).build()
    graph = mark_saved(graph, graph.outputs)
    meta = GraphMeta(
        model=spec.name,
        source="synthetic",
        batch=batch,
        seq=s,
        optimizer="AdamW",
        capture_s=time.perf_counter() - t0,
        block_container="h",
    )
    return replace(graph, meta=meta)
