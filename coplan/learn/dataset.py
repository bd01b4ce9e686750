"""Training data for the learned planner, generated here: sampled jobs labelled by coplan's planners.

``write_dataset`` samples jobs (``jobs.sample_job``, deterministic from the seed), plans each with
the teacher (``joint-exact``: the exact op-level optimum of fusion x recomputation x precision per
parallel layout, every layout searched; ``joint`` where the exact model fails) and with the
production passes in sequence (``sequential``, the baseline the learned policy must beat), and
writes them as JSON lines in shards of ``shard_size`` jobs beside a manifest. Every label is a
plan checked by the plan checker and priced by the cost model (``run_strategy``).

The manifest (``manifest.json``) names the format and its version, the seed, the number of jobs,
the shard size, the teacher and the baseline, the splits (what each holds) and, per shard
written, its file, first job, job count, split counts and SHA-256. A shard is written to a
temporary file and renamed, then the manifest is rewritten the same way, so an interrupted run
leaves only whole shards that the manifest lists; running the same command again labels only
the shards that are missing (``resume``). ``open_dataset`` refuses a manifest of another format
or version and a shard that disagrees with it (a missing file, another hash, another count), in
one line (``DatasetError``, exit 2).

Labelling runs in local worker processes (``coplan.procs.Pool``), one job per task, or on a Ray
cluster (``ray=`` "auto" or an address: ``ray.init(address=...)``), where each job is one remote
task; the driver assembles shards in either case.
"""

from __future__ import annotations

import hashlib
import json
import os
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from coplan.errors import CoplanError, SpecError
from coplan.fileio import write_text
from coplan.learn.jobs import (
    FAMILIES,
    FAMILY_SPLITS,
    HELDOUT_FAMILIES,
    HELDOUT_WIDTHS,
    SPLITS,
    Job,
    sample_job,
)

__all__ = [
    "BASELINE",
    "DATASET_FORMAT",
    "DATASET_VERSION",
    "TEACHER",
    "Dataset",
    "DatasetError",
    "Summary",
    "label_job",
    "open_dataset",
    "write_dataset",
]

DATASET_FORMAT = "coplan-learn-dataset"
DATASET_VERSION = 2  # 2: the encoder family (its own held-out split)
MANIFEST = "manifest.json"
TEACHER = "joint-exact"
FALLBACK = "joint"
BASELINE = "sequential"
DEFAULT_SHARD_SIZE = 32

#: what each split holds (recorded in the manifest)
SPLIT_DOC = {
    "train": f"families {', '.join(f for f in FAMILIES if f not in HELDOUT_FAMILIES)}, "
    f"widths other than {', '.join(map(str, HELDOUT_WIDTHS))}; trained on",
    "val": "the same population as train, a held-aside tenth; for model selection",
    "heldout": f"the trained families at widths {', '.join(map(str, HELDOUT_WIDTHS))}; never trained on",
    **{split: f"family {family}; never trained on" for family, split in FAMILY_SPLITS.items()},
}


class DatasetError(CoplanError):
    """A dataset folder that cannot be used (exit 2)."""

    def __init__(self, where: Path | str, message: str) -> None:
        super().__init__(f"dataset {where}: {message}")


def _result(r: Any) -> dict[str, Any]:
    e = r.estimate
    return {
        "strategy": r.strategy,
        "step_time_s": e.step_time_s,
        "peak_bytes": e.memory.peak_bytes,
        "mfu": e.mfu,
        "fits": r.fits,
        "plan_time_s": r.plan_time_s,
        "evaluations": r.evaluations,
        "violations": [str(v) for v in r.violations],
        "plan": r.plan.to_dict(),
    }


def label_job(job: Job) -> dict[str, Any]:
    """One dataset record: ``job`` planned by the teacher and by the baseline, each plan checked
    and priced. A job coplan refuses (a bad combination the sampler let through) is kept with its
    one-line reason under ``"error"``, so that indexes stay dense."""
    from coplan.search import run_strategy

    t0 = time.perf_counter()
    record: dict[str, Any] = {"id": job.id, "job": job.to_dict(), "labels": {}}
    try:
        ctx = job.context()
        try:
            teacher = run_strategy(TEACHER, ctx)
        except CoplanError:
            teacher = run_strategy(FALLBACK, ctx)
        record["labels"]["teacher"] = _result(teacher)
        record["labels"]["baseline"] = _result(run_strategy(BASELINE, ctx))
    except CoplanError as err:
        record["error"] = str(err)
    record["label_s"] = time.perf_counter() - t0
    return record


def _label_index(seed: int, index: int) -> dict[str, Any]:
    import torch

    torch.set_num_threads(1)  # one job per worker process; planning is not BLAS-bound
    return label_job(sample_job(seed, index))


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as fh:
        for block in iter(lambda: fh.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def _shard_name(k: int) -> str:
    return f"shard-{k:05d}.jsonl"


@dataclass(frozen=True, slots=True)
class Summary:
    """What ``write_dataset`` did."""

    out: Path
    n: int
    shards: int
    written: int  # jobs labelled by this run
    skipped: int  # jobs in shards an earlier run completed
    counts: dict[str, int]
    seconds: float
    label_s_mean: float
    feasible: int  # jobs, over the whole dataset, whose teacher plan fits
    errors: int
    complete: bool

    def to_dict(self) -> dict[str, Any]:
        return {
            "out": str(self.out),
            "n": self.n,
            "shards": self.shards,
            "written": self.written,
            "skipped": self.skipped,
            "splits": dict(self.counts),
            "seconds": self.seconds,
            "label_s_mean": self.label_s_mean,
            "feasible": self.feasible,
            "errors": self.errors,
            "complete": self.complete,
        }


def _header(seed: int, n: int, shard_size: int) -> dict[str, Any]:
    from importlib.metadata import PackageNotFoundError, version

    try:
        coplan_version = version("coplan")
    except PackageNotFoundError:  # a checkout on sys.path, not installed
        coplan_version = "unknown"
    return {
        "format": DATASET_FORMAT,
        "version": DATASET_VERSION,
        "seed": seed,
        "n": n,
        "shard_size": shard_size,
        "teacher": TEACHER,
        "fallback": FALLBACK,
        "baseline": BASELINE,
        "splits": SPLIT_DOC,
        "coplan": coplan_version,
    }


def check_out(out: Path, seed: int, n: int, shard_size: int) -> dict[str, Any] | None:
    """Refuse, before any work, a ``--out`` that cannot hold this dataset; return the manifest an
    earlier run of the same command left there (to resume), or None."""
    label = f"--out {out}"
    if out.exists() and not out.is_dir():
        raise SpecError(label, None, "is a file; give a folder for the dataset")
    parent = out.parent if str(out.parent) else Path(".")
    if not out.exists() and not parent.is_dir():
        raise SpecError(label, None, f"folder {parent} does not exist")
    target = out if out.exists() else parent
    if not os.access(target, os.W_OK | os.X_OK):
        raise SpecError(label, None, f"folder {target} is not writable")
    manifest = out / MANIFEST
    if not manifest.exists():
        if out.exists() and any(out.iterdir()):
            raise SpecError(label, None, "holds files but no dataset manifest; give an empty or new folder")
        return None
    got = _read_manifest(out)
    want = _header(seed, n, shard_size)
    for key in ("seed", "n", "shard_size", "teacher", "baseline"):
        if got.get(key) != want[key]:
            raise SpecError(
                label,
                None,
                f"holds a dataset of {key} {got.get(key)!r}, not {want[key]!r}: resume it with the "
                "same options or give another folder",
            )
    return got


def _read_manifest(out: Path) -> dict[str, Any]:
    try:
        data = json.loads((out / MANIFEST).read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError) as err:
        raise DatasetError(out, f"cannot read {MANIFEST}: {err}") from None
    except json.JSONDecodeError as err:
        raise DatasetError(out, f"{MANIFEST} is not JSON (line {err.lineno}): {err.msg}") from None
    if not isinstance(data, dict) or data.get("format") != DATASET_FORMAT:
        raise DatasetError(out, f"{MANIFEST} is not a coplan dataset manifest")
    if data.get("version") != DATASET_VERSION:
        raise DatasetError(
            out,
            f"dataset version {data.get('version')!r}; this coplan reads version {DATASET_VERSION}: "
            "write it again with 'coplan learn dataset'",
        )
    return data


def _tasks_ray(address: str, seed: int, todo: list[int]) -> Iterator[dict[str, Any]]:
    try:
        import ray
    except ImportError:
        raise SpecError("--ray", None, "needs the 'ray' package: pip install 'coplan[learn]'") from None
    if not ray.is_initialized():
        try:
            try:
                ray.init(address=address, include_dashboard=False, log_to_driver=False)
            except ConnectionError:
                if address != "auto":
                    raise
                # "auto" with no cluster running: a Ray instance on this machine
                ray.init(include_dashboard=False, log_to_driver=False)
        except (ConnectionError, ValueError, RuntimeError) as err:
            raise SpecError(f"--ray {address}", None, f"cannot reach a Ray cluster: {err}") from None
    remote = ray.remote(num_cpus=1)(_label_index)
    pending = [remote.remote(seed, i) for i in todo]
    try:
        while pending:
            done, pending = ray.wait(pending, num_returns=1)
            yield ray.get(done[0])
    finally:
        for ref in pending:
            ray.cancel(ref, force=True)


def _tasks_local(jobs: int, seed: int, todo: list[int]) -> Iterator[dict[str, Any]]:
    if jobs <= 1 or len(todo) <= 1:
        for i in todo:
            yield _label_index(seed, i)
        return
    from concurrent.futures import as_completed

    from coplan import procs

    with procs.Pool(min(jobs, len(todo))) as pool:
        futures = [pool.submit(_label_index, seed, i) for i in todo]
        for fut in as_completed(futures):
            yield fut.result()


def write_dataset(
    out: Path,
    n: int,
    seed: int = 0,
    *,
    shard_size: int = DEFAULT_SHARD_SIZE,
    jobs: int = 1,
    ray: str | None = None,
    progress: Callable[[int, int, str], None] | None = None,
) -> Summary:
    """Label jobs ``0 .. n-1`` of ``seed`` into ``out`` (see the module doc). Shards an earlier run
    of the same command completed are kept; a Ctrl-C keeps what finished and re-raises."""
    t0 = time.perf_counter()
    prior = check_out(out, seed, n, shard_size)
    out.mkdir(parents=True, exist_ok=True)
    n_shards = -(-n // shard_size)
    header = _header(seed, n, shard_size)
    shards: dict[int, dict[str, Any]] = {}
    if prior is not None:
        for entry in prior.get("shards", []):
            k = int(entry["first"]) // shard_size
            path = out / entry["file"]
            if path.is_file() and _sha256(path) == entry["sha256"]:
                shards[k] = entry
    skipped = sum(int(e["count"]) for e in shards.values())
    todo = [
        i
        for k in range(n_shards)
        if k not in shards
        for i in range(k * shard_size, min(n, (k + 1) * shard_size))
    ]
    pending: dict[int, dict[int, dict[str, Any]]] = {}
    written = 0
    label_s = 0.0

    def save_manifest(complete: bool) -> None:
        entries = [shards[k] for k in sorted(shards)]
        counts = {s: sum(e["splits"].get(s, 0) for e in entries) for s in SPLITS}
        body = header | {
            "complete": complete,
            "counts": counts,
            "feasible": sum(e["feasible"] for e in entries),
            "errors": sum(e["errors"] for e in entries),
            "shards": entries,
        }
        write_text(out / MANIFEST, json.dumps(body, indent=1) + "\n")

    def flush(k: int) -> None:
        got = pending.pop(k)
        records = [got[i] for i in sorted(got)]
        path = out / _shard_name(k)
        write_text(path, "".join(json.dumps(r, separators=(",", ":")) + "\n" for r in records))
        splits: dict[str, int] = {}
        for r in records:
            s = r["job"]["split"]
            splits[s] = splits.get(s, 0) + 1
        shards[k] = {
            "file": path.name,
            "first": k * shard_size,
            "count": len(records),
            "splits": splits,
            "feasible": sum(1 for r in records if r["labels"].get("teacher", {}).get("fits")),
            "errors": sum(1 for r in records if "error" in r),
            "sha256": _sha256(path),
        }
        save_manifest(complete=len(shards) == n_shards)

    if progress:
        progress(skipped, n, "resuming" if skipped else "labelling")
    tasks = _tasks_ray(ray, seed, todo) if ray else _tasks_local(jobs, seed, todo)
    for record in tasks:
        i = int(record["job"]["index"])
        k = i // shard_size
        pending.setdefault(k, {})[i] = record
        written += 1
        label_s += float(record["label_s"])
        if len(pending[k]) == min(n, (k + 1) * shard_size) - k * shard_size:
            flush(k)
        if progress:
            progress(
                skipped + written, n, f"{record['job']['spec']['name']} on {record['job']['cluster']['name']}"
            )
    if not todo or prior is None:
        save_manifest(complete=len(shards) == n_shards)
    entries = list(shards.values())
    return Summary(
        out=out,
        n=n,
        shards=n_shards,
        written=written,
        skipped=skipped,
        counts={s: sum(e["splits"].get(s, 0) for e in entries) for s in SPLITS},
        seconds=time.perf_counter() - t0,
        label_s_mean=label_s / written if written else 0.0,
        feasible=sum(e["feasible"] for e in entries),
        errors=sum(e["errors"] for e in entries),
        complete=len(shards) == n_shards,
    )


@dataclass(frozen=True, slots=True)
class Dataset:
    """A dataset folder whose shards agree with its manifest."""

    path: Path
    manifest: dict[str, Any]

    @property
    def n(self) -> int:
        return int(self.manifest["n"])

    def records(self, split: str | None = None) -> Iterator[dict[str, Any]]:
        """The records of ``split`` (None: all), shard by shard, in job order."""
        for entry in self.manifest["shards"]:
            with open(self.path / entry["file"], encoding="utf-8") as fh:
                for line in fh:
                    r = json.loads(line)
                    if split is None or r["job"]["split"] == split:
                        yield r

    def jobs(self, split: str | None = None) -> Iterator[Job]:
        for r in self.records(split):
            yield Job.from_dict(r["job"])


def open_dataset(path: Path) -> Dataset:
    """``path`` as a dataset: a manifest of this format and version, every shard it lists present
    with its hash and job count (``DatasetError`` otherwise)."""
    if not path.is_dir():
        raise DatasetError(path, "is not a folder" if path.exists() else "does not exist")
    if not (path / MANIFEST).is_file():
        raise DatasetError(path, f"has no {MANIFEST} (write one with 'coplan learn dataset')")
    manifest = _read_manifest(path)
    entries = manifest.get("shards")
    if not isinstance(entries, list) or not entries:
        raise DatasetError(path, "its manifest lists no shards")
    for entry in entries:
        name = entry.get("file") if isinstance(entry, dict) else None
        if not isinstance(name, str) or "/" in name or name.startswith("."):
            raise DatasetError(path, f"its manifest names a shard badly: {entry!r}")
        shard = path / name
        if not shard.is_file():
            raise DatasetError(path, f"shard {name} listed in the manifest is missing")
        if _sha256(shard) != entry.get("sha256"):
            raise DatasetError(
                path, f"shard {name} does not match the manifest's SHA-256 (changed since written)"
            )
        with open(shard, "rb") as fh:
            lines = sum(1 for _ in fh)
        if lines != entry.get("count"):
            raise DatasetError(
                path, f"shard {name} holds {lines} jobs, the manifest says {entry.get('count')}"
            )
    return Dataset(path, manifest)
