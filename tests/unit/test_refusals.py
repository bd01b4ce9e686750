"""Inputs that once ended in a traceback, lost work or wrote a file on failure: each class is now
one line on stderr, exit 2 (3: nothing fits), and nothing written."""

from __future__ import annotations

import json
import os
from collections.abc import Callable
from pathlib import Path

import pytest

from coplan.fileio import check_output, read_text, write_text

Cli = Callable[..., tuple[int, str, str]]


def one_line(code: int, err: str, *needles: str, exit_code: int = 2) -> None:
    assert code == exit_code, err
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: ") and "Traceback" not in err, err
    for needle in needles:
        assert needle in lines[0], (needle, lines[0])


# --- output paths, checked before any work --------------------------------------------------------


@pytest.mark.parametrize(
    ("command", "option"),
    [
        (("plan", "-m", "gpt-tiny"), "--out"),
        (("plan", "-m", "gpt-tiny"), "--html"),
        (("compare", "-m", "gpt-tiny"), "--out"),
        (("compare", "-m", "gpt-tiny"), "--html"),
        (("coupling",), "--html"),
        (("calibrate", "--quick"), "--out"),
    ],
)
@pytest.mark.parametrize("where", ["directory", "missing folder", "proc", "too long"])
def test_bad_output_paths_are_refused_before_any_work(
    cli: Cli, tmp_path: Path, command: tuple[str, ...], option: str, where: str
) -> None:
    target = {
        "directory": str(tmp_path),
        "missing folder": str(tmp_path / "no" / "such" / "out.json"),
        "proc": "/proc/version",
        "too long": str(tmp_path / ("a" * 300)),
    }[where]
    code, out, err = cli(*command, option, target)
    one_line(code, err, option)
    assert out == ""  # refused before the search printed anything
    assert sorted(os.listdir(tmp_path)) == []


def test_run_record_to_a_directory_is_refused_before_training(cli: Cli, tmp_path: Path) -> None:
    plan = tmp_path / "plan.json"
    plan.write_text("{}")
    code, _, err = cli("run", "-m", "gpt-tiny", "--plan", str(plan), "--record", str(tmp_path))
    one_line(code, err, "--record", "directory")


@pytest.mark.skipif(os.geteuid() == 0, reason="root may write into read-only folders")
def test_read_only_folder_is_refused(tmp_path: Path) -> None:
    folder = tmp_path / "ro"
    folder.mkdir()
    folder.chmod(0o500)
    try:
        with pytest.raises(Exception, match="not writable"):
            check_output("--out", folder / "x.json")
    finally:
        folder.chmod(0o700)


def test_write_text_replaces_whole_files_only(tmp_path: Path) -> None:
    target = tmp_path / "plan.json"
    target.write_text("old")
    target.chmod(0o640)
    write_text(target, "new")
    assert target.read_text() == "new"
    assert target.stat().st_mode & 0o777 == 0o640  # the replaced file's permissions are kept
    assert os.listdir(tmp_path) == ["plan.json"]  # no temporary left behind


def test_infeasible_plan_writes_nothing(cli: Cli, tmp_path: Path) -> None:
    out, html = tmp_path / "plan.json", tmp_path / "report.html"
    code, stdout, err = cli(
        "plan", "-m", "gpt2-124m", "--memory-budget-gb", "0.01", "--out", str(out), "--html", str(html)
    )
    one_line(code, err, "nothing fits", exit_code=3)
    assert not out.exists() and not html.exists()
    assert "written" not in stdout


# --- unreadable inputs ----------------------------------------------------------------------------


@pytest.fixture
def binary(tmp_path: Path) -> Path:
    path = tmp_path / "binary.json"
    path.write_bytes(bytes(range(256)) * 4)
    return path


def test_binary_plan_file(cli: Cli, binary: Path) -> None:
    code, _, err = cli("run", "-m", "gpt-tiny", "--plan", str(binary))
    one_line(code, err, str(binary), "UTF-8")


def test_binary_tp_overlap_cfg(cli: Cli, binary: Path) -> None:
    code, _, err = cli("estimate", "--tp-overlap-cfg", str(binary))
    one_line(code, err, "--tp-overlap-cfg", "UTF-8")


@pytest.mark.parametrize("command", ["estimate", "plan", "graph"])
def test_model_path_of_300_characters(cli: Cli, command: str) -> None:
    code, _, err = cli(command, "--model", "m" * 300 + ".json")
    one_line(code, err)


def test_cluster_path_of_300_characters(cli: Cli) -> None:
    code, _, err = cli("estimate", "--cluster", "/tmp/" + "c" * 300 + ".json")
    one_line(code, err, "255 characters")


def test_read_text_names_what_is_wrong(tmp_path: Path, binary: Path) -> None:
    for path, why in ((tmp_path, "directory"), (tmp_path / "none", "no such file"), (binary, "UTF-8")):
        with pytest.raises(Exception, match=why):
            read_text(path)


# --- choices and searches -------------------------------------------------------------------------


def test_unknown_strategy_is_refused_before_the_model_loads(cli: Cli) -> None:
    # the model does not exist: a choice checked first never gets to say so
    code, _, err = cli("plan", "--model", "no-such-model", "--strategy", "bogus")
    one_line(code, err, "--strategy", "bogus", "joint")
    code, _, err = cli("compare", "--model", "no-such-model", "--strategies", "joint,bogus")
    one_line(code, err, "--strategies", "bogus")


def test_exhaustive_on_a_large_problem_is_one_line(cli: Cli) -> None:
    # every option the cost model prices: GPT-2's per-tensor recompute sets alone are too many
    code, _, err = cli("plan", "--strategy", "exhaustive", "--stack", "open")
    one_line(code, err, "exhaustive search would price")


@pytest.mark.parametrize(
    ("args", "why"),
    [
        (("--stack", "coplan"), "stack 'coplan' emulates fp8"),
        (("--stack", "fsdp"), "stack 'fsdp' runs no fp8"),
        (("--cluster", "dgx-a100-80gb"), "devices have no fp8 units"),
    ],
)
def test_dtypes_nothing_runs_natively_is_one_line(cli: Cli, args: tuple[str, ...], why: str) -> None:
    # the search would otherwise fall back to the default plan without a word
    for command in ("plan", "compare"):
        code, _, err = cli(command, "--dtypes", "fp8", *args)
        one_line(code, err, "--dtypes", why)


def test_tf32_where_the_devices_have_no_tf32_is_one_line(cli: Cli) -> None:
    # a CPU runs fp32 but has no tf32 mode: searching tf32 there would find nothing
    code, _, err = cli("plan", "-m", "gpt-tiny", "--cluster", "cpu", "--dtypes", "tf32")
    one_line(code, err, "--dtypes", "no tf32 units")
    code, out, err = cli("plan", "-m", "gpt-tiny", "--cluster", "dgx-a100-80gb", "--dtypes", "tf32", "--json")
    assert code == 0, err
    assert json.loads(out)["plan"]["precision"]["compute"] == "tf32"


def test_every_strategy_keeps_to_the_dtypes_asked_for(cli: Cli) -> None:
    code, out, err = cli(
        "compare",
        "-m",
        "gpt-tiny",
        "--cluster",
        "dgx-a100-80gb",
        "--dtypes",
        "fp32",
        "--json",
        "--strategies",
        "sequential,sequential-best,iterated,hierarchical,joint",
    )
    assert code == 0, err
    got = {n: e["plan"]["precision"]["compute"] for n, e in json.loads(out)["strategies"].items()}
    assert set(got.values()) == {"fp32"}, got


def test_strategy_choices_match_the_registry() -> None:
    import coplan.learn.strategy  # noqa: F401  (registers the learned strategies, as ``plan`` does)
    from coplan.cli.options import Strategy
    from coplan.search import STRATEGIES

    assert sorted(s.value for s in Strategy) == sorted(STRATEGIES)


def test_enum_choices_match_the_library() -> None:
    from coplan.apply.step import MODES
    from coplan.cli.calibrate_cmd import CalibrateDevice
    from coplan.cli.coupling_cmd import Grid
    from coplan.cli.run_cmd import HostAllocator, Mode
    from coplan.experiments.coupling import GRIDS
    from coplan.hardware.allocator import HOST_ALLOCATORS
    from coplan.hardware.calibrate import DEVICES

    assert [m.value for m in Mode] == list(MODES)
    assert [h.value for h in HostAllocator] == list(HOST_ALLOCATORS)
    assert [g.value for g in Grid] == list(GRIDS)
    assert [d.value for d in CalibrateDevice] == list(DEVICES)


# --- one grammar ----------------------------------------------------------------------------------


def test_batch_means_sequences_per_step_in_every_command(cli: Cli) -> None:
    """``-b``, ``--batch`` and ``--global-batch`` are one option: sequences per optimizer step."""
    for flag in ("-b", "--batch", "--global-batch"):
        code, out, err = cli(
            "estimate", "-m", "gpt-tiny", "--gpus", "2", "--microbatch", "2", flag, "8", "--json"
        )
        assert code == 0, err
        assert json.loads(out)["config"]["global_batch"] == 8
        code, out, err = cli("plan", "-m", "gpt-tiny", "--strategy", "sequential", flag, "8", "--json")
        assert code == 0, err
        assert json.loads(out)["global_batch"] == 8
        code, out, err = cli("graph", "-m", "gpt-tiny", flag, "8", "--seq", "16", "--json")
        assert code == 0, err
        assert json.loads(out)["batch"] == 8


def test_default_job_is_the_same_for_estimate_and_plan(cli: Cli) -> None:
    code, out, err = cli("estimate", "--json")
    assert code == 0, err
    est = json.loads(out)
    code, out, err = cli("plan", "--strategy", "sequential", "--json")
    assert code == 0, err
    plan = json.loads(out)
    assert est["gpus"] == plan["gpus"] == 1
    assert est["model"] == plan["model"] == "gpt2-124m"
    assert plan["global_batch"] == 32
    assert est["config"]["global_batch"] == 32


def test_default_global_batch_rounds_up_to_the_replicas() -> None:
    from coplan.cli.options import default_global_batch

    assert default_global_batch(1) == 32
    assert default_global_batch(64) == 64
    assert default_global_batch(24) == 48


def test_compare_tables_fit_80_columns_without_cutting_numbers(
    cli: Cli, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("COLUMNS", "80")
    code, out, err = cli("compare", "-m", "llama-tiny", "--gpus", "2", "--memory-budget-gb", "1")
    assert code == 0, err
    assert "…" not in out  # Rich's ellipsis: a number or header cut short
    assert max(len(line) for line in out.splitlines()) <= 80
    assert "GiB" in out or "MiB" in out  # sizes carry their binary unit
