"""The host allocator of a CPU training process: glibc malloc's thresholds pinned at their steady state.

glibc serves a block below its mmap threshold from the heap, maps anything larger afresh and unmaps
it on free, and gives the top of the heap back to the OS once more than its trim threshold lies
free there. Both thresholds move: each freed mapped block raises the mmap threshold to its size
(up to 32 MiB on 64-bit), and the trim threshold to twice that. So whether a training step
page-faults its tensors in again depends on what the process allocated before. Measured in fresh
processes (eight of each, alternating; docs/applying-plans.md), a bf16 training step of
the CPU benchmark's gpt-a at batch 8 x 128 faulted 15-20 MB a step with glibc's defaults and took
29.1 ms (median), and faulted nothing with the thresholds held: 23.8 ms.

``pin_host_allocator`` holds them at the state a long-running process reaches on its own: blocks
under 32 MiB from the heap, never trimmed back, blocks of 32 MiB and more mapped (and faulted in)
on every allocation. That is also what the cost model prices on a CPU: the first-touch tier charges
fresh tensors at least the size of the last-level cache (32 MiB on the development machine), and
nothing below. ``coplan run`` pins it in every training process (``--host-allocator default``
turns that off; the run's notes say which), and ``coplan calibrate --device cpu`` while its probes
run, so that they measure kernels as a run executes them. It changes the whole process's allocator,
the caller's too for work done in this process.
"""

from __future__ import annotations

import ctypes
import platform

#: glibc's ``mallopt`` parameters (malloc.h)
_M_TRIM_THRESHOLD = -1
_M_MMAP_THRESHOLD = -3
#: glibc's largest mmap threshold on 64-bit (``DEFAULT_MMAP_THRESHOLD_MAX``): the value the dynamic
#: threshold rises to, and the largest ``mallopt`` accepts
MMAP_THRESHOLD = 32 * 1024 * 1024
#: ``mallopt`` takes a C int: the largest trim threshold it can hold, far above any free heap top here
TRIM_THRESHOLD = 2**31 - 1

HOST_ALLOCATORS = ("pinned", "default")


def pin_host_allocator() -> str | None:
    """Hold glibc's mmap threshold at 32 MiB and turn heap trimming off, for this process. Returns
    a line saying what was set, or None where the C library is not glibc (nothing is changed)."""
    if platform.system() != "Linux" or platform.libc_ver()[0] != "glibc":
        return None
    # the process's own symbols hold the C library it runs on (no search for libc's file)
    mallopt = getattr(ctypes.CDLL(None), "mallopt", None)
    if mallopt is None:
        return None
    mallopt.argtypes = (ctypes.c_int, ctypes.c_int)
    mallopt.restype = ctypes.c_int
    # mallopt returns 1 on success; either call also stops glibc moving the thresholds itself
    if mallopt(_M_MMAP_THRESHOLD, MMAP_THRESHOLD) != 1 or mallopt(_M_TRIM_THRESHOLD, TRIM_THRESHOLD) != 1:
        return None
    return "host allocator pinned: glibc mmap threshold 32 MiB, heap trimming off"
