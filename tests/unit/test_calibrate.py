"""``coplan calibrate``: the fitting math recovers known rates exactly, a quick run on this CPU writes
a profile the loaders accept, and bad input is a one-line error (exit 2)."""

from __future__ import annotations

import json
import math
from collections.abc import Callable, Sequence
from dataclasses import replace
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from coplan.cli import main
from coplan.cost.kernels import Rates, Scale, kernel_time
from coplan.hardware import device_presets, load_cluster
from coplan.hardware.calibrate import (
    MAX_RESIDUAL,
    Measurement,
    NoisyCalibration,
    Params,
    calibrate,
    check_residuals,
    predict,
    preset_for_gpu,
    to_device,
)
from coplan.hardware.calibrate.fit import (
    _kernel,
    fit,
    fit_attention,
    fit_first_touch,
    fit_launch,
    fit_link,
    fit_matmul,
    fit_vector,
    least_squares,
    rms_residuals,
)
from coplan.hardware.calibrate.probes import Plan, transformer_gemms
from coplan.hardware.device import VECTOR_FAMILIES, DeviceSpec
from coplan.hardware.tiling import TORCH_CPU_FLASH

# A machine whose families differ as a CPU's do: a tanh-GELU slower per counted FLOP than a sum, and
# 16-bit work slower than fp32 where conversions dominate.
VEC_RATES = {
    "elementwise.fp32": 1.8e10,
    "transcendental.fp32": 9e9,
    "reduction.fp32": 4.5e10,
    "norm.fp32": 3e10,
    "softmax.fp32": 2.4e10,
    "elementwise.bf16": 1.2e10,
    "transcendental.bf16": 8e9,
    "reduction.bf16": 4e10,
    "norm.bf16": 1.8e10,
    "softmax.bf16": 2.2e10,
}
TRUTH = Params(
    peaks={"fp32": 4e11, "bf16": 8e11},
    mm_flops={"fp32": 1.5e11, "bf16": 6.2e11},
    attention={"fp32": 0.07, "bf16": 0.04},
    vec_flops=VEC_RATES["elementwise.fp32"],
    bandwidth=9e10,
    half_dim=48.0,
    launch_s=3.5e-6,
    link_bandwidth=2.5e9,
    link_latency_s=4e-5,
    vec_rates=VEC_RATES,
    attention_backward={"fp32": 0.06, "bf16": 0.025},
    first_touch=3e9,
    cache_bytes=float(1 << 25),
    mm_tn={"fp32": 1.0, "bf16": 0.8},  # weight-gradient GEMMs 20% slower in bf16 only
    host_op_s=2.5e-6,
)
START = Params(
    peaks=TRUTH.peaks,
    mm_flops={"fp32": 2e11, "bf16": 4e11},
    attention={"fp32": 0.5, "bf16": 0.5},
    vec_flops=2e11,
    bandwidth=2e10,
    half_dim=0.0,
    launch_s=1e-6,
    link_bandwidth=1e10,
    link_latency_s=1e-6,
    cache_bytes=TRUTH.cache_bytes,
)


def _timed(ms: list[Measurement], p: Params = TRUTH) -> list[Measurement]:
    """The measurements as a machine that is exactly the model with rates ``p`` would time them."""
    return [replace(m, seconds=predict(m, p)) for m in ms]


def _attention_probes(dtype: str, geos: tuple[tuple[int, int, int], ...], size: int) -> list[Measurement]:
    """Causal attention forward and backward measurements (times 0 until ``_timed``) for each
    (batch x heads, sequence, head dim), ``size`` bytes per element."""
    ms = []
    for bh, s, d in geos:
        flops, geo, nbytes = 4.0 * bh * s * s * d, (bh, s, s, d), 4.0 * bh * s * d * size
        ms.append(Measurement("attention", f"a {s}", dtype, 0.0, flops, 0.0, nbytes, geo))
        ms.append(
            Measurement("attention", f"a {s} bwd", dtype, 0.0, 2.5 * flops, 0.0, 2 * nbytes, geo, "backward")
        )
    return ms


def _synthetic() -> list[Measurement]:
    ms = [Measurement("launch", "autograd chain (per kernel)", "fp32", 0.0, dims=(8,))]
    ms.append(Measurement("host_op", "view chain (per op)", "fp32", 0.0, dims=(8,)))
    for dtype in ("fp32", "bf16"):
        for family in VECTOR_FAMILIES:
            for n in (1 << 12, 1 << 16, 1 << 20, 1 << 22):
                for per, nbytes in ((1.0, 12.0), (8.0, 4.0)):  # memory- and compute-bound
                    ms.append(
                        Measurement(
                            "vector",
                            f"{family} v{per} {n}",
                            dtype,
                            0.0,
                            vec_flops=per * n,
                            bytes=nbytes * n,
                            family=family,
                        )
                    )
    for size in (1 << 25, 1 << 26):
        ms.append(Measurement("first_touch", f"fresh {size}", "fp32", 0.0, bytes=float(size)))
    for dtype in ("fp32", "bf16"):
        size = 4 if dtype == "fp32" else 2
        for m, n, k, lay in ((64, 64, 64, "nn"), (256, 256, 256, "nn"), *transformer_gemms(1024, 256, 2048)):
            nbytes = size * (m * k + k * n + m * n)
            ms.append(
                Measurement(
                    "matmul",
                    f"mm {m}x{n}x{k}",
                    dtype,
                    0.0,
                    2.0 * m * n * k,
                    0.0,
                    nbytes,
                    (m, n, k),
                    layout=lay,
                )
            )
        ms += _attention_probes(dtype, ((8, 128, 32), (16, 256, 64), (32, 512, 64)), size)
    for nbytes in (1 << 10, 1 << 16, 1 << 20, 1 << 24):
        for name in ("all_reduce", "all_gather"):
            ms.append(
                Measurement("collective", f"{name} {nbytes}", "fp32", 0.0, bytes=float(nbytes), dims=(2,))
            )
    return _timed(ms)


def _close(a: float, b: float, rel: float = 1e-6) -> bool:
    return math.isclose(a, b, rel_tol=rel)


# --- the fitting math -------------------------------------------------------------------------------


def test_least_squares_solves_a_nonlinear_fit_exactly() -> None:
    xs = np.linspace(0.0, 3.0, 20)
    ys = 2.5 * np.exp(-0.7 * xs) + 0.3

    def res(p: np.ndarray) -> np.ndarray:
        return p[0] * np.exp(-p[1] * xs) + p[2] - ys

    got = least_squares(res, [1.0, 0.1, 0.0])
    assert np.allclose(got, [2.5, 0.7, 0.3], rtol=1e-8)


def test_each_stage_recovers_its_rates_from_exact_timings() -> None:
    ms = _synthetic()
    assert fit_launch(ms) == pytest.approx(TRUTH.launch_s, rel=1e-12)
    known = replace(START, launch_s=TRUTH.launch_s)
    vec = fit_vector(ms, known)
    assert _close(vec.bandwidth, TRUTH.bandwidth) and _close(vec.vec_flops, TRUTH.vec_flops)
    assert vec.vec_rates.keys() == VEC_RATES.keys()
    for key, rate in VEC_RATES.items():
        assert _close(vec.vec_rates[key], rate), key
    touch = fit_first_touch(ms, replace(TRUTH, first_touch=1e8))
    assert _close(touch.first_touch, TRUTH.first_touch)
    vector = {"bandwidth": TRUTH.bandwidth, "vec_flops": TRUTH.vec_flops, "vec_rates": VEC_RATES}
    mm = fit_matmul(ms, replace(known, **vector))  # type: ignore[arg-type]
    assert _close(mm.half_dim, TRUTH.half_dim)
    for dtype, rate in TRUTH.mm_flops.items():
        assert _close(mm.mm_flops[dtype], rate)
        assert _close(mm.mm_tn[dtype], TRUTH.mm_tn[dtype])
    att = fit_attention(ms, replace(TRUTH, attention={"fp32": 0.9, "bf16": 0.9}, attention_backward={}))
    for dtype in ("fp32", "bf16"):
        assert _close(att.attention[dtype], TRUTH.attention[dtype])
        assert _close(att.attention_backward[dtype], TRUTH.attention_backward[dtype])
    link = fit_link(ms, replace(TRUTH, link_bandwidth=1e11, link_latency_s=1e-3))
    assert _close(link.link_bandwidth, TRUTH.link_bandwidth) and _close(
        link.link_latency_s, TRUTH.link_latency_s
    )


def test_full_fit_recovers_every_rate_and_leaves_no_residual() -> None:
    ms = _synthetic()
    got = fit(ms, START)
    for name in (
        "vec_flops",
        "bandwidth",
        "half_dim",
        "launch_s",
        "link_bandwidth",
        "link_latency_s",
        "first_touch",
        "host_op_s",
    ):
        assert _close(getattr(got, name), getattr(TRUTH, name)), name
    for name in ("attention", "attention_backward", "vec_rates", "mm_flops", "mm_tn"):
        want = getattr(TRUTH, name)
        assert getattr(got, name).keys() == want.keys(), name
        assert all(_close(getattr(got, name)[k], v) for k, v in want.items()), name
    fitted = [replace(m, fitted=predict(m, got)) for m in ms]
    assert all(v < 1e-6 for v in rms_residuals(fitted).values())


def test_fitted_rates_round_trip_through_the_device_spec() -> None:
    """The device written to disk prices kernels at exactly the fitted rates (cost-model ``Rates``)."""
    base = device_presets()["cpu"]
    p = replace(TRUTH, peaks={d: base.peak(d) for d in ("fp32", "bf16")}, bandwidth=1.5e10)
    device, notes = to_device(base, p, ["fp32", "bf16"], "cpu-calibrated", "test")
    assert notes == []
    assert device.peak_flops == base.peak_flops  # data-sheet peaks kept
    for dtype in ("fp32", "bf16"):
        rates = Rates.of(device, dtype)
        assert _close(rates.mm_flops, p.mm_flops[dtype])
        assert _close(rates.attn_flops, p.peaks[dtype] * p.attention[dtype])
        assert _close(rates.attn_bwd_flops, p.peaks[dtype] * p.attention_backward[dtype])
        assert rates.attn_head_half == device.matmul_half_dim  # measured per dtype: head dim derated
        assert _close(rates.vec_flops, p.vec_flops) and _close(rates.bandwidth, p.bandwidth)
        for family, rate in zip(VECTOR_FAMILIES, rates.vec_rates, strict=True):
            assert _close(rate, p.vec_rates[f"{family}.{dtype}"])
        assert _close(rates.first_touch, p.first_touch) and rates.cache_bytes == base.sram_bytes
        assert rates.half_dim == pytest.approx(p.half_dim, abs=1e-3) and rates.launch_s == p.launch_s
        assert _close(rates.mm_tn, p.mm_tn[dtype]) and rates.host_op_s == p.host_op_s
    # a layout no slower than the others writes no key: absent means 1
    assert "matmul_tn.fp32" not in device.efficiency and device.efficiency["matmul_tn.bf16"] == 0.8


def test_a_rate_above_the_data_sheet_raises_it_and_says_so() -> None:
    base = device_presets()["cpu"]
    fast = replace(TRUTH, peaks={"fp32": 4.736e11, "bf16": 9.472e11}, bandwidth=base.memory_bandwidth * 3)
    device, notes = to_device(base, fast, ["fp32", "bf16"], "x", "test")
    assert device.memory_bandwidth == pytest.approx(base.memory_bandwidth * 3)
    assert device.efficiency_of("memory") == 1.0
    assert any("memory bandwidth" in n for n in notes)


@pytest.mark.parametrize(
    ("name", "preset"),
    [
        ("NVIDIA H100 80GB HBM3", "h100-sxm"),
        ("NVIDIA H100 PCIe", None),
        ("NVIDIA H200", "h200"),
        ("NVIDIA A100-SXM4-80GB", "a100-sxm-80gb"),
        ("NVIDIA A100-SXM4-40GB", "a100-sxm-40gb"),
        ("NVIDIA L4", "l4"),
        ("NVIDIA L40S", None),
        ("NVIDIA GeForce RTX 4090", None),
    ],
)
def test_gpu_names_map_to_presets(name: str, preset: str | None) -> None:
    assert preset_for_gpu(name) == preset
    if preset is not None:
        assert preset in device_presets()


def test_quick_plan_is_smaller_than_the_full_one() -> None:
    quick, full = Plan.of("cpu", True), Plan.of("cpu", False)
    assert len(quick.matmul) < len(full.matmul) and len(quick.vector_sizes) < len(full.vector_sizes)
    assert {layout for *_, layout in full.matmul} == {"nn", "nt", "tn"}


# --- a real run on this machine ---------------------------------------------------------------------


def _run(capsys: pytest.CaptureFixture[str], *args: str) -> tuple[int, str, str]:
    with pytest.raises(SystemExit) as exc:
        main(list(args))
    code = exc.value.code
    out, err = capsys.readouterr()
    return (code if isinstance(code, int) else (0 if code is None else 1)), out, err


def _check_sane(path: Path) -> None:
    cluster = load_cluster(str(path))
    d = cluster.device
    assert "measured by `coplan calibrate" in d.source and torch.__version__ in d.source
    assert d.peak_flops == device_presets()["cpu"].peak_flops
    for kind, value in d.efficiency.items():
        assert 0.0 < value <= 1.0, kind
    assert 1e-8 < d.kernel_launch_s < 1e-3
    assert 1e-8 < d.host_op_s < 1e-3  # a view's host time, fitted on a CPU
    assert 0.0 <= d.matmul_half_dim < 1e4
    assert 1e8 < d.memory_bandwidth * d.efficiency_of("memory") < 1e13
    assert 1e8 < d.vector_flops * d.efficiency_of("vector") < 1e13
    for dtype in ("fp32", "bf16"):
        assert 1e9 < Rates.of(d, dtype).mm_flops < 1e13
    assert load_cluster(str(path), 1).num_devices == 1


#: A CPU that times every probe exactly as the cost model with TRUTH's rates prices it: the cpu
#: preset's peaks (so the profile keeps its data sheet), PyTorch's attention tiling with a cost per
#: tile, and a fixed cost per GEMM call, the terms a CPU calibration fits.
CPU_TRUTH = replace(
    TRUTH,
    peaks=dict(device_presets()["cpu"].peak_flops),
    attn_tiling=TORCH_CPU_FLASH,
    attn_tile_s={"forward.fp32": 4e-6, "backward.fp32": 9e-6, "forward.bf16": 3e-6, "backward.bf16": 6e-5},
    mm_call_s={"fp32": 4e-6, "bf16": 1.5e-5},
    fit_calls=True,
)


def _machine(p: Params, noise: Callable[[int], float] = lambda i: 1.0) -> Callable[..., list[Measurement]]:
    """``run_probes`` on a machine that is the cost model with rates ``p``, each probe's time
    multiplied by ``noise(i)``: the real probes are built, their timings are injected."""

    def run_probes(
        probes: Sequence[Any], clock: object, passes: int, tick: Callable[[str], None], between: Any = None
    ) -> list[Measurement]:
        for probe in probes:
            tick(probe.template.name)
        return [
            replace(pr.template, seconds=predict(pr.template, p) * noise(i)) for i, pr in enumerate(probes)
        ]

    return run_probes


def test_quick_cpu_calibration_writes_a_loadable_profile(
    capsys: pytest.CaptureFixture[str], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The quick CPU calibration end to end on injected timings: the profile written recovers the
    machine's rates, loads, and the fit leaves no residual."""
    monkeypatch.setattr("coplan.hardware.calibrate.run_probes", _machine(CPU_TRUTH))
    out = tmp_path / "profile.json"
    code, stdout, err = _run(
        capsys, "calibrate", "--device", "cpu", "--quick", "--procs", "1", "--out", str(out), "--json"
    )
    assert code == 0, err
    data = json.loads(stdout)  # the whole of stdout is one JSON document
    assert data["out"] == str(out)
    kinds = {m["kind"] for m in data["measurements"]}
    assert kinds == {"launch", "host_op", "vector", "first_touch", "matmul", "attention"}
    assert all(m["seconds"] > 0 and m["fitted_s"] > 0 for m in data["measurements"])
    assert all(v < 1e-3 for v in data["residuals"].values()), data["residuals"]
    assert json.loads(out.read_text())["groups"] == data["groups"]  # the file is the cluster spec alone
    _check_sane(out)
    d = load_cluster(str(out)).device
    assert d.kernel_launch_s == pytest.approx(CPU_TRUTH.launch_s, rel=1e-3)
    assert d.host_op_s == pytest.approx(CPU_TRUTH.host_op_s, rel=1e-3)
    for dtype in ("fp32", "bf16"):
        rates = Rates.of(d, dtype)
        assert rates.mm_flops == pytest.approx(CPU_TRUTH.mm_flops[dtype], rel=1e-3)
        assert rates.mm_call_s == pytest.approx(CPU_TRUTH.mm_call_s[dtype], rel=1e-2)


def test_table_output_names_every_microbenchmark(
    capsys: pytest.CaptureFixture[str], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr("coplan.hardware.calibrate.run_probes", _machine(CPU_TRUTH))
    out = tmp_path / "p.json"
    code, stdout, err = _run(capsys, "calibrate", "--quick", "--procs", "1", "--out", str(out))
    assert code == 0, err
    assert "mm nt" in stdout and "layer_norm" in stdout and "fit residuals" in stdout
    assert f"wrote {out}" in stdout


def test_noisy_timings_are_refused_and_nothing_is_written(
    capsys: pytest.CaptureFixture[str], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Timings a busy machine would give (every other probe 5x slower) leave residuals far above
    MAX_RESIDUAL: one line naming them, exit 1, and no profile on disk."""
    monkeypatch.setattr(
        "coplan.hardware.calibrate.run_probes", _machine(CPU_TRUTH, lambda i: 5.0 if i % 2 else 1.0)
    )
    out = tmp_path / "p.json"
    code, stdout, err = _run(capsys, "calibrate", "--quick", "--procs", "1", "--out", str(out), "--json")
    assert code == 1 and stdout == ""
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), err
    assert "residual" in lines[0] and f"{MAX_RESIDUAL:.0%} bound" in lines[0], err
    assert not out.exists()


def test_residual_bound_names_each_kind_over_it_and_nan() -> None:
    check_residuals({"matmul": 0.05, "vector": MAX_RESIDUAL})  # at the bound: kept
    with pytest.raises(NoisyCalibration, match=r"vector 453%") as exc:
        check_residuals({"matmul": 0.05, "vector": 4.53})
    assert "matmul" not in str(exc.value) and exc.value.exit_code == 1
    with pytest.raises(NoisyCalibration, match="attention nan"):
        check_residuals({"attention": math.nan})


def test_calibrate_help_states_the_residual_bound(capsys: pytest.CaptureFixture[str]) -> None:
    code, stdout, _ = _run(capsys, "calibrate", "--help")
    assert code == 0 and f"above {MAX_RESIDUAL:.0%}" in " ".join(stdout.split())


def test_a_live_quick_calibration_writes_a_profile_or_refuses_in_one_line(
    capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    """Real timings on this machine: a loadable profile, or (when the machine is too busy to
    measure) the one-line residual refusal with nothing written, never a bad profile."""
    out = tmp_path / "live.json"
    code, stdout, err = _run(
        capsys, "calibrate", "--device", "cpu", "--quick", "--procs", "1", "--out", str(out), "--json"
    )
    if code == 0:
        data = json.loads(stdout)
        assert all(v <= MAX_RESIDUAL for v in data["residuals"].values())
        assert load_cluster(str(out)).device.name == "cpu-calibrated"
    else:
        assert code == 1 and not out.exists(), err
        assert len(err.strip().splitlines()) == 1 and "residual" in err


@pytest.mark.slow
def test_quick_calibration_with_collectives_measures_a_link(tmp_path: Path) -> None:
    # the link's presence is the point here, not the fit's precision on a shared machine
    cal = calibrate("cpu", procs=2, quick=True, max_residual=None)
    assert cal.cluster.num_devices == 2
    link = cal.cluster.groups[0].intra_node
    assert link.name == "gloo-measured" and 1e6 < link.bandwidth < 1e12 and 0 < link.latency_s < 0.1
    assert any(m.kind == "collective" for m in cal.measurements)


# --- bad input ---------------------------------------------------------------------------------------


def _one_line_error(code: int, err: str, needle: str) -> None:
    assert code == 2, err
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: ") and needle in lines[0], err


@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has a CUDA device")
def test_cuda_without_a_gpu_is_a_one_line_error(capsys: pytest.CaptureFixture[str]) -> None:
    code, _, err = _run(capsys, "calibrate", "--device", "cuda")
    _one_line_error(code, err, "no CUDA device")


def test_unknown_device_and_bad_procs_are_one_line_errors(capsys: pytest.CaptureFixture[str]) -> None:
    code, _, err = _run(capsys, "calibrate", "--device", "tpu")
    _one_line_error(code, err, "'tpu' is not one of")
    code, _, err = _run(capsys, "calibrate", "--procs", "0")
    _one_line_error(code, err, "--procs")


# --- the model's recompute modes (the accuracy benchmark trains with them) ---------------------------


def test_transformer_recompute_modes_keep_gradients_and_drop_saved_activations() -> None:
    from coplan.models.spec import ModelSpec
    from coplan.models.transformer import Transformer, example_batch

    spec = ModelSpec(name="t", n_layers=2, d_model=32, n_heads=4, vocab_size=64, seq_len=16)
    torch.manual_seed(0)
    model = Transformer(spec)
    idx, targets = example_batch(spec, 2, 16)
    grads, saved = {}, {}
    for mode in ("none", "selective", "full"):
        model.recompute = mode
        model.zero_grad()
        count: dict[int, int] = {}

        def pack(t: torch.Tensor, count: dict[int, int] = count) -> torch.Tensor:
            count.setdefault(t.untyped_storage().data_ptr(), t.untyped_storage().nbytes())
            return t

        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            loss = model(idx, targets)
        loss.backward()
        grads[mode] = [p.grad.clone() for p in model.parameters() if p.grad is not None]
        saved[mode] = sum(count.values())
    for mode in ("selective", "full"):
        for a, b in zip(grads["none"], grads[mode], strict=True):
            torch.testing.assert_close(a, b)
    assert saved["full"] < saved["selective"] < saved["none"]
    with pytest.raises(ValueError, match="recompute"):
        model.recompute = "some"


# --- from recorded training runs (coplan calibrate --runs) -------------------------------------------

RUNS_TRUTH = {"gemm": 0.4, "vector": 0.6, "launch": 2.5, "link": 1.0}


def _record_runs(path: Path, truth: dict[str, float] | None = None, noise: float = 0.02) -> list[float]:
    """Runs of gpt-tiny under several plans and batches, written as ``coplan run --record`` writes
    them, whose "measured" step times are the cost model's on a machine ``truth`` times the cpu
    preset's rates (and ``noise`` of log-normal jitter). Returns the measured times."""
    import random
    from types import SimpleNamespace

    from coplan.apply.predict import make_context, megatron_recompute, plan_for, run_cluster
    from coplan.cli.run_cmd import append_record
    from coplan.hardware.calibrate.runs import Scales, scaled_cluster
    from coplan.models.spec import PRESETS
    from coplan.plan.types import RematPlan

    spec = PRESETS["gpt-tiny"]
    base = load_cluster("cpu")
    machine = scaled_cluster(base, Scales(**(truth or RUNS_TRUTH)))
    rng = random.Random(0)
    times = []
    for nproc, batch, seq, compute, rec in (
        (1, 1, 16, "fp32", "none"),
        (1, 2, 32, "bf16", "full"),
        (1, 8, 64, "fp32", "selective"),
        (1, 16, 64, "bf16", "none"),
        (1, 32, 64, "fp32", "full"),
        (2, 4, 32, "fp32", "none"),
        (2, 16, 64, "bf16", "none"),
    ):
        ctx = make_context(spec, run_cluster(base, nproc, "cpu"), batch, seq)
        plan = plan_for(ctx, compute=compute).with_(remat=RematPlan(recompute=megatron_recompute(ctx, rec)))
        true = make_context(spec, run_cluster(machine, nproc, "cpu"), batch, seq).price(plan).step_time_s
        times.append(true * math.exp(rng.gauss(0.0, noise)))
        req = SimpleNamespace(
            spec=spec,
            plan=plan,
            nproc=nproc,
            device="cpu",
            global_batch=batch,
            seq=seq,
            mode="plan",
            cluster=base,
        )
        out = {
            "measured": {"step_time_s": times[-1], "saved_activation_bytes": 1, "peak_bytes": 1.0},
            "predicted": {"step_time_s": ctx.price(plan).step_time_s},
            "grad_check": {"max_rel_err": 0.0, "tolerance": 1e-4, "ok": True},
            "run": {"cluster": ctx.cluster.name, "device_name": "test-cpu"},
        }
        append_record(path, req, out)
    return times


def test_runs_fit_recovers_the_machine_and_improves_held_out_runs(tmp_path: Path) -> None:
    from coplan.hardware.calibrate.runs import base_cluster, fit_runs, read_runs

    path = tmp_path / "runs.jsonl"
    measured = _record_runs(path, noise=0.0)
    records, notes = read_runs(path)
    assert not notes and [r.step_time_s for r in records] == pytest.approx(measured)
    fit = fit_runs(records, base_cluster(records, None, path))
    # exact timings: the factors come back (the prior moves them by less than 1%); the link's too,
    # which only the two-process runs see
    assert fit.scales.to_dict() == pytest.approx(RUNS_TRUTH, rel=0.02)
    assert fit.rms_before > 0.5 and fit.rms_after < 0.01
    # each run predicted from the factors fitted to the other six
    assert fit.loo_after < 0.01 and fit.loo_before > 0.5
    assert len(fit.loo_after_s) == len(records)


def test_calibrate_runs_writes_a_profile_that_prices_the_runs(
    capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    from coplan.apply.predict import make_context, run_cluster

    path, out = tmp_path / "runs.jsonl", tmp_path / "fitted.json"
    _record_runs(path)
    code, stdout, err = _run(capsys, "calibrate", "--runs", str(path), "--out", str(out), "--json")
    assert code == 0, err
    data = json.loads(stdout)
    assert data["runs"] == 7 and data["out"] == str(out) and data["device"] == "test-cpu"
    # 2% timing noise: held-out runs predicted within a few percent, from 100% off before
    assert data["error"]["held_out"]["after"] < 0.05 < 0.5 < data["error"]["held_out"]["before"]
    fitted = load_cluster(str(out))  # what --cluster accepts
    assert "runs fit" in fitted.groups[0].device.source
    from coplan.hardware.calibrate.runs import read_runs

    for rec, row in zip(read_runs(path)[0], data["per_run"], strict=True):
        ctx = make_context(rec.spec, run_cluster(fitted, rec.nproc, "cpu"), rec.global_batch, rec.seq)
        assert ctx.price(rec.plan).step_time_s == pytest.approx(row["after_s"], rel=1e-9)
    code, stdout, _ = _run(capsys, "calibrate", "--runs", str(path), "--out", str(out))
    assert code == 0 and "held out (leave-one-out)" in stdout and f"wrote {out}" in stdout


def test_calibrate_runs_bad_input_is_a_one_line_error(
    capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    missing = tmp_path / "nope.jsonl"
    code, _, err = _run(capsys, "calibrate", "--runs", str(missing))
    _one_line_error(code, err, f"--runs {missing}: no such file")
    good = tmp_path / "good.jsonl"
    _record_runs(good)
    lines = good.read_text().splitlines()
    bad = tmp_path / "bad.jsonl"
    bad.write_text(lines[0] + "\n" + lines[1][:40] + "\n")
    code, _, err = _run(capsys, "calibrate", "--runs", str(bad))
    _one_line_error(code, err, f"{bad}:2: not JSON")
    row = json.loads(lines[0])
    del row["plan"]
    bad.write_text(json.dumps(row) + "\n")
    code, _, err = _run(capsys, "calibrate", "--runs", str(bad))
    _one_line_error(code, err, f"{bad}:1: missing 'plan'")
    row = json.loads(lines[0])
    row["measured"]["step_time_s"] = -1
    bad.write_text(json.dumps(row) + "\n")
    code, _, err = _run(capsys, "calibrate", "--runs", str(bad))
    _one_line_error(code, err, f"{bad}:1: 'measured.step_time_s' must be a positive number")
    rows = [json.loads(x) for x in lines]
    for r in rows:
        del r["cluster_spec"]
    bad.write_text("".join(json.dumps(r) + "\n" for r in rows))
    code, _, err = _run(capsys, "calibrate", "--runs", str(bad))
    _one_line_error(code, err, "--cluster")
    code, _, err = _run(capsys, "calibrate", "--cluster", "cpu")
    _one_line_error(code, err, "only applies with --runs")


# --- tiled attention (a CPU's flash kernel) ---------------------------------------------------------


def test_tiled_attention_fit_recovers_rate_and_tile_cost_exactly() -> None:
    """With a tiling, the attention fit finds the fraction of peak and the seconds per tile that
    produced the timings (shapes on both sides of the tiling's 192 and 768 thresholds)."""
    costs = {"forward.fp32": 4e-6, "backward.fp32": 9e-6, "forward.bf16": 3e-6, "backward.bf16": 6e-5}
    truth = replace(TRUTH, attn_tiling=TORCH_CPU_FLASH, attn_tile_s=costs)
    geos = ((8, 64, 32), (16, 128, 32), (16, 256, 64), (8, 512, 64), (4, 1024, 64))
    ms = _timed([m for dtype in ("fp32", "bf16") for m in _attention_probes(dtype, geos, 2)], truth)
    start = replace(truth, attention={"fp32": 0.5, "bf16": 0.5}, attention_backward={}, attn_tile_s={})
    got = fit_attention(ms, start)
    for dtype in ("fp32", "bf16"):
        assert _close(got.attention[dtype], TRUTH.attention[dtype], 1e-5)
        assert _close(got.attention_backward[dtype], TRUTH.attention_backward[dtype], 1e-5)
    for key, cost in costs.items():
        assert _close(got.attn_tile_s[key], cost, 1e-5), key
    # the roofline fit without the tiling cannot reproduce these timings
    flat = fit_attention(ms, replace(start, attn_tiling=None))
    worst = max(abs(predict(m, flat) / m.seconds - 1) for m in ms)
    assert worst > 0.2


def test_tiling_reaches_the_device_written_and_its_rates() -> None:
    base = device_presets()["cpu"]
    costs = {"forward.fp32": 4e-6, "backward.bf16": 6e-5}
    p = replace(TRUTH, peaks={d: base.peak(d) for d in ("fp32", "bf16")}, bandwidth=1.5e10)
    p = replace(p, attn_tiling=TORCH_CPU_FLASH, attn_tile_s=costs)
    device, _ = to_device(base, p, ["fp32", "bf16"], "cpu-calibrated", "test")
    assert device.attention_tiles == TORCH_CPU_FLASH.with_costs(costs)
    fp32, bf16 = Rates.of(device, "fp32"), Rates.of(device, "bf16")
    assert (fp32.attn_tile_s, fp32.attn_bwd_tile_s) == (4e-6, 0.0)
    assert (bf16.attn_tile_s, bf16.attn_bwd_tile_s) == (0.0, 6e-5)
    assert fp32.attn_tiling is device.attention_tiles
    # what the fit priced is what the written device prices
    geo = (16, 128, 128, 32)
    m = Measurement("attention", "a", "bf16", 1.0, 4.0 * 16 * 128 * 128 * 32, 0.0, 1e5, geo, "backward")
    flat = Scale(1, False, (1.0,) * 6, 4, True)  # type: ignore[arg-type]
    assert _close(kernel_time(_kernel(m), bf16, flat), predict(m, p))
    assert kernel_time(_kernel(m), bf16, flat) > 16 * 4 * 6e-5  # 4 tiles per head at s = 128


def test_matmul_fit_with_call_costs_recovers_them_exactly() -> None:
    """On a CPU the GEMM fit also finds a fixed cost per call and dtype (BLAS packing and kernel
    lookup), which the shape derating alone cannot stand in for."""
    calls = {"fp32": 4e-6, "bf16": 1.5e-5}
    truth = replace(TRUTH, mm_call_s=calls, fit_calls=True)
    ms = _timed([m for m in _synthetic() if m.kind == "matmul"], truth)
    start = replace(truth, mm_flops={"fp32": 2e11, "bf16": 4e11}, half_dim=8.0, mm_call_s={})
    got = fit_matmul(ms, start)
    assert _close(got.half_dim, TRUTH.half_dim, 1e-5)
    for dtype in ("fp32", "bf16"):
        assert _close(got.mm_flops[dtype], TRUTH.mm_flops[dtype], 1e-5)
        assert _close(got.mm_call_s[dtype], calls[dtype], 1e-4)
    without = fit_matmul(ms, replace(start, fit_calls=False))
    assert without.mm_call_s == {}
    assert max(abs(predict(m, without) / m.seconds - 1) for m in ms) > 0.05


def test_call_costs_reach_the_device_and_its_rates() -> None:
    base = device_presets()["cpu"]
    p = replace(TRUTH, peaks={d: base.peak(d) for d in ("fp32", "bf16")}, bandwidth=1.5e10)
    device, _ = to_device(base, replace(p, mm_call_s={"bf16": 1.5e-5}), ["fp32", "bf16"], "c", "test")
    assert dict(device.matmul_call_s) == {"bf16": 1.5e-5}
    assert Rates.of(device, "bf16").mm_call_s == 1.5e-5 and Rates.of(device, "fp32").mm_call_s == 0.0
    m = Measurement("matmul", "mm", "bf16", 1.0, 2.0 * 64**3, 0.0, 3 * 2 * 64 * 64, (64, 64, 64))
    flat = Scale(1, False, (1.0,) * 6, 4, True)  # type: ignore[arg-type]
    assert _close(
        kernel_time(_kernel(m), Rates.of(device, "bf16"), flat),
        predict(m, replace(p, mm_call_s={"bf16": 1.5e-5})),
    )


def test_a_gpu_calibration_fits_attention_under_the_presets_occupancy_term() -> None:
    """The fit prices attention probes with the base device's ``attention_parallel_half``, so the
    efficiency it writes is the one the device's kernel rule (which applies the term) expects."""
    from coplan.hardware.calibrate import _start_params

    h100 = device_presets()["h100-sxm"]
    start = _start_params(h100, ["bf16"])
    assert start.attn_par_half == (424.0, 185.0)
    truth = replace(start, attention={"bf16": 0.4}, attention_backward={"bf16": 0.3})
    ms = _timed(_attention_probes("bf16", ((8, 1024, 128), (32, 2048, 128), (64, 4096, 128)), 2), truth)
    got = fit_attention(ms, replace(truth, attention={"bf16": 0.7}, attention_backward={}))
    assert _close(got.attention["bf16"], 0.4, 1e-5) and _close(got.attention_backward["bf16"], 0.3, 1e-5)
    device, _ = to_device(h100, replace(got, mm_flops={"bf16": 7e14}), ["bf16"], "h100-calibrated", "test")
    flat = Scale(1, False, (1.0,) * 6, 4, True)  # type: ignore[arg-type]
    for m in ms:
        assert _close(kernel_time(_kernel(m), Rates.of(device, "bf16"), flat), predict(m, got))


def test_a_gpu_calibration_labels_attention_with_the_kernel_its_probes_ran() -> None:
    """The probes run PyTorch's SDPA, FlashAttention-2 on an NVIDIA GPU: the written H100 profile's
    attention efficiencies describe that kernel, and Transformer Engine's cuDNN kernel, the
    preset's own, stays priceable at the preset's rates."""
    from coplan.cost.kernels import FLASH_DROPOUT_COST
    from coplan.hardware.calibrate import _start_params

    h100 = device_presets()["h100-sxm"]
    p = replace(_start_params(h100, ["bf16"]), attention={"bf16": 0.4}, attention_backward={"bf16": 0.3})
    device, _ = to_device(h100, p, ["bf16"], "h100-calibrated", "test", "flash2")
    assert device.attention_kernel == "flash2" and device.attention_rates("flash2") is None
    assert device.attention_rates("cudnn") == (0.45, 0.45, FLASH_DROPOUT_COST)
    fa2, cudnn = Rates.of(device, "bf16", "flash2"), Rates.of(device, "bf16", "cudnn")
    assert fa2.attn_flops == Rates.of(device, "bf16").attn_flops == 0.4 * h100.peak("bf16")
    assert cudnn.attn_bwd_flops == Rates.of(h100, "bf16").attn_bwd_flops
    assert DeviceSpec.from_dict(device.to_dict()) == device
    # a calibration naming no kernel (a CPU's) leaves the base's labels as they are
    cpu, _ = to_device(h100, p, ["bf16"], "x", "test")
    assert cpu.attention_kernel == "cudnn" and cpu.attention_kernels == h100.attention_kernels
