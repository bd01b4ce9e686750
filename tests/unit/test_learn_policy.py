"""The learned planner's network and decoder (``coplan.learn``): features and labels read off a
plan exactly, any network output decodes to a valid plan, training lowers the imitation loss,
policy files round-trip and bad ones are refused in one line, and the CLI's contract."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from coplan.cost import CostModel, load_stack
from coplan.hardware import load_cluster
from coplan.learn.dataset import open_dataset, write_dataset
from coplan.learn.decode import plan_with_policy
from coplan.learn.features import (
    EDGE_DIM,
    GLOBAL_DIM,
    LAYOUT_DIM,
    NODE_DIM,
    PHYS_FEATURES,
    job_graph,
    layout_candidates,
    layout_features,
    layout_matrix,
    plan_labels,
)
from coplan.learn.policy import PolicyConfig, PolicyNet
from coplan.learn.train import PolicyError, examples, load_policy, save_policy, train
from coplan.models.spec import PRESETS
from coplan.plan import PlanContext, check
from coplan.search import run_strategy
from coplan.search.space import SearchSpace


def ctx_for(stack: str = "coplan", budget: float | None = None) -> PlanContext:
    return PlanContext(
        CostModel(spec=PRESETS["gpt-tiny"]),
        load_cluster("dgx-h100", 8),
        16,
        64,
        budget_bytes=budget,
        stack=load_stack(stack),
    )


def test_features_have_their_documented_shapes_and_labels_match_the_plan():
    ctx = ctx_for()
    jg = job_graph(ctx)
    n = jg.x.shape[0]
    assert jg.x.shape == (n, NODE_DIM) and jg.u.shape == (GLOBAL_DIM,)
    assert jg.edge_index.shape[0] == 2 and jg.edge_attr.shape == (jg.edge_index.shape[1], EDGE_DIM)
    assert jg.edge_attr[: jg.n_data, 0].eq(1).all() and jg.edge_attr[jg.n_data :, 1].eq(1).all()
    assert torch.isfinite(jg.x).all() and torch.isfinite(jg.u).all()
    plan = run_strategy("joint-exact", ctx).plan
    lab = plan_labels(jg, plan)
    group_of = {name: i for i, g in enumerate(plan.fusion.groups) for name in g}
    src, dst = jg.edge_index[:, : jg.n_data].tolist()
    expect = [
        float(jg.names[a] in group_of and group_of[jg.names[a]] == group_of.get(jg.names[b]))
        for a, b in zip(src, dst, strict=True)
    ]
    assert lab.fuse.tolist() == expect and sum(expect) > 0
    kept = plan.remat.all_names
    assert lab.recompute.tolist() == [float(any(t in kept for t in ns)) for ns in jg.saved_names]
    cands = layout_candidates(ctx)
    feats = layout_matrix(ctx, cands)
    assert feats.shape == (len(cands), LAYOUT_DIM) and bool(torch.isfinite(feats).all())
    for i in (0, len(cands) - 1):  # one layout alone reads the same as in the matrix
        assert layout_features(ctx, *cands[i]) == pytest.approx(feats[i].tolist(), rel=1e-6)


def test_roofline_features_follow_their_formulas():
    """The layout's roofline shares (``layout_matrix``) as first-order accounting says: ZeRO-3's
    gathers are paid once per microbatch, so twice the microbatch halves them; only ZeRO-3
    gathers; sharding states by ZeRO's stage only shrinks them; one pipeline stage has no bubble,
    and 1F1B's bubble is (pp - 1) / (m + pp - 1)."""
    from coplan.plan.types import ParallelPlan, PrecisionPlan

    ctx = ctx_for("megatron")
    prec = PrecisionPlan(compute="bf16")
    col = {name: LAYOUT_DIM - len(PHYS_FEATURES) + i for i, name in enumerate(PHYS_FEATURES)}
    share = lambda f: 2.0 ** (4.0 * float(f)) - 1.0  # noqa: E731  (the inverse of features._ratio)
    rows = layout_matrix(
        ctx,
        [
            (ParallelPlan(dp=8, zero=3, microbatch=1), prec),
            (ParallelPlan(dp=8, zero=3, microbatch=2), prec),
            (ParallelPlan(dp=8, zero=0), prec),
            (ParallelPlan(dp=8, zero=1), prec),
            (ParallelPlan(dp=8, zero=2), prec),
            (ParallelPlan(pp=4, dp=2), prec),
        ],
    ).double()
    g = rows[:, col["gathers"]]
    assert share(g[0]) == pytest.approx(2.0 * share(g[1]), rel=1e-5) and float(g[2:5].abs().max()) == 0.0
    states = rows[[2, 3, 4, 0], col["states"]].tolist()
    assert states == sorted(states, reverse=True) and states[0] > states[-1]
    assert float(rows[:5, col["bubble"]].abs().max()) == 0.0
    m = 16 / 2  # a global batch of 16 over 2 data-parallel ranks, microbatch 1
    assert float(rows[5, col["bubble"]]) == pytest.approx(3 / (m + 3), rel=1e-6)


@pytest.mark.parametrize("seed", [0, 1])
@pytest.mark.parametrize("stack", ["coplan", "megatron", "torchtitan"])
def test_any_network_decodes_to_a_valid_plan_that_fits_where_one_can(seed, stack):
    """Untrained networks (random outputs) still yield checked, legal plans: the decoder only
    picks legal kernels (on torchtitan, fp8 layouts under torch.compile only) and the repair
    recomputes until the plan fits."""
    torch.manual_seed(seed)
    net = PolicyNet(PolicyConfig(hidden=16, layers=1)).eval()
    # a budget the default plan does not meet: the repair must recompute or pick another layout
    tight = ctx_for(stack)
    tight.budget_bytes = 0.5 * tight.price(tight.default_plan()).memory.peak_bytes
    ctx = ctx_for(stack, budget=tight.budget_bytes)
    plan, priced, _ = plan_with_policy(ctx, net, 4)
    assert priced >= 1
    assert check(plan, ctx, memory=False) == []
    if stack == "torchtitan":
        # the H100s run fp8: its layouts are candidates, decoded under torch.compile only
        fp8 = {prec for _, prec in layout_candidates(ctx) if prec.compute == "fp8"}
        assert fp8
        assert all([f.label for f in SearchSpace().fusions(ctx, prec)] == ["compiled"] for prec in fp8)
    if run_strategy("joint", ctx_for(stack, budget=tight.budget_bytes)).fits:
        assert ctx.fits(ctx.price(plan))


@pytest.fixture(scope="module")
def data(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("learn") / "d"
    write_dataset(out, 6, seed=21, shard_size=3, jobs=1)
    return out


def test_training_lowers_the_imitation_loss_and_files_round_trip(data, tmp_path):
    items = examples(open_dataset(data), None)
    assert items and any(e.target >= 0 for e in items)
    _, first = train(items, epochs=1, seed=0, config=PolicyConfig(hidden=16, layers=1))
    net, last = train(items, epochs=12, seed=0, config=PolicyConfig(hidden=16, layers=1))
    assert sum(last.values()) < sum(first.values())
    path = tmp_path / "p.pt"
    save_policy(net, path, {"jobs": len(items)})
    back, meta = load_policy(path)
    assert meta == {"jobs": len(items)}
    ex = items[0]
    with torch.no_grad():
        a, b = net(ex.graph, ex.layouts, 0), back(ex.graph, ex.layouts, 0)
    assert torch.equal(a.layout, b.layout) and torch.equal(a.fuse, b.fuse)
    (tmp_path / "junk.pt").write_bytes(b"not a model")
    with pytest.raises(PolicyError, match="not a coplan policy file"):
        load_policy(tmp_path / "junk.pt")
    blob = torch.load(path, weights_only=True)
    blob["version"] = 99
    torch.save(blob, tmp_path / "v99.pt")
    with pytest.raises(PolicyError, match="version 99"):
        load_policy(tmp_path / "v99.pt")
    with pytest.raises(PolicyError, match="does not exist"):
        load_policy(tmp_path / "none.pt")


def test_cli_train_eval_and_plan_with_a_policy(data, tmp_path, cli):
    model = tmp_path / "m.pt"
    code, stdout, err = cli(
        "learn", "train", "--data", str(data), "--out", str(model), "--epochs", "2", "--json"
    )
    assert code == 0, err
    assert json.loads(stdout)["train_jobs"] >= 1 and model.is_file()
    code, stdout, err = cli(
        "learn", "eval", "--data", str(data), "--policy", str(model), "--split", "train", "--json"
    )
    assert code == 0, err
    res = json.loads(stdout)
    assert set(res) >= {
        "split",
        "n",
        "vs_sequential",
        "vs_joint",
        "feasible_rate",
        "plan_time_s",
        "cost_model",
    }
    assert set(res["vs_sequential"]) == {"median_ratio", "p10_ratio", "wins", "losses"}
    assert set(res["vs_joint"]) == {"median_ratio", "p90_ratio"}
    pair = res["fusion_remat"]  # fusion x remat alone, the layout fixed at the baseline's
    assert set(pair) == {"n", "median_ratio", "p10_ratio", "wins", "losses"}
    assert pair["n"] == sum(j["fusion_remat_ratio"] is not None for j in res["jobs"]) <= res["n"]
    assert pair["wins"] + pair["losses"] <= pair["n"]
    assert set(res["plan_time_s"]) == {"learned", "joint", "sequential"}
    assert set(res["cost_model"]) == {"kendall_tau", "top1_regret", "mape"}
    assert res["verdict"] in ("validated", "killed") and res["split"] == "train"
    job = ("--model", "gpt-tiny", "--gpus", "2", "--global-batch", "8", "--stack", "coplan")
    code, stdout, err = cli("plan", *job, "--strategy", "learned", "--policy", str(model), "--json")
    assert code == 0, err
    plan = json.loads(stdout)
    assert plan["strategy"] == "learned" and plan["fits"] and plan["violations"] == []
    code, stdout, err = cli("plan", *job, "--warm-start", "learned", "--policy", str(model), "--json")
    assert code == 0, err
    # learned, sequential and hierarchical seed joint
    assert "warm-started from 3 plans" in json.loads(stdout)["notes"]
    code, stdout, err = cli(
        "compare",
        *job,
        "--strategies",
        "sequential,learned-greedy",
        "--policy",
        str(model),
        "--json",
    )
    assert code == 0, err
    cmp = json.loads(stdout)["strategies"]
    assert set(cmp["learned-greedy"]) == set(cmp["sequential"])
    (tmp_path / "bad.pt").write_text("x")
    for bad, why in (
        (
            ("plan", *job, "--strategy", "learned", "--policy", str(tmp_path / "bad.pt")),
            "not a coplan policy",
        ),
        (("plan", *job, "--strategy", "joint", "--policy", str(model)), "--policy"),
        (("plan", *job, "--strategy", "sequential", "--warm-start", "learned"), "--warm-start"),
        (("learn", "eval", "--data", str(tmp_path), "--policy", str(model)), "manifest"),
        (("learn", "train", "--data", str(data), "--out", str(tmp_path)), "directory"),
    ):
        code, stdout, err = cli(*bad)
        assert code == 2, (bad, err)
        assert err.count("\n") == 1 and why in err and "Traceback" not in err


def test_kendall_tau_is_exact_on_known_rankings():
    from coplan.learn.costnet import kendall_tau

    assert kendall_tau([1, 2, 3, 4], [10, 20, 30, 40]) == 1.0
    assert kendall_tau([1, 2, 3, 4], [40, 30, 20, 10]) == -1.0
    # one swapped pair of six: (5 - 1) / 6
    assert kendall_tau([1, 2, 3, 4], [1, 2, 4, 3]) == pytest.approx(4 / 6)
    assert kendall_tau([1.0], [2.0]) is None


def test_the_learned_cost_model_fits_its_labels_and_rides_in_the_policy_file(data, tmp_path):
    from coplan.learn.costnet import CostNet, rank_report, train_costnet
    from coplan.learn.samples import cost_examples
    from coplan.learn.train import attach_cost

    recs = [r for r in open_dataset(data).records() if "error" not in r]
    items = cost_examples(recs, 4, seed=0)
    assert len(items) >= 2 * len(recs)  # at least the teacher's and the baseline's plan per job
    _, first = train_costnet(items, epochs=1, hidden=16, layers=1)
    cost, last = train_costnet(items, epochs=10, hidden=16, layers=1)
    assert last < first
    report = rank_report(cost, items)
    assert report["kendall_tau"] is not None and -1.0 <= report["kendall_tau"] <= 1.0
    assert report["top1_regret"] is not None and report["top1_regret"] >= 0.0
    net = attach_cost(PolicyNet(PolicyConfig(hidden=16, layers=1)), cost)
    path = tmp_path / "with_cost.pt"
    save_policy(net, path, {})
    back, _ = load_policy(path)
    assert isinstance(back.cost, CostNet)
    ex = items[0]
    with torch.no_grad():
        assert torch.equal(back.cost(ex.graph, ex.plan_x, ex.layout), cost(ex.graph, ex.plan_x, ex.layout))
    # the autotuner: decoded plans ranked by the cost model, the best few priced and checked
    ctx = ctx_for()
    plan, priced, notes = plan_with_policy(ctx, back, 2)
    assert priced >= 1 and check(plan, ctx, memory=False) == [] and "learned cost model" in notes[0]


def test_the_shipped_policy_plans_without_training(cli):
    from coplan.learn.decode import DEFAULT_POLICY

    assert DEFAULT_POLICY.is_file(), (
        "coplan/learn/policy.pt ships with the package (benchmarks/train_policy.py)"
    )
    assert DEFAULT_POLICY.stat().st_size < 8 * 2**20  # a few MB at most
    code, stdout, err = cli(
        "plan",
        "--model",
        "gpt-tiny",
        "--gpus",
        "2",
        "--global-batch",
        "8",
        "--strategy",
        "learned",
        "--json",
    )
    assert code == 0, err
    body = json.loads(stdout)
    assert body["strategy"] == "learned" and body["fits"] and 0 < body["mfu"] <= 1


def test_large_jobs_are_deterministic_and_beyond_the_imitation_data():
    from coplan.learn.distill import sample_large_job
    from coplan.learn.jobs import LARGE_SPLITS, _params

    jobs = [sample_large_job(3, i) for i in range(12)]
    assert [j.to_dict() for j in jobs] == [sample_large_job(3, i).to_dict() for i in range(12)]
    assert all(2.0e10 <= _params(j.spec) <= 8.0e10 for j in jobs)
    assert all(64 <= j.cluster.num_devices <= 1024 and j.split in LARGE_SPLITS for j in jobs)


def test_neighbouring_layouts_differ_in_at_most_three_fields_fewest_first():
    from coplan.learn.distill import MOVE_FIELDS, _neighbours

    keys = [(1, 1, 8, 0), (2, 1, 4, 0), (1, 2, 4, 0), (2, 2, 2, 1), (1, 1, 9, 0), (2, 2, 2, 0)]
    # one field first (the fifth key differs in its third alone), then two, then three; (2, 2, 2, 1)
    # differs in four
    assert MOVE_FIELDS == 3
    assert _neighbours(keys, 0) == [4, 1, 2, 5]
    assert _neighbours(keys, 0, limit=2) == [4, 1, 2]


def test_the_policy_guided_search_never_returns_a_worse_plan():
    from coplan.learn.decode import default_policy
    from coplan.learn.distill import improve
    from coplan.passes.base import score

    ctx = ctx_for("megatron", budget=3e9)
    got = improve(ctx, default_policy(), 2, 5.0)
    assert got.key <= got.proposed_key
    assert got.key == score(got.plan, ctx) and not check(got.plan, ctx, memory=False)
    assert got.gain >= 1.0 and got.priced >= 1


def test_distillation_fine_tunes_a_copy(data, tmp_path, cli):
    from coplan.learn.distill import distill
    from coplan.learn.jobs import Job

    items = examples(open_dataset(data), None)
    net, _ = train(items, epochs=1, seed=0, config=PolicyConfig(hidden=16, layers=1))
    before = {k: v.clone() for k, v in net.state_dict().items()}
    jobs = [Job.from_dict(r["job"]) for r in open_dataset(data).records(None)][:2]
    tuned, report = distill(net, jobs, items, k=1, seconds=1.0, epochs=1)
    assert report.jobs == 2 and len(report.gains) <= 2 and all(g >= 1.0 for g in report.gains)
    assert all(torch.equal(before[k], v) for k, v in net.state_dict().items())  # the input is kept
    assert any(not torch.equal(before[k], v) for k, v in tuned.state_dict().items())
    out = tmp_path / "d.pt"
    code, stdout, err = cli(
        "learn", "distill", "--out", str(out), "--data", str(data), "--replay", "2",
        "--n", "3", "--rounds", "1", "--seconds", "1", "--json",
    )  # fmt: skip
    assert code == 0, err
    res = json.loads(stdout)
    assert res["distilled"]["rounds"][0]["jobs"] == res["distilled"]["large_jobs"] and out.is_file()
    written = load_policy(out)[1]  # the source policy's provenance, and what distillation did
    assert written["distilled"] == res["distilled"] and "train_jobs" in written and "cost_model" in written
    code, _, err = cli("learn", "distill", "--out", str(tmp_path / "x.pt"), "--n", "0")
    assert code == 2 and err.strip().count("\n") == 0 and not (tmp_path / "x.pt").exists()


def test_learned_search_is_a_strategy_never_worse_than_learned(cli):
    args = ("plan", "--model", "gpt-tiny", "--cluster", "h100", "--gpus", "8", "--global-batch", "16")
    args += ("--seq", "64", "--json")
    code, out, err = cli(*args, "--strategy", "learned")
    assert code == 0, err
    plain = json.loads(out)
    code, out, err = cli(*args, "--strategy", "learned-search")
    assert code == 0, err
    searched = json.loads(out)
    assert searched["strategy"] == "learned-search" and searched["fits"]
    assert any("policy-guided search" in n for n in searched["notes"])
    assert searched["step_time_s"] <= plain["step_time_s"] * (1 + 1e-9)


def test_measured_runs_become_cost_examples_labelled_with_what_was_measured(tmp_path):
    from coplan.learn.measured import accuracy, measured_report, read_runs, run_examples

    recorded = Path(__file__).parents[2] / "benchmarks" / "results" / "apply_runs.jsonl"
    lines = recorded.read_text().splitlines()[:3]
    bad = json.loads(lines[0]) | {"grad_check": {"ok": False}}
    path = tmp_path / "runs.jsonl"
    path.write_text("\n".join([*lines, json.dumps(bad)]) + "\n")
    runs = read_runs([path])
    assert len(runs) == 3  # the run whose gradients failed their check is left out
    data, analytic = run_examples(runs)
    for r, ex, a in zip(runs, data, analytic, strict=True):
        assert ex.step_s == r["measured"]["step_time_s"]
        # priced today on the context the runner prices it in: what the run recorded as predicted
        assert a == pytest.approx(r["predicted"]["step_time_s"], rel=1e-6)
    exact = accuracy([ex.step_s for ex in data], data)
    assert exact["mape"] == 0.0 and exact["top1_regret"] == 0.0
    assert set(measured_report(None, data, analytic)) == {"analytic"}


def test_eval_prices_the_labels_with_todays_cost_model():
    from coplan.learn.evaluate import _repriced

    ctx = ctx_for()
    plan = run_strategy("sequential", ctx).plan
    stale = {"strategy": "sequential", "step_time_s": 123.0, "fits": True, "plan": plan.to_dict()}
    got = _repriced(stale, ctx)
    assert got["step_time_s"] == ctx.price(plan).step_time_s and got["fits"]
    # a label plan the loader or the checker refuses counts as not fitting
    bad = plan.to_dict() | {"fingerprint": "0" * 16}
    assert _repriced(stale | {"plan": bad}, ctx)["fits"] is False
    tiny = PlanContext(
        CostModel(spec=PRESETS["gpt-tiny"]), load_cluster("dgx-h100", 8), 16, 64, budget_bytes=1.0
    )
    assert _repriced(stale, tiny)["fits"] is False


def test_the_fusion_decoded_at_other_odds_is_legal_and_wants_fewer_edges_as_the_threshold_rises():
    """``decode``'s ``fuse_at``: an edge is wanted fused where its logit exceeds it, so a higher
    threshold wants a subset of the edges (the kernels taken from them, largest candidates first,
    need not shrink with it); every decode is a checked, legal plan, and with no edge wanted
    less is fused than with every edge."""
    from coplan.learn.decode import FUSE_SPREAD, decode, default_policy
    from coplan.learn.policy import Outputs

    ctx = ctx_for()
    net = default_policy()
    jg = job_graph(ctx)
    cands = layout_candidates(ctx)
    feats = layout_matrix(ctx, cands)
    with torch.no_grad():
        x, g = net.encode(jg)
        out = Outputs(torch.zeros(0), *net.decisions(jg, x, g, feats[0]))
    thresholds = (-10.0, *FUSE_SPREAD[:2], 0.0, *FUSE_SPREAD[2:], 10.0)
    wanted = [int((out.fuse > at).sum()) for at in thresholds]
    assert wanted == sorted(wanted, reverse=True)
    fused = []
    for at in thresholds:
        plan = decode(ctx, out, *cands[0], fuse_at=at)
        assert check(plan, ctx, memory=False) == []
        fused.append(sum(len(grp) for grp in plan.fusion.groups))
    assert fused[-1] < fused[0]


def test_fusion_and_recomputation_alone_keep_the_baselines_layout_and_precision(data):
    """``learn eval``'s ``fusion_remat``: both sides keep the baseline's layout and precision
    exactly; the production side is the fusion pass then the remat pass under them, the policy's
    is valid."""
    from coplan.learn.decode import default_policy
    from coplan.learn.evaluate import _fusion_remat
    from coplan.learn.jobs import Job
    from coplan.plan.checker import is_valid
    from coplan.plan.types import Plan

    net = default_policy()
    seen = 0
    for r in open_dataset(data).records(None):
        if "error" in r or not r["labels"]["baseline"]["fits"]:
            continue
        ctx = Job.from_dict(r["job"]).context()
        fixed = Plan.from_dict(r["labels"]["baseline"]["plan"])
        got = _fusion_remat(ctx, net, fixed, 2)
        if got is None or got[1] is None:
            continue
        seq, own = got
        for p in (seq, own):
            assert p.parallel == fixed.parallel and p.precision == fixed.precision
        assert is_valid(own, ctx)
        seen += 1
    assert seen >= 1
