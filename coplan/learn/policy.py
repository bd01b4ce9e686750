"""The learned planner's network (PyTorch Geometric): a GNN over a job's ops, conditioned on the
device, cluster, job and model (``features.JobGraph.u``), with four heads:

- **layout**: a score for each parallel layout x compute precision the search space offers for the
  job (the teacher's choice should score highest: trained with cross-entropy over the job's
  candidates, so it ranks layouts rather than predicting a time);
- **fuse**: per data edge, fuse the producer with this consumer or not;
- **recompute**: per op with an output saved for backward, recompute it or keep it;
- **dtype**: per op, its precision override class (``features.DTYPE_CLASSES``).

The per-op heads also read the chosen layout's features: what to recompute depends on the
microbatch and the sharding as much as on the graph. Message passing runs both ways along every
edge (a reversed copy carries a flag), with edge features, in ``GINEConv`` layers with residual
connections; the graph is summarised by mean and max pooling for the layout head.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from coplan.learn.features import DTYPE_CLASSES, EDGE_DIM, GLOBAL_DIM, LAYOUT_DIM, NODE_DIM, JobGraph
from coplan.learn.gnn import gine_layers, propagate

__all__ = ["POLICY_VERSION", "Outputs", "PolicyConfig", "PolicyNet"]

POLICY_VERSION = 2


@dataclass(frozen=True, slots=True)
class PolicyConfig:
    hidden: int = 64
    layers: int = 3
    cost: bool = False  # carries a learned cost model (``costnet.CostNet``) beside the policy

    def __post_init__(self) -> None:
        if self.hidden < 4 or self.layers < 1:
            raise ValueError(f"hidden >= 4 and layers >= 1, got {self.hidden}, {self.layers}")


@dataclass(frozen=True, slots=True)
class Outputs:
    layout: torch.Tensor  # (L,) scores of the candidate layouts
    fuse: torch.Tensor  # (n_data,) logits
    recompute: torch.Tensor  # (N,) logits
    dtype: torch.Tensor  # (N, len(DTYPE_CLASSES)) logits


def _mlp(i: int, h: int, o: int) -> nn.Sequential:
    return nn.Sequential(nn.Linear(i, h), nn.ReLU(), nn.Linear(h, o))


class PolicyNet(nn.Module):
    def __init__(self, config: PolicyConfig | None = None) -> None:
        super().__init__()
        self.config = config or PolicyConfig()
        h = self.config.hidden
        self.glob = _mlp(GLOBAL_DIM, h, h)
        self.embed = nn.Linear(NODE_DIM + h, h)
        self.convs, self.norms = gine_layers(h, self.config.layers)
        self.lay = _mlp(LAYOUT_DIM, h, h)
        self.layout_head = _mlp(3 * h + h, h, 1)
        self.fuse_head = _mlp(3 * h + EDGE_DIM, h, 1)
        self.rec_head = _mlp(2 * h, h, 1)
        self.dtype_head = _mlp(2 * h, h, len(DTYPE_CLASSES))
        self.cost: nn.Module | None = None
        if self.config.cost:
            from coplan.learn.costnet import CostNet

            self.cost = CostNet(h, self.config.layers)

    def encode(self, jg: JobGraph) -> tuple[torch.Tensor, torch.Tensor]:
        """(node embeddings (N, h), the global embedding (h,))."""
        g = self.glob(jg.u)
        x = self.embed(torch.cat([jg.x, g.expand(jg.x.shape[0], -1)], dim=1))
        return propagate(self.convs, self.norms, x, jg), g

    def scores(self, x: torch.Tensor, g: torch.Tensor, layouts: torch.Tensor) -> torch.Tensor:
        """(L,) scores of ``layouts`` (L, LAYOUT_DIM) for the encoded job ``x``, ``g``."""
        pooled = torch.cat([x.mean(0), x.max(0).values, g])
        lay = self.lay(layouts)
        return self.layout_head(torch.cat([pooled.expand(lay.shape[0], -1), lay], dim=1)).squeeze(-1)

    def decisions(
        self, jg: JobGraph, x: torch.Tensor, g: torch.Tensor, layout: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(fuse logits per data edge, recompute logits per op, dtype logits per op) under the
        layout whose features are ``layout`` (LAYOUT_DIM,)."""
        mine = self.lay(layout)
        cond = x + mine  # the per-op heads see the layout they decide under
        src, dst = jg.edge_index[:, : jg.n_data]
        fuse = self.fuse_head(
            torch.cat([cond[src], cond[dst], mine.expand(src.shape[0], -1), jg.edge_attr[: jg.n_data]], dim=1)
        ).squeeze(-1)
        both = torch.cat([cond, g.expand(x.shape[0], -1)], dim=1)
        return fuse, self.rec_head(both).squeeze(-1), self.dtype_head(both)

    def forward(self, jg: JobGraph, layouts: torch.Tensor, chosen: int) -> Outputs:
        """Scores of ``layouts`` (L, LAYOUT_DIM) and the per-op decisions under ``layouts[chosen]``."""
        x, g = self.encode(jg)
        fuse, rec, dtype = self.decisions(jg, x, g, layouts[chosen])
        return Outputs(self.scores(x, g, layouts), fuse, rec, dtype)
