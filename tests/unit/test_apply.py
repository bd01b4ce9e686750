"""Plans applied to real training (``coplan.apply``, ``coplan run``), single process on a CPU.

The partitioner must save exactly what the plan keeps (the cost model's activation bytes, to the
byte, for the dense GPT), recomputed tensors must really be gone from what autograd keeps,
gradients must match eager fp32 within the precision's tolerance, and the CLI must keep its JSON
contract and refuse plans made for another job with one line and exit code 2.
"""

from __future__ import annotations

import json
import platform
from pathlib import Path

import pytest
import torch
from apply_steps import compiled_step

import coplan
from coplan.apply.measure import LiveBytes, SavedBytes, SavedPeak, spearman
from coplan.apply.names import map_saved, saved_tensor_names
from coplan.apply.precision import FP8_MAX, UNIT_ROUNDOFF, LossScaler, fp8_quantize, layer_norm, tolerance
from coplan.apply.predict import make_context, megatron_recompute, plan_for
from coplan.apply.step import batches, build, reference_grads, rel_errors
from coplan.cli.app import main
from coplan.hardware import load_cluster
from coplan.models.spec import PRESETS
from coplan.plan.types import ParallelPlan, PrecisionPlan, RematPlan

SPEC = PRESETS["gpt-tiny"]
B, S = 4, 32


@pytest.fixture(scope="module")
def ctx():
    return make_context(SPEC, load_cluster("cpu"), B, S)


def _plan(ctx, mode: str = "none", compute: str = "fp32"):
    plan = plan_for(ctx, compute=compute)
    return plan.with_(remat=RematPlan(recompute=megatron_recompute(ctx, mode)))


def _compiled_step(plan):
    """(saved bytes by the compiled forward, shapes+dtypes autograd saved, model, backend, batch)."""
    return compiled_step(SPEC, plan, B, S)


@pytest.mark.parametrize("mode", ["none", "full", "selective"])
def test_saved_bytes_are_the_plans(ctx, mode):
    plan = _plan(ctx, mode)
    saved, shapes, model, be, batch = _compiled_step(plan)
    predicted = ctx.price(plan).memory.activations_bytes
    # the cost model counts the loss scalars, which backward never reads (4 bytes)
    assert saved["activation"] == pytest.approx(predicted, abs=16)
    assert not be.report.missing
    hidden = SPEC.d_model
    lse = (B, SPEC.n_heads, S)
    ffn = (B * S, 4 * hidden)
    if mode == "selective":
        assert lse not in [s for s, _ in shapes]  # the attention core is recomputed
        assert ffn in [s for s, _ in shapes]
    if mode == "full":
        assert lse not in [s for s, _ in shapes] and ffn not in [s for s, _ in shapes]
    if mode == "none":
        assert lse in [s for s, _ in shapes] and ffn in [s for s, _ in shapes]
    ref = build(SPEC, 0)
    err, _ = rel_errors(model, reference_grads(ref, *batch), {})
    assert err <= tolerance(plan.precision, SPEC.n_layers)


def test_recompute_lowers_bytes_in_order(ctx):
    got = {m: _compiled_step(_plan(ctx, m))[0]["activation"] for m in ("none", "selective", "full")}
    assert got["full"] < got["selective"] < got["none"]


def test_bf16_plan_casts_and_stays_close(ctx):
    plan = _plan(ctx, "none", "bf16")
    saved, shapes, model, be, batch = _compiled_step(plan)
    assert saved["activation"] == pytest.approx(ctx.price(plan).memory.activations_bytes, rel=0.01)
    dtypes = {d for _, d in shapes}
    assert torch.bfloat16 in dtypes
    # the loss path stays fp32: log-softmax of the logits is saved in fp32
    assert ((B * S, SPEC.vocab_size), torch.float32) in shapes
    assert be.report.casts[0].param_casts == len(list(model.parameters()))
    err, _ = rel_errors(model, reference_grads(build(SPEC, 0), *batch), {})
    assert 0 < err <= tolerance(plan.precision, SPEC.n_layers)


def test_bf16_layer_norm_sums_parameter_gradients_in_fp32():
    # PyTorch's CPU kernel sums dgamma and dbeta over the tokens in bf16: ~6 u of error on 1024
    # tokens; the precision pass's layer_norm keeps the same forward and input gradient and sums
    # the two in fp32, leaving the rounding of dy and of the result (< u)
    gen = torch.Generator().manual_seed(0)
    n, d = 1024, 128
    x, w, b = torch.randn(n, d, generator=gen), torch.randn(d, generator=gen), torch.randn(d, generator=gen)
    dy = torch.randn(n, d, generator=gen) * 1e-3 + 3e-5

    def grads(fn, dtype):
        xs = [t.to(dtype).requires_grad_() for t in (x, w, b)]
        fn(xs[0], (d,), xs[1], xs[2], 1e-5).backward(dy.to(dtype))
        return [t.grad.double() for t in xs]

    ref = grads(torch.nn.functional.layer_norm, torch.float64)
    u = UNIT_ROUNDOFF["bf16"]

    def err(fn):
        return [float((g - r).norm() / r.norm()) for g, r in zip(grads(fn, torch.bfloat16), ref, strict=True)]

    ours, native = err(layer_norm), err(torch.nn.functional.layer_norm)
    assert max(ours) < u
    assert ours[0] == pytest.approx(native[0], rel=1e-6)  # the input gradient is the kernel's own
    assert min(native[1:]) > 3 * u  # what it fixes (if PyTorch fixes its kernel, drop the workaround)


def test_fp8_plan_quantizes_the_blocks_gemms(ctx):
    plan = _plan(ctx, "none", "fp8")
    _, _, model, be, batch = _compiled_step(plan)
    linears = sum(
        1 for n, m in model.named_modules() if n.startswith("h.") and isinstance(m, torch.nn.Linear)
    )
    assert len(be.report.casts[0].overridden) == linears == 4 * SPEC.n_layers
    assert not be.report.casts[0].not_found
    err, _ = rel_errors(model, reference_grads(build(SPEC, 0), *batch), {})
    # quantized operands: further from fp32 than bf16 alone (~6e-3), within fp8's tolerance
    assert 1e-2 < err <= tolerance(plan.precision, SPEC.n_layers)


def test_tolerance_is_three_sigma_of_the_roundings():
    def tol(compute, layers):
        return tolerance(PrecisionPlan(compute=compute, loss_scaling=compute == "fp16"), layers)

    assert tol("fp32", 2) == 1e-4
    # 2 blocks: 20 roundings in each of 3 stages, 3 sqrt(60 / 3) = 13.4 u
    assert tol("bf16", 2) == pytest.approx(3 * (60 / 3) ** 0.5 * 2.0**-8)
    assert tol("fp16", 2) == pytest.approx(tol("bf16", 2) / 8)
    assert tol("bf16", 8) == pytest.approx(tol("bf16", 2) * (9 / 3) ** 0.5)
    assert tol("fp8", 2) > tol("bf16", 2)
    lowered = PrecisionPlan(compute="fp32", ops=(("h.0.mlp.c_fc", "fp8"),))
    assert tolerance(lowered, 2) == pytest.approx(tol("fp8", 2))


def test_vocab_parallel_cross_entropy_is_cross_entropy():
    # one rank holds the whole vocabulary: the collectives are identities, the math is the loss's
    import torch.distributed as dist

    from coplan.apply.vocab import vocab_cross_entropy

    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        group = dist.group.WORLD.group_name
        gen = torch.Generator().manual_seed(0)
        logits = torch.randn(2, 8, 32, generator=gen, dtype=torch.float64) * 5
        tgt = torch.randint(0, 32, (2, 8), generator=gen)
        tgt[0, 0] = -100  # ignored, as cross_entropy ignores it
        a = logits.clone().requires_grad_()
        want = torch.nn.functional.cross_entropy(a.view(-1, 32), tgt.view(-1))
        want.backward()
        for fn in (
            vocab_cross_entropy,
            torch.compile(vocab_cross_entropy, backend="aot_eager", fullgraph=True),
        ):
            b = logits.clone().requires_grad_()
            got = fn(b, tgt, 0, group)
            got.backward()
            assert got.item() == pytest.approx(want.item(), rel=1e-12)
            assert torch.allclose(b.grad, a.grad, rtol=1e-10, atol=1e-14)
    finally:
        dist.destroy_process_group()


def test_every_saved_tensor_has_a_node(ctx):
    plan = _plan(ctx)
    _, _, _, be, _ = _compiled_step(plan)
    cut = be.report.cuts[0]
    assert set(cut.saved) == set(saved_tensor_names(be.ir))
    assert map_saved  # the mapping module is importable as the partitioner uses it


def test_fp8_quantize_rounds_to_the_grid_and_passes_gradients():
    x = torch.randn(64, 32, requires_grad=True)
    q = fp8_quantize(x)
    scale = x.detach().abs().max() / FP8_MAX
    grid = (q.detach() / scale).to(torch.float8_e4m3fn).float() * scale
    assert torch.allclose(q.detach(), grid, rtol=1e-6)
    assert (q.detach() - x.detach()).abs().max() > 0
    assert float((q.detach() - x.detach()).norm() / x.detach().norm()) < 0.05
    q.sum().backward()
    assert torch.equal(x.grad, torch.ones_like(x))


def test_loss_scaler_skips_overflow():
    p = torch.nn.Parameter(torch.ones(2))
    s = LossScaler(True, init_scale=8.0)
    p.grad = torch.tensor([16.0, float("inf")])
    assert not s.unscale([p]) and s.scale == 4.0 and s.skipped == 1
    p.grad = torch.tensor([8.0, 4.0])
    assert s.unscale([p]) and torch.equal(p.grad, torch.tensor([2.0, 1.0]))


def test_spearman():
    assert spearman([1, 2, 3, 4], [10, 20, 30, 40]) == pytest.approx(1.0)
    assert spearman([1, 2, 3, 4], [4, 3, 2, 1]) == pytest.approx(-1.0)


def test_compiled_plan_still_runs_after_the_memory_tracker(ctx):
    # Dynamo runs no compiled code under a dispatch mode it does not know to ignore, and marks
    # the frame to be skipped from then on: every step after the tracked one ran eagerly in fp32
    plan = _plan(ctx, "none", "bf16")
    torch._dynamo.reset()
    model = build(SPEC, 0)
    compiled = torch.compile(model, backend=coplan.backend(plan, SPEC))
    idx, tgt = batches(SPEC, B, S, 1, 0)[0]
    planned = compiled(idx, tgt).item()
    assert planned != model(idx, tgt).item()  # bf16 and fp32 differ
    with LiveBytes() as live:
        tracked = compiled(idx, tgt)
        tracked.backward()
    assert tracked.item() == planned and live.peak_bytes > 0
    assert compiled(idx, tgt).item() == planned


def test_saved_peak_counts_what_backward_still_needs():
    w = torch.nn.Parameter(torch.randn(16, 16))
    x = torch.randn(8, 16)
    with SavedPeak(exclude=(w, x)) as sp:
        a = torch.tanh(x @ w)  # saves its output (512 bytes)
        b = torch.tanh(a @ w)  # saves a (a tanh output already counted) and its own output
        b.sum().backward()  # frees both graphs' saved tensors
        c = torch.tanh(x @ w)  # a later microbatch: the earlier ones no longer count
        held = sp.hold(torch.ones(4))  # kept outside autograd (a pipeline stage's output)
        del held
    assert sp.peak_bytes() == 2 * 8 * 16 * 4
    assert sum(delta for _, delta in sp.events) == 8 * 16 * 4  # c's output is still saved
    del c


def test_saved_bytes_measures_eager_autograd():
    x = torch.randn(8, 16, requires_grad=True)
    w = torch.nn.Parameter(torch.randn(16, 16))
    with SavedBytes() as sb:
        y = torch.tanh(x @ w)
    del y
    # matmul saves x (a leaf: excluded) and w (a parameter: excluded); tanh saves its output
    assert sb.activation_bytes() == 8 * 16 * 4


# --- the CLI --------------------------------------------------------------------------------------


def _cli(capsys, *args):
    with pytest.raises(SystemExit) as exc:
        main(["run", *args])
    out = capsys.readouterr()
    return exc.value.code, out.out, out.err


@pytest.fixture(scope="module")
def plan_file(tmp_path_factory, ctx) -> Path:
    path = tmp_path_factory.mktemp("plans") / "plan.json"
    plan = _plan(ctx, "selective").with_(parallel=ParallelPlan(microbatch=2))
    path.write_text(plan.to_json())
    return path


def test_run_json_contract(capsys, plan_file):
    code, out, err = _cli(capsys, "--model", "gpt-tiny", "--plan", str(plan_file), "--steps", "3", "--json")
    assert code == 0, err
    data = json.loads(out)
    assert {"measured", "predicted", "loss", "grad_check", "fusion"} <= set(data)
    keys = {"step_time_s", "saved_activation_bytes", "peak_bytes"}
    assert set(data["measured"]) == keys and set(data["predicted"]) == keys
    assert set(data["grad_check"]) == {"max_rel_err", "tolerance", "ok"}
    assert set(data["fusion"]) == {"groups_planned", "groups_honoured", "not_honoured"}
    missed = data["fusion"]["not_honoured"]
    assert len(missed) == data["fusion"]["groups_planned"] - data["fusion"]["groups_honoured"]
    assert all(m["ops"] and m["reason"] for m in missed)
    # what the compiler split is priced apart: the plan without those groups
    ran = data.get("predicted_as_run")
    assert (ran is not None) == bool(missed), missed
    if ran is not None:
        assert ran["groups"] < ran["groups_planned"] and ran["step_time_s"] > 0
    assert len(data["loss"]) == 3 and all(v > 0 for v in data["loss"])
    assert data["grad_check"]["ok"] and data["grad_check"]["tolerance"] == 1e-4
    m, p = data["measured"], data["predicted"]
    assert abs(m["saved_activation_bytes"] / p["saved_activation_bytes"] - 1) <= 0.05
    assert m["step_time_s"] > 0 and m["peak_bytes"] > m["saved_activation_bytes"]
    if platform.libc_ver()[0] == "glibc":  # the run says how it held the host allocator
        assert any(n.startswith("host allocator pinned") for n in data["run"]["notes"])


@pytest.mark.parametrize(
    ("args", "needle"),
    [
        (["--model", "llama-tiny"], "plan is for model 'gpt-tiny'"),
        (["--model", "gpt-tiny", "--nproc", "2"], "world size of 1"),
        (["--model", "gpt-tiny", "--batch", "8"], "global batch 4"),
        (["--model", "gpt-tiny", "--steps", "0"], "--steps"),
        (["--model", "gpt-tiny", "--host-allocator", "jemalloc"], "--host-allocator"),
    ],
)
def test_run_refuses_plans_for_another_job(capsys, plan_file, args, needle):
    code, out, err = _cli(capsys, "--plan", str(plan_file), *args)
    assert code == 2
    assert out == "" and err.count("\n") == 1 and needle in err and "Traceback" not in err


def test_run_refuses_pipeline_plans_with_data_parallelism(capsys, tmp_path, ctx):
    plan = ctx.default_plan().with_(gpus=4, parallel=ParallelPlan(pp=2, dp=2, microbatch=1))
    path = tmp_path / "pp.json"
    path.write_text(plan.to_json())
    code, _, err = _cli(capsys, "--model", "gpt-tiny", "--plan", str(path), "--nproc", "4")
    assert code == 2 and "pipeline parallelism with tp=1, dp=2" in err and err.count("\n") == 1


def test_why_a_planned_group_was_not_honoured():
    from coplan.apply.fusion import why_not_honoured

    group = ("ln", "gelu")
    refused = [(frozenset({"ln"}), frozenset({"gelu"}), "intermediate nodes between node1 & node2")]
    assert why_not_honoured(group, refused, []) == "Inductor: intermediate nodes between node1 & node2"
    # a refusal involving ops outside the group is not this group's reason
    other = [(frozenset({"ln", "mm"}), frozenset({"gelu"}), "no shared data")]
    assert why_not_honoured(group, other, []).startswith("Inductor kept")
    gemm = ("fc", "gelu")
    assert "library call" in why_not_honoured(gemm, [], [frozenset({"fc"})])


def test_reference_chunk_bounds_tokens_on_a_gpu() -> None:
    from coplan.apply.step import REFERENCE_TOKENS, reference_chunk

    gpu, cpu = torch.device("cuda"), torch.device("cpu")
    assert reference_chunk(64, 1024, gpu) == REFERENCE_TOKENS // 1024
    assert reference_chunk(8, 2048, gpu) * 2048 <= REFERENCE_TOKENS
    assert reference_chunk(1, 1024, gpu) == 1  # never more than the microbatch
    assert reference_chunk(4, 4 * REFERENCE_TOKENS, gpu) == 1  # a sequence longer than the bound
    assert reference_chunk(64, 1024, cpu) == 64


def test_the_optimizer_is_priced_as_the_runner_runs_it() -> None:
    from coplan.apply.predict import run_cluster
    from coplan.apply.run import runner_optimizer
    from coplan.apply.step import adamw_form
    from coplan.search.space import fusion_option

    ctx = make_context(PRESETS["gpt-tiny"], run_cluster(load_cluster("dgx-h100"), 1, "cuda"), 8, 64, "cuda")
    plain = plan_for(ctx, compute="bf16")  # eager kernels: no optimizer groups
    grouped = plain.with_(fusion=fusion_option(ctx, "greedy"))  # a group per block's updates
    assert (runner_optimizer(plain, ctx, "plan", "cuda"), adamw_form("plan", False)) == (
        "for-loop",
        {"foreach": False},
    )
    assert (runner_optimizer(grouped, ctx, "plan", "cuda"), adamw_form("plan", True)) == ("", {"fused": True})
    # a baseline gets PyTorch's default construction: the multi-tensor form on a GPU
    assert (runner_optimizer(plain, ctx, "compile", "cuda"), adamw_form("compile", False)) == ("foreach", {})
    assert runner_optimizer(plain, ctx, "eager", "cpu") == ""
    # a pipeline stage runs the loop whatever the plan groups (``pipeline.py``)
    two = make_context(PRESETS["gpt-tiny"], run_cluster(load_cluster("dgx-h100"), 2, "cuda"), 8, 64, "cuda")
    staged = plan_for(two, compute="bf16", pp=2)
    staged = staged.with_(fusion=fusion_option(two, "greedy"))
    assert runner_optimizer(staged, two, "plan", "cuda") == "for-loop"


def test_a_recorded_run_is_priced_with_the_adamw_it_built() -> None:
    from coplan.apply.predict import run_cluster
    from coplan.apply.run import RunRequest, priced_request

    cluster = load_cluster("dgx-h100")
    ctx = make_context(PRESETS["gpt-tiny"], run_cluster(cluster, 1, "cuda"), 8, 64, "cuda")
    req = RunRequest(
        plan=plan_for(ctx, compute="bf16"), spec=PRESETS["gpt-tiny"], steps=1, nproc=1,
        global_batch=8, seq=64, cluster=cluster, device="cuda", mode="eager",
    )  # fmt: skip
    own_ctx, _, own, _ = priced_request(req)
    loop_ctx, _, loop, _ = priced_request(req, optimizer="for-loop")
    assert (own_ctx.stack.optimizer, loop_ctx.stack.optimizer) == ("foreach", "for-loop")
    # the loop issues eight ops per parameter from the host: a tiny model's step pays for it
    assert loop.step_time_s > own.step_time_s


def test_a_plan_as_run_leaves_out_the_groups_the_compiler_split() -> None:
    from coplan.apply.fusion import as_run, expand_groups_from
    from coplan.search.space import fusion_option

    ctx = make_context(PRESETS["gpt-tiny"], load_cluster("cpu"), 8, 64, "cpu")
    plan = plan_for(ctx, compute="fp32").with_(fusion=fusion_option(ctx, "greedy"))
    expanded = expand_groups_from(plan, ctx.index.graph)
    # a block group appears once per block, each copy naming its own block's ops
    blocks = PRESETS["gpt-tiny"].n_layers
    first = next(j for _, j in expanded if sum(1 for _, o in expanded if o == j) == blocks)
    copies = [i for i, (_, j) in enumerate(expanded) if j == first]
    split = copies[-1]  # honoured in every block but the last
    record = {
        "groups_planned": len(expanded),
        "honoured": [i for i in range(len(expanded)) if i != split],
        "not_honoured": [split],
        "why_not": {str(split): {"ops": list(expanded[split][0]), "reason": "Inductor: test"}},
    }
    ran = as_run(plan, ctx.index.graph, [record])
    assert ran is not None
    assert len(ran.fusion.groups) == len(plan.fusion.groups) - 1
    assert plan.fusion.groups[first] not in ran.fusion.groups
    assert as_run(plan, ctx.index.graph, [{**record, "not_honoured": [], "why_not": {}}]) is plan
    # a record of another graph's numbering is not this plan's: no price rather than a wrong one
    other = {**record, "why_not": {str(split): {"ops": ["not", "these"], "reason": ""}}}
    assert as_run(plan, ctx.index.graph, [other]) is None


def test_a_run_prices_the_plan_as_the_compiler_ran_it() -> None:
    """Llama-tiny's greedy groups on a CPU: Inductor keeps one apart (torch 2.13: 'no shared
    data'); the report prices the plan without it beside the plan as made."""
    from coplan.apply.run import RunRequest, run_plan
    from coplan.search.space import fusion_option

    spec, cluster = PRESETS["llama-tiny"], load_cluster("cpu")
    ctx = make_context(spec, cluster, 8, 64, "cpu")
    plan = plan_for(ctx, compute="fp32").with_(fusion=fusion_option(ctx, "greedy"))
    out = run_plan(
        RunRequest(
            plan=plan, spec=spec, steps=2, nproc=1, global_batch=8, seq=64, cluster=cluster, device="cpu"
        )
    )
    f, ran = out["fusion"], out.get("predicted_as_run")
    assert (ran is not None) == (f["groups_honoured"] < f["groups_planned"])
    if ran is not None:
        assert ran["groups_planned"] == len(plan.fusion.groups) > ran["groups"]
        assert set(ran) >= set(out["predicted"])


def test_saved_bytes_by_shape_groups_what_autograd_kept():
    """``SavedBytes.by_shape``: each saved storage once, under the shape and dtype it was first
    saved as, largest total first; parameters and excluded storages left out, as in the total."""
    from coplan.apply.measure import SavedBytes

    x = torch.randn(64, 32, requires_grad=True)
    w = torch.randn(32, 16, requires_grad=True)
    batch = torch.randn(8, 16)
    with SavedBytes(exclude=(batch,)) as sb:
        h = (x * 2.0).relu()
        loss = ((h @ w).sin() * batch.sum()).sum() + (h @ w).cos().sum()
    rows = sb.by_shape()
    assert sum(r["bytes"] for r in rows) == sb.activation_bytes()
    assert rows[0]["shape"] == [64, 32] and rows[0]["dtype"] == "float32"
    assert [r["bytes"] for r in rows] == sorted((r["bytes"] for r in rows), reverse=True)
    assert all(r["shape"] != [32, 16] for r in rows)  # the weight, a parameter
    assert loss.requires_grad
