"""The prepared GPU benchmark (``benchmarks/bench_gpu.py all``) runs end to end on this CPU, and
``coplan run``'s memory-budgeted ``torch.compile`` baseline it relies on."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parents[2] / "benchmarks"
RUN_KEYS = {
    "batch",
    "tokens_per_s",
    "step_time_s",
    "predicted_step_time_s",
    "peak_bytes",
    "saved_activation_bytes",
    "grad_ok",
}


@pytest.fixture
def gpu_all():
    sys.path.insert(0, str(BENCH))
    try:
        import gpu_all

        yield gpu_all
    finally:
        sys.path.remove(str(BENCH))


def test_activation_budget_needs_compile_mode(tmp_path, cli):
    plan = tmp_path / "p.json"
    job = ["--model", "gpt-tiny", "--cluster", "cpu", "--gpus", "1", "-b", "4", "--seq", "32"]
    assert cli("plan", *job, "--stack", "coplan", "--out", str(plan))[0] == 0
    base = ["run", "--model", "gpt-tiny", "--plan", str(plan), "--steps", "1", "--device", "cpu"]
    code, _, err = cli(*base, "--mode", "eager", "--activation-budget", "0.5")
    assert code == 2 and "--activation-budget: needs --mode compile" in err
    code, _, err = cli(*base, "--mode", "compile", "--activation-budget", "1.5")
    assert code == 2 and "between 0 and 1" in err


def test_budget_gives_compile_the_joint_plans_saved_bytes(gpu_all):
    runs = {
        "coplan_joint@tight": {"saved_activation_bytes": 30.0, "predicted_saved_activation_bytes": 31.0},
        "compile@tight": {"saved_activation_bytes": 40.0, "predicted_saved_activation_bytes": 50.0},
        "coplan_joint@loose": {"predicted_saved_activation_bytes": 10.0},
        "compile@loose": {"error": "OutOfMemoryError", "predicted_saved_activation_bytes": 5.0},
    }
    assert gpu_all._budget(runs, "tight") == pytest.approx(0.75)  # measured where both ran
    assert gpu_all._budget(runs, "loose") == 1.0  # predicted otherwise, clamped to [0, 1]


def test_summary_compares_and_ranks(gpu_all):
    def run(ms, pred):
        return {"step_time_s": ms, "predicted_step_time_s": pred, "tokens_per_s": 1.0 / ms}

    result = {
        "models": {
            "m": {
                "runs": {
                    "eager@loose": run(4.0, 3.0),
                    "compile@loose": run(2.0, 2.5),
                    "coplan_joint@loose": run(1.0, 1.0),
                    "coplan_sequential@loose": run(1.5, 1.2),
                    "compile_budget@loose": {"batch": 4, "error": "OutOfMemoryError"},
                }
            }
        }
    }
    (row,) = gpu_all.summary(result)
    assert row["joint_vs_compile"] == pytest.approx(2.0)
    assert row["joint_vs_sequential"] == pytest.approx(1.5)
    assert row["ranking_matches"] is True
    assert row["pairs_ordered"] == [6, 6]
    assert row["failed"] == ["compile_budget"]


def test_runs_priced_the_same_make_no_claim_about_their_order(gpu_all):
    """The budgeted ``torch.compile`` at fraction 1.00 is the defaults' configuration, priced the
    same: whichever of the two measures faster, the ranking is judged on the other pairs."""
    ordered = gpu_all._ordered
    assert ordered([2.0, 2.1, 1.0], [3.0, 3.0, 1.5]) == (2, 2)
    assert ordered([2.1, 2.0, 1.0], [3.0, 3.0, 1.5]) == (2, 2)
    assert ordered([2.1, 2.0, 3.0], [3.0, 3.0, 1.5]) == (0, 2)


@pytest.mark.slow
def test_all_runs_end_to_end_on_a_cpu(tmp_path, gpu_all):
    """Five runs at each batch for a tiny GPT; the JSON a GPU run writes, in its shape."""
    out = gpu_all.run_all(["gpt-tiny"], "cpu", tmp_path, steps=2, plan_dir=tmp_path / "plans")
    written = json.loads((tmp_path / "bench_gpu.json").read_text())
    assert written["models"].keys() == out["models"].keys() == {"gpt-tiny"}
    model = written["models"]["gpt-tiny"]
    assert model["batch_tight"] > model["batch_loose"]
    assert set(model["runs"]) == {f"{r}@{k}" for r in gpu_all.RUNS for k in ("tight", "loose")}
    for name, r in model["runs"].items():
        assert set(r) >= RUN_KEYS, name
        assert r["grad_ok"], name
    budget = model["runs"]["compile_budget@tight"]["activation_budget"]
    assert 0.0 <= budget <= 1.0
    # the tight batch runs whole: the plans meet their budget without splitting it
    for run in gpu_all.RUNS:
        assert model["runs"][f"{run}@tight"]["microbatch"] == model["batch_tight"], run
    assert "| gpt-tiny | tight |" in gpu_all.table(written)


def test_an_isolated_run_reports_from_its_own_process(tmp_path, gpu_all):
    """On a GPU each run has a process of its own; its result comes back as the in-process one does."""
    out = gpu_all.run_all(
        ["gpt-tiny"], "cpu", tmp_path, steps=2, plan_dir=tmp_path / "plans", kinds=("loose",),
        only=("eager",), isolate=True,
    )  # fmt: skip
    (run,) = out["models"]["gpt-tiny"]["runs"].values()
    assert set(run) >= RUN_KEYS
    assert run["grad_ok"]


def test_a_calibrated_profile_ranks_the_runs_a_second_time(gpu_all):
    def run(ms, pred, cal):
        return {
            "step_time_s": ms,
            "predicted_step_time_s": pred,
            "predicted_calibrated_step_time_s": cal,
            "tokens_per_s": 1.0 / ms,
        }

    result = {
        "models": {
            "m": {
                "runs": {
                    "compile@tight": run(2.0, 3.0, 1.9),
                    "coplan_joint@tight": run(2.1, 2.5, 2.2),
                }
            }
        }
    }
    (row,) = gpu_all.summary(result)
    assert row["pairs_ordered"] == [0, 1]
    assert row["calibrated"]["pairs_ordered"] == [1, 1]
    assert row["calibrated"]["errors"]["compile"] == pytest.approx(-0.05)
    for r in result["models"]["m"]["runs"].values():
        r.update(batch=8, saved_activation_bytes=0.0, predicted_saved_activation_bytes=0.0, peak_bytes=0.0)
        r.update(recomputed=0, grad_ok=True)
    assert "on the calibrated profile 1 of 1" in gpu_all.table({"device": "d", "torch": "t", **result})


def test_recorded_gpu_baselines_are_priced_again_as_coplan_run_prices_them(gpu_all):
    """``benchmarks/reprice_gpu.py``: each recorded eager and compiled baseline priced now, beside
    the record's own figures, with its eager / compiled ratios measured and priced."""
    sys.path.insert(0, str(BENCH))
    try:
        import reprice_gpu
    finally:
        sys.path.remove(str(BENCH))
    record = json.loads(reprice_gpu.RECORD.read_text())
    got = reprice_gpu.reprice(record)
    for model, m in got["models"].items():
        runs = record["models"][model]["runs"]
        for key, r in m["runs"].items():
            assert key.split("@")[0] in ("eager", "compile")
            assert r["measured_s"] == runs[key]["step_time_s"]
            assert r["error"] == pytest.approx(r["predicted_s"] / r["measured_s"] - 1)
        assert m["eager_over_compiled"]  # every model's pair ran at one batch at least
        for ratio in m["eager_over_compiled"].values():
            # eager kernels are never priced faster than the compiler's fused ones
            assert ratio["priced"] > 1.0 and ratio["measured"] > 1.0


def test_sustained_probe_times_windows_and_summarises_them_on_a_cpu():
    """The sustained-load probe (``benchmarks/data/gpu_sustained_probe.py``) runs its loop here:
    windows of back-to-back GEMMs, each with its rate, and the first and last spans' medians."""
    data = BENCH / "data"
    sys.path.insert(0, str(data))
    try:
        import gpu_sustained_probe as probe
    finally:
        sys.path.remove(str(data))
    rows = probe.windows(0.6, 64, "cpu", window_s=0.1)
    assert len(rows) >= 3 and all(r["calls"] > 0 and r["tflops"] > 0 for r in rows)
    assert [r["t_s"] for r in rows] == sorted(r["t_s"] for r in rows)
    got = probe.summary(rows, span_s=0.25)
    assert got["first"]["tflops"] > 0 and got["last"]["tflops"] > 0
    assert got["last_over_first"] == pytest.approx(got["last"]["tflops"] / got["first"]["tflops"])
    assert got["first"]["clocks.sm"] is None  # no nvidia-smi readings on a CPU


def test_gemm_in_step_reads_the_committed_profile_and_prices_the_same_gemms():
    """``benchmarks/data/gemm_in_step.py`` splits the compiled GPT-2 step's profile into GEMM classes
    by cuBLAS's kernel names (four linear layers x 24 block passes each) and prices the same GEMMs:
    every rate is a fraction of the peak, and the priced block GEMMs are the same FLOPs each way."""
    sys.path.insert(0, str(BENCH))
    sys.path.insert(0, str(BENCH / "data"))
    try:
        import gemm_in_step as g
    finally:
        sys.path.remove(str(BENCH / "data"))
        sys.path.remove(str(BENCH))
    rows = {r["class"]: r for r in g.table(g.PROFILE)}
    assert rows["block forward"]["calls"] == 96
    assert rows["block weight gradients"]["calls"] == 96
    assert rows["input gradients (blocks + LM head)"]["calls"] == 96 + 2
    for r in rows.values():
        assert 0 < r["measured_of_peak"] <= 1 and 0 < r["priced_of_peak"] <= 1
    # the forward, input-gradient and weight-gradient GEMMs of a linear layer do the same FLOPs, and
    # the cost model prices them alike
    assert rows["block forward"]["priced_ms"] == pytest.approx(rows["block weight gradients"]["priced_ms"])
