"""The README and the pages under docs/ hold to what they promise: every `coplan` command and flag
they show exists, their Python examples run as written, their links resolve, the figures they quote
match the benchmark results they cite, and they speak of what coplan does, not of how it was built."""

from __future__ import annotations

import importlib.util
import json
import re
import shlex
import shutil
import subprocess
import sys
from pathlib import Path
from types import ModuleType

import pytest
import typer.main

from coplan.cli.app import app

ROOT = Path(__file__).resolve().parents[2]
README = ROOT / "README.md"
DOCS = sorted((ROOT / "docs").glob("*.md"))
PAGES = [README, *DOCS]
RESULTS = ROOT / "benchmarks" / "results"

#: Wording about how coplan was built (development sessions, tracker items, who did the work),
#: which belongs to git's history. A citation of another project's tracker reads `owner/repo#N`.
HISTORY = re.compile(r"\bsessions?\b|\bissues?\s*#?\d+|\bthe issue\b|\bhelpers?\b", re.IGNORECASE)


def _rel(page: Path) -> str:
    return str(page.relative_to(ROOT))


def _text(page: Path) -> str:
    return page.read_text(encoding="utf-8")


def _blocks(lang: str) -> list[tuple[str, int, str]]:
    """(page, index on the page, code) of every fenced block in ``lang``."""
    out = []
    for page in PAGES:
        for i, code in enumerate(re.findall(rf"```{lang}\n(.*?)```", _text(page), re.S)):
            out.append((_rel(page), i, code))
    return out


PYTHON = _blocks("python")
SHELL = _blocks("bash")


def _command_lines(code: str) -> list[list[str]]:
    """The shell commands of a block, as argument lists: continuations joined, comments dropped,
    ``a && b`` split into its commands."""
    commands = []
    for line in code.replace("\\\n", " ").splitlines():
        words = shlex.split(line, comments=True)
        current: list[str] = []
        for w in [*words, "&&"]:
            if w in ("&&", "||", ";", "|"):
                if current:
                    commands.append(current)
                current = []
            else:
                current.append(w)
    return commands


COPLAN = [
    (page, " ".join(cmd), cmd)
    for page, _, code in SHELL
    for cmd in _command_lines(code)
    if cmd[0] == "coplan"
]
SCRIPTS = [
    (page, " ".join(cmd), cmd)
    for page, _, code in SHELL
    for cmd in _command_lines(code)
    if cmd[0] == "python" and len(cmd) > 1 and cmd[1].endswith(".py")
]


def _options(cmd: object) -> set[str]:
    """Every option name of a command; of a command group (``history``), its subcommands' too."""
    own = {o for p in getattr(cmd, "params", []) for o in (*p.opts, *getattr(p, "secondary_opts", []))}
    for sub in getattr(cmd, "commands", {}).values():
        own |= _options(sub)
    return own


def _cli() -> dict[str, set[str]]:
    """Each `coplan` command with every option name it accepts."""
    group = typer.main.get_command(app)
    commands = getattr(group, "commands", {})
    return {name: _options(cmd) | {"--help", "-h"} for name, cmd in commands.items()}


# --- the README is a short guide ----------------------------------------------------------------


def test_readme_is_short() -> None:
    assert len(_text(README).splitlines()) <= 400


def test_readme_shows_every_command() -> None:
    shown = {cmd[1] for page, _, cmd in COPLAN if page == "README.md" and len(cmd) > 1}
    assert set(_cli()) <= shown, f"README shows no example of: {sorted(set(_cli()) - shown)}"


def test_readme_installs_then_runs_the_main_job_and_the_tests() -> None:
    first = re.search(r"```bash\n(.*?)```", _text(README), re.S)
    assert first is not None
    commands = [" ".join(c) for c in _command_lines(first.group(1))]
    assert any(c.startswith("pip install") for c in commands), commands
    assert "coplan plan" in commands, commands
    assert any(c.startswith("python -m pytest") for c in commands), commands


@pytest.mark.parametrize("page", PAGES, ids=_rel)
def test_no_history_wording(page: Path) -> None:
    hits = [m.group(0) for m in HISTORY.finditer(_text(page))]
    assert not hits, f"{_rel(page)}: {hits}"


# --- what the pages show exists -------------------------------------------------------------------


def test_the_pages_show_commands() -> None:
    assert len(COPLAN) >= 10
    assert len(SCRIPTS) >= 5


@pytest.mark.parametrize(("page", "line", "cmd"), COPLAN, ids=[f"{p}: {line}" for p, line, _ in COPLAN])
def test_shown_coplan_command_exists(page: str, line: str, cmd: list[str]) -> None:
    cli = _cli()
    assert len(cmd) > 1 and cmd[1] in cli, f"{page}: `{line}`: no such command"
    flags = {w.split("=")[0] for w in cmd[2:] if w.startswith("-") and not w.lstrip("-")[:1].isdigit()}
    unknown = sorted(flags - cli[cmd[1]])
    assert not unknown, f"{page}: `{line}`: `coplan {cmd[1]}` has no option {unknown}"


@pytest.mark.parametrize(("page", "line", "cmd"), SCRIPTS, ids=[f"{p}: {line}" for p, line, _ in SCRIPTS])
def test_shown_script_exists(page: str, line: str, cmd: list[str]) -> None:
    assert (ROOT / cmd[1]).is_file(), f"{page}: `{line}`: no file {cmd[1]}"


def _slug(heading: str) -> str:
    """GitHub's anchor for a heading: lower case, punctuation dropped, spaces to hyphens."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def _anchors(page: Path) -> set[str]:
    text = re.sub(r"```.*?```", "", _text(page), flags=re.S)
    return {_slug(h) for h in re.findall(r"^#+ (.+)$", text, re.M)}


LINKS = [
    (_rel(page), target)
    for page in PAGES
    for target in re.findall(r"\]\(([^)\s]+)\)", _text(page))
    if not re.match(r"[a-z]+://", target)
]


def test_the_readme_links_every_docs_page() -> None:
    linked = {(README.parent / t.split("#")[0]).resolve() for p, t in LINKS if p == "README.md"}
    assert DOCS and set(DOCS) <= linked, sorted(_rel(d) for d in set(DOCS) - linked)


@pytest.mark.parametrize(("page", "target"), LINKS, ids=[f"{p} -> {t}" for p, t in LINKS])
def test_link_resolves(page: str, target: str) -> None:
    path, _, anchor = target.partition("#")
    dest = (ROOT / page).parent / path if path else ROOT / page
    assert dest.exists(), f"{page}: link to {target}: no such file"
    if anchor:
        assert anchor in _anchors(dest), f"{page}: link to {target}: no such heading"


# --- the Python examples run as written -----------------------------------------------------------


def test_the_pages_have_python_examples() -> None:
    assert any(page == "README.md" for page, _, _ in PYTHON)
    assert len(PYTHON) >= 3


@pytest.mark.parametrize(("page", "index", "code"), PYTHON, ids=[f"{p} block {i}" for p, i, _ in PYTHON])
def test_python_example_runs(page: str, index: int, code: str, capsys: pytest.CaptureFixture[str]) -> None:
    exec(compile(code, f"{page} python block {index}", "exec"), {})
    assert capsys.readouterr().out.strip()  # every example prints its result


@pytest.mark.parametrize(("page", "index", "code"), PYTHON, ids=[f"{p} block {i}" for p, i, _ in PYTHON])
def test_python_example_is_formatted(page: str, index: int, code: str) -> None:
    if shutil.which("ruff"):
        ruff = [shutil.which("ruff") or "ruff"]
    elif importlib.util.find_spec("ruff") is not None:
        ruff = [sys.executable, "-m", "ruff"]
    else:
        pytest.skip("ruff is not installed (pip install -e '.[dev]')")
    done = subprocess.run(
        [*ruff, "format", "--check", "--line-length", "110", "-"],
        input=code,
        capture_output=True,
        text=True,
    )
    assert done.returncode == 0, done.stdout + done.stderr


# --- the figures quoted match the results they cite -----------------------------------------------


def _bench(name: str) -> ModuleType:
    """A benchmark script as a module (benchmarks/ is not a package)."""
    spec = importlib.util.spec_from_file_location(name, ROOT / "benchmarks" / f"{name}.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module  # dataclasses look their module up while the script runs
    spec.loader.exec_module(module)
    return module


def _results(name: str) -> dict:
    return json.loads((RESULTS / name).read_text(encoding="utf-8"))


def _doc(name: str) -> str:
    return _text(ROOT / "docs" / name)


def _table_lines(markdown: str) -> list[str]:
    return [line for line in markdown.splitlines() if line.startswith("|")]


def test_published_runs_table_matches_the_results() -> None:
    bench = _bench("bench_published")
    rows = [r for r in _results("published.json")["rows"] if r["cluster"].startswith(bench.SCOPE)]
    page = _doc("cost-model.md")
    missing = [line for line in _table_lines(bench.markdown_table(rows)) if line not in page]
    assert not missing, "docs/cost-model.md's table differs from published.json: " + "\n".join(missing)


def test_planner_table_matches_the_results() -> None:
    bench = _bench("bench_planner")
    page = _doc("planner.md")
    table = _table_lines(bench.markdown(_results("planner.json")["scenarios"]))
    missing = [line for line in table if line not in page]
    assert not missing, "docs/planner.md's table differs from planner.json: " + "\n".join(missing)


def _pct(x: float) -> str:
    return f"{x:.1%}"


def _quoted(where: str, text: str, figures: list[str]) -> None:
    missing = [f for f in figures if f not in text]
    assert not missing, f"{where} does not quote {missing} as the results have them"


def test_headline_figures_match_the_results() -> None:
    readme, cost = _text(README), _doc("cost-model.md")
    pub = _results("published.json")["summary"]
    scope, held = pub["megatron-lm A100/H100"], pub["held out A100/H100"]
    figures = [
        f"{scope['runs']} Megatron-stack runs",
        _pct(scope["mean_abs_error"]),
        _pct(scope["worst_abs_error"]),
        f"{held['runs']} of them",
        _pct(held["mean_abs_error"]),
        _pct(held["worst_abs_error"]),
    ]
    _quoted("README.md", readme, figures)
    _quoted("docs/cost-model.md", cost, figures[1:3] + figures[4:])
    contract = _results("published_contract.json")["summary"]["megatron-lm A100/H100"]
    figures = [
        _pct(contract["mean_abs_error"]),
        _pct(contract["worst_abs_error"]),
        f"{contract['within_15pct']} of {contract['runs']}",
    ]
    _quoted("README.md", readme, figures)
    _quoted("docs/cost-model.md", cost, figures)

    cpu = _results("cpu_accuracy.json")["summary"]
    figures = [
        _pct(cpu["mape"]),
        f"{cpu['within_step_target']} of {cpu['configs']}",
        f"{cpu['spearman']:.3f}",
        f"{cpu['max_abs_saved_bytes_error']:.2%}",
    ]
    _quoted("docs/cost-model.md", cost, figures)
    _quoted("README.md", readme, [f"{cpu['configs']} real training steps", *figures[2:]])

    apply = _results("apply.json")
    figures = [f"Spearman {apply['summary']['spearman']:.3f}", f"{len(apply['results'])} plans"]
    _quoted("README.md", readme, figures)
    _quoted("docs/applying-plans.md", _doc("applying-plans.md"), [figures[0]])

    coupling = _results("coupling.json")
    page = _doc("coupling.md")
    pairs = ("remat+parallel", "parallel+precision")
    figures = [f"{coupling['pairs'][p]['max_joint_over_sequential']:.3f}" for p in pairs]
    _quoted("README.md", readme, [*figures, f"{len(coupling['scenarios'])} scenarios"])
    _quoted("docs/coupling.md", page, [*figures, f"{coupling['plans_checked']} plans checked"])
    assert coupling["verdict"] == "validated" and "**validated**" in readme


def test_gpu_figures_match_the_results() -> None:
    """The GPU comparison the README states is the one ``bench_gpu.json`` holds."""
    sys.path.insert(0, str(ROOT / "benchmarks"))
    try:
        gpu_all = _bench("gpu_all")
    finally:
        sys.path.remove(str(ROOT / "benchmarks"))
    rows = {
        r["batch"]: r for r in gpu_all.summary(_results("gpu/bench_gpu.json")) if r["model"] == "gpt2-124m"
    }
    figures = [
        f"{rows['tight']['joint_vs_compile']:.2f}x `torch.compile`'s defaults at the memory-tight batch",
        f"{rows['tight']['joint_vs_compile_budget']:.2f}x)",
        f"{rows['loose']['joint_vs_compile']:.2f}x at the loose batch",
    ]
    _quoted("README.md", _text(README), figures)
    assert not rows["tight"]["ranking_matches"] and "not the measured one" in _text(README)
