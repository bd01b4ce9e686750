"""The README's Python examples run as written (they had drifted: a recompute set naming a GELU
tensor for a SwiGLU model)."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

README = Path(__file__).resolve().parents[2] / "README.md"
BLOCKS = re.findall(r"```python\n(.*?)```", README.read_text(encoding="utf-8"), re.S)


def test_the_readme_has_python_examples() -> None:
    assert len(BLOCKS) >= 2


@pytest.mark.parametrize("index", range(len(BLOCKS)))
def test_readme_python_example_runs(index: int, capsys: pytest.CaptureFixture[str]) -> None:
    exec(compile(BLOCKS[index], f"README.md python block {index}", "exec"), {})
    assert capsys.readouterr().out.strip()  # every example prints its result


@pytest.mark.parametrize("index", range(len(BLOCKS)))
def test_readme_python_example_is_formatted(index: int) -> None:
    import shutil
    import subprocess

    ruff = shutil.which("ruff")
    if ruff is None:
        pytest.skip("ruff is not installed (pip install -e '.[dev]')")
    done = subprocess.run(
        [ruff, "format", "--check", "--line-length", "110", "-"],
        input=BLOCKS[index],
        capture_output=True,
        text=True,
    )
    assert done.returncode == 0, done.stdout + done.stderr
