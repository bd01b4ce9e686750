"""``coplan inspect`` from the command line: its JSON contract, its recording and its refusals."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

CONTRACT = {
    "fingerprint",
    "passes",
    "kernels",
    "fallbacks",
    "unfused",
    "lineage",
    "graph_breaks",
    "record_id",
}


#: the smallest transformer the command builds: one block (a spec file, as users pass their own)
ONE_BLOCK = {"name": "gpt-one", "n_layers": 1, "d_model": 32, "n_heads": 2, "vocab_size": 128, "seq_len": 32}


@pytest.mark.compile
def test_inspect_json_and_history(cli, tmp_path: Path) -> None:
    db = tmp_path / "h.sqlite"
    html = tmp_path / "r.html"
    spec = tmp_path / "gpt-one.json"
    spec.write_text(json.dumps(ONE_BLOCK))
    code, out, err = cli(
        "inspect", "--model", str(spec), "--steps", "1", "--json", "--db", str(db), "--html", str(html)
    )
    assert code == 0, err
    rec = json.loads(out)
    assert set(rec) >= CONTRACT
    assert {"name", "fingerprint", "ops_before", "ops_after"} <= set(rec["passes"][0])
    assert all({"ops", "reason", "predicted_saving_s"} <= set(u) for u in rec["unfused"])
    assert isinstance(rec["kernels"], int) and rec["kernels"] > 0
    assert isinstance(rec["record_id"], int)
    assert rec["model"] == str(spec) and rec["device"] == "cpu" and rec["hardware"] == "cpu"
    assert rec["seq"] == 32  # the default 128, capped at the model's length
    assert html.read_text().startswith("<!doctype html>")
    code, out, _ = cli("history", "list", "--db", str(db), "--json")
    assert code == 0
    assert [r["id"] for r in json.loads(out)["records"]] == [rec["record_id"]]
    code, out, _ = cli("history", "show", str(rec["record_id"]), "--db", str(db), "--json")
    assert code == 0 and json.loads(out)["fingerprint"] == rec["fingerprint"]


@pytest.mark.parametrize(
    ("args", "words"),
    [
        (["--html", "/no/such/folder/r.html"], "does not exist"),
        (["--model", "no-such-model"], "no-such-model"),
        (["--batch", "0"], "--batch"),
        (["--seq", "100000"], "--seq"),
        (["--steps", "-1"], "--steps"),
        (["--hardware", "no-such-device"], "no-such-device"),
    ],
)
def test_bad_input_is_one_line_before_any_compile(cli, tmp_path: Path, args: list[str], words: str) -> None:
    code, out, err = cli("inspect", "--model", "gpt-tiny", "--no-record", *args)
    assert code == 2, (out, err)
    assert err.count("\n") == 1 and words in err and "Traceback" not in err


def test_a_history_path_that_is_a_folder_is_refused(cli, tmp_path: Path) -> None:
    code, _, err = cli("inspect", "--model", "gpt-tiny", "--db", str(tmp_path))
    assert code == 2 and "directory" in err


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the refusal where no CUDA device is visible")
def test_cuda_without_a_gpu_is_refused(cli) -> None:
    code, _, err = cli("inspect", "--model", "gpt-tiny", "--no-record", "--device", "cuda")
    assert code == 2 and "CUDA" in err


@pytest.mark.slow
@pytest.mark.compile
def test_a_hugging_face_config_file(cli, tmp_path: Path) -> None:
    pytest.importorskip("transformers", reason="the hf extra is not installed")
    config = {
        "model_type": "gpt2",
        "n_layer": 2,
        "n_embd": 64,
        "n_head": 4,
        "vocab_size": 512,
        "n_positions": 64,
        "architectures": ["GPT2LMHeadModel"],
    }
    path = tmp_path / "config.json"
    path.write_text(json.dumps(config))
    code, out, err = cli("inspect", "--model", str(path), "--no-record", "--steps", "0", "--json")
    assert code == 0, err
    rec = json.loads(out)
    assert rec["seq"] == 64  # the default 128 capped at the config's positions
    names = [g["name"] for g in rec["graphs"]]
    assert names[0] == "forward" and "backward" in names
    # transformers' GPT-2 breaks the graph where it logs (a logger call Dynamo does not trace): each
    # break is reported where it is, and the frames after it compile as graphs of their own
    assert all(b["location"].startswith("transformers/") and b["reason"] for b in rec["graph_breaks"])
    assert len(names) > 2 if rec["graph_breaks"] else len(names) == 2
    code, _, err = cli("inspect", "--model", str(path), "--no-record", "--seq", "65")
    assert code == 2 and "64" in err


def test_optimizer_choices_match_the_registry() -> None:
    from coplan.cli.choices import Optimizer
    from coplan.cost.config import OPTIMIZER_IMPLEMENTATIONS
    from coplan.inspect.step import OPTIMIZERS

    assert sorted(o.value for o in Optimizer) == sorted(OPTIMIZERS)
    # the cost model's "" is "as a plan's optimizer kernels say", no flag's value
    assert sorted(o.value for o in Optimizer) == sorted(x for x in OPTIMIZER_IMPLEMENTATIONS if x)
