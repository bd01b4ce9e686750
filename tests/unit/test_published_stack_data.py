"""The other-stack runs (benchmarks/data/published_stack_runs.json: torchtitan, PyTorch FSDP, DeepSpeed, eager
PyTorch) stay loadable and self-consistent: every run is complete and cited, its model loads as a ModelSpec,
its cluster resolves, its layout adds up, and its eager/compiled pair points at the same job."""

from __future__ import annotations

import copy
import json
import re
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest

from coplan.hardware import load_cluster
from coplan.models.spec import ModelSpec, load_model_spec

ROOT = Path(__file__).resolve().parents[2]
DATA = json.loads((ROOT / "benchmarks" / "data" / "published_stack_runs.json").read_text())
RUNS = DATA["runs"]
BY_ID = {r["id"]: r for r in RUNS}
FIELDS = (
    *("id", "stack", "source", "model", "cluster", "gpus", "tp", "pp", "vpp", "microbatch", "global_batch"),
    *("seq", "recompute", "sequence_parallel", "zero", "dtype", "flash_attention", "stack_settings"),
    *("measured", "assumptions"),
)
STACKS = ("torchtitan", "fsdp", "deepspeed", "eager")
SETTINGS = (
    "compile",
    "float8",
    "fsdp",
    "sharding",
    "reshard_after_forward",
    "activation_checkpoint",
    "async_tp",
    "cpu_offload",
    "mixed_precision",
    "attention",
    "fused_optimizer",
    "sources",
)
AC = re.compile(r"none|full|selective-op|selective-layer:[1-9]\d*|selective-fraction:(0(\.\d+)?|1)")
# what a pair may differ in: the compile flag and what it changes (the measurement, the citations)
PAIR_FREE = {"id", "pair", "source", "measured", "stack_settings", "assumptions"}


def _bench_module(name: str) -> Any:
    """A module of ``benchmarks/`` or ``benchmarks/data/`` (the scripts are not a package)."""
    import importlib
    import sys

    paths = [str(ROOT / "benchmarks"), str(ROOT / "benchmarks" / "data")]
    sys.path[:0] = paths
    try:
        return importlib.import_module(name)
    finally:
        for p in paths:
            sys.path.remove(p)


def test_about_and_ids() -> None:
    assert DATA["about"]
    ids = [r["id"] for r in RUNS]
    assert len(ids) == len(set(ids))


def test_each_stack_is_covered() -> None:
    counts = {s: sum(r["stack"] == s for r in RUNS) for s in STACKS}
    assert counts["torchtitan"] >= 10 and counts["fsdp"] >= 10 and counts["deepspeed"] >= 8, counts
    assert counts["eager"] >= 1, counts
    assert sum("pair" in r for r in RUNS) >= 8  # at least four eager/compiled pairs


@pytest.mark.parametrize("run", RUNS, ids=[r["id"] for r in RUNS])
def test_run_is_complete_and_cited(run: dict) -> None:
    for field in FIELDS:
        assert field in run, field
    assert run["stack"] in STACKS
    assert run["source"] and run["assumptions"]
    measured = run["measured"]
    assert measured["step_time_s"] > 0 and measured["published_as"] and measured["derivation"]
    if "peak_memory_bytes" in measured:
        assert measured["memory_kind"] in ("reserved", "allocated", "active", "nvidia-smi")
        assert 2**30 < measured["peak_memory_bytes"] < 200 * 2**30
    settings = run["stack_settings"]
    for key in SETTINGS:
        assert key in settings, key
    assert settings["sources"], "every run cites where its stack settings come from"
    for key in settings["sources"]:
        assert key in settings, f"a source for a setting the run does not state: {key}"
    assert isinstance(settings["compile"], bool)
    assert settings["float8"] in (None, "tensorwise", "rowwise", "rowwise_with_gw_hp")
    assert (settings["float8"] is not None) == (run["dtype"] == "fp8")
    assert settings["fsdp"] in (None, "fsdp1", "fsdp2")
    assert AC.fullmatch(settings["activation_checkpoint"]), settings["activation_checkpoint"]
    assert run["recompute"] in ("none", "full", "partial")
    if settings["activation_checkpoint"] in ("none", "full"):
        assert run["recompute"] == settings["activation_checkpoint"]
    assert run["zero"] in (0, 1, 2, 3)
    if settings["fsdp"] == "fsdp2":
        assert run["zero"] == 3
    assert not re.search(r"\bsessions?\b", json.dumps(run), re.IGNORECASE)


@pytest.mark.parametrize("run", RUNS, ids=[r["id"] for r in RUNS])
def test_model_cluster_and_layout_resolve(run: dict) -> None:
    model = ModelSpec.from_dict(run["model"], source=run["id"])
    assert model.resolve_seq(run["seq"]) == run["seq"]
    cluster = load_cluster(run["cluster"], run["gpus"])
    assert cluster.num_devices == run["gpus"]
    tp, pp, cp = run["tp"], run["pp"], run.get("cp", 1)
    assert run["gpus"] % (tp * pp * cp) == 0
    dp = run["gpus"] // (tp * pp * cp)
    assert tp * pp * cp * dp == run["gpus"]
    assert run["global_batch"] % (run["microbatch"] * dp) == 0
    assert model.n_heads % tp == 0 and model.kv_heads % min(tp, model.kv_heads) == 0
    if "stage_layers" in run:
        assert len(run["stage_layers"]) == pp and sum(run["stage_layers"]) == model.n_layers
    else:
        assert model.n_layers % (pp * run["vpp"]) == 0
    if "attention" in run:
        assert run["flash_attention"] and run["attention"]["source"]
        assert all(d.prices_attention(run["attention"]["kernel"]) for d in cluster.devices)


PAIRS = [r for r in RUNS if "pair" in r]


@pytest.mark.parametrize("run", PAIRS, ids=[r["id"] for r in PAIRS])
def test_pairs_are_the_same_job_eager_and_compiled(run: dict) -> None:
    other = BY_ID[run["pair"]]
    assert other["pair"] == run["id"]
    assert run["stack_settings"]["compile"] != other["stack_settings"]["compile"]
    for key in set(run) | set(other):
        if key not in PAIR_FREE and key != "variant_of":
            assert run.get(key) == other.get(key), key
    for key in ("float8", "fsdp", "sharding", "activation_checkpoint", "async_tp", "mixed_precision"):
        assert run["stack_settings"][key] == other["stack_settings"][key], key


VARIANTS = [r for r in RUNS if "variant_of" in r]


@pytest.mark.parametrize("run", VARIANTS, ids=[r["id"] for r in VARIANTS])
def test_variants_point_at_runs_of_the_same_model(run: dict) -> None:
    other = BY_ID[run["variant_of"]]
    assert other["id"] != run["id"] and other["model"] == run["model"] and other["gpus"] == run["gpus"]


def test_stated_parameter_counts_match_the_model_fields() -> None:
    # runs that quote a source's parameter count check the model fields against it
    checked = 0
    for run in RUNS:
        found = re.search(r"param_count for these fields is ([\d,]+)", run["assumptions"])
        if found:
            count = int(found.group(1).replace(",", ""))
            assert ModelSpec.from_dict(run["model"]).param_count() == count, run["id"]
            checked += 1
    assert checked >= 6


def test_token_throughput_derivations_reproduce_the_step_time() -> None:
    # 'step_time = global_batch*seq / (tokens/s per GPU * GPUs) = B*S / (T*G)' restated from the run's fields
    pattern = re.compile(r"= (\d+)\*(\d+) / \(([\d.]+)\*(\d+)\)")
    checked = 0
    for run in RUNS:
        found = pattern.search(run["measured"]["derivation"])
        if not found:
            continue
        batch, seq, tps, gpus = (float(x) for x in found.groups())
        assert (batch, seq, gpus) == (run["global_batch"], run["seq"], run["gpus"]), run["id"]
        step = batch * seq / (tps * gpus)
        assert run["measured"]["step_time_s"] == pytest.approx(step, rel=1e-3), run["id"]
        checked += 1
    assert checked >= 40


def test_llm_foundrys_one_node_sweep_derives_from_the_128_gpu_run() -> None:
    """``benchmarks/data/llmfoundry_seq_sweep.py``: each README row becomes the 128-GPU MPT-1B run on
    one node at its own sequence and batch, its step time from the row's tokens per second, and
    each prices (``bench_stacks``) to a finite step; its learned position table grows with the
    sequence as the README's parameter counts do."""
    sweep = _bench_module("llmfoundry_seq_sweep")
    runs = sweep.runs()
    assert len(runs) == len(sweep.ROWS)
    for run, (cluster, _, seq, mb, ga, tps) in zip(runs, sweep.ROWS, strict=True):
        assert (run["cluster"], run["gpus"], run["seq"], run["model"]["seq_len"]) == (cluster, 8, seq, seq)
        assert run["global_batch"] == mb * ga * 8
        assert run["measured"]["step_time_s"] == pytest.approx(run["global_batch"] * seq / (tps * 8))
    # the README's NumParams for 1b at 32,768 tokens (line 131): 1,378,865,152
    long = next(r for r in runs if r["seq"] == 32768)
    assert ModelSpec.from_dict(long["model"]).param_count() == 1_378_865_152
    rows = sweep.table()
    assert all(-1.0 < r["error"] < 1.0 for r in rows)


def test_weak_scaling_pairs_runs_doing_the_same_work_per_gpu() -> None:
    """``bench_stacks.weak_scaling``: llm-foundry's 128- and 512-GPU runs of each MPT size (the same
    microbatch, sequences per GPU and settings) pair up, and runs whose work per GPU differs (the
    8-GPU seq-32k torchtitan run beside the 8B runs) do not."""
    bench_stacks = _bench_module("bench_stacks")
    runs = json.loads((ROOT / "benchmarks" / "data" / "published_stack_runs.json").read_text())["runs"]
    rows = [
        {"id": r["id"], "measured_s": r["measured"]["step_time_s"], "priced": {"predicted_s": 1.0}}
        for r in runs
    ]
    pairs = {(w["small"], w["large"]): w for w in bench_stacks.weak_scaling(rows, runs)}
    for size in ("1b", "3b", "7b", "13b", "30b", "70b"):
        w = pairs[(f"llmfoundry-h100-128gpu-mpt-{size}", f"llmfoundry-h100-512gpu-mpt-{size}")]
        assert w["gpus"] == [128, 512] and w["priced"] == 1.0
    assert not any("seq32k" in a or "seq32k" in b for a, b in pairs)
    per_gpu = {r["id"]: r["global_batch"] / r["gpus"] for r in runs}
    assert all(per_gpu[a] == per_gpu[b] for a, b in pairs)


def test_float8_linear_check_prices_torchaos_benchmarked_shapes() -> None:
    """``benchmarks/data/float8_linear_check.py``: the cost model's GEMM rule prices the bf16 GEMMs
    torchao timed at LLaMA-70B's TP 8 shapes within 15%, prices every row-wise float8 linear faster
    than its bf16 one at those shapes (the measured speedups are 1.11-1.73), and the 128-column
    projections slower (pytorch/torchtitan#1207 measured them slower)."""
    check = _bench_module("float8_linear_check")
    out = check.table("h100-sxm")
    assert [r["name"] for r in out["rows"]] == [s[0] for s in check.SHAPES]
    for r in out["rows"]:
        measured, priced = r["gemm_bf16_ms"]
        assert priced == pytest.approx(measured, rel=0.15), r["name"]
        assert r["linear_speedup"][0] > 1.0 and r["linear_speedup"][1] > 1.0, r["name"]
    assert all(r["float8_over_bf16"] > 1.0 for r in out["narrow"])


def test_llm_foundrys_tables_build_every_size_as_published() -> None:
    """``benchmarks/data/llmfoundry_tables.py``: each row of llm-foundry's H100 and A100 80GB tables
    becomes a run whose model has exactly the table's parameter count (sizes 125M to 70B, learned
    positions for the row's sequence), whose step time is the row's tokens per second, and which
    prices to a finite step that fits the device (the sweep ran it)."""
    tables = _bench_module("llmfoundry_tables")
    runs = tables.runs()
    every = tables.ROWS + tables.FP8_ROWS + tables.A100_40GB_ROWS
    assert len(runs) == len(every) > 100
    for run, row in zip(runs, every, strict=True):
        cluster, _, _, seq, gpus, mb, accum, tps, _, _, params = row
        assert ModelSpec.from_dict(run["model"]).param_count() == params, run["id"]
        assert (run["cluster"], run["gpus"], run["global_batch"]) == (cluster, gpus, mb * accum * gpus)
        assert run["measured"]["step_time_s"] == pytest.approx(run["global_batch"] * seq / (tps * gpus))
    rows = tables.table()
    assert all(-1.0 < r["error"] < 1.0 for r in rows)
    # every row ran, so each is priced as fitting its device
    assert [r["id"] for r in rows if not r["fits"]] == []
    assert sum(r["fitted"] for r in rows) == sum(1 for r in tables.ROWS if r[2] == "1b" and r[4] == 8)
    assert not any(r["fitted"] for r in rows if r["cluster"] == "dgx-a100-40gb")
    assert {r["dtype"] for r in rows} == {"bf16", "fp8"}


def test_nanogpts_vocabulary_padding_check_prices_the_head_alone() -> None:
    """``benchmarks/data/nanogpt_vocab_padding.py``: nanoGPT@77e7e04c's step (GPT-2 124M, tied head,
    no biases: 124,373,760 parameters with the padded vocabulary) is priced slower with its odd
    vocabulary, and the whole difference lies in the LM head (the blocks' kernels are the same)."""
    check = _bench_module("nanogpt_vocab_padding")
    spec = replace(load_model_spec("gpt2-124m"), vocab_size=50304, **check.GPT2)
    assert spec.param_count() == 124_373_760
    odd, padded = check.price(50257, "dgx-a100-40gb"), check.price(50304, "dgx-a100-40gb")
    assert odd["step_s"] > padded["step_s"]
    assert odd["head_share"] > padded["head_share"]
    blocks = (odd["step_s"] - odd["head_s"], padded["step_s"] - padded["head_s"])
    assert blocks[0] == pytest.approx(blocks[1], rel=0.01)


def test_a_runs_own_gemm_padding_overrides_its_presets() -> None:
    """``stack_settings.gemm_padding``: nanoGPT's compiled rows ran on an Inductor that did not pad
    matrix multiplies yet, so the ``eager-compile`` preset's padding is switched off for them."""
    bench_stacks = _bench_module("bench_stacks")
    runs = json.loads((ROOT / "benchmarks" / "data" / "published_stack_runs.json").read_text())["runs"]
    run = next(r for r in runs if r["id"] == "nanogpt-a100-1gpu-gpt2-124m-compile")
    assert run["stack_settings"]["gemm_padding"] is False
    _, _, config = bench_stacks.configured(run, "eager-compile")
    assert config.gemm_padding is False
    unpadded = copy.deepcopy(run)
    del unpadded["stack_settings"]["gemm_padding"]
    assert bench_stacks.configured(unpadded, "eager-compile")[2].gemm_padding is True
    # and it is priced slower for it: the LM head's gradient GEMMs run unaligned
    assert bench_stacks.price(run, "eager-compile")[0] > bench_stacks.price(unpadded, "eager-compile")[0]


def test_the_other_stacks_runs_kept_with_the_megatron_data_are_priced_with_their_preset() -> None:
    """MT-NLG 530B ran Megatron-DeepSpeed: ``bench_stacks`` prices its rows of ``published_runs.json``
    with the ``deepspeed`` preset (DeepSpeed's pipeline engine, whole sends), where the Megatron
    benchmark reports them apart under Megatron's schedule; a Megatron-LM run is not taken."""
    bench_stacks = _bench_module("bench_stacks")
    megatron = json.loads((ROOT / "benchmarks" / "data" / "published_runs.json").read_text())["runs"]
    others = bench_stacks.other_stack_runs()
    assert {r["id"] for r in others} == {r["id"] for r in megatron if r.get("stack") == "megatron-deepspeed"}
    assert others and all(r["stack"] == "deepspeed" and not r["stack_settings"]["compile"] for r in others)
    assert not {r["id"] for r in others} & set(BY_ID)  # no run twice
    run = others[0]
    assert bench_stacks.configured(run, "deepspeed")[2].pp_send == "whole"
    megatron_step = bench_stacks.price(run, "megatron")[0]
    assert bench_stacks.price(run, "deepspeed")[0] > megatron_step  # its engine: blocking, whole sends
