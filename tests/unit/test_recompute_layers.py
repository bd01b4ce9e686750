"""Full recomputation of only some blocks of each model chunk (``TrainingConfig.recompute_layers``:
Megatron-LM's ``--recompute-method block --recompute-num-layers N``), and the per-layer policies of
torchtitan and fms-fsdp counted by their own rules (``cost.checkpoint.checkpointed_blocks``)."""

from __future__ import annotations

import json
from dataclasses import replace

import pytest

from coplan.cost import CostModel, TrainingConfig
from coplan.cost.config import ConfigError
from coplan.hardware import load_cluster
from coplan.models.spec import PRESETS

# eight blocks: chunks of several blocks under pp 2 x vpp 2
LLAMA = replace(PRESETS["llama-tiny"], n_layers=8)
GPT = replace(PRESETS["gpt-tiny"], n_layers=8)


def _est(spec, gpus: int = 1, **kw):  # type: ignore[no-untyped-def]
    base = TrainingConfig(microbatch=2, global_batch=8 * kw.get("dp", 1), seq=64, **kw)
    return CostModel(spec=spec).estimate(load_cluster("dgx-h100", gpus), base)


@pytest.mark.parametrize("spec", [LLAMA, GPT], ids=["llama", "gpt"])
def test_every_block_of_each_chunk_is_full_recomputation(spec) -> None:  # type: ignore[no-untyped-def]
    for pp, vpp in ((1, 1), (2, 1), (2, 2)):
        layers = spec.n_layers // (pp * vpp)
        full = _est(spec, pp, pp=pp, vpp=vpp, recompute="full")
        same = _est(spec, pp, pp=pp, vpp=vpp, recompute="full", recompute_layers=layers)
        assert same.step_time_s == full.step_time_s
        assert same.memory.peak_bytes == full.memory.peak_bytes
        assert same.memory.activations_bytes == full.memory.activations_bytes
        # more than a chunk holds is every block of it
        more = _est(spec, pp, pp=pp, vpp=vpp, recompute="full", recompute_layers=layers + 3)
        assert more.memory.activations_bytes == full.memory.activations_bytes


@pytest.mark.parametrize("spec", [LLAMA, GPT], ids=["llama", "gpt"])
def test_saved_bytes_and_time_are_linear_in_the_recomputed_blocks(spec) -> None:  # type: ignore[no-untyped-def]
    """Each recomputed block trades its saved set for its input: the stored activations of N of L
    blocks recomputed lie exactly on the line from no recomputation to full (the boundary where
    the recomputed blocks end holds one block input that neither side counts, and the embedding
    output one that both count), and so does the step's time on one GPU."""
    n = spec.n_layers
    none = _est(spec, recompute="none")
    full = _est(spec, recompute="full")
    for k in range(1, n + 1):
        got = _est(spec, recompute="full", recompute_layers=k)
        share = k / n
        want = none.memory.activations_bytes + share * (
            full.memory.activations_bytes - none.memory.activations_bytes
        )
        assert got.memory.activations_bytes == pytest.approx(want, rel=1e-12)
        assert got.step_time_s == pytest.approx(
            none.step_time_s + share * (full.step_time_s - none.step_time_s), rel=1e-12
        )
        assert got.breakdown_s["recompute"] == pytest.approx(share * full.breakdown_s["recompute"], rel=1e-12)


def test_a_pipeline_stage_recomputes_its_first_blocks_per_chunk() -> None:
    spec = LLAMA
    none = _est(spec, 2, pp=2, vpp=2, recompute="none")
    full = _est(spec, 2, pp=2, vpp=2, recompute="full")
    one = _est(spec, 2, pp=2, vpp=2, recompute="full", recompute_layers=1)
    assert full.memory.activations_bytes < one.memory.activations_bytes < none.memory.activations_bytes
    assert none.breakdown_s["recompute"] == 0 < one.breakdown_s["recompute"] < full.breakdown_s["recompute"]


def test_refused_without_full_recomputation_or_a_positive_count() -> None:
    with pytest.raises(ConfigError, match=r"recompute_layers.*needs recompute 'full'"):
        TrainingConfig(recompute="selective", recompute_layers=2)
    with pytest.raises(ConfigError, match=r"recompute_layers.*positive"):
        TrainingConfig(recompute="full", recompute_layers=0)
    with pytest.raises(ConfigError, match=r"recompute_layers.*integer"):
        TrainingConfig(recompute="full", recompute_layers=True)  # type: ignore[arg-type]
    # one stage fully recomputing is enough: the count applies to the stages that do
    TrainingConfig(pp=2, recompute_per_stage=("full", "none"), recompute_layers=2)


def test_written_only_when_set() -> None:
    assert "recompute_layers" not in TrainingConfig(recompute="full").to_dict()
    assert TrainingConfig(recompute="full", recompute_layers=3).to_dict()["recompute_layers"] == 3


def test_estimate_flag(cli) -> None:  # type: ignore[no-untyped-def]
    args = ("estimate", "--model", "llama-tiny", "--cluster", "dgx-h100", "--gpus", "1", "--seq", "64")
    code, out, _ = cli(*args, "--recompute", "full", "--recompute-layers", "1", "--json")
    assert code == 0
    got = json.loads(out)
    assert got["config"]["recompute_layers"] == 1
    code, out, _ = cli(*args, "--recompute", "full", "--json")
    assert got["breakdown_s"]["recompute"] < json.loads(out)["breakdown_s"]["recompute"]
    code, _, err = cli(*args, "--recompute-layers", "1")
    assert code == 2
    assert err.strip().count("\n") == 0 and "recompute_layers" in err


# --- planning: the fewest blocks that fit, where the stack checkpoints only some ---------------------


def _ctx(stack: str, budget: float | None = None):  # type: ignore[no-untyped-def]
    from coplan.cost import load_stack
    from coplan.plan import PlanContext

    return PlanContext(
        CostModel(spec=LLAMA),
        load_cluster("dgx-h100", 1),
        global_batch=8,
        seq=64,
        stack=load_stack(stack),
        budget_bytes=budget,
    )


def _full(ctx):  # type: ignore[no-untyped-def]
    from coplan.plan.capabilities import policy_sets
    from coplan.plan.types import PrecisionPlan, RematPlan

    base = ctx.default_plan().with_(precision=PrecisionPlan(compute="bf16"))
    return base, base.with_(remat=RematPlan(recompute=policy_sets(ctx)["full"]))


@pytest.mark.parametrize("stack", ["megatron", "fsdp", "torchtitan"])
def test_full_recomputation_keeps_only_the_blocks_the_budget_needs(stack: str) -> None:
    from coplan.passes.remat import fewest_layers
    from coplan.plan import check

    loose = _ctx(stack)
    none, full = _full(loose)
    low, high = loose.price(full).memory.peak_bytes, loose.price(none).memory.peak_bytes
    ctx = _ctx(stack, budget=(low + high) / 2)
    _, full = _full(ctx)
    got = fewest_layers(full, ctx)
    k = got.remat.layers
    assert k is not None and 0 < k < LLAMA.n_layers
    assert k in ctx.stack.layer_counts(LLAMA.n_layers)
    est = ctx.price(got)
    assert ctx.fits(est) and est.step_time_s < ctx.price(full).step_time_s
    # the fewest that fit: the stack's next smaller count does not
    fewer = [n for n in ctx.stack.layer_counts(LLAMA.n_layers) if n < k]
    if fewer:
        from dataclasses import replace as _replace

        assert not ctx.fits(ctx.price(got.with_(remat=_replace(got.remat, layers=fewer[-1]))))
    assert [v.message for v in check(got, ctx, memory=False)] == []


def test_a_stack_without_per_layer_checkpointing_refuses_it() -> None:
    from dataclasses import replace as _replace

    from coplan.passes.remat import fewest_layers
    from coplan.plan import check

    ctx = _ctx("coplan", budget=1.0)
    _, full = _full(ctx)
    assert fewest_layers(full, ctx) is full
    some = full.with_(remat=_replace(full.remat, layers=2))
    msgs = [v.message for v in check(some, ctx, memory=False)]
    want = "stack 'coplan' cannot fully recompute only some blocks (its policies: none, selective, full)"
    assert want in msgs


def test_the_checker_refuses_counts_a_stack_cannot_give() -> None:
    from dataclasses import replace as _replace

    from coplan.plan import check
    from coplan.plan.types import RematPlan

    ctx = _ctx("torchtitan")
    base, full = _full(ctx)
    # every N-th of 8 blocks: 4, 2, 1 (and 8 // 3 = 2)
    assert ctx.stack.layer_counts(8) == (1, 2, 4)
    msgs = [v.message for v in check(full.with_(remat=_replace(full.remat, layers=3)), ctx, memory=False)]
    assert any("3 of 8 blocks is not one of its counts (1, 2, 4)" in m for m in msgs)
    # a count without full recomputation
    one = next(iter(sorted(full.remat.recompute)))
    odd = base.with_(remat=RematPlan(recompute=frozenset({one}), layers=2))
    msgs = [v.message for v in check(odd, ctx, memory=False)]
    assert "remat.layers counts fully recomputed blocks, but no stage recomputes the full set" in msgs


def test_plan_files_keep_the_count_and_old_fingerprints() -> None:
    from coplan.plan.types import Plan, PlanError, RematPlan

    ctx = _ctx("megatron")
    _, full = _full(ctx)
    assert "layers" not in full.decisions()["remat"]
    some = full.with_(remat=RematPlan(recompute=full.remat.recompute, layers=3))
    back = Plan.from_dict(json.loads(some.to_json()))
    assert back.remat.layers == 3 and back.fingerprint == some.fingerprint != full.fingerprint
    with pytest.raises(PlanError, match=r"remat\.layers"):
        RematPlan(recompute=full.remat.recompute, layers=0)


def test_a_stack_names_where_its_per_layer_checkpoints_sit() -> None:
    from coplan.cost.stacks import StackError, StackSpec

    with pytest.raises(StackError, match="layer_checkpointing"):
        StackSpec(name="x", checkpointing=("none", "full", "selective-layer"))
    with pytest.raises(StackError, match="layer_checkpointing"):
        StackSpec(name="x", checkpointing=("none", "full"), layer_checkpointing="first")
    spread = StackSpec(
        name="x", checkpointing=("none", "full", "selective-layer"), layer_checkpointing="spread"
    )
    assert spread.layer_counts(4) == (1, 2, 3)
    assert StackSpec(name="x").layer_counts(4) == ()
