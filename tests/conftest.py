"""Test tiers: unit (no tracing), capture (fake-tensor traces, seconds), slow (large models), gpu.

The default run (`python -m pytest`) excludes slow and gpu (see pyproject's addopts); GPU tests
skip with a reason when no CUDA device is present.
"""

import pytest
import torch


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA device; none is visible to torch")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)
