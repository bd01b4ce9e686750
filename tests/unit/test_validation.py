"""Bad numbers are refused in one line naming the field (exit 2): NaN, infinities, negatives and sizes
beyond ``coplan.limits``' bounds, in model specs, device and cluster specs and job sizes; the seq and
the memory budget are checked alike by every command; a run whose numerics failed exits 1 after
printing its report."""

from __future__ import annotations

import json
import math
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from coplan.apply.run import RunFailed, failure
from coplan.cost import CostModel, TrainingConfig
from coplan.cost.config import ConfigError
from coplan.errors import SpecError
from coplan.hardware import device_presets, load_cluster
from coplan.limits import (
    MAX_D_MODEL,
    MAX_DEVICES,
    MAX_DEVICES_PER_NODE,
    MAX_EXPERTS,
    MAX_FFN_HIDDEN,
    MAX_GLOBAL_BATCH,
    MAX_LAYERS,
    MAX_SEQ,
    MAX_VOCAB,
)
from coplan.models.spec import PRESETS, ModelSpec
from coplan.passes.parallel import _divisors
from coplan.plan import GiB, PlanContext

#: the ``cli`` fixture (tests/conftest.py): ``coplan ARGS`` in process -> (exit code, stdout, stderr)
Cli = Callable[..., tuple[int, str, str]]

TINY: dict[str, Any] = {"n_layers": 2, "d_model": 64, "n_heads": 4, "vocab_size": 512, "seq_len": 64}
MOE = {"n_experts": 4, "top_k": 2}


def assert_one_line_error(code: int, err: str, *needles: str) -> None:
    assert code == 2, err
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), err
    for needle in needles:
        assert needle in lines[0], (needle, lines[0])


def _write(tmp_path: Path, name: str, data: object) -> Path:
    path = tmp_path / name
    path.write_text(json.dumps(data))  # NaN and Infinity as the JSON literals Python reads back
    return path


# --- model specs ---------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("fields", "field", "needle"),
    [
        ({"capacity_factor": math.nan, **MOE}, "capacity_factor", "nan"),
        ({"capacity_factor": math.inf}, "capacity_factor", "inf"),
        ({"capacity_factor": 0}, "capacity_factor", "positive"),
        ({"capacity_factor": 10**400}, "capacity_factor", "finite"),
        ({"norm_eps": math.nan}, "norm_eps", "nan"),
        ({"norm_eps": -1e-5}, "norm_eps", "positive"),
        ({"norm_eps": 1.0}, "norm_eps", "(0, 1)"),
        ({"rope_theta": -math.inf}, "rope_theta", "-inf"),
        ({"rope_theta": -1.0}, "rope_theta", "positive"),
        ({"hidden_dropout": math.nan}, "hidden_dropout", "nan"),
        ({"attention_dropout": math.inf}, "attention_dropout", "inf"),
        ({"n_layers": -3}, "n_layers", "positive"),
        ({"n_layers": True}, "n_layers", "True"),
        ({"ffn_hidden": False}, "ffn_hidden", "False"),
        ({**MOE, "top_k": True}, "top_k", "True"),
    ],
)
def test_non_finite_negative_and_boolean_model_fields_are_refused(
    cli: Cli, tmp_path: Path, fields: dict[str, Any], field: str, needle: str
) -> None:
    path = _write(tmp_path, "m.json", {**TINY, **fields})
    code, out, err = cli("plan", "--model", str(path))
    assert out == ""
    assert_one_line_error(code, err, str(path), f"'{field}'", needle)


@pytest.mark.parametrize(
    ("fields", "field", "bound"),
    [
        ({"n_layers": 2**31}, "n_layers", MAX_LAYERS),
        ({"n_layers": 10**12}, "n_layers", MAX_LAYERS),
        ({"n_layers": 10**400}, "n_layers", MAX_LAYERS),
        ({"d_model": 2 * MAX_D_MODEL}, "d_model", MAX_D_MODEL),
        ({"ffn_hidden": 2 * MAX_FFN_HIDDEN}, "ffn_hidden", MAX_FFN_HIDDEN),
        ({"vocab_size": 2 * MAX_VOCAB}, "vocab_size", MAX_VOCAB),
        ({"seq_len": 2 * MAX_SEQ}, "seq_len", MAX_SEQ),
        ({"n_experts": 2 * MAX_EXPERTS, "top_k": 1}, "n_experts", MAX_EXPERTS),
    ],
)
def test_model_sizes_beyond_the_bounds_are_refused_at_once(
    cli: Cli, tmp_path: Path, fields: dict[str, Any], field: str, bound: int
) -> None:
    path = _write(tmp_path, "m.json", {**TINY, **fields})
    code, _, err = cli("plan", "--model", str(path))
    assert_one_line_error(code, err, str(path), f"'{field}'", f"at most {bound:,}")


def test_the_bounds_admit_the_largest_published_models() -> None:
    big = PRESETS["megatron-1t"]
    assert big.n_layers <= MAX_LAYERS and big.d_model <= MAX_D_MODEL
    assert PRESETS["llama3-405b"].ffn <= MAX_FFN_HIDDEN and PRESETS["nemotron4-340b"].vocab_size <= MAX_VOCAB
    # a 2^17-token context and Switch-C's 2,048 experts
    ModelSpec(**{**TINY, "seq_len": 2**17, "n_experts": 2048, "top_k": 1})
    ModelSpec(**{**TINY, "n_layers": MAX_LAYERS, "d_model": MAX_D_MODEL, "vocab_size": MAX_VOCAB})


@pytest.mark.parametrize("seq", [0, -5, True, 2.5])
def test_resolve_seq_refuses_anything_but_a_positive_integer(seq: Any) -> None:
    with pytest.raises(SpecError) as exc:
        PRESETS["gpt-tiny"].resolve_seq(seq)
    assert exc.value.field == "seq"
    assert PRESETS["gpt-tiny"].resolve_seq(None) == 64 and PRESETS["gpt-tiny"].resolve_seq(32) == 32


@pytest.mark.parametrize(
    "args",
    [("plan", "--seq", "0"), ("plan", "--seq", "-5"), ("estimate", "--seq", "0"), ("graph", "--seq", "0")],
)
def test_every_command_refuses_a_non_positive_seq(cli: Cli, args: tuple[str, ...]) -> None:
    code, out, err = cli(*args, "--model", "gpt-tiny")
    assert out == ""
    assert_one_line_error(code, err, "seq", args[-1])


# --- device and cluster specs --------------------------------------------------------------------


@pytest.mark.parametrize(
    ("key", "value", "field", "needle"),
    [
        ("memory_bandwidth", math.nan, "memory_bandwidth", "nan"),
        ("vector_flops", math.inf, "vector_flops", "inf"),
        ("vector_flops", 10**400, "vector_flops", "finite"),
        ("kernel_launch_s", -1e-6, "kernel_launch_s", ">= 0"),
        ("memory_bytes", True, "memory_bytes", "boolean"),
        ("peak_flops", {"fp32": -math.inf}, "peak_flops.fp32", "-inf"),
        ("efficiency", {"matmul": math.nan}, "efficiency.matmul", "nan"),
    ],
)
def test_bad_device_numbers_are_refused(
    cli: Cli, tmp_path: Path, key: str, value: object, field: str, needle: str
) -> None:
    data = {**device_presets()["cpu"].to_dict(), key: value}
    path = _write(tmp_path, "d.json", data)
    code, _, err = cli("plan", "--model", "gpt-tiny", "--cluster", str(path))
    assert_one_line_error(code, err, str(path), field, needle)


def _cluster(**group: object) -> dict[str, Any]:
    data = load_cluster("dgx-h100").to_dict()
    data["groups"][0] = {**data["groups"][0], "device": "h100-sxm", **group}
    return data


@pytest.mark.parametrize(
    ("group", "field", "needle"),
    [
        ({"nodes": 10**9}, "groups[0].nodes", f"at most {MAX_DEVICES:,}"),
        (
            {"devices_per_node": 4 * MAX_DEVICES_PER_NODE},
            "groups[0].devices_per_node",
            f"{MAX_DEVICES_PER_NODE:,}",
        ),
        ({"nodes": True}, "groups[0].nodes", "boolean"),
        ({"nodes": math.inf}, "groups[0].nodes", "inf"),
    ],
)
def test_bad_cluster_sizes_are_refused(
    cli: Cli, tmp_path: Path, group: dict[str, object], field: str, needle: str
) -> None:
    path = _write(tmp_path, "c.json", _cluster(**group))
    code, _, err = cli("plan", "--model", "gpt-tiny", "--cluster", str(path))
    assert_one_line_error(code, err, str(path), field, needle)


def test_bad_link_numbers_and_too_many_devices_in_all_are_refused(cli: Cli, tmp_path: Path) -> None:
    data = _cluster()
    data["inter_node"]["latency_s"] = -math.inf
    path = _write(tmp_path, "c.json", data)
    code, _, err = cli("plan", "--model", "gpt-tiny", "--cluster", str(path))
    assert_one_line_error(code, err, "inter_node.latency_s", "-inf")
    # each group within the bounds, the two together beyond them
    data = _cluster(nodes=MAX_DEVICES // 8)
    data["groups"].append(data["groups"][0])
    path = _write(tmp_path, "c2.json", data)
    code, _, err = cli("plan", "--model", "gpt-tiny", "--cluster", str(path))
    assert_one_line_error(code, err, "groups", f"{MAX_DEVICES:,}")


# --- job sizes and the memory budget ---------------------------------------------------------------


def test_a_huge_gpu_count_is_refused_not_searched(cli: Cli) -> None:
    code, _, err = cli("plan", "--model", "gpt-tiny", "--gpus", str(10**9))
    assert_one_line_error(code, err, "gpus", f"at most {MAX_DEVICES:,}")
    assert load_cluster("dgx-h100", 100_000).num_devices == 100_000  # the largest clusters built


def test_a_huge_global_batch_is_refused(cli: Cli) -> None:
    code, _, err = cli("plan", "--model", "gpt-tiny", "--global-batch", str(2 * MAX_GLOBAL_BATCH))
    assert_one_line_error(code, err, "global_batch", f"at most {MAX_GLOBAL_BATCH:,}")
    with pytest.raises(ConfigError, match="global_batch"):
        TrainingConfig(global_batch=2 * MAX_GLOBAL_BATCH)
    with pytest.raises(ConfigError, match="dp"):
        TrainingConfig(dp=2 * MAX_DEVICES)


def test_divisors_are_those_of_the_brute_force_search() -> None:
    for n in [*range(1, 200), 100_000, 2**17, 3 * 7 * 11 * 13, 997**2]:
        assert _divisors(n) == [d for d in range(1, n + 1) if n % d == 0], n


@pytest.mark.parametrize(
    ("budget", "needle"), [("inf", "finite"), ("nan", "--memory-budget-gb"), ("130", "exceeds the 40.0 GiB")]
)
def test_a_budget_beyond_the_device_is_refused(cli: Cli, budget: str, needle: str) -> None:
    code, out, err = cli(
        "plan", "--model", "gpt-tiny", "--cluster", "dgx-a100-40gb", "--memory-budget-gb", budget
    )
    assert out == ""
    assert_one_line_error(code, err, "budget", needle)


def test_a_budget_up_to_the_capacity_is_taken_as_given() -> None:
    cluster = load_cluster("dgx-a100-40gb")
    cap = cluster.device.memory_bytes
    ctx = PlanContext(CostModel(spec=PRESETS["gpt-tiny"]), cluster, global_batch=8, seq=64, budget_bytes=cap)
    assert ctx.budget == cap
    for bad in (cap + 1, math.inf, -GiB, 0.0):
        with pytest.raises(SpecError, match="memory budget"):
            PlanContext(
                CostModel(spec=PRESETS["gpt-tiny"]), cluster, global_batch=8, seq=64, budget_bytes=bad
            )


# --- a run whose numbers went wrong ----------------------------------------------------------------

GOOD_CHECK = {"max_rel_err": 1e-6, "tolerance": 1e-3, "ok": True}


def test_failure_names_a_non_finite_loss_and_a_failed_gradient_check() -> None:
    assert failure({"loss": [7.1, 7.0], "grad_check": GOOD_CHECK}) is None
    why = failure({"loss": [7.1, math.nan, math.inf], "grad_check": GOOD_CHECK})
    assert why is not None and "loss is not finite at step 1 (2 of 3 steps)" in why
    bad = {"max_rel_err": 0.2, "tolerance": 1e-3, "ok": False}
    why = failure({"loss": [7.1], "grad_check": bad})
    assert why is not None and "gradient check failed" in why and "2.00e-01" in why and "loss" not in why
    both = failure({"loss": [None], "grad_check": {**bad, "max_rel_err": math.nan}})
    assert both is not None and "loss" in both and "gradient" in both and "\n" not in both


@pytest.mark.parametrize(
    ("report", "needle"),
    [
        ({"loss": [math.nan, math.nan], "grad_check": GOOD_CHECK}, "loss is not finite"),
        (
            {"loss": [7.0, 6.9], "grad_check": {**GOOD_CHECK, "max_rel_err": 0.5, "ok": False}},
            "gradient check",
        ),
    ],
)
def test_run_prints_its_report_then_exits_1_when_the_run_failed(
    cli: Cli, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, report: dict[str, Any], needle: str
) -> None:
    spec = PRESETS["gpt-tiny"]
    ctx = PlanContext(CostModel(spec=spec), load_cluster("cpu"), global_batch=2, seq=64)
    plan = tmp_path / "plan.json"
    plan.write_text(ctx.default_plan().to_json())
    monkeypatch.setattr("coplan.apply.run.run_plan", lambda req: report)
    code, out, err = cli("run", "--model", "gpt-tiny", "--plan", str(plan), "--steps", "2", "--json")
    assert code == RunFailed.exit_code == 1
    assert json.loads(out)["loss"] == [None if not math.isfinite(v) else v for v in report["loss"]]
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: run failed: ") and needle in lines[0], err
