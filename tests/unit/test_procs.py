"""Processes coplan starts end with it (``coplan.procs``), and Ctrl-C stops a command cleanly.

The ``procs`` tests start a coplan command in its own session, wait until its workers are guarded
(they carry ``coplan-worker`` in ``/proc/<pid>/comm``), then kill the command: SIGKILL (or
SIGTERM) must leave no process of the session behind within 5 s, and SIGINT to the process group
(what a terminal's Ctrl-C sends) must end it with exit code 130, one ``error: interrupted: ...``
line and no traceback. Each takes seconds (the ``run`` ones tens of seconds on a loaded machine);
``-m 'not procs'`` deselects them. The partial result of an interrupted coupling grid is checked
in this process, on tiny scenarios.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from coplan import procs
from coplan.cli import main
from coplan.experiments import coupling as C
from coplan.experiments import coupling_summary as S

ROOT = Path(__file__).resolve().parents[2]
LINUX = sys.platform.startswith("linux")
#: how long a command may take to start its workers (imports, planning) on a busy machine
START_S = 240.0
#: how long the processes of a killed command may outlive it
GONE_S = 5.0

on_linux = pytest.mark.skipif(not LINUX, reason="reads /proc")

#: ``command(*args)`` starts ``coplan ARGS`` in a session of its own
Command = Callable[..., "subprocess.Popen[bytes]"]


def session(sid: int) -> dict[int, str]:
    """The live processes (pid -> comm) of session ``sid``; zombies are dead and excluded."""
    out = {}
    for d in os.listdir("/proc"):
        if not d.isdigit():
            continue
        try:
            stat = Path(f"/proc/{d}/stat").read_text()
            comm = Path(f"/proc/{d}/comm").read_text().strip()
        except OSError:
            continue
        fields = stat[stat.rindex(")") + 2 :].split()  # state ppid pgrp session ...
        if int(fields[3]) == sid and fields[0] != "Z":
            out[int(d)] = comm
    return out


def reap(p: subprocess.Popen[bytes]) -> None:
    """Kill ``p`` and whatever of its session runs: whatever a test did, nothing is left running."""
    for pid in session(p.pid):
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
    p.kill()
    p.communicate()


def gone_within(sid: int, seconds: float) -> dict[int, str]:
    """Wait up to ``seconds`` for session ``sid`` to empty; what is left then."""
    end = time.monotonic() + seconds
    while (left := session(sid)) and time.monotonic() < end:
        time.sleep(0.05)
    return left


def _dies_with_the_tests() -> None:
    """In the started command, before it runs: SIGKILL it if pytest dies (a CI timeout kills pytest
    without its fixtures' teardown; the command's own workers then follow it by coplan's guard)."""
    import ctypes

    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL(None, use_errno=True).prctl(1, int(signal.SIGKILL), 0, 0, 0)  # PR_SET_PDEATHSIG


@pytest.fixture
def command(tmp_path: Path) -> Iterator[Command]:
    started: list[subprocess.Popen[bytes]] = []

    def start(*args: str) -> subprocess.Popen[bytes]:
        env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]))
        p = subprocess.Popen(
            [sys.executable, "-m", "coplan.cli", *args],
            cwd=tmp_path,
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            start_new_session=True,
            preexec_fn=_dies_with_the_tests,
        )
        started.append(p)
        return p

    yield start
    for p in started:
        reap(p)


def wait_for_workers(p: subprocess.Popen[bytes], n: int) -> list[int]:
    """Block until ``n`` guarded workers of ``p`` run; fail if ``p`` ends first."""
    end = time.monotonic() + START_S
    while time.monotonic() < end:
        workers = [pid for pid, comm in session(p.pid).items() if comm == procs.WORKER_NAME]
        if len(workers) >= n:
            return workers
        if p.poll() is not None:
            _, err = p.communicate()
            pytest.fail(f"the command ended (code {p.returncode}) before its workers ran:\n{err.decode()}")
        time.sleep(0.05)
    pytest.fail(f"no {n} workers within {START_S} s")


def killed_leaves_nothing(p: subprocess.Popen[bytes], workers: int, sig: signal.Signals) -> None:
    wait_for_workers(p, workers)
    os.kill(p.pid, sig)  # the parent alone: its workers must follow it
    p.wait()
    left = gone_within(p.pid, GONE_S)
    assert not left, f"left running {GONE_S} s after {sig.name}: {left}"


def interrupted_cleanly(p: subprocess.Popen[bytes], workers: int) -> tuple[str, str]:
    wait_for_workers(p, workers)
    os.killpg(p.pid, signal.SIGINT)  # a terminal's Ctrl-C reaches the whole process group
    out, err = p.communicate(timeout=120)
    assert p.returncode == 130, err
    assert "Traceback" not in err.decode()
    lines = err.decode().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: interrupted: "), lines
    assert not gone_within(p.pid, GONE_S)
    return out.decode(), lines[0]


@pytest.fixture(scope="module")
def plan2(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A plan for the tiny GPT on two CPU processes."""
    from coplan.apply.predict import make_context, plan_for, run_cluster
    from coplan.hardware import load_cluster
    from coplan.models.spec import PRESETS

    ctx = make_context(PRESETS["gpt-tiny"], run_cluster(load_cluster("cpu"), 2, "cpu"), 8, 32)
    path = tmp_path_factory.mktemp("plan") / "plan2.json"
    path.write_text(plan_for(ctx).to_json())
    return path


RUN = ("run", "--model", "gpt-tiny", "--nproc", "2", "--steps", "1000000", "--device", "cpu")


# --- killed: nothing remains ---------------------------------------------------------------------


@on_linux
@pytest.mark.procs
@pytest.mark.parametrize("sig", [signal.SIGKILL, signal.SIGTERM], ids=["SIGKILL", "SIGTERM"])
def test_coupling_workers_end_with_the_command(command: Command, sig: signal.Signals) -> None:
    killed_leaves_nothing(command("coupling", "--jobs", "2", "--json"), 2, sig)


@on_linux
@pytest.mark.procs
def test_run_ranks_end_with_the_command(command: Command, plan2: Path) -> None:
    killed_leaves_nothing(command(*RUN, "--plan", str(plan2)), 2, signal.SIGKILL)


@on_linux
@pytest.mark.procs
@pytest.mark.slow
def test_calibrate_ranks_end_with_the_command(command: Command) -> None:
    # the collective benchmarks come after every microbenchmark: a minute or more
    killed_leaves_nothing(command("calibrate", "--quick", "--procs", "2", "--json"), 2, signal.SIGKILL)


@on_linux
@pytest.mark.procs
@pytest.mark.slow
def test_calibrate_ctrl_c(command: Command, tmp_path: Path) -> None:
    out, line = interrupted_cleanly(command("calibrate", "--quick", "--procs", "2", "--json"), 2)
    assert out == "" and "calibration stopped; no profile written" in line
    assert not list(tmp_path.glob("coplan-profile-*.json"))  # the command ran there


@on_linux
@pytest.mark.procs
def test_calibrate_collective_ranks_end_with_their_parent(tmp_path: Path) -> None:
    # what `coplan calibrate --procs 2` runs last, driven alone (the command reaches it only after
    # a minute of microbenchmarks: ``test_calibrate_ranks_end_with_the_command``, slow tier)
    driver = (
        "from dataclasses import replace\n"
        "from coplan.hardware.calibrate import Plan\n"
        "from coplan.hardware.calibrate.probes import measure_collectives\n"
        "plan = replace(Plan.of('cpu', True), collective_bytes=(1 << 22,) * 100_000)\n"
        "measure_collectives('cpu', 2, plan, print)\n"
    )
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    p = subprocess.Popen(
        [sys.executable, "-c", driver],
        cwd=tmp_path,
        env=env,
        start_new_session=True,
        stderr=subprocess.PIPE,
        preexec_fn=_dies_with_the_tests,
    )
    try:
        killed_leaves_nothing(p, 2, signal.SIGKILL)
    finally:
        reap(p)


# --- Ctrl-C: one line, exit 130 ------------------------------------------------------------------


@on_linux
@pytest.mark.procs
def test_coupling_ctrl_c(command: Command) -> None:
    out, line = interrupted_cleanly(command("coupling", "--jobs", "2", "--json"), 2)
    assert "coupling (small grid) stopped with" in line
    if out:  # scenarios finished before the interrupt: reported, marked partial
        data = json.loads(out)
        assert data["partial"] is True and len(data["scenarios"]) < data["scenarios_total"]


@on_linux
@pytest.mark.procs
def test_run_ctrl_c(command: Command, plan2: Path) -> None:
    out, line = interrupted_cleanly(command(*RUN, "--plan", str(plan2), "--json"), 2)
    assert out == "" and "training stopped" in line


# --- the guard itself ----------------------------------------------------------------------------


def _child_of(tmp_path: Path, child: str) -> tuple[subprocess.Popen[bytes], int]:
    """A driver process that forks a child, which runs ``child`` (Python; ``parent`` is the
    driver's pid) and sleeps; both sleep. Returns the driver and the child's pid once it ran."""
    code = (
        "import os, time\n"
        "from coplan import procs\n"
        "parent = os.getpid()\n"
        "if os.fork() == 0:\n"
        f"    {child}\n"
        "    print(os.getpid(), flush=True)\n"
        "    time.sleep(120)\n"
        "    os._exit(0)\n"
        "time.sleep(120)\n"
    )
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    p = subprocess.Popen(
        [sys.executable, "-c", code], cwd=tmp_path, env=env, stdout=subprocess.PIPE, start_new_session=True
    )
    assert p.stdout is not None
    return p, int(p.stdout.readline())


@on_linux
@pytest.mark.procs
@pytest.mark.parametrize("how", ["guard", "watch"])
def test_orphan_ends(tmp_path: Path, how: str) -> None:
    # ``guard`` (Linux: the kernel's parent-death signal) and ``watch`` (the portable fallback)
    child = "procs.guard(parent)" if how == "guard" else "procs.watch(parent, poll_s=0.1)"
    p, pid = _child_of(tmp_path, child)
    try:
        if how == "guard":
            assert Path(f"/proc/{pid}/comm").read_text().strip() == procs.WORKER_NAME
            os.kill(pid, signal.SIGINT)  # Ctrl-C is the parent's: the worker ignores it
            time.sleep(0.2)
            assert pid in session(p.pid)
        p.kill()
        p.wait()
        assert not gone_within(p.pid, GONE_S)
    finally:
        reap(p)


def _fail_or_hang(rank: int, message: str) -> None:
    if rank == 0:
        raise ValueError(message)
    time.sleep(120)


def test_a_failed_rank_ends_the_others() -> None:
    import multiprocessing

    with pytest.raises(procs.WorkerFailed) as exc:
        procs.spawn(_fail_or_hang, 2, ("rank zero fails",))
    assert str(exc.value).strip().splitlines()[-1] == "ValueError: rank zero fails"
    assert not multiprocessing.active_children()


# --- an interrupted grid keeps what finished ---------------------------------------------------


def tiny(n: int) -> list[C.Scenario]:
    return [C.Scenario("gpt-tiny", "dgx-h100", 2, 8 * (i + 1), seq=64) for i in range(n)]


def interrupt_after(finished: int) -> C.Progress:
    def progress(done: int, total: int, what: str) -> None:
        if done >= finished and what != "done":
            raise KeyboardInterrupt

    return progress


@pytest.mark.parametrize("jobs", [1, 2])
def test_interrupted_study_keeps_what_finished(jobs: int) -> None:
    todo = tiny(4)
    study = C.run_study(todo, progress=interrupt_after(1), jobs=jobs)
    assert study.partial and study.total == 4
    assert 1 <= len(study.scenarios) < 4
    ids = [r.scenario.id for r in study.scenarios]
    assert ids == [sc.id for sc in todo if sc.id in ids]  # grid order
    data = S.to_json(study)
    assert {"pairs", "all4", "verdict", "scenarios"} <= data.keys()
    assert data["partial"] is True and data["scenarios_total"] == 4
    assert len(data["scenarios"]) == len(study.scenarios)
    assert data["verdict_detail"]["conclusive"] == (data["verdict"] == "validated")
    whole = S.to_json(C.run_study(todo[:1]))
    assert whole["partial"] is False and whole["verdict_detail"]["conclusive"] is True


@pytest.mark.parametrize("json_out", [True, False], ids=["json", "tables"])
def test_cli_prints_the_partial_grid(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str], json_out: bool
) -> None:
    real = C.run_study

    def stopped(
        grid: str, progress: C.Progress | None = None, jobs: int = 1, granularity: str = "op"
    ) -> C.Study:
        return real(tiny(3), progress=interrupt_after(1), jobs=1, granularity=granularity)

    monkeypatch.setattr(C, "run_study", stopped)
    with pytest.raises(SystemExit) as exc:
        main(["coupling", "--jobs", "1", *(["--json"] if json_out else [])])
    out, err = capsys.readouterr()
    assert exc.value.code == 130
    if json_out:
        data = json.loads(out)
        assert data["partial"] is True and len(data["scenarios"]) == 1
    else:
        assert "partial: 1 of 3 scenarios finished" in out
    assert err.splitlines() == [
        "error: interrupted: coupling (small grid) stopped with 1 of 3 scenarios done; "
        "those are reported, marked partial"
    ]
