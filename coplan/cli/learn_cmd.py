"""``coplan learn``: the learned planner's data.

    coplan learn dataset --out DIR [--n N] [--seed S] [--ray auto|ADDRESS] [--jobs J] [--json]

``dataset`` samples ``N`` training jobs from seed ``S`` and labels each with coplan's teacher
(``joint-exact``) and baseline (``sequential``) plans, in shards beside a manifest
(``coplan.learn.dataset``). Run again with the same options, it labels only the shards that are
missing. Local worker processes by default; ``--ray auto`` uses the Ray cluster this machine
belongs to (or starts one here), ``--ray ADDRESS`` a given one. ``--json`` prints one object:
``{"out", "n", "shards", "written", "skipped", "splits": {SPLIT: jobs}, "seconds",
"label_s_mean", "feasible", "errors", "complete"}``. Bad input (a ``--out`` that is a file or
holds another dataset, ``--n`` not positive): one line, exit 2, nothing written. Ctrl-C keeps the
shards that finished (the manifest lists them), then one line, exit 130.
"""

from __future__ import annotations

import enum
import os
from pathlib import Path
from typing import Annotated

import typer

from coplan.cli.common import interruptible, positive, print_json, stdout
from coplan.cli.coupling_cmd import _Bar
from coplan.cli.options import JsonOpt

app = typer.Typer(
    name="learn",
    help="The learned planner: its training data, its training and its verdict.",
    no_args_is_help=True,
    add_completion=False,
)


def _check_seed(seed: int) -> None:
    """``--seed`` is a non-negative integer (one line, exit 2, otherwise)."""
    from coplan.errors import SpecError

    if isinstance(seed, bool) or seed < 0:
        raise SpecError("--seed", None, f"must be a non-negative integer, got {seed!r}")


@app.command("dataset")
def dataset(
    out: Annotated[Path, typer.Option("--out", "-o", help="Folder of the dataset (made if missing).")],
    n: Annotated[int, typer.Option("--n", "-n", help="Training jobs to sample and label.")] = 512,
    seed: Annotated[int, typer.Option("--seed", help="Seed of the job sampler.")] = 0,
    ray: Annotated[
        str | None,
        typer.Option(
            "--ray",
            help="Label on a Ray cluster: auto (the one this machine belongs to, else one started "
            "here) or its address \\[default: local worker processes].",
            show_default=False,
        ),
    ] = None,
    jobs: Annotated[
        int | None,
        typer.Option("--jobs", "-j", help="Local worker processes (default: the CPUs).", show_default=False),
    ] = None,
    shard_size: Annotated[int, typer.Option("--shard-size", help="Jobs per shard file.")] = 32,
    json: JsonOpt = False,
) -> None:
    """Sample training jobs and label them with coplan's teacher and baseline plans."""
    from coplan.errors import SpecError
    from coplan.learn.dataset import check_out, write_dataset

    positive("--n", n)
    positive("--shard-size", shard_size)
    _check_seed(seed)
    workers = positive("--jobs", jobs, optional=True) or os.cpu_count() or 1
    if ray is not None and jobs is not None:
        raise SpecError("--jobs", None, "applies to local workers, not with --ray (Ray schedules its own)")
    if ray is not None and not ray.strip():
        raise SpecError("--ray", None, "give auto or a Ray cluster's address")
    out = Path(os.path.expanduser(str(out)))
    check_out(out, seed, n, shard_size)  # before any work: a folder that can hold this dataset
    bar = _Bar(f"dataset ({n} jobs)")
    try:
        with interruptible(
            f"learn dataset stopped; the finished shards in {out} are kept (run again to resume)"
        ):
            summary = write_dataset(out, n, seed, shard_size=shard_size, jobs=workers, ray=ray, progress=bar)
    finally:
        bar.close()
    if json:
        print_json(summary.to_dict())
        return
    console = stdout()
    console.print(
        f"{summary.written} jobs labelled, {summary.skipped} kept from an earlier run, "
        f"{summary.shards} shards in {out} ({summary.seconds:.1f} s, {summary.label_s_mean:.2f} s per job)"
    )
    splits = ", ".join(f"{k} {v}" for k, v in summary.counts.items())
    console.print(f"splits: {splits}; teacher plan fits in {summary.feasible} of {summary.n}")
    if summary.errors:
        console.print(
            f"[yellow]{summary.errors} jobs refused by coplan (their reason is in the record)[/yellow]"
        )


@app.command("train")
def train_cmd(
    data: Annotated[Path, typer.Option("--data", help="Dataset folder (coplan learn dataset --out).")],
    out: Annotated[Path, typer.Option("--out", "-o", help="Write the trained policy here (a .pt file).")],
    epochs: Annotated[int, typer.Option("--epochs", help="Passes over the training split.")] = 30,
    seed: Annotated[int, typer.Option("--seed", help="Seed of the initial weights and the order.")] = 0,
    json: JsonOpt = False,
) -> None:
    """Train the policy by imitation of the teacher's plans on the dataset's train split."""
    import time

    import torch

    from coplan.errors import SpecError
    from coplan.fileio import check_output
    from coplan.learn.dataset import open_dataset
    from coplan.learn.train import examples, save_policy, train

    positive("--epochs", epochs)
    _check_seed(seed)
    out = Path(os.path.expanduser(str(out)))
    check_output("--out", out)
    ds = open_dataset(Path(os.path.expanduser(str(data))))
    torch.set_num_threads(1)  # small graphs: one thread is fastest, and leaves the other cores free
    t0 = time.perf_counter()
    bar = _Bar("features")
    try:
        with interruptible("learn train stopped; nothing written"):
            items = examples(ds, "train", progress=bar)
            if not items:
                raise SpecError(f"--data {data}", None, "has no jobs in its train split")
            bar.close()
            bar = _Bar(f"training ({len(items)} jobs)")
            net, losses = train(items, epochs=epochs, seed=seed, progress=bar)
    finally:
        bar.close()
    meta = {
        "dataset": {k: ds.manifest[k] for k in ("seed", "n", "teacher", "baseline", "counts")},
        "train_jobs": len(items),
        "epochs": epochs,
        "seed": seed,
        "losses": losses,
        "seconds": time.perf_counter() - t0,
    }
    save_policy(net, out, meta)
    if json:
        print_json({"out": str(out), **meta})
        return
    console = stdout()
    lost = ", ".join(f"{k} {v:.3f}" for k, v in losses.items())
    console.print(
        f"policy written to {out}: {len(items)} jobs, {epochs} epochs ({meta['seconds']:.0f} s); "
        f"last-epoch losses {lost}"
    )


class Split(enum.StrEnum):
    heldout = "heldout"
    heldout_family = "heldout_family"
    heldout_encoder = "heldout_encoder"
    train = "train"
    val = "val"


@app.command("eval")
def eval_cmd(
    data: Annotated[Path, typer.Option("--data", help="Dataset folder (coplan learn dataset --out).")],
    policy: Annotated[
        Path | None,
        typer.Option("--policy", help="Policy file \\[default: the one coplan ships].", show_default=False),
    ] = None,
    split: Annotated[Split, typer.Option("--split", help="Which jobs to plan.")] = Split.heldout,
    limit: Annotated[
        int | None,
        typer.Option("--limit", help="Plan at most this many jobs of the split.", show_default=False),
    ] = None,
    json: JsonOpt = False,
) -> None:
    """Plan a split's jobs with the policy and compare with the teacher and the baseline (Claim 2)."""
    import torch

    from coplan.errors import SpecError
    from coplan.learn.dataset import open_dataset
    from coplan.learn.decode import default_policy
    from coplan.learn.evaluate import evaluate

    positive("--limit", limit, optional=True)
    net = default_policy(Path(os.path.expanduser(str(policy))) if policy is not None else None)
    ds = open_dataset(Path(os.path.expanduser(str(data))))
    torch.set_num_threads(1)
    bar = _Bar(f"eval ({split.value})")
    try:
        with interruptible("learn eval stopped"):
            result = evaluate(ds, net, split.value, limit=limit, progress=bar)
    finally:
        bar.close()
    if result["n"] == 0:
        raise SpecError(f"--data {data}", None, f"has no jobs in its {split.value} split")
    if json:
        print_json(result)
        return
    console = stdout()
    s, j = result["vs_sequential"], result["vs_joint"]

    def f(x: float | None) -> str:
        return "n/a" if x is None else f"{x:.3f}"

    console.print(f"{split.value}: {result['n']} jobs")
    console.print(
        f"learned / sequential step time: median {f(s['median_ratio'])}, p10 {f(s['p10_ratio'])}; "
        f"{s['wins']} wins, {s['losses']} losses"
    )
    console.print(f"learned / joint-exact step time: median {f(j['median_ratio'])}, p90 {f(j['p90_ratio'])}")
    rate = result["feasible_rate"]
    console.print(f"valid and fitting where the teacher fits: {'n/a' if rate is None else f'{rate:.1%}'}")
    t = result["plan_time_s"]
    console.print(
        f"median planning time: learned {f(t['learned'])} s, joint-exact {f(t['joint'])} s, "
        f"sequential {f(t['sequential'])} s"
    )
    console.print(f"verdict (Claim 2 on this split): [bold]{result['verdict']}[/bold]")


@app.command("distill")
def distill_cmd(
    out: Annotated[Path, typer.Option("--out", "-o", help="Write the fine-tuned policy here (a .pt file).")],
    policy: Annotated[
        Path | None,
        typer.Option(
            "--policy", help="Policy to improve \\[default: the one coplan ships].", show_default=False
        ),
    ] = None,
    data: Annotated[
        Path | None,
        typer.Option(
            "--data",
            help="Dataset whose train split is replayed beside the improved plans, so that the policy "
            "keeps what it imitated \\[default: none].",
            show_default=False,
        ),
    ] = None,
    n: Annotated[int, typer.Option("--n", help="Large jobs sampled (a quarter is held out).")] = 48,
    rounds: Annotated[int, typer.Option("--rounds", help="Rounds of search and fine-tuning.")] = 2,
    seconds: Annotated[float, typer.Option("--seconds", help="Search budget per job, in seconds.")] = 20.0,
    replay: Annotated[int, typer.Option("--replay", help="Imitation examples replayed (with --data).")] = 200,
    seed: Annotated[int, typer.Option("--seed", help="Seed of the large jobs.")] = 0,
    json: JsonOpt = False,
) -> None:
    """Improve the policy with the cost model as its reward (search distillation): large jobs planned
    by the policy, improved by a policy-guided local search, and the policy fine-tuned on them."""
    import time

    import torch

    from coplan.errors import SpecError
    from coplan.fileio import check_output
    from coplan.learn.dataset import open_dataset
    from coplan.learn.decode import DEFAULT_POLICY
    from coplan.learn.distill import distill, sample_large_job
    from coplan.learn.train import example, load_policy, save_policy

    positive("--n", n)
    positive("--rounds", rounds)
    positive("--replay", replay)
    if not seconds > 0:
        raise SpecError("--seconds", None, f"must be positive, got {seconds!r}")
    _check_seed(seed)
    out = Path(os.path.expanduser(str(out)))
    check_output("--out", out)
    source = Path(os.path.expanduser(str(policy))) if policy is not None else None
    net, source_meta = load_policy(source or DEFAULT_POLICY)  # its provenance goes into the new file
    ds = open_dataset(Path(os.path.expanduser(str(data)))) if data is not None else None
    torch.set_num_threads(1)
    t0 = time.perf_counter()
    reports = []
    bar = _Bar("replay")
    try:
        with interruptible("learn distill stopped; nothing written"):
            items = []
            if ds is not None:
                records = [r for r in ds.records("train") if "error" not in r][:replay]
                for i, r in enumerate(records):
                    items.append(example(r))
                    bar(i + 1, len(records), r["id"])
            bar.close()
            jobs = [j for j in (sample_large_job(seed, i) for i in range(n)) if j.split == "large_train"]
            for k in range(rounds):
                bar = _Bar(f"round {k + 1}/{rounds} ({len(jobs)} jobs)")
                net, rep = distill(net, jobs, items, seconds=seconds, seed=seed + k, progress=bar)
                bar.close()
                reports.append(rep.to_dict())
    finally:
        bar.close()
    meta = {
        "distilled": {
            "from": str(source) if source is not None else "shipped",
            "large_jobs": len(jobs),
            "replayed": len(items),
            "rounds": reports,
        },
        "seconds": time.perf_counter() - t0,
    }
    save_policy(net, out, source_meta | meta)
    if json:
        print_json({"out": str(out), **meta})
        return
    console = stdout()
    for k, got in enumerate(reports, start=1):
        med = got["gain_median"]
        console.print(
            f"round {k}: the search improved {got['improved']} of {got['jobs']} plans "
            f"(median gain {'n/a' if med is None else f'{med:.3f}x'})"
        )
    console.print(f"policy written to {out} ({meta['seconds']:.0f} s)")
