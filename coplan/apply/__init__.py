"""Applying plans to real PyTorch training (``coplan run``).

``backend(plan)`` is a ``torch.compile`` backend that enforces a plan's precision (casts inserted
into Dynamo's graph), rematerialization (an AOTAutograd partitioner saving exactly the plan's set)
and fusion (Inductor constrained to the plan's groups, where it compiles the step); ``train``
runs steps with the plan's parallel layout and measures what happened next to what the cost model
predicted.
"""

from __future__ import annotations

from coplan.apply.backend import Backend, backend

__all__ = ["Backend", "backend"]
