"""Holding glibc malloc's thresholds (``coplan.hardware.allocator``): tensors below 32 MiB stop
page-faulting in again after the first step."""

from __future__ import annotations

import platform
import resource
import subprocess
import sys

import pytest
import torch

from coplan.hardware.allocator import MMAP_THRESHOLD, pin_host_allocator

glibc = pytest.mark.skipif(platform.libc_ver()[0] != "glibc", reason="glibc's mallopt only")


def _faults() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt


#: Run in a process of its own: the heap of a test process is in whatever state earlier tests left
#: it (a compile's many allocations, helper threads allocating meanwhile), and what is measured is
#: how a training process's heap behaves from its first steps on.
_REUSE = """
import resource, torch
from coplan.hardware.allocator import MMAP_THRESHOLD, pin_host_allocator

def faults():
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt

assert pin_host_allocator() is not None
n = MMAP_THRESHOLD // 2 // 4  # a 16 MiB fp32 tensor: from the heap once pinned
# warm-up: an aligned block's small remainders keep the first few freed blocks from merging into a
# free one large enough for the next request, so the heap grows a few times (measured: four 16 MiB
# steps) before every request is served from freed memory
for _ in range(8):
    x = torch.empty(n)
    x.fill_(1.0)
    del x  # glibc's default would trim the heap top here, or have mapped the block afresh
before = faults()
for _ in range(10):
    x = torch.empty(n)
    x.fill_(1.0)
    del x
print(faults() - before)
"""


@glibc
def test_pinned_heap_reuses_its_pages() -> None:
    done = subprocess.run([sys.executable, "-c", _REUSE], capture_output=True, text=True, check=False)
    assert done.returncode == 0, done.stderr
    # 4096 pages a tensor: re-faulting them would be 40,960 faults; a few stray ones are the
    # interpreter's own
    assert int(done.stdout.strip()) < 500


@glibc
def test_tensors_of_32_mib_and_more_are_still_mapped_afresh() -> None:
    # what the cost model's first-touch tier charges: these fault in on every allocation
    assert pin_host_allocator() is not None
    n = 2 * MMAP_THRESHOLD // 4
    x = torch.empty(n)
    x.fill_(1.0)
    del x
    before = _faults()
    for _ in range(3):
        x = torch.empty(n)
        x.fill_(1.0)
        del x
    assert _faults() - before > 3 * 16_384 // 2  # 16,384 pages a tensor (4 KiB pages)
