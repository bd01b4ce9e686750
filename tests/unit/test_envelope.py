"""The validated envelope: the packaged file is what its script builds, a published run's own
configuration lies inside it, and each dimension beyond it is named as extrapolated."""

from __future__ import annotations

import importlib.util
import json
from dataclasses import replace
from pathlib import Path
from types import ModuleType

import pytest

from coplan.cost import CostModel, load_stack
from coplan.cost.envelope import Validated, _load, validated
from coplan.cost.results import Estimate
from coplan.errors import SpecError
from coplan.hardware import load_cluster
from coplan.models.spec import ModelSpec

ROOT = Path(__file__).resolve().parents[2]
RUNS = {
    r["id"]: r for r in json.loads((ROOT / "benchmarks" / "data" / "published_runs.json").read_text())["runs"]
}
#: A validated Megatron run (A100 80GB, fp16, TP 2, 64 GPUs) that prices in a fraction of a second.
RUN = "narayanan21-gpt-3.6b"


def _script(name: str) -> ModuleType:  # benchmarks/ is not a package: load the script by path
    spec = importlib.util.spec_from_file_location(name, ROOT / "benchmarks" / f"{name}.py")
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def _priced(run: dict, cluster: str | None = None, **config: object) -> tuple[Estimate, ModelSpec]:
    """The run as bench_published.py prices it, with ``config`` fields (and the cluster) replaced."""
    bench = _script("bench_published")
    spec = ModelSpec(**{k: v for k, v in run["model"].items() if v is not None})
    cfg = replace(bench.run_config(run), **config)
    gpus = cfg.tp * cfg.pp * cfg.dp
    return CostModel(spec=spec).estimate(load_cluster(cluster or run["cluster"], gpus), cfg), spec


@pytest.fixture(scope="module")
def inside() -> tuple[Estimate, ModelSpec]:
    return _priced(RUNS[RUN])


def test_the_packaged_envelope_is_what_the_script_builds() -> None:
    build = _script("build_envelope")
    assert (ROOT / "coplan" / "cost" / "envelope.json").read_text() == build.render(build.build())


def test_the_envelope_holds_only_stacks_and_devices_within_the_bar() -> None:
    env = _load()
    for stack, pairs in env.stacks.items():
        for device, pair in pairs.items():
            ok = pair["mean_abs_error"] <= env.bar and pair["runs"] >= env.min_runs
            assert pair["validated"] == ok, (stack, device)
            if ok:
                assert stack in env.bounds["stacks"] and device in env.bounds["devices"]


def test_a_published_runs_own_configuration_is_inside(inside: tuple[Estimate, ModelSpec]) -> None:
    v = validated(*inside)
    assert v.inside and v.extrapolated == ()
    assert RUN in v.nearest and len(v.nearest) <= 3
    assert v.to_dict() == {"inside": True, "nearest": list(v.nearest), "extrapolated": []}
    assert json.loads(json.dumps(v.to_dict())) == v.to_dict()


def test_every_validated_megatron_run_is_inside_on_its_layout_and_model() -> None:
    """The layout, scale and model dimensions alone: each validated run's recorded values are inside
    (its MFU comes from the estimate, checked on RUN above)."""
    env = _load()
    rows = json.loads((ROOT / "coplan" / "cost" / "envelope.json").read_text())["runs"]
    for row in rows:
        if env.stacks[row["stack"]][row["device"]]["validated"]:
            assert row["stack"] in env.bounds["stacks"]
            assert row["dtype"] in env.bounds["dtypes"][row["device"]]
            assert row["gpus"] <= env.bounds["zero"][str(row["zero"])]
            for key in ("tp", "pp", "vpp", "dp", "gpus"):
                assert row[key] <= env.bounds["max"][key]
            assert env.bounds["seq"][0] <= row["seq"] <= env.bounds["seq"][1]
            assert row["mfu"] <= env.bounds["mfu_max"][row["dtype"]]


def test_zero3_at_4096_gpus_is_extrapolated() -> None:
    est, spec = _priced(RUNS[RUN], tp=1, dp=4096, zero=3, global_batch=4096, microbatch=1)
    v = validated(est, spec)
    assert not v.inside
    reach = _load().stack_bounds["megatron"]["zero"]["3"]
    assert any(m.startswith("ZeRO-3 at 4,096 GPUs") and f"up to {reach:,}" in m for m in v.extrapolated)


def test_each_validated_stack_is_held_to_its_own_runs(monkeypatch: pytest.MonkeyPatch) -> None:
    """A validated stack is bounded by its own runs: torchtitan's compiled runs on Meta's H100 reach
    ZeRO-3 at 256 GPUs, and were they validated (they are within a point of the bar) they would
    validate neither a Megatron ZeRO-3 job at 64 GPUs nor a torchtitan job on an A100, which
    their runs never were."""
    import coplan.cost.envelope as envelope

    build = _script("build_envelope")
    rows = [
        r for r in build._rows() if r["stack"] == "torchtitan-compile" and r["device"] == "h100-hbm2e-500w"
    ]
    env = envelope._load()
    own = build._bounds(rows)
    monkeypatch.setattr(
        envelope, "_load", lambda: replace(env, stack_bounds={**env.stack_bounds, "torchtitan-compile": own})
    )
    assert own["zero"]["3"] >= 64 > env.stack_bounds["megatron"]["zero"]["3"]
    est, spec = _priced(RUNS[RUN], tp=1, dp=64, zero=3, global_batch=64, microbatch=1)
    megatron = validated(est, spec, stack="megatron")
    assert any(m.startswith("ZeRO-3 at 64 GPUs") for m in megatron.extrapolated), megatron.extrapolated
    titan = validated(est, spec, stack="torchtitan-compile")
    assert not any(m.startswith("ZeRO-3") for m in titan.extrapolated), titan.extrapolated
    assert any(m.startswith("device a100-sxm-80gb outside") for m in titan.extrapolated), titan.extrapolated


def test_tp_16_is_extrapolated() -> None:
    est, spec = _priced(RUNS[RUN], tp=16, dp=4)
    v = validated(est, spec)
    assert not v.inside
    assert any(m.startswith("TP 16 > ") for m in v.extrapolated), v.extrapolated


def test_a_b200_is_extrapolated() -> None:
    est, spec = _priced(RUNS[RUN], cluster="dgx-b200")
    v = validated(est, spec)
    assert not v.inside
    assert any(m.startswith("device b200 outside") for m in v.extrapolated), v.extrapolated


def test_fp8_on_an_a100_is_extrapolated(inside: tuple[Estimate, ModelSpec]) -> None:
    est, spec = inside
    v = validated(replace(est, config=replace(est.config, dtype="fp8")), spec)
    assert any(m.startswith("fp8 on a100-sxm-80gb") for m in v.extrapolated), v.extrapolated


def test_the_torchtitan_stack_is_extrapolated(inside: tuple[Estimate, ModelSpec]) -> None:
    v = validated(*inside, stack="torchtitan")
    assert not v.inside
    assert any(m.startswith("stack torchtitan: priced") for m in v.extrapolated), v.extrapolated
    # its nearest runs are the stack's own published runs
    ids = {r.id for r in _load().by_stack["torchtitan"]}
    assert v.nearest and set(v.nearest) <= ids
    unknown = validated(*inside, stack="my-stack")
    assert "stack my-stack: no published runs validate it" in unknown.extrapolated


def test_mfu_above_the_range_is_extrapolated(inside: tuple[Estimate, ModelSpec]) -> None:
    est, spec = inside
    top = _load().stack_bounds["megatron"]["mfu_max"][est.config.dtype]
    v = validated(replace(est, mfu=top + 0.05), spec)
    assert not v.inside
    assert any(m.startswith("MFU ") and "above" in m for m in v.extrapolated), v.extrapolated


def test_a_model_beyond_the_size_range_is_extrapolated(inside: tuple[Estimate, ModelSpec]) -> None:
    est, spec = inside
    small = replace(spec, n_layers=2, d_model=256, n_heads=4, vocab_size=1000)
    v = validated(est, small)
    assert any(m.startswith("model ") and "below the smallest" in m for m in v.extrapolated)


def test_the_envelope_is_read_once(inside: tuple[Estimate, ModelSpec]) -> None:
    validated(*inside)
    misses = _load.cache_info().misses
    for _ in range(5):
        validated(*inside)
    assert _load.cache_info().misses == misses


def test_validated_is_consistent() -> None:
    with pytest.raises(SpecError):
        Validated(inside=True, nearest=(), extrapolated=("TP 16 > 8 (largest validated)",))
    with pytest.raises(SpecError):
        Validated(inside=True, nearest=("a", "b", "c", "d"), extrapolated=())


def test_a_traced_graph_is_extrapolated_and_compared_by_layout(inside: tuple[Estimate, ModelSpec]) -> None:
    est, _ = inside
    v = validated(est, None)
    assert not v.inside
    assert v.extrapolated == ("model: a traced graph, where the validated runs are transformer specs",)
    assert RUN in v.nearest


def test_planned_fusion_and_recompute_sets_are_extrapolated(inside: tuple[Estimate, ModelSpec]) -> None:
    est, spec = inside
    cfg = replace(est.config, fusion=((0, 1), (2,)), recompute=frozenset({"attn.softmax"}))
    v = validated(replace(est, config=cfg), spec)
    assert any(m.startswith("fusion: 2 planned kernel groups") for m in v.extrapolated), v.extrapolated
    assert any(m.startswith("recompute: chosen tensor sets") for m in v.extrapolated), v.extrapolated


def test_a_recompute_set_that_is_a_stacks_policy_is_judged_as_that_policys_runs() -> None:
    """torchtitan's per-op checkpointing is a set over the step's graph, as its published runs
    (``partial`` in the data) were priced: a plan or estimate recomputing it is inside on that
    count, where a set of the plan's own choosing is not."""
    from coplan.plan import PlanContext
    from coplan.plan.capabilities import validated_plan
    from coplan.plan.context import policy_sets

    spec = ModelSpec(
        name="tiny", n_layers=2, d_model=256, n_heads=4, vocab_size=1000, seq_len=128, activation="swiglu"
    )
    stack = load_stack("torchtitan-compile")
    ctx = PlanContext(CostModel(spec=spec), load_cluster("grand-teton-h100", 8), 8, 128, stack=stack)
    per_op = policy_sets(ctx)["selective-op"]
    plan = ctx.default_plan().with_(remat=replace(ctx.default_plan().remat, recompute=per_op))
    est = ctx.price(plan)
    assert isinstance(est.config.recompute, frozenset)
    assert "partial" in _load().stack_bounds["torchtitan-compile"]["recompute"]
    assert not any(m.startswith("recompute") for m in validated_plan(ctx, plan, est).extrapolated)
    bare = validated(est, spec, stack.name).extrapolated  # no policy named: a chosen set
    assert any(m.startswith("recompute: chosen tensor sets") for m in bare), bare
    named = validated(est, spec, stack.name, policies={est.config.recompute: "selective-op"}).extrapolated
    assert not any(m.startswith("recompute") for m in named), named


def test_groups_that_are_a_named_kernel_set_are_judged_by_its_name(
    inside: tuple[Estimate, ModelSpec],
) -> None:
    """A stack running Megatron-LM's kernels beside other options (DeepSpeed's) gives them to the
    cost model as groups: they are the validated runs' kernels, not a grouping of the plan's own."""
    est, spec = inside
    cfg = replace(est.config, fusion=((0, 1), (2,)))
    grouped = replace(est, config=cfg)
    assert not any(m.startswith("fusion") for m in validated(grouped, spec, kernels="megatron").extrapolated)
    eager = validated(grouped, spec, kernels="eager").extrapolated
    assert "fusion eager: validated runs are priced with megatron kernels" in eager, eager


def test_a_deepspeed_plan_of_megatron_kernels_names_them() -> None:
    from coplan.plan import PlanContext
    from coplan.plan.capabilities import named_fusion
    from coplan.search.space import fusion_option

    spec = ModelSpec(
        name="tiny", n_layers=2, d_model=256, n_heads=4, vocab_size=1000, seq_len=128, activation="gelu"
    )
    ctx = PlanContext(CostModel(spec=spec), load_cluster("dgx-h100", 8), 8, 64, stack=load_stack("deepspeed"))
    plan = ctx.default_plan()
    megatron = replace(plan, fusion=fusion_option(ctx, "megatron"))
    assert named_fusion(ctx, megatron) == "megatron"
    assert named_fusion(ctx, replace(plan, fusion=fusion_option(ctx, "eager"))) == "eager"
    own = replace(megatron.fusion, groups=megatron.fusion.groups[1:])
    assert named_fusion(ctx, replace(plan, fusion=own)) is None


def test_a_run_priced_far_off_bounds_nothing() -> None:
    """A validated pair's runs priced more than ``WORST`` off their measurement extend no bound:
    torchtitan's compiled runs on Meta's H100 include context parallelism over 8 ranks at 262,144
    tokens, priced a third fast, yet the stack's envelope stops at the CP degree and sequence of
    its runs priced within 20%."""
    build = _script("build_envelope")
    rows = [
        r for r in build._rows() if r["stack"] == "torchtitan-compile" and r["device"] == "h100-hbm2e-500w"
    ]
    far = [r for r in rows if abs(r["error"]) > build.WORST]
    assert far, "the data holds runs of this pair priced more than WORST off"
    bounds = build.build()["by_stack"]["torchtitan-compile"]
    near = [r for r in rows if abs(r["error"]) <= build.WORST]
    assert bounds["max"]["cp"] == max(r["cp"] for r in near) < max(r["cp"] for r in far)
    assert bounds["seq"][1] == max(r["seq"] for r in near) < max(r["seq"] for r in far)


def test_a_price_far_above_the_runs_usual_scale_carries_the_measured_scale_trend() -> None:
    """The scale trend of the published series (``envelope.json``'s ``scale_trend``, from
    ``bench_published.py``) is named for a configuration at least one doubling above the median GPU
    count of the runs it is compared with, scaled by its doublings; never below, and never in
    ``to_dict``, whose keys stay the contract's."""
    import math
    import statistics

    env = _load()
    trend = env.scale_trend
    assert trend is not None and trend["per_doubling"] < 0 and trend["series"] >= 10
    own = [r for r in env.by_stack["megatron"] if r.validated]
    median = 2 ** statistics.median(r.logs[0] for r in own)
    run = RUNS["korthikanti22-gpt-530b-full-recompute-2240gpu"]
    big = validated(*_priced(run))
    doublings = math.log2(run["gpus"] / median)
    assert doublings >= 1
    (caution,) = big.cautions
    assert f"{doublings:.1f} doublings" in caution
    assert f"about {-trend['per_doubling'] * doublings:.0%} slower" in caution
    assert set(big.to_dict()) == {"inside", "nearest", "extrapolated"}
    small = validated(*_priced(RUNS[RUN]))
    assert RUNS[RUN]["gpus"] < 2 * median and small.cautions == ()


def test_estimate_judges_its_per_op_checkpointing_as_torchtitans_runs(cli) -> None:  # type: ignore[no-untyped-def]
    args = ("estimate", "--model", "llama3-8b", "--cluster", "grand-teton-h100", "--gpus", "8", "--zero", "3")
    code, out, err = cli(*args, "--stack", "torchtitan-compile", "--recompute", "selective-op", "--json")
    assert code == 0, err
    assert not any(m.startswith("recompute") for m in json.loads(out)["validated"]["extrapolated"])
