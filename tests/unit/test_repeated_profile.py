"""A spec's step is priced from a two-block graph, its one template repeated to the model's depth
(``CostModel.priced_profile``): every price must equal the whole graph's."""

from __future__ import annotations

import random

import pytest

from coplan.cost import CostModel, TrainingConfig, load_stack
from coplan.cost.config import ConfigError
from coplan.hardware import load_cluster
from coplan.models.spec import PRESETS

MODELS = ("gpt2-124m", "llama2-7b", "llama3-8b", "mixtral-8x7b", "bert-base", "nemotron4-15b", "gpt3-5b")


def _configs(name: str, rng: random.Random, n: int) -> list[TrainingConfig]:
    spec = PRESETS[name]
    out: list[TrainingConfig] = []
    while len(out) < n:
        tp = rng.choice([1, 2, 4])
        pp = rng.choice([1, 2, 4])
        vpp = rng.choice([1, 2]) if pp > 1 else 1
        dp = rng.choice([1, 2, 8])
        mb = rng.choice([1, 2])
        kw = {
            "tp": tp,
            "pp": pp,
            "vpp": vpp,
            "dp": dp,
            "microbatch": mb,
            "global_batch": mb * dp * rng.choice([1, 4, 8]),
            "seq": rng.choice([256, 512]),
            "recompute": rng.choice(["none", "selective", "full"]),
            "zero": rng.choice([0, 1, 2, 3]),
            "dtype": rng.choice(["bf16", "fp8"]),
            "sequence_parallel": tp > 1 and rng.random() < 0.5,
            "flash_attention": rng.random() < 0.8,
        }
        if kw["recompute"] == "full" and rng.random() < 0.5:
            kw["recompute_layers"] = rng.choice([1, 2, 3])
        if spec.n_layers % (pp * vpp) or spec.n_heads % tp:
            continue
        try:
            config = TrainingConfig(**kw)  # type: ignore[arg-type]
        except ConfigError:
            continue
        stack = rng.choice(["megatron", "torchtitan", "fsdp-compile", "deepspeed"])
        config = load_stack(stack).configure(config)
        # the per-tensor optimizer loop and synchronous launches count every block's kernels
        out.append(
            config.with_(
                optimizer=rng.choice(["", "foreach", "for-loop"]), launch_blocking=rng.random() < 0.3
            )
        )
    return out


@pytest.mark.parametrize("name", MODELS)
def test_a_repeated_profile_prices_as_the_whole_graph(name: str, monkeypatch: pytest.MonkeyPatch) -> None:
    rng = random.Random(name)
    model = CostModel(spec=PRESETS[name])
    wholes = CostModel(spec=PRESETS[name])
    checked = 0
    for config in _configs(name, rng, 12):
        cluster = load_cluster("dgx-h100", config.gpus)
        try:
            model.check(cluster, config)
        except ConfigError:
            continue
        seq = model.seq_of(config)
        short = model.priced_profile(config.microbatch, seq, config.fusion)
        whole = model.profile(config.microbatch, seq, config.fusion)
        assert short.n_layers == whole.n_layers and len(short.graph.ops) < len(whole.graph.ops)
        assert short.model_flops == pytest.approx(whole.model_flops, rel=1e-12)
        got = model.estimate(cluster, config)
        with monkeypatch.context() as m:
            # the same model priced from whole graphs only
            m.setattr(CostModel, "priced_profile", CostModel.profile)
            want = wholes.estimate(cluster, config)
        assert got.step_time_s == pytest.approx(want.step_time_s, rel=1e-9)
        assert got.memory.peak_bytes == pytest.approx(want.memory.peak_bytes, rel=1e-9)
        assert got.memory.activations_bytes == pytest.approx(want.memory.activations_bytes, rel=1e-9)
        for key, value in want.breakdown_s.items():
            assert got.breakdown_s[key] == pytest.approx(value, rel=1e-9, abs=1e-12), key
        assert got.mfu == pytest.approx(want.mfu, rel=1e-9)
        checked += 1
    assert checked >= 4


def test_op_groups_and_per_op_dtypes_take_the_whole_graph() -> None:
    model = CostModel(spec=PRESETS["llama2-7b"])
    whole = model.profile(1, 512, "none")
    assert model.priced_profile(1, 512, ((0, 1),)) is model.profile(1, 512, ((0, 1),))
    over = ("bf16", ((3, "fp32"),))
    assert model.priced_profile(1, 512, "none", over) is model.profile(1, 512, "none", over)
    assert model.priced_profile(1, 512, "none").graph is not whole.graph
