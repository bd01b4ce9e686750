"""What `plan`, `compare` and `estimate` say beside their numbers: whether the configuration lies
inside the validated envelope, which stack it was planned for, and the recipe that runs a plan."""

from __future__ import annotations

import json
import tomllib
from collections.abc import Callable
from pathlib import Path

Cli = Callable[..., tuple[int, str, str]]


def test_estimate_json_says_whether_it_is_validated(cli: Cli) -> None:
    base = ("estimate", "--model", "gpt3-175b", "--cluster", "dgx-a100-80gb", "--gpus", "1024", "--tp", "8")
    base += ("--pp", "8", "--global-batch", "1536", "--seq", "2048", "--recompute", "selective", "--json")
    code, out, err = cli(*base)
    assert code == 0, err
    inside = json.loads(out)["validated"]
    assert set(inside) == {"inside", "nearest", "extrapolated"}
    assert inside["inside"] and inside["nearest"] and not inside["extrapolated"]
    code, out, err = cli(*base, "--stack", "torchtitan")
    assert code == 0, err
    outside = json.loads(out)
    assert outside["stack"] == "torchtitan"
    assert not outside["validated"]["inside"]
    assert any("torchtitan" in what for what in outside["validated"]["extrapolated"])


def test_plan_and_compare_json_carry_stack_and_trust(cli: Cli) -> None:
    code, out, err = cli("plan", "-m", "gpt-tiny", "--strategy", "sequential", "--stack", "fsdp", "--json")
    assert code == 0, err
    body = json.loads(out)
    assert body["stack"] == "fsdp" and body["validated"]["inside"] is False
    decisions = {"kernels", "fused_edges", "recomputed", "dtype_overrides"}
    assert decisions <= set(body["decisions"]) and decisions <= set(body["decisions"]["outside"])
    code, out, err = cli("compare", "-m", "gpt-tiny", "--strategies", "sequential,joint", "--json")
    assert code == 0, err
    body = json.loads(out)
    assert body["stack"] == "megatron"
    for entry in body["strategies"].values():
        assert {"validated", "mfu_dtype_peak", "decisions"} <= set(entry)


def test_plan_emits_a_recipe_per_target(cli: Cli, tmp_path: Path) -> None:
    args = ("plan", "-m", "gpt2-124m", "--gpus", "8", "--global-batch", "64", "--strategy", "sequential")
    code, out, err = cli(*args, "--emit", "torchtitan", "--json")
    assert code == 0, err
    body = json.loads(out)
    toml = tomllib.loads(body["emit"]["text"])
    par = body["plan"]["parallel"]
    assert toml["parallelism"]["tensor_parallel_degree"] == par["tp"]
    code, out, err = cli(*args, "--emit", "megatron")
    assert code == 0, err
    assert "--tensor-model-parallel-size" in out and "pretrain_gpt.py" in out
    target = tmp_path / "plan.json"
    code, out, err = cli(*args, "--emit", "coplan", "--out", str(target))
    assert code == 0, err
    assert target.is_file() and f"--plan {target}" in " ".join(out.split())
    code, _, err = cli(*args, "--emit", "jax")
    assert code == 2 and "'jax' is not one of" in err


def test_a_plan_for_a_stack_without_a_recipe_says_so(cli: Cli) -> None:
    args = ("plan", "-m", "gpt-tiny", "--strategy", "sequential", "--stack")
    code, out, err = cli(*args, "deepspeed")
    assert code == 0, err
    text = " ".join(out.split())
    assert "coplan writes no deepspeed recipe" in text and "--stack coplan" in text
    code, out, err = cli(*args, "coplan")
    assert code == 0, err
    assert "coplan run --model gpt-tiny --plan plan.json" in " ".join(out.split())


def test_estimate_prices_torchtitans_per_op_checkpointing_by_name(cli: Cli) -> None:
    from coplan.cost import CostModel, TrainingConfig, load_stack
    from coplan.cost.checkpoint import selective_op_names
    from coplan.hardware import load_cluster
    from coplan.models.spec import load_model_spec

    args = ("estimate", "-m", "gpt-tiny", "--gpus", "8", "--zero", "3", "--global-batch", "8", "--json")
    runs = {}
    for mode in ("none", "selective-op", "full"):
        code, out, err = cli(*args, "--stack", "torchtitan", "--recompute", mode)
        assert code == 0, err
        runs[mode] = json.loads(out)
    got = runs["selective-op"]
    assert got["stack_problems"] == []
    # the policy's set over the step's own graph, as the cost model prices it called directly
    model = CostModel(spec=load_model_spec("gpt-tiny"))
    config = load_stack("torchtitan").configure(TrainingConfig(dp=8, zero=3, global_batch=8))
    names = selective_op_names(model.profile(1, model.seq_of(config), config.fusion).graph)
    assert sorted(got["config"]["recompute"]) == sorted(names)
    direct = model.estimate(load_cluster("dgx-h100", 8), config.with_(recompute=names))
    assert got["step_time_s"] == direct.step_time_s
    peak = {m: r["memory"]["peak_bytes"] for m, r in runs.items()}
    assert peak["full"] < peak["selective-op"] < peak["none"]
    # a stack without the policy prices it as asked and says so
    code, out, err = cli(*args, "--recompute", "selective-op")
    assert code == 0, err
    assert any("cannot recompute 'selective-op'" in p for p in json.loads(out)["stack_problems"])
    code, _, err = cli(*args, "--recompute", "selective-op", "--recompute-layers", "1")
    assert code == 2 and "--recompute-layers" in err


def test_estimate_takes_the_optimizer_and_the_hybrid_shard_group(cli: Cli) -> None:
    args = ("estimate", "-m", "gpt-tiny", "--gpus", "16", "--zero", "3", "--global-batch", "16")
    args += ("--stack", "fsdp", "--json")
    got = {}
    for extra in ((), ("--optimizer", "fused"), ("--optimizer", "for-loop"), ("--fsdp-shard", "8")):
        code, out, err = cli(*args, *extra)
        assert code == 0, err
        got[extra] = json.loads(out)
    base = got[()]
    assert base["config"]["optimizer"] == "foreach"  # the preset's
    fused, loop = got[("--optimizer", "fused")], got[("--optimizer", "for-loop")]
    assert (
        fused["breakdown_s"]["optimizer"]
        < base["breakdown_s"]["optimizer"]
        < loop["breakdown_s"]["optimizer"]
    )
    hsdp = got[("--fsdp-shard", "8")]
    assert hsdp["config"]["fsdp_shard"] == 8 and "fsdp_shard" not in base["config"]
    # sharded over half the GPUs: twice the parameter shard
    assert hsdp["memory"]["params_bytes"] == 2 * base["memory"]["params_bytes"]
    for bad in (("--fsdp-shard", "3"), ("--optimizer", "sgd")):
        code, _, err = cli(*args, *bad)
        assert code == 2 and err.count("\n") == 1, err
    code, _, err = cli("estimate", "-m", "gpt-tiny", "--gpus", "8", "--fsdp-shard", "4")
    assert code == 2 and "--fsdp-shard" in err


def test_stacks_lists_the_presets_and_shows_one_with_its_citations(cli: Cli, tmp_path: Path) -> None:
    from coplan.cost import load_stack
    from coplan.cost.stacks import SETTINGS, stack_names

    code, out, err = cli("stacks", "--json")
    assert code == 0, err
    listed = json.loads(out)
    assert sorted(listed) == sorted(stack_names())
    assert listed["fsdp"]["sharding"] == "fsdp1" and listed["fsdp"]["hybrid_shard"] is True
    code, out, err = cli("stacks", "torchtitan", "--json")
    assert code == 0, err
    one = json.loads(out)
    titan = load_stack("torchtitan")
    assert one["sources"] == dict(titan.sources) and one["about"] == titan.about
    assert {s: one[s] for s in SETTINGS} == {s: titan.to_dict()[s] for s in SETTINGS}
    code, out, err = cli("stacks", "torchtitan")
    assert code == 0, err
    assert "hybrid_shard" in out and "layer_checkpointing" in out
    mine = tmp_path / "mine.json"
    mine.write_text(
        json.dumps({"name": "mine", "extends": "fsdp", "optimizer": "fused", "sources": {"optimizer": "x"}})
    )
    code, out, err = cli("stacks", "--stack-file", str(mine), "--json")
    assert code == 0, err
    assert json.loads(out)["optimizer"] == "fused"
    for bad in (("nope",), ("fsdp", "--stack-file", str(mine))):
        code, _, err = cli("stacks", *bad)
        assert code == 2 and err.startswith("error: stacks:") and err.count("\n") == 1, err


def test_estimate_json_names_the_scale_caution_beside_the_envelope(cli: Cli) -> None:
    base = ("estimate", "--model", "gpt3-175b", "--cluster", "dgx-a100-80gb", "--tp", "8", "--pp", "8")
    base += ("--seq", "2048", "--recompute", "selective", "--json")
    code, out, err = cli(*base, "--gpus", "2048", "--global-batch", "2048")
    assert code == 0, err
    body = json.loads(out)
    assert set(body["validated"]) == {"inside", "nearest", "extrapolated"}
    (caution,) = body["cautions"]
    assert caution.startswith("scale: 2,048 GPUs") and "slower than priced" in caution
    code, out, err = cli(*base, "--gpus", "128", "--global-batch", "128")
    assert code == 0, err
    assert "cautions" not in json.loads(out)
