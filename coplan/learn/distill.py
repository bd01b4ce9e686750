"""Search distillation: the policy improved with the cost model as its reward.

Imitation teaches the policy what ``joint-exact`` chooses on jobs small enough to label that way
(models up to 20B). Beyond them no exact teacher is affordable per job, and the policy alone drifts
where it never looked: LLaMA-2 70B on 1,024 H100 planned 25% slower than ``joint``. Expert
iteration closes the loop with the cost model as the judge (Anthony et al. 2017, "Thinking Fast and
Slow with Deep Learning and Tree Search"; Silver et al. 2017's AlphaZero trains its policy on the
search's choices the same way):

1. the policy proposes (``decode.plan_with_policy``);
2. a local search guided by it improves the proposal under the cost model (``improve``): the
   layouts next to the best one (up to ``MOVE_FIELDS`` of TP, PP, DP, virtual stages, sequence
   parallelism, ZeRO stage, microbatch, precision changed) decoded by the policy's own per-op
   heads, repaired to fit and priced, climbing while a neighbour scores better (fits first, then
   step time). The ``learned-search`` strategy is steps 1 and 2;
3. the policy is fine-tuned to imitate the improved plans, with the imitation examples it was
   trained on replayed beside them so that it keeps what it knew (``distill``).

The reward is the cost model's score, the judge every strategy shares; it is not differentiable,
and a policy gradient over thousands of candidate layouts per job would need many more priced
samples than a search step costs, so the search's result is the target rather than a gradient.
Every plan the search prices is checked by the plan checker.
"""

from __future__ import annotations

import random
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from coplan.learn.jobs import LARGE_SPLITS, Job, _hypothetical, _params, _spec
from coplan.learn.policy import PolicyNet
from coplan.plan.types import Plan

__all__ = ["MOVE_FIELDS", "SEARCH_S", "Improved", "distill", "improve", "sample_large_job"]

LARGE_HELDOUT_P = 0.25
_LARGE_WIDTHS = (5120, 6144, 8192)
_LARGE_DEPTHS = (32, 40, 48, 64, 80)
_LARGE_GPUS = (64, 128, 256, 512, 1024)
_LARGE_CLUSTERS = ("dgx-a100-80gb", "dgx-h100", "dgx-h200")
_LARGE_PARAMS = (2.0e10, 8.0e10)
_LARGE_STACKS = ("megatron", "coplan", "torchtitan")
_LARGE_STACK_WEIGHTS = (0.5, 0.25, 0.25)


def sample_large_job(seed: int, index: int) -> Job:
    """Large job ``index`` of ``seed`` (deterministic, as ``jobs.sample_job``): a GPT or LLaMA of
    20B to 80B parameters on 64 to 1,024 GPUs, beyond what the imitation dataset labels."""
    from coplan.hardware.registry import load_cluster

    rng = random.Random(f"large:{seed}:{index}")
    family = rng.choice(("gpt", "llama"))
    while True:
        width = rng.choice(_LARGE_WIDTHS)
        depth = rng.choice(_LARGE_DEPTHS)
        seq = rng.choice((2048, 4096))
        spec = _spec(rng, family, width, depth, seq)
        if _LARGE_PARAMS[0] <= _params(spec) <= _LARGE_PARAMS[1]:
            break
    gpus = rng.choice(_LARGE_GPUS)
    cluster = load_cluster(rng.choice(_LARGE_CLUSTERS), gpus)
    hypothetical = rng.random() < 0.3
    if hypothetical:
        cluster = _hypothetical(rng, cluster)
    return Job(
        index=index,
        family=family,
        split=LARGE_SPLITS[1] if rng.random() < LARGE_HELDOUT_P else LARGE_SPLITS[0],
        spec=spec,
        cluster=cluster,
        global_batch=gpus * rng.choice((1, 2, 4)),
        seq=seq,
        budget_fraction=rng.choice((1.0, 1.0, 0.6)),
        hypothetical=hypothetical,
        stack=rng.choices(_LARGE_STACKS, weights=_LARGE_STACK_WEIGHTS)[0],
    )


@dataclass(frozen=True, slots=True)
class Improved:
    """What ``improve`` found for one job: the policy's plan, the search's, and the work done."""

    proposed: Plan
    plan: Plan
    proposed_key: tuple[Any, ...]
    key: tuple[Any, ...]
    priced: int
    steps: int
    seconds: float

    @property
    def gain(self) -> float:
        """The proposal's step time over the improved plan's where both fit (else 1)."""
        if self.proposed_key[0] == 0 and self.key[0] == 0 and self.key[1] > 0:
            return float(self.proposed_key[1]) / float(self.key[1])
        return 1.0


#: fields of a layout (TP, PP, DP, virtual stages, SP, ZeRO, microbatch, precision, fp8 weights) a
#: search move may change at once: TP x PP x DP is the GPU count, so most moves change two, and
#: moving TP and PP against each other with interleaving (LLaMA-2 70B on 1,024 H100: TP2 DP512 ->
#: TP2 PP2 DP256 with 40 chunks) changes three
MOVE_FIELDS = 3
#: seconds the ``learned-search`` strategy's search may take at most
SEARCH_S = 10.0


def _neighbours(keys: list[tuple[object, ...]], at: int, limit: int = MOVE_FIELDS) -> list[int]:
    """Layouts differing from layout ``at`` in at most ``limit`` of their fields, the fewest
    first."""
    base = keys[at]
    near = [(sum(a != b for a, b in zip(k, base, strict=True)), i) for i, k in enumerate(keys) if i != at]
    return [i for d, i in sorted(near) if d <= limit]


def improve(ctx: Any, net: PolicyNet, k: int, seconds: float) -> Improved:
    """The policy's plan for ``ctx``'s job, then improved by local search over its neighbouring
    layouts (each decoded by the policy, repaired and priced) for at most ``seconds``."""
    from coplan.learn.decode import _anchors, layout_plan, plan_with_policy, repair
    from coplan.learn.features import _layout_key, job_graph, layout_candidates, layout_matrix
    from coplan.passes.base import score
    from coplan.plan.checker import is_valid

    t0 = time.perf_counter()
    proposed, priced, _ = plan_with_policy(ctx, net, k)
    best, best_key = proposed, score(proposed, ctx)
    first_key = best_key
    cands = layout_candidates(ctx)
    keys = [_layout_key(p, q) for p, q in cands]
    index = {key: i for i, key in enumerate(keys)}
    at = index.get(_layout_key(best.parallel, best.precision))
    if at is None:
        return Improved(proposed, best, first_key, best_key, priced, 0, time.perf_counter() - t0)
    feats = layout_matrix(ctx, cands)
    jg = job_graph(ctx, anchors=_anchors(ctx))
    seen = {at}
    steps = 0
    with torch.no_grad():
        enc = net.encode(jg)
        moved = True
        while moved and time.perf_counter() - t0 < seconds:
            moved = False
            for i in _neighbours(keys, at):
                if i in seen:
                    continue
                if time.perf_counter() - t0 >= seconds:
                    break
                seen.add(i)
                plans, names = layout_plan(ctx, net, jg, enc, feats[i], cands[i], 1)
                for p in plans:
                    p = repair(p, ctx, names)
                    priced += 1
                    if not is_valid(p, ctx):
                        continue
                    got = score(p, ctx)
                    if got < best_key:
                        best, best_key, at, moved = p, got, i, True
                if moved:  # first improvement: climb from the better layout
                    steps += 1
                    break
    return Improved(proposed, best, first_key, best_key, priced, steps, time.perf_counter() - t0)


@dataclass(frozen=True, slots=True)
class DistillReport:
    """What one round of distillation did."""

    jobs: int
    improved: int  # jobs whose search beat the policy's own plan
    gains: list[float] = field(default_factory=list)  # policy plan / improved plan, per job
    search_s: float = 0.0
    train_s: float = 0.0
    losses: dict[str, float] = field(default_factory=dict)

    def to_dict(self) -> dict[str, Any]:
        g = sorted(self.gains)
        return {
            "jobs": self.jobs,
            "improved": self.improved,
            "gain_median": g[len(g) // 2] if g else None,
            "gain_max": g[-1] if g else None,
            "search_s": self.search_s,
            "train_s": self.train_s,
            "losses": self.losses,
        }


def distill(
    net: PolicyNet,
    jobs: list[Job],
    replay: list[Any],
    *,
    k: int = 8,
    seconds: float = 20.0,
    epochs: int = 8,
    lr: float = 1e-3,
    repeat: int = 4,
    seed: int = 0,
    progress: Callable[[int, int, str], None] | None = None,
) -> tuple[PolicyNet, DistillReport]:
    """One round of expert iteration: each job improved by the policy-guided search (``improve``),
    then a copy of ``net`` fine-tuned on the improved plans and on ``replay`` (the imitation
    examples, ``train.Example``), with a small learning rate so that it moves toward the search's
    choices without forgetting the teacher's; each improved plan is seen ``repeat`` times an epoch
    (the replayed examples outnumber them)."""
    from coplan.learn.train import example_of, train

    t0 = time.perf_counter()
    found: list[Any] = []
    gains: list[float] = []
    improved = 0
    for n, job in enumerate(jobs):
        ctx = job.context()
        got = improve(ctx, net, k, seconds)
        fits = ctx.fits(ctx.price(got.plan))
        found.append(example_of(job, got.plan if fits else None, ctx))
        if fits:
            gains.append(got.gain)
            improved += got.gain > 1.0
        if progress:
            progress(n + 1, len(jobs), f"{job.spec.name} x{got.gain:.3f}")
    search_s = time.perf_counter() - t0
    t1 = time.perf_counter()
    tuned, losses = train([*found * max(1, repeat), *replay], epochs=epochs, seed=seed, lr=lr, start=net)
    report = DistillReport(len(jobs), improved, gains, search_s, time.perf_counter() - t1, losses)
    return tuned, report
