"""The ``coplan`` command line: JSON output, one-line user errors with exit code 2, presets listing."""

from __future__ import annotations

import importlib.util
import json
import re
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from coplan.cli.common import human_bytes, human_count, human_flops, one_line

SUMMARY_KEYS = {"params", "flops", "ops", "activation_bytes", "blocks", "fingerprint"}
GPT_TINY_PARAMS = 136960
#: the ``cli`` fixture (tests/conftest.py): ``coplan ARGS`` in process -> (exit code, stdout, stderr)
Cli = Callable[..., tuple[int, str, str]]


def assert_one_line_error(code: int, err: str, *needles: str) -> None:
    assert code == 2, err
    assert "Traceback" not in err
    lines = err.strip().splitlines()
    assert len(lines) == 1, err
    assert lines[0].startswith("error: "), err
    for needle in needles:
        assert needle in lines[0], (needle, lines[0])


def _hardware_available() -> bool:
    try:
        return importlib.util.find_spec("coplan.hardware") is not None
    except ImportError:
        return False


needs_hardware = pytest.mark.skipif(not _hardware_available(), reason="coplan.hardware is not available yet")


# --- graph -------------------------------------------------------------------------------------


@pytest.mark.capture
def test_graph_json(cli: Cli) -> None:
    code, out, _ = cli("graph", "--model", "gpt-tiny", "--batch", "2", "--seq", "32", "--json")
    assert code == 0
    data = json.loads(out)  # the whole of stdout is one JSON document
    assert isinstance(data, dict)
    assert data.keys() >= SUMMARY_KEYS
    assert data["params"] == GPT_TINY_PARAMS
    assert (data["batch"], data["seq"], data["model"]) == (2, 32, "gpt-tiny")
    assert data["flops"] > 0 and data["activation_bytes"] > 0 and data["blocks"] == 2


@pytest.mark.capture
def test_graph_text(cli: Cli) -> None:
    code, out, err = cli("graph", "--model", "gpt-tiny", "--batch", "2", "--seq", "32")
    assert code == 0, err
    for text in ("gpt-tiny", "137.0K", "136,960", "FLOP", "forward", "backward", "matmul", "fingerprint"):
        assert text in out, text


@pytest.mark.capture
def test_graph_seq_defaults_to_model_seq_len(cli: Cli) -> None:
    code, out, _ = cli("graph", "-m", "gpt-tiny", "--json")
    assert code == 0
    assert json.loads(out)["seq"] == 64


def test_graph_synthetic_matches_params(cli: Cli) -> None:
    if importlib.util.find_spec("coplan.capture.synthetic") is None:
        pytest.skip("coplan.capture.synthetic is not available yet")
    code, out, err = cli(
        "graph", "-m", "gpt-tiny", "--batch", "2", "--seq", "32", "--impl", "synthetic", "--json"
    )
    assert code == 0, err
    assert json.loads(out)["params"] == GPT_TINY_PARAMS


def test_unknown_model(cli: Cli) -> None:
    code, out, err = cli("graph", "--model", "nope")
    assert out == ""
    assert_one_line_error(code, err, "'nope'")


def test_spec_file_unknown_field(cli: Cli, tmp_path: Path) -> None:
    spec = tmp_path / "bad_field.json"
    spec.write_text(json.dumps({"n_layers": 2, "d_model": 64, "n_heads": 4, "vocab_size": 512, "bogus": 1}))
    code, _, err = cli("graph", "--model", str(spec))
    assert_one_line_error(code, err, str(spec), "bogus")


def test_spec_file_bad_json(cli: Cli, tmp_path: Path) -> None:
    spec = tmp_path / "broken.json"
    spec.write_text('{"n_layers": 2,')
    code, _, err = cli("graph", "--model", str(spec))
    assert_one_line_error(code, err, str(spec), "JSON")


def test_spec_file_missing(cli: Cli, tmp_path: Path) -> None:
    spec = tmp_path / "absent.json"
    code, _, err = cli("graph", "--model", str(spec))
    assert_one_line_error(code, err, str(spec))


@pytest.mark.parametrize(("option", "value"), [("--batch", "0"), ("--batch", "-3"), ("--seq", "0")])
def test_bad_sizes(cli: Cli, option: str, value: str) -> None:
    code, out, err = cli("graph", "--model", "gpt-tiny", option, value)
    assert out == ""
    assert_one_line_error(code, err, option, value)


def test_seq_longer_than_model(cli: Cli) -> None:
    code, _, err = cli("graph", "--model", "gpt-tiny", "--seq", "65")
    assert_one_line_error(code, err, "seq_len", "65")


def test_usage_errors_exit_2(cli: Cli) -> None:
    for args in (
        ("graph", "--model"),
        ("graph", "-m", "gpt-tiny", "--batch", "x"),
        ("graph", "-m", "gpt-tiny", "--impl", "jax"),
        ("plan", "--strategy", "bogus"),
        ("nocommand",),
    ):
        code, _, err = cli(*args)
        assert_one_line_error(code, err)


def test_help(cli: Cli) -> None:
    code, out, _ = cli("--help")
    assert code == 0
    for command in ("graph", "hardware", "plan"):
        assert command in out


def test_subprocess_error_has_no_traceback() -> None:
    """End to end through ``python -m coplan.cli``: stderr is exactly one line."""
    proc = subprocess.run(
        [sys.executable, "-m", "coplan.cli", "graph", "--model", "nope"],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert proc.stdout == ""
    assert_one_line_error(proc.returncode, proc.stderr, "'nope'")


# --- hardware ----------------------------------------------------------------------------------


@needs_hardware
def test_hardware_json(cli: Cli) -> None:
    code, out, _ = cli("hardware", "--json")
    assert code == 0
    data: dict[str, Any] = json.loads(out)
    assert set(data) == {"devices", "clusters", "aliases"}
    assert "h100-sxm" in data["devices"] and "dgx-h100" in data["clusters"]
    assert data["devices"]["h100-sxm"]["memory_bytes"] > 0
    assert data["aliases"]["dgx-a100"] == "dgx-a100-80gb"


def test_estimate_takes_a_short_cluster_name(cli: Cli) -> None:
    args = ("estimate", "-m", "gpt2-124m", "--gpus", "16", "--tp", "2", "--microbatch", "2", "--json")
    runs = [json.loads(cli(*args, "--cluster", name)[1]) for name in ("dgx-a100", "dgx-a100-80gb")]
    assert runs[0]["step_time_s"] == runs[1]["step_time_s"] > 0


@needs_hardware
def test_hardware_text(cli: Cli) -> None:
    code, out, _ = cli("hardware")
    assert code == 0
    for text in ("h100-sxm", "dgx-h100", "TFLOP/s", "nvlink"):
        assert text in out


# --- plan --------------------------------------------------------------------------------------


@needs_hardware
@pytest.mark.capture
def test_plan_json(cli: Cli, tmp_path: Path) -> None:
    out_file = tmp_path / "plan.json"
    code, out, err = cli(
        "plan", "--model", "gpt-tiny", "--global-batch", "8", "--json", "--out", str(out_file)
    )
    assert code == 0, err
    data = json.loads(out)
    for key in ("step_time_s", "tokens_per_s", "mfu", "peak_bytes", "fits", "plan_time_s", "plan"):
        assert key in data, key
    assert data["fits"] is True and data["peak_bytes"] <= data["budget_bytes"]
    assert data["plan"]["model"] == "gpt-tiny" and data["plan"]["gpus"] == 1
    # the file holds the same plan, and it loads back with a matching fingerprint
    from coplan.plan import Plan

    assert Plan.load(str(out_file)).fingerprint == data["plan"]["fingerprint"]


@needs_hardware
def test_plan_text(cli: Cli) -> None:
    code, out, err = cli("plan", "-m", "gpt-tiny", "--global-batch", "4", "--seq", "16")
    assert code == 0, err
    assert "gpt-tiny" in out and "step time" in out and "fingerprint" in out


@needs_hardware
def test_compare_json_contract(cli: Cli, tmp_path: Path) -> None:
    report = tmp_path / "r.html"
    code, out, err = cli("compare", "-m", "gpt-tiny", "--global-batch", "8", "--json", "--html", str(report))
    assert code == 0, err
    data = json.loads(out)
    names = {"sequential", "sequential-best", "iterated", "hierarchical", "joint"}
    assert set(data["strategies"]) == names
    for entry in data["strategies"].values():
        assert {
            "step_time_s",
            "tokens_per_s",
            "mfu",
            "peak_bytes",
            "fits",
            "plan_time_s",
            "plan",
        } <= entry.keys()
    joint = data["strategies"]["joint"]["step_time_s"]
    assert all(joint <= e["step_time_s"] * (1 + 1e-9) for e in data["strategies"].values() if e["fits"])
    text = report.read_text()
    assert "Plotly.newPlot" in text and "chosen by joint" in text
    assert re.search(r"<script[^>]*\bsrc\s*=", text) is None  # plotly.js is embedded: opens offline


@needs_hardware
def test_infeasible_plan_exits_3(cli: Cli) -> None:
    code, out, err = cli("plan", "-m", "llama2-70b", "--gpus", "1", "--seq", "512", "--json")
    assert code == 3
    data = json.loads(out)
    assert data["fits"] is False and "nothing fits" in data["reason"]
    assert err.startswith("error: nothing fits") and len(err.strip().splitlines()) == 1


@needs_hardware
@pytest.mark.parametrize(
    ("args", "needle"),
    [
        (("--cluster", "nope"), "'nope'"),
        (("--gpus", "0"), "--gpus"),
        (("--cluster", "dgx-h100", "--gpus", "12"), "12"),
        (("--global-batch", "0"), "--global-batch"),
        (("--memory-budget-gb", "-1"), "--memory-budget-gb"),
        (("--strategy", "magic"), "magic"),
        (("--strategy", "sequential", "--order", "fusion,remat"), "--order"),
    ],
)
def test_plan_errors(cli: Cli, args: tuple[str, ...], needle: str) -> None:
    code, _, err = cli("plan", "--model", "gpt-tiny", *args)
    assert_one_line_error(code, err, needle)


# --- formatting --------------------------------------------------------------------------------


def test_human_numbers() -> None:
    assert human_count(124_439_808) == "124.4M"
    assert human_count(950) == "950"
    assert human_count(1.5e9) == "1.5B"
    assert human_flops(2.3e12) == "2.3 TFLOP"
    assert human_flops(0) == "0 FLOP"
    assert human_bytes(816_926_728) == "779.1 MiB"
    assert human_bytes(2.5 * 2**30) == "2.5 GiB"
    assert one_line("a\n  b\n\nc") == "a b c"


def test_estimate_stack_flags_reach_the_cost_model(cli: Cli) -> None:
    base = ("estimate", "--model", "gpt2-124m", "--cluster", "dgx-h100", "--gpus", "8", "--tp", "2")
    base += ("--pp", "2", "--microbatch", "2", "--global-batch", "16", "--json")

    def est(*extra: str) -> dict:
        code, out, err = cli(*base, *extra)
        assert code == 0, err
        return json.loads(out)

    ref = est()
    # 16-bit gradients halve the gradient bytes
    assert est("--grad-reduce-16bit")["memory"]["grads_bytes"] == pytest.approx(
        ref["memory"]["grads_bytes"] / 2
    )
    # an uneven split moves layers onto one stage: its time and the step's grow
    assert est("--stage-layers", "4,8")["step_time_s"] > ref["step_time_s"]
    # blocking sends cost more than overlapped ones with an interleaved schedule
    inter = ("--vpp", "2")
    assert est(*inter, "--no-overlap-p2p")["breakdown_s"]["pp_comm"] > est(*inter)["breakdown_s"]["pp_comm"]
    # DeepSpeed's engine sends the whole activation from every TP rank: its stack's default, and a flag
    whole = est("--pp-send", "whole")
    assert whole["config"]["pp_send"] == "whole" and "pp_send" not in ref["config"]
    assert whole["breakdown_s"]["pp_comm"] != ref["breakdown_s"]["pp_comm"]
    assert est("--stack", "deepspeed")["config"]["pp_send"] == "whole"
    assert "pp_send" not in est("--stack", "deepspeed", "--pp-send", "scatter-gather")["config"]
    # a bad split is one line naming the option, exit 2
    code, _, err = cli(*base, "--stage-layers", "5,x")
    assert code == 2 and "--stage-layers" in err and len(err.strip().splitlines()) == 1
    code, _, err = cli(*base, "--stage-layers", "5,6")
    assert code == 2 and "stage_layers" in err
    # FlashAttention-2 forced on an H100 (TE with NVTE_FUSED_ATTN=0) is slower than cuDNN's kernel
    fa2 = est("--attention-kernel", "flash2")
    assert fa2["breakdown_s"]["compute"] > ref["breakdown_s"]["compute"]
    assert est("--attention-kernel", "cudnn")["step_time_s"] == ref["step_time_s"]
    # MPT's Triton kernel, slower again than FlashAttention-2 (llm-foundry's sequence sweep)
    assert est("--attention-kernel", "triton")["breakdown_s"]["compute"] > fa2["breakdown_s"]["compute"]
    # a kernel the device has no rates for is one line naming the field, exit 2
    code, _, err = cli(*base[:4], "dgx-b200", *base[5:], "--attention-kernel", "flash2")
    assert_one_line_error(code, err, "attention_kernel", "flash2")


def test_plan_short_s_is_the_sequence_length_as_on_every_command(cli: Cli) -> None:
    # `-s` once belonged to both --seq and --strategy on `coplan plan`, and --strategy won
    args = ("plan", "--model", "gpt-tiny", "--cluster", "cpu", "--gpus", "1", "--global-batch", "4")
    code, out, err = cli(*args, "-s", "32", "--json")
    assert code == 0, err
    assert json.loads(out)["plan"]["seq"] == 32


def test_help_keeps_computed_defaults_in_brackets(cli: Cli) -> None:
    # Rich markup took "[default: ...]" for a style tag and dropped it from every help text
    code, out, _ = cli("estimate", "--help")
    flat = " ".join(out.replace("│", " ").split())
    assert code == 0 and "[default: N / (tp x pp)]" in flat


def test_estimate_overlaps_default_to_what_a_production_stack_runs(
    cli: Cli,
) -> None:
    """Unsaid, TP comm overlap follows sequence parallelism on Hopper (fp8-capable) GPUs only, and
    the parameter all-gather overlap follows the distributed optimizer; either flag overrides."""

    def config(cluster: str, *extra: str) -> dict:
        args = ("estimate", "--model", "gpt2-124m", "--cluster", cluster, "--gpus", "8", "--tp", "2")
        code, out, err = cli(*args, "--microbatch", "2", "--global-batch", "16", "--json", *extra)
        assert code == 0, err
        return json.loads(out)["config"]

    sp = ("--sequence-parallel",)
    assert config("dgx-h100", *sp)["tp_comm_overlap"] is True
    assert config("dgx-h100")["tp_comm_overlap"] is False  # TE's overlap needs sequence parallelism
    assert config("dgx-a100-80gb", *sp)["tp_comm_overlap"] is False
    assert config("dgx-h100", *sp, "--no-tp-comm-overlap")["tp_comm_overlap"] is False
    assert config("dgx-a100-80gb", *sp, "--tp-comm-overlap")["tp_comm_overlap"] is True
    # forced without sequence parallelism: what Megatron-Core refuses, one line, exit 2
    args = ("estimate", "--model", "gpt2-124m", "--cluster", "dgx-h100", "--gpus", "8", "--tp", "2")
    code, out, err = cli(*args, "--tp-comm-overlap", "--json")
    assert code == 2 and out == "" and "tp_comm_overlap" in err and "sequence parallelism" in err
    assert len(err.strip().splitlines()) == 1
    assert config("dgx-h100", "--zero", "1")["overlap_param_gather"] is True
    assert config("dgx-h100")["overlap_param_gather"] is False
    assert config("dgx-h100", "--zero", "1", "--no-overlap-param-gather")["overlap_param_gather"] is False


def test_plan_of_a_spec_file_tells_coplan_run_to_read_the_same_file(cli: Cli, tmp_path: Path) -> None:
    from coplan.models.spec import PRESETS

    spec = tmp_path / "mine.json"
    spec.write_text(json.dumps({**PRESETS["gpt-tiny"].to_dict(), "name": "mine"}))
    code, out, err = cli(
        "plan", "--model", str(spec), "--cluster", "cpu", "--global-batch", "8", "--stack", "coplan",
        "--out", str(tmp_path / "plan.json"),
    )  # fmt: skip
    assert code == 0, err
    flat = " ".join(out.split())
    assert f"coplan run --model {spec} --plan" in flat
