"""How a stack splits a model's blocks over pipeline chunks that do not divide them
(``StackSpec.pipeline_split``, ``coplan.cost.stages.weighted_split``): torchtitan counts the
embedding and the norm + output as a block each and spreads them all as evenly as they go;
Megatron-LM refuses the split unless one is given."""

from __future__ import annotations

import json

import pytest

from coplan.cost import CostModel
from coplan.cost.stacks import load_stack
from coplan.cost.stages import weighted_split
from coplan.hardware import load_cluster
from coplan.models.spec import PRESETS
from coplan.passes.parallel import candidates
from coplan.plan import PlanContext


def test_the_weighted_split_spreads_the_embedding_and_output_with_the_blocks() -> None:
    # Llama 3.1 405B on 16 stages: 126 + 2 = 128 slots, 8 a stage, the first and last one block
    # short (the split the Llama 3 paper describes for its own pipeline)
    assert weighted_split(126, 16) == (7,) + (8,) * 14 + (7,)
    # 32 + 2 = 34 over 4: 9, 9, 8, 8 slots, the first and last less a block
    assert weighted_split(32, 4) == (8, 9, 8, 7)
    assert weighted_split(27, 4) == (7, 7, 7, 6)
    assert weighted_split(2, 4) == (0, 1, 1, 0)  # a chunk of the embedding alone, as torchtitan
    assert weighted_split(1, 4) is None  # 3 slots over 4 chunks: one would hold nothing
    assert weighted_split(8, 1) == (8,)
    for n, chunks in ((126, 8), (80, 6), (61, 4), (95, 16)):
        got = weighted_split(n, chunks)
        assert got is not None and sum(got) == n and len(got) == chunks
        assert max(got) - min(got) <= 2


def test_only_a_weighted_stack_splits_chunks_that_do_not_divide() -> None:
    titan, megatron = load_stack("torchtitan"), load_stack("megatron")
    assert titan.pipeline_split == "weighted" and megatron.pipeline_split == "even"
    assert titan.stage_split(126, 16) == weighted_split(126, 16)
    assert titan.stage_split(128, 16) is None  # they divide: the even split
    assert titan.stage_split(126, 1) is None
    assert megatron.stage_split(126, 16) is None


def test_estimate_splits_as_the_stack_does(cli) -> None:  # type: ignore[no-untyped-def]
    args = ("estimate", "--model", "gpt-tiny", "--gpus", "3", "--pp", "3", "--global-batch", "6")
    code, out, err = cli(*args, "--stack", "torchtitan", "--json")
    assert code == 0, err
    data = json.loads(out)
    assert data["config"]["stage_layers"] == list(weighted_split(2, 3))
    assert [s["layers"] for s in data["stages"]] == list(weighted_split(2, 3))
    code, _, err = cli(*args)
    assert code == 2 and "--stage-layers" in err and len(err.strip().splitlines()) == 1


@pytest.mark.parametrize("stack", ["torchtitan", "megatron"])
def test_the_search_prices_uneven_pipelines_only_where_the_stack_runs_them(stack: str) -> None:
    ctx = PlanContext(
        CostModel(spec=PRESETS["gpt-tiny"]),
        load_cluster("dgx-h100", 3),
        global_batch=6,
        seq=64,
        stack=load_stack(stack),
    )
    three = [p for p in candidates(ctx) if p.pp == 3]
    if stack == "megatron":
        assert three == []
    else:
        assert three and all(p.stage_layers == weighted_split(2, 3) and p.vpp == 1 for p in three)
        price = ctx.price(ctx.default_plan().with_(parallel=three[0]))
        assert [st.layers for st in price.stages] == list(weighted_split(2, 3))


def test_estimate_shows_the_split_it_priced(cli) -> None:  # type: ignore[no-untyped-def]
    args = ("estimate", "--model", "gpt-tiny", "--gpus", "3", "--pp", "3", "--global-batch", "6")
    code, out, err = cli(*args, "--stack", "torchtitan")
    assert code == 0, err
    assert "layers=" + "/".join(map(str, weighted_split(2, 3))) in " ".join(out.split())
