"""What a baseline run executes, as the cost model prices it (``apply.predict.baseline_plan``):
``torch.compile``'s defaults recompute what Inductor's min-cut partitioner recomputes by default
(on one H200, Llama 3.2 1B's compiled step saved 28.4 GiB where the plan's layout without
recomputation is priced at 35.9; the partitioner's rule takes 4 GiB of it, the SwiGLU's SiLU
output); eager PyTorch recomputes nothing; a budgeted ``torch.compile`` keeps the plan's set."""

from __future__ import annotations

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
