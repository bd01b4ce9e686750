"""Fuzzing the command line: random model spec files and random option values, through ``main()``.

Every outcome must be an answer: exit 0 with output that parses (and numbers that are not absurd),
or a refusal of exactly one line ``error: ...`` with exit 2 (bad input) or 3 (nothing fits). An
uncaught exception anywhere fails the test with its traceback. The default tier draws a few hundred
cases; ``-m slow`` draws thousands (``FUZZ_EXAMPLES`` below; the count is reported in docs/cli.md).
"""

from __future__ import annotations

import contextlib
import io
import json
import math
import os
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from coplan.cli import main

#: Examples per test: (default tier, slow tier). Four tests: 4 x 75 = 300 and 4 x 1,250 = 5,000.
FUZZ_EXAMPLES = (75, 1250)

_TMP = Path(tempfile.mkdtemp(prefix="coplan-fuzz-"))


def invoke(*args: str) -> tuple[int, str, str]:
    """``coplan ARGS`` in process: (exit code, stdout, stderr). Anything but ``SystemExit`` escapes."""
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try:
            main(list(args))
        except SystemExit as done:
            code = done.code if isinstance(done.code, int) else (0 if done.code is None else 1)
        else:  # pragma: no cover - main always exits
            code = 0
    return code, out.getvalue(), err.getvalue()


def assert_answer(code: int, out: str, err: str, *, json_out: bool) -> None:
    """An exit code coplan documents, and the shape that goes with it."""
    assert "Traceback" not in err, err
    if code == 0:
        if json_out:
            data = json.loads(out)
            _not_absurd(data)
        return
    assert code in (2, 3), (code, err)
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), err


def _not_absurd(data: dict[str, Any]) -> None:
    mfu = data.get("mfu")
    if mfu is not None:
        assert 0 < mfu <= 1, mfu
    step = data.get("step_time_s")
    if step is not None:
        assert math.isfinite(step) and step > 0, step
    fits, memory = data.get("fits"), data.get("memory")
    if fits and isinstance(memory, dict) and "capacity_bytes" in memory:
        assert memory["peak_bytes"] <= memory["capacity_bytes"], memory


def _examples(slow: bool) -> int:
    return FUZZ_EXAMPLES[1 if slow else 0]


# --- model spec files -----------------------------------------------------------------------------

_weird = st.one_of(
    st.none(),
    st.booleans(),
    st.text(max_size=8),
    st.lists(st.integers(), max_size=2),
    st.floats(allow_nan=True, allow_infinity=True),
    st.sampled_from([0, -1, 2**31, 10**12, 2**63, -(2**63), 1e308, -1e-300]),
)
_small_int = st.integers(min_value=1, max_value=64)
_fields: dict[str, st.SearchStrategy[Any]] = {
    "n_layers": st.one_of(st.integers(1, 4), _weird),
    "d_model": st.one_of(st.sampled_from([32, 64, 96, 128]), _weird),
    "n_heads": st.one_of(st.sampled_from([1, 2, 4, 8]), _weird),
    "vocab_size": st.one_of(st.integers(2, 1024), _weird),
    "seq_len": st.one_of(st.sampled_from([16, 32, 64]), _weird),
    "ffn_hidden": st.one_of(_small_int.map(lambda x: 16 * x), _weird),
    "n_kv_heads": st.one_of(st.sampled_from([1, 2, 4]), _weird),
    "activation": st.one_of(st.sampled_from(["gelu", "swiglu", "relu", "squared_relu"]), _weird),
    "norm": st.one_of(st.sampled_from(["layernorm", "rmsnorm"]), _weird),
    "position": st.one_of(st.sampled_from(["learned", "rope"]), _weird),
    "tied_embeddings": st.one_of(st.booleans(), _weird),
    "bias": st.one_of(st.booleans(), _weird),
    "n_experts": st.one_of(st.sampled_from([0, 1, 2, 4]), _weird),
    "top_k": st.one_of(st.sampled_from([1, 2]), _weird),
    "capacity_factor": st.one_of(st.floats(0.5, 2.0), _weird),
    "norm_eps": st.one_of(st.floats(1e-8, 1e-3), _weird),
    "rope_theta": st.one_of(st.floats(100.0, 1e6), _weird),
    "hidden_dropout": st.one_of(st.floats(0.0, 0.5), _weird),
    "attention_dropout": st.one_of(st.floats(0.0, 0.5), _weird),
}
_REQUIRED = ("n_layers", "d_model", "n_heads", "vocab_size")


@st.composite
def spec_files(draw: st.DrawFn) -> str:
    """A spec JSON file: mostly valid fields with a few odd ones, sometimes not an object at all."""
    if draw(st.integers(0, 19)) == 0:
        text = draw(st.sampled_from(["", "[]", "null", "{", "\x00\x01", '{"n_layers": NaN}', "1e999"]))
    else:
        spec: dict[str, Any] = {"n_layers": 2, "d_model": 64, "n_heads": 4, "vocab_size": 256, "seq_len": 32}
        for name in draw(st.lists(st.sampled_from(sorted(_fields)), max_size=5, unique=True)):
            spec[name] = draw(_fields[name])
        if draw(st.integers(0, 9)) == 0:
            spec.pop(draw(st.sampled_from(_REQUIRED)), None)
        if draw(st.integers(0, 19)) == 0:
            spec["no_such_field"] = 1
        # allow_nan: JSON files in the wild carry NaN and Infinity (Python's json reads them)
        text = json.dumps(spec, allow_nan=True)
    path = _TMP / f"spec-{abs(hash(text))}.json"
    path.write_text(text, encoding="utf-8")
    return str(path)


_SETTINGS: dict[str, Any] = {"deadline": None, "suppress_health_check": [HealthCheck.too_slow]}
#: Each fuzz test runs in two tiers: a fixed draw by default, fresh draws under ``-m slow``.
TIERS = pytest.mark.parametrize("slow", [pytest.param(False), pytest.param(True, marks=pytest.mark.slow)])


def fuzz(cases: st.SearchStrategy[Any], check: Callable[[Any], None], slow: bool) -> None:
    """Run ``check`` on the tier's number of ``cases`` (derandomized outside the slow tier)."""
    settings(max_examples=_examples(slow), derandomize=not slow, **_SETTINGS)(given(cases)(check))()


def _spec_estimate(path: str) -> None:
    code, out, err = invoke("estimate", "--model", path, "--cluster", "cpu", "--global-batch", "2", "--json")
    assert_answer(code, out, err, json_out=True)


def _spec_graph(path: str) -> None:
    code, out, err = invoke("graph", "--model", path, "--impl", "synthetic", "--batch", "1", "--json")
    assert_answer(code, out, err, json_out=True)


@TIERS
def test_spec_files_estimate(slow: bool) -> None:
    fuzz(spec_files(), _spec_estimate, slow)


@TIERS
def test_spec_files_graph(slow: bool) -> None:
    fuzz(spec_files(), _spec_graph, slow)


# --- option values ----------------------------------------------------------------------------------

_numbers = st.one_of(
    st.integers(-3, 70).map(str),
    st.sampled_from(["0", "-1", "nan", "inf", "-inf", "1e309", "2147483648", "10000000000", "1.5", "", "x"]),
)
_paths = st.sampled_from(
    ["/proc/version", "/tmp", "/nonexistent/dir/out.json", "a" * 300 + ".json", "/dev/null", "ok.json"]
)

# per command: the options fuzzed and how their values are drawn; a fixed small job keeps each call quick
_ESTIMATE = {
    "--gpus": _numbers,
    "--tp": _numbers,
    "--pp": _numbers,
    "--dp": _numbers,
    "--vpp": _numbers,
    "--microbatch": _numbers,
    "--global-batch": _numbers,
    "--seq": _numbers,
    "--zero": _numbers,
    "--dtype": st.sampled_from(["fp32", "bf16", "fp8", "fp4", ""]),
    "--recompute": st.sampled_from(["none", "selective", "full", "selective-op", "half"]),
    "--recompute-layers": _numbers,
    "--fsdp-shard": _numbers,
    "--optimizer": st.sampled_from(["fused", "foreach", "for-loop", "adam", ""]),
    "--hidden-dropout": _numbers,
    "--attention-dropout": _numbers,
    "--stage-layers": st.sampled_from(["1,1", "2", "0,2", "x", "1,-1", ""]),
    "--dp-bucket-params": _numbers,
    "--kernels": _numbers,
    "--zero3-gather": st.sampled_from(["unit", "module", "tensor-list", "layer", ""]),
    "--eager-loss-cast": st.sampled_from(["float", "autocast", "none", "fused", "fp8", ""]),
    "--stack": st.sampled_from(["megatron", "deepspeed", "fsdp", "torchtitan", "eager", "nope", ""]),
    "--cluster": st.sampled_from(["cpu", "dgx-h100", "a100-sxm", "nope", "/tmp", "/proc/version"]),
}
_PLAN = {
    "--gpus": _numbers,
    "--global-batch": _numbers,
    "--seq": _numbers,
    "--memory-budget-gb": _numbers,
    "--tolerance": _numbers,
    "--dtypes": st.sampled_from(["bf16", "fp32,bf16", "fp9", "", ","]),
    "--order": st.sampled_from(["remat,fusion,parallel,precision", "fusion", "x,y", ""]),
    "--out": _paths,
    "--html": _paths,
    "--cluster": st.sampled_from(["cpu", "dgx-h100", "nope"]),
    "--stack": st.sampled_from(["fsdp", "torchtitan", "deepspeed", "nope"]),
}


@st.composite
def option_lists(draw: st.DrawFn, table: dict[str, st.SearchStrategy[str]]) -> list[str]:
    names = draw(st.lists(st.sampled_from(sorted(table)), min_size=1, max_size=4, unique=True))
    args: list[str] = []
    for name in names:
        value = draw(table[name])
        if name in ("--out", "--html") and value == "ok.json":
            value = str(_TMP / f"out-{draw(st.integers(0, 10**6))}.json")
        args += [name, value]
    return args


def _estimate_options(args: list[str]) -> None:
    code, out, err = invoke("estimate", "--model", "gpt-tiny", *args, "--json")
    assert_answer(code, out, err, json_out=True)


@TIERS
def test_estimate_options(slow: bool) -> None:
    fuzz(option_lists(_ESTIMATE), _estimate_options, slow)


def _plan_options(args: list[str]) -> None:
    outputs = [Path(args[i + 1]) for i, a in enumerate(args) if a in ("--out", "--html")]
    before = {p: _state(p) for p in outputs}
    code, out, err = invoke("plan", "--model", "gpt-tiny", "--strategy", "sequential", *args, "--json")
    assert_answer(code, out, err, json_out=True)
    if code != 0:  # a refusal or an infeasible answer writes nothing
        for p in outputs:
            assert _state(p) == before[p], p
    # the atomic writer's temporary files never outlive a write
    assert not [n for n in os.listdir(_TMP) if n.endswith(".tmp")]


@TIERS
def test_plan_options(slow: bool) -> None:
    fuzz(option_lists(_PLAN), _plan_options, slow)


def _state(path: Path) -> tuple[bool, float] | None:
    try:
        return (path.is_file(), path.stat().st_mtime) if path.exists() else None
    except OSError:
        return None
