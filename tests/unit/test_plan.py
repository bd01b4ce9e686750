"""Plans: the JSON round trip and fingerprint and the checker's rules (fusion legality, names,
numerics, identity, layout, memory); the passes are in ``test_passes.py``.

Ops are found by the tensors they produce (``h.0.mlp.gelu``), not by their numbered names, so the
tests follow the synthetic builder if it renumbers ops.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest
from hypothesis import example, given, settings
from hypothesis import strategies as st
from plan_contexts import TINY, make_ctx, messages, producer

from coplan.cost.fusion import source_op
from coplan.errors import CoplanError
from coplan.ir.types import OpKind, Phase
from coplan.models.spec import PRESETS, ModelSpec
from coplan.passes.remat import saved_names
from coplan.plan import (
    FusionPlan,
    Numerics,
    ParallelPlan,
    Plan,
    PlanError,
    PrecisionPlan,
    RematPlan,
    check,
    is_valid,
)
from coplan.plan.checker import group_problem
from coplan.plan.types import COMPUTE_DTYPES, OP_DTYPES

# Plan values and JSON -----------------------------------------------------------------------------

NAMES = tuple(f"h.0.op{i}" for i in range(12))


@st.composite
def plans(draw: st.DrawFn) -> Plan:
    names = draw(st.lists(st.sampled_from(NAMES), unique=True, max_size=9))
    sizes = draw(st.lists(st.integers(2, 3), max_size=3))
    groups, at = [], 0
    for n in sizes:
        if at + n > len(names):
            break
        groups.append(tuple(names[at : at + n]))
        at += n
    pp = draw(st.integers(1, 4))
    compute = draw(st.sampled_from(COMPUTE_DTYPES))
    name_sets = st.frozensets(st.sampled_from(NAMES), max_size=4)
    return Plan(
        model=draw(st.sampled_from(("gpt-tiny", "llama2-7b", "custom model"))),
        graph=draw(st.text("0123456789abcdef", min_size=16, max_size=16)),
        cluster=draw(st.sampled_from(("dgx-h100[8]", "dgx-a100-40gb[2]"))),
        gpus=draw(st.integers(1, 64)),
        global_batch=draw(st.integers(1, 512)),
        seq=draw(st.integers(1, 8192)),
        parallel=ParallelPlan(
            tp=draw(st.integers(1, 8)),
            pp=pp,
            dp=draw(st.integers(1, 8)),
            vpp=draw(st.integers(1, 4)),
            sequence_parallel=draw(st.booleans()),
            zero=draw(st.integers(0, 3)),
            microbatch=draw(st.integers(1, 16)),
            stage_layers=draw(st.none() | st.lists(st.integers(1, 8), min_size=pp, max_size=pp).map(tuple)),
        ),
        fusion=FusionPlan(
            groups=tuple(groups),
            recompute_in_backward=draw(name_sets),
            label=draw(st.sampled_from(("eager", "greedy", "joint"))),
        ),
        remat=RematPlan(
            recompute=draw(name_sets),
            per_stage=draw(st.none() | st.lists(name_sets, min_size=pp, max_size=pp).map(tuple)),
        ),
        precision=PrecisionPlan(
            compute=compute,
            ops=tuple(draw(st.dictionaries(st.sampled_from(NAMES), st.sampled_from(OP_DTYPES))).items()),
            master_weights=draw(st.booleans()),
            loss_scaling=compute == "fp16" or draw(st.booleans()),
            fp8_scaling=draw(st.sampled_from(("", "per-tensor"))),
        ),
        flash_attention=draw(st.booleans()),
    )


@settings(max_examples=60, deadline=None)
@given(plans())
def test_plan_json_round_trip(plan):
    d = plan.to_dict()
    assert d["fingerprint"] == plan.fingerprint
    assert Plan.from_dict(d) == plan
    back = Plan.from_dict(json.loads(plan.to_json()))
    assert back == plan
    assert back.fingerprint == plan.fingerprint
    assert back.to_json() == plan.to_json()


@settings(max_examples=40, deadline=None)
@given(plans(), st.randoms(use_true_random=False))
def test_fingerprint_ignores_the_order_decisions_are_written_in(plan, rnd):
    groups = [list(g) for g in plan.fusion.groups]
    for g in groups:
        rnd.shuffle(g)
    rnd.shuffle(groups)
    ops = list(plan.precision.ops)
    rnd.shuffle(ops)
    same = plan.with_(
        fusion=dataclasses.replace(plan.fusion, groups=tuple(tuple(g) for g in groups)),
        precision=dataclasses.replace(plan.precision, ops=tuple(ops)),
    )
    assert same == plan
    assert same.fingerprint == plan.fingerprint


BASE = Plan(model="gpt-tiny", graph="0123456789abcdef", cluster="dgx-h100[2]", gpus=2, global_batch=8, seq=64)


@pytest.mark.parametrize(
    "changed",
    [
        BASE.with_(parallel=ParallelPlan(microbatch=2)),
        BASE.with_(parallel=ParallelPlan(zero=1)),
        BASE.with_(parallel=ParallelPlan(tp=2)),
        BASE.with_(parallel=ParallelPlan(pp=2, stage_layers=(1, 1))),
        BASE.with_(fusion=FusionPlan(groups=(("a", "b"),))),
        BASE.with_(fusion=FusionPlan(recompute_in_backward=frozenset({"a"}))),
        BASE.with_(remat=RematPlan(recompute=frozenset({"h.0.mlp.gelu"}))),
        BASE.with_(remat=RematPlan(per_stage=(frozenset(),))),
        BASE.with_(precision=PrecisionPlan(compute="bf16")),
        BASE.with_(precision=PrecisionPlan(ops=(("a", "bf16"),))),
        BASE.with_(precision=PrecisionPlan(master_weights=False)),
        BASE.with_(flash_attention=False),
        BASE.with_(global_batch=16),
        BASE.with_(seq=128),
        BASE.with_(gpus=4),
        BASE.with_(model="llama-tiny"),
        BASE.with_(graph="fedcba9876543210"),
    ],
)
def test_fingerprint_changes_with_any_decision(changed):
    assert changed.fingerprint != BASE.fingerprint


def test_fingerprint_ignores_where_a_plan_came_from():
    # the label says which strategy produced the groups; two strategies reaching the same plan
    # report the same fingerprint
    assert BASE.with_(fusion=FusionPlan(label="joint")).fingerprint == BASE.fingerprint


def test_hand_edited_plan_with_stale_fingerprint_is_refused():
    d = BASE.to_dict()
    d["parallel"]["microbatch"] = 4
    with pytest.raises(PlanError) as e:
        Plan.from_dict(d, source="plan.json")
    assert e.value.field == "fingerprint"
    assert "edited by hand" in str(e.value)
    assert str(e.value).startswith("plan.json: field 'fingerprint'")
    # without a stated fingerprint the edit is taken as is
    del d["fingerprint"]
    assert Plan.from_dict(d).parallel.microbatch == 4


@pytest.mark.parametrize("missing", ["model", "gpus", "global_batch", "seq"])
def test_missing_field_is_named(missing):
    d = BASE.to_dict()
    del d[missing]
    del d["fingerprint"]
    with pytest.raises(PlanError) as e:
        Plan.from_dict(d, source="p.json")
    assert e.value.field == missing
    assert f"field '{missing}'" in str(e.value)


@pytest.mark.parametrize(
    ("edit", "field"),
    [
        (lambda d: d["parallel"].update(tp=0), "parallel.tp"),
        (lambda d: d["parallel"].update(zero=4), "parallel.zero"),
        (lambda d: d.update(gpus="2"), "gpus"),
        (lambda d: d["precision"].update(compute="fp4"), "precision.compute"),
        (lambda d: d["precision"].update(compute="fp16", loss_scaling=False), "precision.loss_scaling"),
        (lambda d: d["fusion"].update(groups=[["a"]]), "fusion.groups"),
        (lambda d: d["fusion"].update(groups=[["a", "b"], ["b", "c"]]), "fusion.groups"),
        (lambda d: d.update(version=99), "version"),
    ],
)
def test_bad_field_is_named(edit, field):
    d = BASE.to_dict()
    del d["fingerprint"]
    edit(d)
    with pytest.raises(PlanError) as e:
        Plan.from_dict(d, source="p.json")
    assert e.value.field == field
    assert str(e.value).startswith(f"p.json: field '{field}'")


JSON = st.recursive(
    st.none() | st.booleans() | st.integers(-3, 3) | st.floats(allow_nan=False) | st.text(max_size=3),
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=3), inner, max_size=3),
    max_leaves=6,
)
_D = BASE.to_dict()
FIELDS = [(k,) for k in _D if k != "fingerprint"] + [
    (k, j) for k in _D if isinstance(_D[k], dict) for j in _D[k]
]


@settings(max_examples=300, deadline=None)
@given(st.sampled_from(FIELDS), JSON)
@example(where=("parallel",), value={"\n": None})  # an unknown key quoted in the error broke the line
@example(where=("parallel", "stage_layers"), value=[float("inf")])  # int() raised OverflowError
def test_any_hand_edit_is_a_plan_or_a_plan_error(where, value):
    # a plan file is user input: whatever a field is edited to, loading gives a plan or a one-line
    # PlanError, never another exception
    d = BASE.to_dict()
    del d["fingerprint"]
    if len(where) == 1:
        d[where[0]] = value
    else:
        d[where[0]][where[1]] = value
    try:
        Plan.from_dict(d, source="p.json")
    except PlanError as e:
        assert str(e).startswith("p.json")
        assert "\n" not in str(e)


@pytest.mark.parametrize(
    ("edit", "field"),
    [
        # quoted booleans would read as true; bare strings as sets of characters
        (lambda d: d.update(flash_attention="false"), "flash_attention"),
        (lambda d: d["precision"].update(master_weights="no"), "precision.master_weights"),
        (lambda d: d["parallel"].update(sequence_parallel="false"), "parallel.sequence_parallel"),
        (lambda d: d["remat"].update(recompute="h.0.mlp.gelu"), "remat.recompute"),
        (lambda d: d["fusion"].update(groups=["ab"]), "fusion.groups"),
        (lambda d: d.update(parallel=[1, 2]), "parallel"),
        (lambda d: d["precision"].update(ops=[["a", "bf16"]]), "precision.ops"),
    ],
)
def test_wrongly_typed_field_is_named(edit, field):
    d = BASE.to_dict()
    del d["fingerprint"]
    edit(d)
    with pytest.raises(PlanError) as e:
        Plan.from_dict(d, source="p.json")
    assert e.value.field == field


def test_plan_is_a_json_object():
    with pytest.raises(PlanError, match="expected a JSON object"):
        Plan.from_dict([1, 2], source="p.json")  # type: ignore[arg-type]


def test_plan_file_round_trip_and_one_line_errors(tmp_path: Path):
    good = tmp_path / "plan.json"
    good.write_text(BASE.to_json())
    assert Plan.load(str(good)) == BASE

    missing = tmp_path / "nope.json"
    with pytest.raises(PlanError) as e:
        Plan.load(str(missing))
    assert str(missing) in str(e.value)
    assert "no such file" in str(e.value)
    assert "\n" not in str(e.value)
    assert isinstance(e.value, CoplanError)
    assert e.value.exit_code == 2

    bad = tmp_path / "bad.json"
    bad.write_text('{"model": "gpt-tiny",\n  oops}')
    with pytest.raises(PlanError) as e:
        Plan.load(str(bad))
    assert str(bad) in str(e.value)
    assert "not valid JSON (line 2" in str(e.value)
    assert "\n" not in str(e.value)

    stale = tmp_path / "stale.json"
    d = BASE.to_dict()
    d["seq"] = 32
    stale.write_text(json.dumps(d))
    with pytest.raises(PlanError, match="edited by hand") as e:
        Plan.load(str(stale))
    assert str(e.value).startswith(f"{stale}: field 'fingerprint'")


# The checker --------------------------------------------------------------------------------------


@pytest.mark.parametrize("model", TINY)
def test_default_plan_is_valid_and_fits(model):
    ctx = make_ctx(model)
    plan = ctx.default_plan()
    assert check(plan, ctx) == []
    assert is_valid(plan, ctx)
    assert plan.graph == ctx.graph_fingerprint


@pytest.mark.parametrize(
    ("group", "why"),
    [
        # the QKV and MLP-in GEMMs with the attention between them
        (("h.0.attn.c_attn.out", "h.0.attn.c_proj.out"), "holds 2 library kernels"),
        (("h.0.mlp.c_fc.out", "h.0.mlp.gelu", "h.0.mlp.c_proj.out"), "holds 2 library kernels"),
        (("h.0.mlp.gelu", "bwd:h.0.mlp.c_fc.out.grad"), "mixes phases backward, forward"),
        # the attention residual add and the GELU read nothing in common
        (("h.0.attn_residual", "h.0.mlp.gelu"), "share no data"),
        # a layer norm feeding a GEMM: no GEMM prologue or epilogue holds a row reduction
        (("h.0.ln_2.out", "h.0.mlp.c_fc.out"), "GEMM epilogues and prologues hold pointwise ops only"),
        # the final norm (outside the blocks) with the first block's norm
        (("ln_f.out", "h.0.ln_1.out"), "spans blocks"),
    ],
)
def test_illegal_fusion_group_is_refused(gpt, group, why):
    ops = tuple(
        producer(gpt, t[4:], Phase.BACKWARD) if t.startswith("bwd:") else producer(gpt, t) for t in group
    )
    plan = gpt.default_plan().with_(fusion=FusionPlan(groups=(ops,)))
    found = messages(plan, gpt, "fusion")
    assert any(why in m for m in found), found
    assert not is_valid(plan, gpt)
    ids = tuple(gpt.index.op_by_name[n].id for n in ops)
    assert group_problem(gpt.index.graph, ids) is not None


def test_reduction_in_prologue_names_the_norm_and_the_gemm(gpt):
    norm, gemm = producer(gpt, "h.0.ln_2.out"), producer(gpt, "h.0.mlp.c_fc.out")
    plan = gpt.default_plan().with_(fusion=FusionPlan(groups=((norm, gemm),)))
    assert messages(plan, gpt, "fusion") == [
        f"group [{', '.join(sorted((norm, gemm)))}] {norm} (norm, a row reduction) in the kernel of GEMM "
        f"{gemm}: GEMM epilogues and prologues hold pointwise ops only"
    ]


def test_log_softmax_over_the_vocabulary_is_no_gemm_epilogue(gpt):
    # the IR calls log-softmax and its gradient elementwise, yet each reduces a whole row of the
    # vocabulary: no GEMM epilogue holds it, forward (the LM head's output) or backward (the
    # input gradient's GEMM reads the log-softmax gradient)
    graph = gpt.index.graph
    ops = {op.target.removeprefix("aten."): op for op in graph.ops if op.block is None}
    fwd = ops["log_softmax"]
    head = graph.ops[source_op(graph, fwd.inputs[0])]
    bwd = ops["log_softmax_bwd"]
    readers = [graph.ops[c] for o in bwd.outputs for c in graph.tensors[o].consumers]
    grad_gemm = next(op for op in readers if op.kind is OpKind.MATMUL)
    assert head.kind is OpKind.MATMUL and fwd.kind is OpKind.ELEMENTWISE
    for row, gemm in ((fwd, head), (bwd, grad_gemm)):
        plan = gpt.default_plan().with_(fusion=FusionPlan(groups=((row.name, gemm.name),)))
        found = messages(plan, gpt, "fusion")
        assert any(f"{row.name} (elementwise, a row reduction) in the kernel of GEMM" in m for m in found)


def test_only_groups_an_executor_emits_pass(gpt):
    # attention is a library kernel that takes no other op (FlashAttention, cuDNN, Inductor's SDPA
    # fallback): not even the RoPE that produces its query and key; a GEMM's epilogue holds
    # pointwise ops (cuBLASLt, Inductor's GEMM templates) but no reduction, e.g. the norm that
    # reads the projection's output through the residual add
    llama = make_ctx("llama-tiny")
    g = llama.index.graph
    attn = next(
        op for op in g.ops if op.kind is OpKind.ATTENTION and op.block == 0 and op.phase is Phase.FORWARD
    )
    rope = next(
        g.ops[i]
        for t in attn.inputs
        if (i := source_op(g, t)) is not None and g.ops[i].kind is OpKind.ELEMENTWISE
    )
    plan = llama.default_plan().with_(fusion=FusionPlan(groups=((rope.name, attn.name),)))
    assert messages(plan, llama, "fusion") == [
        f"group [{', '.join(sorted((rope.name, attn.name)))}] {rope.name} (elementwise) fused into attention "
        f"{attn.name}: it takes no other ops"
    ]
    proj = producer(gpt, "h.0.attn.c_proj.out")
    res, ln = producer(gpt, "h.0.attn_residual"), producer(gpt, "h.0.ln_2.out")
    plan = gpt.default_plan().with_(fusion=FusionPlan(groups=((proj, res, ln),)))
    assert any("pointwise ops only" in m for m in messages(plan, gpt, "fusion"))
    plan = gpt.default_plan().with_(fusion=FusionPlan(groups=((proj, res),)))
    assert messages(plan, gpt, "fusion") == []


def test_legal_epilogue_group_passes(gpt):
    # the contrast to the refusals above: pointwise work after a GEMM is one kernel
    gemm, gelu = producer(gpt, "h.0.mlp.c_fc.out"), producer(gpt, "h.0.mlp.gelu")
    plan = gpt.default_plan().with_(fusion=FusionPlan(groups=((gemm, gelu),)))
    assert check(plan, gpt) == []


def test_cycle_between_kernels_is_refused(gpt):
    # the two residual adds are connected (the first feeds the second) and each is pointwise, so
    # the group itself is legal; but the second needs the MLP, which needs the first's output
    a, b = producer(gpt, "h.0.attn_residual"), producer(gpt, "h.0.mlp_residual")
    ids = (gpt.index.op_by_name[a].id, gpt.index.op_by_name[b].id)
    assert group_problem(gpt.index.graph, ids) is None
    plan = gpt.default_plan().with_(fusion=FusionPlan(groups=((a, b),)))
    assert any("form a cycle" in m for m in messages(plan, gpt, "fusion"))


def test_unknown_names_are_refused_without_crashing(gpt):
    base = gpt.default_plan()
    gelu = producer(gpt, "h.0.mlp.gelu")
    plan = base.with_(fusion=FusionPlan(groups=(("no_such_op", gelu),)))
    assert messages(plan, gpt, "fusion") == ["fusion names unknown ops: no_such_op"]
    assert messages(plan, gpt, "parallel") == []  # the layout rule does not trip over the groups
    with pytest.raises(PlanError, match="unknown op 'no_such_op'"):
        gpt.price(plan)

    plan = base.with_(remat=RematPlan(recompute=frozenset({"h.0.no_such_tensor"})))
    assert messages(plan, gpt, "remat") == [
        "remat names tensors that are not saved for backward: h.0.no_such_tensor"
    ]
    # a real tensor that is not saved for backward (the GEMM output the residual add consumes)
    plan = base.with_(remat=RematPlan(recompute=frozenset({"h.0.attn.c_proj.out"})))
    assert messages(plan, gpt, "remat")

    plan = base.with_(precision=PrecisionPlan(ops=(("no_such_op", "fp32"),)))
    assert messages(plan, gpt, "precision") == ["precision.ops names unknown op 'no_such_op'"]

    plan = base.with_(fusion=FusionPlan(recompute_in_backward=frozenset({"no_such_op"})))
    assert messages(plan, gpt, "fusion") == ["fusion.recompute_in_backward names unknown op 'no_such_op'"]


def test_fp8_needs_fp8_units():
    a100 = make_ctx(cluster="dgx-a100-40gb")
    plan = a100.default_plan().with_(precision=PrecisionPlan(compute="fp8"))
    assert any("fp8 is not supported" in m for m in messages(plan, a100, "precision"))
    gemm = producer(a100, "h.0.attn.c_attn.out")
    plan = a100.default_plan().with_(precision=PrecisionPlan(compute="bf16", ops=((gemm, "fp8"),)))
    assert any("no fp8 units" in m for m in messages(plan, a100, "precision"))

    h100 = make_ctx(cluster="dgx-h100")
    plan = h100.default_plan().with_(precision=PrecisionPlan(compute="fp8"))
    assert check(plan, h100) == []
    # fp8 is for GEMMs only, even where the device has it
    norm = producer(h100, "h.0.ln_1.out")
    plan = h100.default_plan().with_(precision=PrecisionPlan(compute="bf16", ops=((norm, "fp8"),)))
    assert any("cannot run in fp8 (GEMMs only)" in m for m in messages(plan, h100, "precision"))


def test_sensitive_op_needs_a_stated_tolerance():
    strict = make_ctx()
    norm = producer(strict, "h.0.ln_1.out")
    plan = strict.default_plan().with_(precision=PrecisionPlan(compute="bf16", ops=((norm, "bf16"),)))
    found = messages(plan, strict, "precision")
    assert len(found) == 1
    assert f"{norm} (norm) is numerically sensitive" in found[0]

    loose = make_ctx(numerics=Numerics(tolerance=0.01))
    assert messages(plan, loose, "precision") == []
    # keeping it in fp32 never needs a tolerance
    plan = strict.default_plan().with_(precision=PrecisionPlan(compute="bf16", ops=((norm, "fp32"),)))
    assert messages(plan, strict, "precision") == []


def test_an_fp32_op_widens_its_outputs_and_costs_a_cast_unless_fused():
    ctx = make_ctx(gpus=1)
    spec = PRESETS["gpt-tiny"]
    norm = producer(ctx, "h.0.ln_2.out")
    base = ctx.default_plan().with_(precision=PrecisionPlan(compute="bf16"))
    wide = base.with_(precision=PrecisionPlan(compute="bf16", ops=((norm, "fp32"),)))
    assert check(wide, ctx) == []
    e0, e1 = ctx.price(base), ctx.price(wide)
    # the GEMM reading the normalised values keeps the 16-bit copy it was cast to (as autocast's
    # linear does), so only the norm's statistics, kept by its own backward, widen to 4 bytes
    g = ctx.index.graph
    outs = [g.tensors[t] for t in ctx.index.op_by_name[norm].outputs]
    assert "h.0.ln_2.out" in {t.name for t in outs}
    widened = sum(t.numel * 2 for t in outs if t.saved_for_backward and t.name != "h.0.ln_2.out")
    assert widened > 0
    assert e1.memory.activations_bytes - e0.memory.activations_bytes == pytest.approx(spec.n_layers * widened)
    # the GEMM reading it is a library kernel: eager needs a cast kernel per block and microbatch
    m = ctx.config_of(base).num_microbatches
    extra = e1.kernels_per_step - e0.kernels_per_step
    assert extra >= m * spec.n_layers and extra % (m * spec.n_layers) == 0
    assert e1.step_time_s > e0.step_time_s
    # fused with the residual add feeding it, the norm is generated code: its forward cast becomes
    # an extra write in its epilogue, not a kernel
    groups = FusionPlan(groups=((producer(ctx, "h.0.attn_residual"), norm),), label="test")
    assert check(wide.with_(fusion=groups), ctx) == []
    f0, f1 = ctx.price(base.with_(fusion=groups)), ctx.price(wide.with_(fusion=groups))
    assert f1.kernels_per_step - f0.kernels_per_step == extra - m * spec.n_layers


def test_a_16bit_loss_halves_the_logits_it_keeps():
    ctx = make_ctx(gpus=1, numerics=Numerics(tolerance=0.01))
    loss_ops = [op.name for op in ctx.index.outside if op.kind is OpKind.LOSS and op.phase is Phase.FORWARD]
    soft = [op.name for op in ctx.index.outside if op.phase is Phase.FORWARD and op.target == "log_softmax"]
    assert loss_ops and soft
    base = ctx.default_plan().with_(precision=PrecisionPlan(compute="bf16"))
    low = base.with_(precision=PrecisionPlan(compute="bf16", ops=tuple((n, "bf16") for n in soft + loss_ops)))
    assert check(low, ctx) == []
    assert ctx.price(low).memory.peak_bytes < ctx.price(base).memory.peak_bytes
    # without the tolerance the checker keeps the loss in fp32
    strict = make_ctx(gpus=1)
    assert any("numerically sensitive" in str(v) for v in check(low, strict))


def test_per_stage_remat_is_priced_per_stage():
    ctx = make_ctx(gpus=2)
    names = frozenset(saved_names(ctx))
    layout = ParallelPlan(pp=2, microbatch=1)
    base = ctx.default_plan().with_(parallel=layout)
    every = ctx.price(base.with_(remat=RematPlan(recompute=names)))
    first = ctx.price(base.with_(remat=RematPlan(per_stage=(names, frozenset()))))
    none = ctx.price(base)
    # stage 0 recomputes as in ``every``, stage 1 as in ``none``
    assert first.stages[0].recompute_s == pytest.approx(every.stages[0].recompute_s)
    assert first.stages[1].recompute_s == 0.0
    assert first.stages[0].memory.activations_bytes == pytest.approx(every.stages[0].memory.activations_bytes)
    assert first.stages[1].memory.activations_bytes == pytest.approx(none.stages[1].memory.activations_bytes)


def test_recompute_inside_the_backward_kernel_costs_arithmetic_only():
    ctx = make_ctx(gpus=1)
    gelu = producer(ctx, "h.0.mlp.gelu")
    base = ctx.default_plan().with_(remat=RematPlan(recompute=frozenset({"h.0.mlp.gelu"})))
    inside = base.with_(fusion=FusionPlan(recompute_in_backward=frozenset({gelu})))
    assert check(inside, ctx) == []
    e0, e1 = ctx.price(base), ctx.price(inside)
    assert 0.0 < e1.breakdown_s["recompute"] < e0.breakdown_s["recompute"]
    assert e1.kernels_per_step == e0.kernels_per_step  # recomputation launches nothing extra here
    assert e1.memory.activations_bytes == e0.memory.activations_bytes  # still not kept
    assert e1.memory.peak_bytes <= e0.memory.peak_bytes  # and never materialised


def test_plan_for_another_job_is_refused(gpt):
    plan = gpt.default_plan()
    found = messages(plan.with_(model="llama-tiny"), gpt, "identity")
    assert found == ["plan is for model 'llama-tiny', this job is 'gpt-tiny'"]
    assert messages(plan.with_(graph="0" * 16), gpt, "identity")
    assert messages(plan.with_(global_batch=16), gpt, "identity") == [
        "plan is for global batch 16 x seq 64, this job is 8 x 64"
    ]
    one = make_ctx(gpus=1)
    assert "plan is for 2 GPUs, this job has 1" in messages(plan, one, "identity")
    # the same model with another shape is another graph
    other = make_ctx(ModelSpec(**{**PRESETS["gpt-tiny"].to_dict(), "d_model": 128}))
    assert any("graph" in m for m in messages(plan, other, "identity"))


def test_layout_rules():
    ctx = make_ctx(gpus=8)
    heads = PRESETS["gpt-tiny"].n_heads
    plan = ctx.default_plan().with_(parallel=ParallelPlan(tp=8))
    found = messages(plan, ctx, "parallel")
    assert any(f"does not divide the model's {heads} attention heads" in m for m in found), found
    plan = ctx.default_plan().with_(parallel=ParallelPlan(tp=2, dp=3))
    assert any("does not equal the 8 GPUs" in m for m in messages(plan, ctx, "parallel"))
    plan = ctx.default_plan().with_(
        parallel=ParallelPlan(pp=2, dp=4), remat=RematPlan(per_stage=(frozenset(),))
    )
    assert "remat.per_stage has 1 sets for 2 pipeline stages" in messages(plan, ctx, "parallel")
    assert is_valid(ctx.default_plan().with_(parallel=ParallelPlan(tp=4, dp=2)), ctx)


def test_memory_is_its_own_level():
    ctx = make_ctx(budget_bytes=1024.0)
    plan = ctx.default_plan()
    found = check(plan, ctx)
    assert [(v.rule, v.level) for v in found] == [("memory", "memory")]
    assert "exceeds the budget" in found[0].message
    assert check(plan, ctx, memory=False) == []
    assert is_valid(plan, ctx)  # valid, but does not fit


def test_default_budget_leaves_the_stated_reserve():
    ctx = make_ctx(cluster="dgx-a100-40gb")
    cap = ctx.cluster.devices[0].memory_bytes
    assert ctx.budget == pytest.approx(cap * 0.95 - 2**30)


@pytest.mark.parametrize(
    ("cluster", "sp", "runner", "want"),
    [
        ("dgx-h100", True, False, True),  # Megatron-Core on Hopper with SP: TE userbuffers
        ("dgx-h100", False, False, False),  # no SP, no userbuffers overlap
        ("dgx-a100-80gb", True, False, False),  # Ampere recipes predate it
        ("dgx-h100", True, True, False),  # coplan's own runner has no userbuffers
    ],
)
def test_plans_price_tp_overlap_as_the_stack_that_runs_them(cluster, sp, runner, want):
    from coplan.cost import StackSpec

    ctx = make_ctx(cluster=cluster)
    if runner:
        ctx = dataclasses.replace(ctx, stack=StackSpec.runner("cuda"))
    plan = BASE.with_(cluster=f"{cluster}[2]", parallel=ParallelPlan(tp=2, sequence_parallel=sp))
    assert ctx.config_of(plan).tp_comm_overlap is want


@pytest.mark.parametrize(
    ("cluster", "runner", "want"),
    [
        ("dgx-h100", False, "auto"),  # Megatron-Core: TE picks cuDNN's kernel, the profile's own
        ("dgx-h100", True, "auto"),  # coplan's runner: SDPA runs cuDNN's kernel on Hopper, the profile's own
        ("dgx-a100-80gb", True, "auto"),  # FlashAttention-2 on an A100, its profile's own
        ("l4-node", True, "auto"),  # no FlashAttention-2 rates on an L4: its profile's kernel
    ],
)
def test_plans_price_the_attention_kernel_of_the_stack_that_runs_them(cluster, runner, want):
    from coplan.cost import StackSpec

    ctx = make_ctx(cluster=cluster)
    if runner:
        ctx = dataclasses.replace(ctx, stack=StackSpec.runner("cuda"))
    plan = BASE.with_(cluster=f"{cluster}[2]", parallel=ParallelPlan(dp=2))
    assert ctx.config_of(plan).attention_kernel == want
    ctx.price(plan)  # every choice prices


def test_gradient_reduction_and_fp8_weights_round_trip_and_keep_old_fingerprints() -> None:
    ctx = make_ctx()
    base = ctx.default_plan().with_(precision=PrecisionPlan(compute="fp8"))
    both = base.with_(precision=PrecisionPlan(compute="fp8", grad_reduce="bf16", fp8_params=True))
    again = Plan.from_dict(json.loads(json.dumps(both.to_dict())))
    assert again == both and again.fingerprint == both.fingerprint != base.fingerprint
    # the defaults are not written, so a plan saved before these keys existed hashes as it did
    assert (
        "grad_reduce" not in base.to_dict()["precision"] and "fp8_params" not in base.to_dict()["precision"]
    )
    cfg = ctx.config_of(both)
    assert not cfg.grad_reduce_fp32 and cfg.fp8_params
    assert ctx.price(both).memory.peak_bytes < ctx.price(base).memory.peak_bytes
    with pytest.raises(PlanError, match="grad_reduce"):
        PrecisionPlan(compute="fp32", grad_reduce="bf16")
    with pytest.raises(PlanError, match="fp8_params"):
        PrecisionPlan(compute="bf16", fp8_params=True)
