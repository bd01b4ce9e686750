"""The learned planner's training data (``coplan.learn``): jobs deterministic from the seed and
split by family and width, labels that are checked and priced plans, shards that agree with the
manifest, resumption, and the CLI's contract."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from coplan.errors import SpecError
from coplan.learn.dataset import (
    DATASET_VERSION,
    MANIFEST,
    DatasetError,
    open_dataset,
    write_dataset,
)
from coplan.learn.jobs import HELDOUT_FAMILIES, HELDOUT_WIDTHS, Job, sample_job
from coplan.plan import check
from coplan.plan.types import Plan


def test_jobs_are_deterministic_per_seed_and_index_and_split_as_documented():
    jobs = [sample_job(7, i) for i in range(300)]
    assert [j.to_dict() for j in jobs[:20]] == [sample_job(7, i).to_dict() for i in range(20)]
    assert [j.id for j in jobs[:20]] != [sample_job(8, i).id for i in range(20)]
    for j in jobs:
        assert Job.from_dict(json.loads(json.dumps(j.to_dict()))) == j
        if j.family in HELDOUT_FAMILIES:
            assert j.split == {"moe": "heldout_family", "encoder": "heldout_encoder"}[j.family]
            # the encoder family is the one that is not a decoder
            assert j.spec.causal is (j.family != "encoder")
        elif j.spec.d_model in HELDOUT_WIDTHS:
            assert j.split == "heldout"
        else:
            assert j.split in ("train", "val")
        assert j.global_batch % j.gpus == 0
    assert {j.split for j in jobs} == {"train", "val", "heldout", "heldout_family", "heldout_encoder"}
    assert all(j.spec.causal for j in jobs if j.split in ("train", "val", "heldout"))
    hypo = [j for j in jobs if j.hypothetical]
    assert hypo and all("~" in j.cluster.devices[0].name for j in hypo)


def test_hypothetical_devices_scale_within_a_factor_of_two():
    from coplan.hardware import load_cluster

    for j in (sample_job(3, i) for i in range(200)):
        if not j.hypothetical:
            continue
        dev = j.cluster.devices[0]
        base = load_cluster(dev.name.split("~")[0]).devices[0]
        for got, ref in (
            (dev.peak("bf16"), base.peak("bf16")),
            (dev.memory_bandwidth, base.memory_bandwidth),
        ):
            assert 0.5 - 1e-9 <= got / ref <= 2.0 + 1e-9


@pytest.fixture(scope="module")
def small(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("ds") / "data"
    write_dataset(out, 5, seed=11, shard_size=2, jobs=1)
    return out


def test_every_label_is_a_checked_priced_plan_and_the_teacher_is_never_worse(small):
    ds = open_dataset(small)
    assert ds.manifest["complete"] and ds.manifest["version"] == DATASET_VERSION
    records = list(ds.records())
    assert [r["job"]["index"] for r in records] == list(range(5))
    assert sum(ds.manifest["counts"].values()) == 5
    for r in records:
        assert "error" not in r
        job = Job.from_dict(r["job"])
        ctx = job.context()
        for label in r["labels"].values():
            plan = Plan.from_dict(label["plan"])
            est = ctx.price(plan)
            assert est.step_time_s == pytest.approx(label["step_time_s"], rel=1e-9)
            if label["fits"]:
                assert check(plan, ctx) == []
            assert 0.0 <= label["mfu"] <= 1.0
        t, b = r["labels"]["teacher"], r["labels"]["baseline"]
        if t["fits"] and b["fits"]:
            assert t["step_time_s"] <= b["step_time_s"] * (1 + 1e-9)


def test_resume_labels_only_missing_shards_and_tampering_is_refused(small, tmp_path):
    import shutil

    copy = tmp_path / "copy"
    shutil.copytree(small, copy)
    (copy / "shard-00001.jsonl").unlink()
    with pytest.raises(DatasetError, match="missing"):
        open_dataset(copy)
    again = write_dataset(copy, 5, seed=11, shard_size=2, jobs=1)
    assert (again.written, again.skipped, again.complete) == (2, 3, True)
    assert [r["job"]["index"] for r in open_dataset(copy).records()] == list(range(5))
    # another job count, seed or shard size in the same folder is refused before any work
    with pytest.raises(SpecError, match="holds a dataset of n 5"):
        write_dataset(copy, 6, seed=11, shard_size=2)
    # a changed shard, a wrong count and another version are refused on reading
    shard = copy / "shard-00000.jsonl"
    lines = shard.read_text().splitlines(keepends=True)
    shard.write_text(lines[0])
    with pytest.raises(DatasetError, match="SHA-256"):
        open_dataset(copy)
    manifest = json.loads((copy / MANIFEST).read_text())
    manifest["shards"][0]["sha256"] = __import__("hashlib").sha256(lines[0].encode()).hexdigest()
    (copy / MANIFEST).write_text(json.dumps(manifest))
    with pytest.raises(DatasetError, match="holds 1 jobs, the manifest says 2"):
        open_dataset(copy)
    manifest["version"] = DATASET_VERSION + 1
    (copy / MANIFEST).write_text(json.dumps(manifest))
    with pytest.raises(DatasetError, match="version"):
        open_dataset(copy)


def test_a_folder_holding_other_files_is_refused(tmp_path):
    (tmp_path / "notes.txt").write_text("mine")
    with pytest.raises(SpecError, match="no dataset manifest"):
        write_dataset(tmp_path, 2, seed=0)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["notes.txt"]  # nothing written


def test_cli_contract(tmp_path, cli):
    out = tmp_path / "d"
    code, stdout, err = cli(
        "learn", "dataset", "--out", str(out), "--n", "2", "--seed", "4", "--jobs", "1", "--json"
    )
    assert code == 0, err
    data = json.loads(stdout)
    assert data["n"] == 2 and data["written"] == 2 and data["complete"] is True
    assert set(data) >= {"out", "n", "shards", "written", "skipped", "splits", "feasible", "complete"}
    for bad, why in (
        (["--out", str(out / MANIFEST)], "is a file"),
        (["--out", str(out), "--n", "3", "--seed", "4"], "holds a dataset of n 2"),
        (["--out", str(tmp_path / "e"), "--n", "0"], "--n"),
        (["--out", str(tmp_path / "e"), "--ray", "auto", "--jobs", "2"], "--jobs"),
    ):
        code, stdout, err = cli("learn", "dataset", *bad)
        assert code == 2, (bad, err)
        assert err.count("\n") == 1 and why in err and "Traceback" not in err
    assert not (tmp_path / "e").exists()


def test_ray_labels_the_same_jobs_on_a_local_instance(tmp_path):
    ray = pytest.importorskip("ray", reason="Ray is in the dev extras; without it --ray is refused")
    ray.init(num_cpus=1, include_dashboard=False, log_to_driver=False)
    try:
        s = write_dataset(tmp_path / "r", 2, seed=11, shard_size=2, ray="auto")
    finally:
        ray.shutdown()
    assert s.complete and s.written == 2
    local = [r["job"] for r in open_dataset(tmp_path / "r").records()]
    assert local == [sample_job(11, i).to_dict() for i in range(2)]
