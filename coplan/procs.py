"""The processes coplan starts, and how they end.

Two ways in: ``Pool`` (a process pool, forked where the platform allows: the coupling grid's
scenarios) and ``spawn`` (ranks in fresh interpreters, CUDA-safe: ``coplan run --nproc`` and the
collective benchmarks of ``coplan calibrate``). Either way every worker

- ends when the process that started it ends, however that ends (Ctrl-C, SIGTERM, SIGKILL): its
  first act (``guard``) asks Linux to SIGKILL it when its parent dies (``PR_SET_PDEATHSIG``), and
  where that is not available a daemon thread polls ``os.getppid()`` and exits once the parent is
  gone. The kernel sends that signal when the *thread* that started the worker ends; both ways in
  start their workers from the calling thread and wait for them there, so that thread outlives
  every worker it needs;
- leaves Ctrl-C to the parent: workers ignore SIGINT, and are started with it blocked so that a
  Ctrl-C during their start-up cannot raise in them either (a terminal sends it to the whole
  process group). The parent gets the ``KeyboardInterrupt``, ends its workers (SIGTERM, then
  SIGKILL after ``GRACE_S``) and re-raises it, so the command decides what to keep and what to say;
- is named ``coplan-worker`` (what ``top`` and ``/proc/<pid>/comm`` show) once guarded.

A rank of ``spawn`` is unpickled only after its guard is set, so a fresh interpreter is guarded
before it imports torch, a fraction of a second after it starts.
"""

from __future__ import annotations

import contextlib
import multiprocessing
import os
import pickle
import signal
import sys
import tempfile
import threading
import time
import traceback
from collections.abc import Callable, Iterator
from concurrent.futures import Future, ProcessPoolExecutor
from multiprocessing.connection import wait
from multiprocessing.process import BaseProcess
from pathlib import Path
from types import TracebackType
from typing import Any, TypeVar

T = TypeVar("T")

#: seconds a stopped worker has between SIGTERM and SIGKILL
GRACE_S = 2.0
#: seconds between the fallback watchdog's looks at the parent's pid
POLL_S = 0.5
#: the name a guarded worker carries (``/proc/<pid>/comm``, at most 15 bytes)
WORKER_NAME = "coplan-worker"

_PR_SET_NAME = 15
_PR_SET_PDEATHSIG = 1


class WorkerFailed(Exception):
    """A rank of ``spawn`` failed: the message is its traceback (the last line names the error),
    or how it ended when it left none."""


# --- in the worker ------------------------------------------------------------------------------


def guard(parent: int) -> None:
    """The first act of every worker: end when ``parent`` ends, ignore Ctrl-C (the parent's to
    handle), and carry ``WORKER_NAME``."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    if hasattr(signal, "pthread_sigmask"):  # started blocked (``_sigint_blocked``); ignored now
        signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGINT})
    if not _prctl(_PR_SET_PDEATHSIG, int(signal.SIGKILL)):
        watch(parent)
    _prctl(_PR_SET_NAME, WORKER_NAME.encode())
    if os.getppid() != parent:  # the parent died before the signal was asked for
        os._exit(1)


def _prctl(option: int, arg: int | bytes) -> bool:
    """``prctl(option, arg)`` on Linux; False where it is not available or fails."""
    if not sys.platform.startswith("linux"):
        return False
    try:
        import ctypes

        libc = ctypes.CDLL(None, use_errno=True)
        return int(libc.prctl(option, arg, 0, 0, 0)) == 0
    except (OSError, AttributeError):
        return False


def watch(parent: int, poll_s: float = POLL_S) -> threading.Thread:
    """A daemon thread that ends this process once ``parent`` is no longer its parent (an orphan
    is re-parented: ``os.getppid()`` changes)."""

    def loop() -> None:
        while os.getppid() == parent:
            time.sleep(poll_s)
        os._exit(1)

    t = threading.Thread(target=loop, name="coplan-parent-watch", daemon=True)
    t.start()
    return t


# --- in the parent ------------------------------------------------------------------------------


@contextlib.contextmanager
def _sigint_blocked() -> Iterator[None]:
    """SIGINT blocked in this thread while workers start: they inherit the mask (across fork and
    exec) and unblock it only once it is ignored (``guard``). A Ctrl-C meanwhile still raises
    here: when the block ends, or at once where another thread of this process takes it."""
    if not hasattr(signal, "pthread_sigmask"):
        yield
        return
    old = signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGINT})
    try:
        yield
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, old)


@contextlib.contextmanager
def _sigint_ignored() -> Iterator[None]:
    """A second Ctrl-C while workers are being stopped does not cut the stopping short."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    old = signal.signal(signal.SIGINT, signal.SIG_IGN)
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, old)


def stop(procs: list[BaseProcess], grace_s: float = GRACE_S) -> None:
    """End ``procs``: SIGTERM, then SIGKILL those still alive after ``grace_s``; reap them all."""
    procs = [p for p in procs if p.pid is not None]  # started
    with _sigint_ignored():
        for p in procs:
            if p.is_alive():
                p.terminate()
        end = time.monotonic() + grace_s
        for p in procs:
            p.join(max(0.0, end - time.monotonic()))
        for p in procs:
            if p.is_alive():
                p.kill()
            p.join()


class Pool:
    """``jobs`` guarded worker processes (``concurrent.futures``); use as a context manager. On
    leaving it normally the pool waits for its work; on an exception (``KeyboardInterrupt``
    included) it cancels what has not started, ends the workers at once and lets the exception
    go on."""

    def __init__(self, jobs: int) -> None:
        # fork where the platform has it: workers start without re-importing the caller's main
        # module (spawn requires a ``__main__`` guard of every caller)
        method = "fork" if "fork" in multiprocessing.get_all_start_methods() else "spawn"
        self._ex = ProcessPoolExecutor(
            max_workers=jobs,
            mp_context=multiprocessing.get_context(method),
            initializer=guard,
            initargs=(os.getpid(),),
        )

    def submit(self, fn: Callable[..., T], /, *args: Any) -> Future[T]:
        with _sigint_blocked():  # the executor starts its workers in ``submit``
            return self._ex.submit(fn, *args)

    def __enter__(self) -> Pool:
        return self

    def __exit__(
        self, kind: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        if kind is None:
            self._ex.shutdown(wait=True)
        else:
            self.terminate()

    def terminate(self) -> None:
        """Cancel the work not started and end the workers now (work under way is lost)."""
        # the executor has no public way to end busy workers (its shutdown waits for them)
        workers = list((getattr(self._ex, "_processes", None) or {}).values())
        manager = getattr(self._ex, "_executor_manager_thread", None)
        with _sigint_ignored():
            self._ex.shutdown(wait=False, cancel_futures=True)
            stop(workers)
            if manager is not None:  # it notices the ended workers and fails what was under way
                manager.join(GRACE_S)


def spawn(fn: Callable[..., object], nprocs: int, args: tuple[Any, ...] = ()) -> None:
    """Run ``fn(rank, *args)`` for each rank in ``range(nprocs)``, each in a fresh guarded
    interpreter, and wait for all. When a rank fails the others are ended and ``WorkerFailed``
    is raised; on any exception here (``KeyboardInterrupt`` included) every rank is ended before
    it goes on. ``fn`` and ``args`` must pickle (``fn`` by reference)."""
    ctx = multiprocessing.get_context("spawn")
    payload = pickle.dumps((fn, args))
    procs: list[BaseProcess] = []
    with tempfile.TemporaryDirectory(prefix="coplan-ranks-") as tmp:
        errors = [str(Path(tmp) / f"rank{r}.err") for r in range(nprocs)]
        try:
            with _sigint_blocked():
                for rank in range(nprocs):
                    p = ctx.Process(
                        target=_rank, args=(os.getpid(), rank, payload, errors[rank]), name=f"rank{rank}"
                    )
                    procs.append(p)  # before it starts: an interrupt inside ``start`` still ends it
                    p.start()
            _join(procs, errors)
        except BaseException:
            stop(procs)
            raise


def _rank(parent: int, rank: int, payload: bytes, error: str) -> None:
    guard(parent)  # before the payload's imports (torch): a second or more
    fn, args = pickle.loads(payload)
    try:
        fn(rank, *args)
    except Exception:
        Path(error).write_text(traceback.format_exc())
        sys.exit(1)


def _join(procs: list[BaseProcess], errors: list[str]) -> None:
    """Wait for every rank; on the first that fails end the rest and raise ``WorkerFailed``."""
    waiting = {p.sentinel: i for i, p in enumerate(procs)}
    while waiting:
        for s in wait(list(waiting)):
            i = waiting.pop(s)  # type: ignore[arg-type]  # a sentinel is an int
            p = procs[i]
            p.join()
            if p.exitcode == 0:
                continue
            stop(procs)
            err = Path(errors[i])
            if err.exists():
                raise WorkerFailed(err.read_text())
            code = p.exitcode or 0
            how = f"signal {signal.Signals(-code).name}" if code < 0 else f"exit code {code}"
            raise WorkerFailed(f"rank {i} ended with {how}")
