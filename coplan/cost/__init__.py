"""The cost model: step time and per-GPU memory of a training configuration (see ``estimate``)."""

from coplan.cost.config import ConfigError, TrainingConfig, check_against, production_overlaps
from coplan.cost.estimate import BREAKDOWN_KEYS, Estimate, MemoryEstimate, StageEstimate, estimate
from coplan.cost.model import CostModel
from coplan.cost.parts import GraphProfile
from coplan.cost.profile import profile_graph
from coplan.cost.stacks import StackSpec, load_stack, load_stack_file, stack_names

__all__ = [
    "BREAKDOWN_KEYS",
    "ConfigError",
    "CostModel",
    "Estimate",
    "GraphProfile",
    "MemoryEstimate",
    "StackSpec",
    "StageEstimate",
    "TrainingConfig",
    "check_against",
    "estimate",
    "load_stack",
    "load_stack_file",
    "production_overlaps",
    "profile_graph",
    "stack_names",
]
