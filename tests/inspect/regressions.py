"""A small model and the compiler regression of the story: a pass that puts an identity op between
a norm and its activation, so they stop fusing.

The identity is a custom op (``coplan_test::identity``): Inductor cannot see into it, calls it as a
fallback kernel, and cannot fuse across it, which is how such an op breaks a fusion in practice.
It is inserted by Inductor's own hook for user passes, ``post_grad_custom_post_pass``, so every
stage before that pass is unchanged and the first diverging fingerprint is that pass's.
"""

from __future__ import annotations

import torch
from torch import nn
from torch._inductor.custom_graph_pass import CustomGraphPass


@torch.library.custom_op("coplan_test::identity", mutates_args=())
def identity(x: torch.Tensor) -> torch.Tensor:
    return x.clone()


@identity.register_fake
def _(x: torch.Tensor) -> torch.Tensor:
    return torch.empty_like(x)


class NormAct(nn.Module):
    """Linear, LayerNorm, GELU, Linear: the norm and its activation fuse into one kernel."""

    def __init__(self, width: int = 64, hidden: int = 128) -> None:
        super().__init__()
        self.up = nn.Linear(width, hidden)
        self.norm = nn.LayerNorm(hidden)
        self.down = nn.Linear(hidden, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down(nn.functional.gelu(self.norm(self.up(x))))


class InsertIdentity(CustomGraphPass):
    """Put ``coplan_test::identity`` between each layer norm's output and the GELU reading it."""

    def __call__(self, graph: torch.fx.Graph) -> None:
        def came_from(node: torch.fx.Node, op: str) -> bool:
            orig = node.meta.get("original_aten")
            return orig is not None and str(getattr(orig, "overloadpacket", orig)) == op

        for node in list(graph.nodes):
            users = [u for u in node.users if came_from(u, "aten.gelu")]
            if not came_from(node, "aten.native_layer_norm") or not users:
                continue
            with graph.inserting_after(node):
                ident = graph.call_function(torch.ops.coplan_test.identity.default, (node,))
            ident.meta["val"] = node.meta.get("val")
            for u in users:
                u.replace_input_with(node, ident)

    def uuid(self) -> str:
        return "coplan-test-insert-identity"


def model_and_inputs(seed: int = 0) -> tuple[NormAct, torch.Tensor]:
    torch.manual_seed(seed)
    return NormAct(), torch.randn(16, 64)


REGRESSION = {"post_grad_custom_post_pass": InsertIdentity()}
