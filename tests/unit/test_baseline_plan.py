"""What a baseline run executes, as the cost model prices it (``apply.predict.baseline_plan``):
``torch.compile``'s defaults recompute what Inductor's min-cut partitioner recomputes by default
(on one H200, Llama 3.2 1B's compiled step saved 28.4 GiB where the plan's layout without
recomputation is priced at 35.9; the partitioner's rule takes 4 GiB of it, the SwiGLU's SiLU
output); eager PyTorch recomputes nothing; a budgeted ``torch.compile`` keeps the plan's set."""

from __future__ import annotations

import pytest

from coplan.apply.predict import baseline_plan, make_context, plan_for
from coplan.hardware import load_cluster
from coplan.models.spec import load_model_spec
from coplan.passes.remat import mincut_names, saved_names


def _ctx():
    spec = load_model_spec("gpt-tiny")
    spec = type(spec)(**{**spec.to_dict(), "activation": "swiglu", "norm": "rmsnorm", "position": "rope"})
    return make_context(spec, load_cluster("dgx-h100", 1), 4, 64, "cuda")


def test_compile_recomputes_the_min_cut_default_and_eager_nothing():
    ctx = _ctx()
    plan = plan_for(ctx, compute="bf16", microbatch=4)
    names = mincut_names(ctx)
    assert names  # the SwiGLU's SiLU output, rebuilt from its saved input
    compiled = baseline_plan(plan, ctx, "compile")
    assert compiled.remat.recompute == names
    assert not baseline_plan(plan, ctx, "eager").remat.recompute
    est = ctx.price(compiled)
    assert est.memory.activations_bytes < ctx.price(compiled.with_(remat=plan.remat)).memory.activations_bytes


def test_a_budgeted_compile_keeps_the_plans_set():
    ctx = _ctx()
    plan = plan_for(ctx, compute="bf16", microbatch=4, recompute=frozenset(saved_names(ctx)[:2]))
    kept = baseline_plan(plan, ctx, "compile", keep_recompute=True)
    assert kept.remat.recompute == plan.remat.recompute


def test_a_budgeted_compile_reruns_recomputed_pointwise_ops_inside_its_backward_kernels():
    """Inductor fuses a recomputed pointwise op into the backward kernels reading its output, so the
    budgeted baseline recomputing the plan's set pays its arithmetic only (``with_remat``), no
    kernel of its own: never slower than the same set priced as separate kernels."""
    from dataclasses import replace

    from coplan.passes.remat import in_backward

    ctx = _ctx()
    names = mincut_names(ctx)
    plan = plan_for(ctx, compute="bf16", microbatch=4, recompute=names)
    kept = baseline_plan(plan, ctx, "compile", keep_recompute=True)
    assert kept.fusion.recompute_in_backward == in_backward(ctx, names) != frozenset()
    apart = kept.with_(fusion=replace(kept.fusion, recompute_in_backward=frozenset()))
    assert ctx.price(kept).step_time_s < ctx.price(apart).step_time_s


def test_an_eager_baseline_keeps_autocasts_fp32_residual_stream():
    import torch

    from coplan.models.transformer import build_model
    from coplan.passes.precision import autocast_ops, autocast_stream_ops

    ctx = _ctx()
    plan = plan_for(ctx, compute="bf16", microbatch=4)
    stream = dict(autocast_stream_ops(ctx))
    kinds = {ctx.index.op_by_name[n].target for n in stream}
    # the embedding's fp32 rows, the residual adds, the norms, RoPE over its fp32 tables, the loss
    assert {"embedding", "add", "rms_norm", "rope", "log_softmax", "nll_loss"} <= kinds
    # what autocast runs in 16 bits, and what reads only 16-bit tensors, stay out
    assert not kinds & {"linear", "attention", "silu", "mul"}
    assert dict(autocast_ops(ctx)).keys() < stream.keys()
    assert dict(baseline_plan(plan, ctx, "eager").precision.ops) == stream
    assert dict(baseline_plan(plan, ctx, "compile").precision.ops) == dict(autocast_ops(ctx))
    # PyTorch's autocast over the fp32 model, on this CPU: the same dtypes module by module
    model = build_model(ctx.model.spec)
    seen: dict[str, torch.dtype] = {}
    for name, module in model.named_modules():
        if name in ("wte", "h.0", "h.0.ln_1", "h.0.attn", "h.0.mlp", "lm_head"):
            module.register_forward_hook(lambda _m, _i, out, name=name: seen.__setitem__(name, out.dtype))
    idx = torch.randint(0, ctx.model.spec.vocab_size, (2, 16))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        model(idx, idx)
    assert seen == {
        "wte": torch.float32,
        "h.0.ln_1": torch.float32,
        "h.0.attn": torch.bfloat16,
        "h.0.mlp": torch.bfloat16,
        "h.0": torch.float32,  # the block's output: fp32 residual plus 16-bit branches
        "lm_head": torch.bfloat16,
    }


def test_an_eager_baselines_loss_keeps_16_bit_log_probabilities_and_nll_losss_fp32_copy():
    """``F.cross_entropy`` under autocast: log-softmax in the logits' 16 bits (the explicit dtype
    ``cross_entropy`` passes, which autocast keeps), ``nll_loss`` on autocast's fp32 list reading a
    cast copy, and autograd keeping both for backward (``nll_loss_backward`` takes its input): 2 + 4
    bytes a logit, where an fp32 log-softmax keeps 4."""
    from dataclasses import replace

    from coplan.passes.precision import autocast_stream_ops

    ctx = _ctx()
    stream = dict(autocast_stream_ops(ctx, "bf16"))
    (lsm,) = [n for n in stream if ctx.index.op_by_name[n].target == "log_softmax"]
    (nll,) = [n for n in stream if ctx.index.op_by_name[n].target == "nll_loss"]
    assert stream[lsm] == "bf16" and stream[nll] == "fp32"
    eager = baseline_plan(plan_for(ctx, compute="bf16", microbatch=4), ctx, "eager")
    fp32_lsm = eager.with_(precision=replace(eager.precision, ops=tuple({**stream, lsm: "fp32"}.items())))
    logits = 4 * 64 * ctx.model.spec.vocab_size
    saved = [ctx.price(p).memory.activations_bytes for p in (eager, fp32_lsm)]
    assert saved[0] - saved[1] == pytest.approx(2 * logits)


def test_nll_losss_saved_copy_is_freed_when_its_backward_is_done():
    """Autograd frees ``nll_loss``'s saved fp32 input once its backward node has run, before the
    log-softmax's backward: the points after it carry the copy as freed (``liveness(freed=...)``),
    so the loss's peak is the fp32 gradient beside everything saved, not that plus the copy."""
    from coplan.cost.parts import FIX, TP

    ctx = _ctx()
    eager = baseline_plan(plan_for(ctx, compute="bf16", microbatch=4), ctx, "eager")
    est = ctx.price(eager)
    post = ctx.model.profile_for(est.config).post
    copy = 4.0 * 4 * 64 * ctx.model.spec.vocab_size  # the fp32 log-probabilities, one microbatch
    fix = [p[FIX * 2 + TP] for p in post.transient]  # bytes on the vocabulary's shard
    assert min(fix) == pytest.approx(-copy)
    assert max(fix) < copy  # no point holds the copy as a temporary on top of the saved one
