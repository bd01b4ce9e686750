"""fp8 training: what Transformer Engine's casts and transposes around the GEMMs cost (exact bytes)."""

from __future__ import annotations

import dataclasses

import pytest

from coplan.cost import CostModel, TrainingConfig
from coplan.cost.estimate import estimate
from coplan.cost.fp8 import quant_bytes, weight_cast_bytes
from coplan.hardware import load_cluster
from coplan.models.spec import PRESETS, ModelSpec

GPT = ModelSpec(name="gpt-test", n_layers=2, d_model=512, n_heads=8, vocab_size=4096, seq_len=256)
B, S = 2, 256


def _block(spec: ModelSpec):
    return CostModel(spec=spec).profile(B, S).templates[0]


def test_gpt_block_quantisation_bytes_without_tensor_parallelism():
    # TP1: QKV and FC1 read the norms' fp8 outputs (a backward transpose each, 1 + 1 bytes); the
    # projection and FC2 inputs are cast and transposed in one forward kernel (2 + 1 + 1); every
    # output gradient is cast and transposed in one kernel (2 + 1 + 1)
    part = _block(GPT)
    t, h = B * S, GPT.d_model
    assert [(g.row_parallel, g.from_norm) for g in part.fp8_gemms] == [
        (False, True),  # QKV
        (True, False),  # projection
        (False, True),  # FC1
        (True, False),  # FC2
    ]
    fwd, bwd, nf, nb = quant_bytes(part.fp8_gemms, 1, False)
    assert fwd == 4 * t * h + 4 * t * 4 * h
    assert bwd == 2 * t * h + 4 * t * 3 * h + 4 * t * h + 2 * t * h + 4 * t * 4 * h + 4 * t * h
    assert (nf, nb) == (2, 6)


def test_gpt_block_quantisation_bytes_under_sequence_parallelism():
    # TP2 + SP: column-parallel inputs are gathered whole; the row-parallel inputs (sharded) are cast
    # forward and transposed backward; a row-parallel output gradient is cast on the local shard,
    # gathered in fp8 and transposed whole; a column-parallel one is cast and transposed, sharded
    part = _block(GPT)
    t, h, tp = B * S, GPT.d_model, 2
    fwd, bwd, nf, nb = quant_bytes(part.fp8_gemms, tp, True)
    assert fwd == 3 * t * h / tp + 3 * t * 4 * h / tp
    qkv = 2 * t * h + 4 * t * 3 * h / tp
    proj = 2 * t * h / tp + 3 * t * h / tp + 2 * t * h
    fc1 = 2 * t * h + 4 * t * 4 * h / tp
    fc2 = 2 * t * 4 * h / tp + 3 * t * h / tp + 2 * t * h
    assert bwd == pytest.approx(qkv + proj + fc1 + fc2)
    assert (nf, nb) == (2, 10)
    # weights: 12 h^2 of them, sharded, each cast and transposed once per step
    assert weight_cast_bytes(part.fp8_gemms, tp) == 4 * 12 * h * h / tp


def test_gemms_sharing_an_input_are_one_module():
    # SwiGLU's gate and up projections read one norm output: one transpose, one gradient cast of
    # their summed outputs, as Megatron-Core's fused FC1 runs them
    spec = PRESETS["llama-tiny"]
    part = CostModel(spec=spec).profile(B, 64).templates[0]
    keys = [g.input_key for g in part.fp8_gemms]
    assert len(set(keys)) == 4 < len(keys)
    _, _, nf, nb = quant_bytes(part.fp8_gemms, 1, False)
    assert (nf, nb) == (2, 6)


def test_a_gemm_kept_in_16_bits_is_not_quantised():
    part = _block(GPT)
    kept = tuple(dataclasses.replace(g, dtype="bf16") if g.row_parallel else g for g in part.fp8_gemms)
    fwd, bwd, nf, nb = quant_bytes(kept, 1, False)
    t, h = B * S, GPT.d_model
    assert (fwd, nf, nb) == (0.0, 0, 4)
    assert bwd == 2 * t * h + 4 * t * 3 * h + 2 * t * h + 4 * t * 4 * h


@pytest.mark.parametrize(("tp", "sp"), [(1, False), (2, True)])
def test_estimate_adds_the_casts_to_each_microbatch_and_the_weights_once(tp, sp):
    cluster = load_cluster("dgx-h100", tp)
    config = TrainingConfig(tp=tp, microbatch=B, global_batch=4 * B, seq=S, sequence_parallel=sp, dtype="fp8")
    prof = CostModel(spec=GPT).profile(B, S)
    bare = dataclasses.replace(
        prof, templates=tuple(dataclasses.replace(p, fp8_gemms=()) for p in prof.templates)
    )
    got, without = estimate(prof, cluster, config).stages[0], estimate(bare, cluster, config).stages[0]
    device = cluster.groups[0].device
    bw = device.memory_bandwidth * device.efficiency_of("memory")
    fwd, bwd, nf, nb = quant_bytes(prof.templates[0].fp8_gemms, tp, sp)
    layers, m = GPT.n_layers, config.num_microbatches
    weights = weight_cast_bytes(prof.templates[0].fp8_gemms, tp) / bw
    assert got.forward_s - without.forward_s == pytest.approx(
        layers * (fwd / bw + nf * device.kernel_launch_s + weights / m)
    )
    assert got.backward_s - without.backward_s == pytest.approx(
        layers * (bwd / bw + nb * device.kernel_launch_s)
    )
    assert got.kernels - without.kernels == layers * (nf + nb)
    # a device without fp8 units runs the GEMMs in 16 bits: nothing to quantise
    a100 = load_cluster("dgx-a100-80gb", tp)
    assert (
        estimate(prof, a100, config).stages[0].forward_s == estimate(bare, a100, config).stages[0].forward_s
    )


@pytest.mark.parametrize(("zero", "cached"), [(0, True), (1, True), (3, False)])
def test_fp8_weight_copies_stay_allocated_unless_zero3(zero, cached):
    # TE keeps each fp8 weight and its transpose (one byte each) from the step's first microbatch on;
    # under ZeRO-3 a layer's weights are gathered and cast per use instead
    cluster = load_cluster("dgx-h100", 2)
    config = TrainingConfig(dp=2, zero=zero, microbatch=B, global_batch=2 * B, seq=S)
    bf16 = CostModel(spec=GPT).estimate(cluster, config).memory
    fp8 = CostModel(spec=GPT).estimate(cluster, config.with_(dtype="fp8")).memory
    part = CostModel(spec=GPT).profile(B, S).templates[0]
    want = GPT.n_layers * 2 * sum(g.weight_elems for g in part.fp8_gemms) if cached else 0.0
    assert fp8.params_bytes - bf16.params_bytes == pytest.approx(want)
    assert (fp8.grads_bytes, fp8.optimizer_bytes) == (bf16.grads_bytes, bf16.optimizer_bytes)


def test_fp8_primary_weights_replace_the_16_bit_copy_and_gather_in_fp8():
    # fp8 params (NeMo fp8_params): the fp8 weight and its transpose replace the 16-bit weight, and
    # the distributed optimizer all-gathers block weights at one byte
    from coplan.cost.comm import Group

    cluster = load_cluster("dgx-h100", 16)
    config = TrainingConfig(
        dp=16, zero=1, microbatch=B, global_batch=16 * B, seq=S, dtype="fp8", overlap_param_gather=False
    )
    cm = CostModel(spec=GPT)
    plain, fp8p = cm.estimate(cluster, config), cm.estimate(cluster, config.with_(fp8_params=True))
    bf16 = cm.estimate(cluster, config.with_(dtype="bf16"))
    assert fp8p.memory.params_bytes == bf16.memory.params_bytes < plain.memory.params_bytes
    part = cm.profile(B, S).templates[0]
    gemm_weights = GPT.n_layers * sum(g.weight_elems for g in part.fp8_gemms)
    p_local = bf16.memory.params_bytes / 2
    net = cluster.groups[0].device.efficiency_of("network")
    group = Group.of(cluster, 16, 1, net)
    assert plain.stages[0].param_gather_s == pytest.approx(group.all_gather(2 * p_local))
    assert fp8p.stages[0].param_gather_s == pytest.approx(group.all_gather(2 * p_local - gemm_weights))


def test_fp8_params_needs_fp8(cli):
    from coplan.cost import ConfigError

    with pytest.raises(ConfigError, match="fp8_params"):
        TrainingConfig(fp8_params=True)
    code, out, err = cli("estimate", "--model", "gpt-tiny", "--fp8-params", "--json")
    assert code == 2 and out == "" and len(err.strip().splitlines()) == 1 and "fp8" in err
    code, out, _ = cli("estimate", "--model", "gpt-tiny", "--dtype", "fp8", "--fp8-params", "--json")
    assert code == 0


def test_fp8_on_a_device_without_fp8_units_is_priced_as_bf16_and_says_so():
    # MFU against the peak of the precision really run (it was the fp32 peak: MFU over 100%)
    cluster = load_cluster("dgx-a100-80gb", 1)
    config = TrainingConfig(microbatch=B, global_batch=B, seq=S)
    bf16 = CostModel(spec=GPT).estimate(cluster, config)
    fp8 = CostModel(spec=GPT).estimate(cluster, config.with_(dtype="fp8"))
    assert fp8.step_time_s == pytest.approx(bf16.step_time_s)
    assert fp8.mfu == pytest.approx(bf16.mfu) and fp8.mfu < 1
    assert fp8.memory.peak_bytes == pytest.approx(bf16.memory.peak_bytes)
    assert bf16.notes == () and len(fp8.notes) == 1 and "bf16" in fp8.notes[0]


def test_a_column_parallel_input_not_from_a_norm_is_cast_on_its_sequence_shard():
    # under sequence parallelism TE casts the local shard, gathers it in fp8, and transposes the
    # gathered input for the weight gradient
    from coplan.cost.parts import QuantGemm

    g = QuantGemm(1, 1000.0, 3000.0, 300.0, row_parallel=False, from_norm=False, dtype="")
    fwd, bwd, nf, nb = quant_bytes((g,), 4, True)
    assert fwd == 3 * 1000 / 4
    assert bwd == 2 * 1000 + 4 * 3000 / 4
    assert (nf, nb) == (1, 2)


def test_moe_router_is_not_an_fp8_gemm():
    part = CostModel(spec=PRESETS["moe-tiny"]).profile(1, 64).templates[0]
    g = CostModel(spec=PRESETS["moe-tiny"]).profile(1, 64).graph
    paths = {g.ops[i].module_path for i in part.op_ids}
    assert any(p.endswith(".router") for p in paths)
    # attention's two linear layers only: the router is a plain linear layer, experts are batched
    assert len(part.fp8_gemms) == 2


def test_zero3_casts_fp8_weights_at_every_use():
    # gathered per layer and freed after use, the weights are cast every microbatch, not once a step
    cluster = load_cluster("dgx-h100", 2)
    config = TrainingConfig(dp=2, zero=1, microbatch=B, global_batch=8 * B, seq=S, dtype="fp8")
    cm = CostModel(spec=GPT)
    z1, z3 = cm.estimate(cluster, config), cm.estimate(cluster, config.with_(zero=3))
    device = cluster.groups[0].device
    bw = device.memory_bandwidth * device.efficiency_of("memory")
    part = cm.profile(B, S).templates[0]
    cast = GPT.n_layers * weight_cast_bytes(part.fp8_gemms, 1) / bw
    m = config.num_microbatches
    assert z3.stages[0].forward_s - z1.stages[0].forward_s == pytest.approx(cast * (1 - 1 / m))


def test_a_mixed_cluster_takes_mfu_against_what_each_device_really_runs():
    # H100s run fp8, A100s fall back to bf16: MFU's peak is the least of those (A100's bf16), not an
    # A100 fp8 peak of zero standing in for fp32's
    cluster = load_cluster("mixed-h100-a100")
    config = TrainingConfig(
        tp=8, pp=2, microbatch=1, global_batch=4, seq=S, dtype="fp8", sequence_parallel=True
    )
    est = CostModel(spec=GPT).estimate(cluster, config)
    a100 = next(d for d in cluster.devices if d.name == "a100-sxm-80gb")
    assert est.peak_flops == a100.peak("bf16") and 0 < est.mfu < 1
    assert [n.split(" ")[0] for n in est.notes] == ["a100-sxm-80gb"]


def test_rowwise_cast_bytes_of_a_gpt_block():
    # torchao's rowwise recipe: each distinct input cast along rows in forward (2 + 1) and along
    # columns, transposed, in backward (2 + 2 + 1); each output gradient both ways (8); each weight
    # cast at every use (3 forward, 7 backward); each backward GEMM's output rescaled (2 + 2).
    # Under TP a column-parallel input and a row-parallel output gradient are whole on every rank.
    from coplan.cost.fp8 import rowwise_bytes

    part = _block(GPT)
    t, h = B * S, GPT.d_model
    for tp in (1, 2):
        fwd, bwd, nf, nb = rowwise_bytes(part.fp8_gemms, tp)
        # inputs: QKV (t h, whole), projection (t h / tp), FC1 (t h, whole), FC2 (4 t h / tp)
        inputs = t * h + t * h / tp + t * h + 4 * t * h / tp
        # output gradients: QKV (3 t h / tp), projection (t h, whole), FC1 (4 t h / tp), FC2 (t h)
        grads = 3 * t * h / tp + t * h + 4 * t * h / tp + t * h
        weights = 12 * h * h / tp
        assert fwd == pytest.approx(3 * inputs + 3 * weights)
        assert bwd == pytest.approx(5 * inputs + 8 * grads + 7 * weights + 4 * (inputs + weights))
        assert (nf, nb) == (4 + 4, 4 * 2 + 4 * 8)


def test_rowwise_scaling_costs_more_than_tensorwise_and_gathers_in_16_bits(cli):
    from coplan.cost import ConfigError

    cluster = load_cluster("dgx-h100", 2)
    config = TrainingConfig(
        tp=2, sequence_parallel=True, microbatch=B, global_batch=4 * B, seq=S, dtype="fp8"
    )
    cm = CostModel(spec=GPT)
    tw, rw = cm.estimate(cluster, config), cm.estimate(cluster, config.with_(fp8_scaling="rowwise"))
    bf16 = cm.estimate(cluster, config.with_(dtype="bf16"))
    assert rw.stages[0].forward_s > tw.stages[0].forward_s
    assert rw.stages[0].backward_s > tw.stages[0].backward_s
    # the block's all-gathers move 16-bit elements, as bf16's do; tensorwise gathers fp8
    assert rw.breakdown_s["tp_comm"] == pytest.approx(bf16.breakdown_s["tp_comm"])
    assert tw.breakdown_s["tp_comm"] < bf16.breakdown_s["tp_comm"]
    # a bf16 configuration ignores the scaling: nothing runs in fp8
    assert cm.estimate(cluster, config.with_(dtype="bf16", fp8_scaling="rowwise")).step_time_s == (
        pytest.approx(bf16.step_time_s)
    )
    with pytest.raises(ConfigError, match="fp8_scaling"):
        TrainingConfig(fp8_scaling="blockwise")
    with pytest.raises(ConfigError, match="fp8_params"):
        TrainingConfig(dtype="fp8", fp8_params=True, fp8_scaling="rowwise")
    args = ("estimate", "--model", "gpt-tiny", "--dtype", "fp8", "--json")
    code, out, _ = cli(*args, "--fp8-scaling", "rowwise")
    assert code == 0 and '"fp8_scaling": "rowwise"' in out
    code, out, err = cli(*args, "--fp8-scaling", "blockwise")
    assert code == 2 and out == "" and "blockwise" in err
