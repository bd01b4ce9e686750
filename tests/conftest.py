"""Test tiers: unit (no tracing), capture (fake-tensor traces, seconds), slow (large models), gpu.

The default run (`python -m pytest`) excludes slow and gpu (see pyproject's addopts); GPU tests
skip with a reason when no CUDA device is present.
"""

from collections.abc import Callable

import pytest
import torch

from coplan.cli import main

#: ``cli(*args)`` runs ``coplan ARGS`` in this process: (exit code, stdout, stderr).
Cli = Callable[..., tuple[int, str, str]]


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA device; none is visible to torch")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture
def cli(capsys: pytest.CaptureFixture[str]) -> Cli:
    """``coplan`` in process, so CLI tests need no subprocess (the entry point always exits)."""

    def run(*args: str) -> tuple[int, str, str]:
        with pytest.raises(SystemExit) as exc:
            main(list(args))
        code = exc.value.code
        out, err = capsys.readouterr()
        return (code if isinstance(code, int) else (0 if code is None else 1)), out, err

    return run
