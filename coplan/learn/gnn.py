"""The message passing the policy and the learned cost model share: ``GINEConv`` layers (PyTorch
Geometric) run both ways along every edge of a job's graph, a reversed copy of each edge carrying
a flag among its features, with residual connections and layer norms."""

from __future__ import annotations

import torch
from torch import nn

from coplan.learn.features import EDGE_DIM, JobGraph

__all__ = ["gine_layers", "propagate"]


def gine_layers(hidden: int, layers: int) -> tuple[nn.ModuleList, nn.ModuleList]:
    """(convolutions, layer norms) of width ``hidden``, ``layers`` deep."""
    from torch_geometric.nn import GINEConv

    convs = nn.ModuleList(
        GINEConv(
            nn.Sequential(nn.Linear(hidden, hidden), nn.ReLU(), nn.Linear(hidden, hidden)),
            edge_dim=EDGE_DIM + 1,
        )
        for _ in range(layers)
    )
    return convs, nn.ModuleList(nn.LayerNorm(hidden) for _ in range(layers))


def propagate(convs: nn.ModuleList, norms: nn.ModuleList, x: torch.Tensor, jg: JobGraph) -> torch.Tensor:
    """Node embeddings ``x`` after the layers, messages flowing both ways along ``jg``'s edges."""
    ei, ea = jg.edge_index, jg.edge_attr
    both = torch.cat([ei, ei.flip(0)], dim=1)
    flag = torch.cat([torch.zeros(ea.shape[0], 1), torch.ones(ea.shape[0], 1)])
    attr = torch.cat([torch.cat([ea, ea]), flag], dim=1)
    for conv, norm in zip(convs, norms, strict=True):
        x = norm(x + torch.relu(conv(x, both, attr)))
    return x
