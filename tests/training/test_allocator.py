"""Training processes keep freed memory for reuse (`common.reuse_freed_memory`): a 64 MiB tensor allocated
and freed step after step faults its pages in once, not at every step. Run in a child process, since the
setting is process-wide."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

CHILD = """
import resource, sys, torch
from latentlm.training.common import reuse_freed_memory
if sys.argv[1] == "reuse":
    assert reuse_freed_memory()
torch.empty(1).fill_(0)
before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
for _ in range(16):
    t = torch.empty(4096, 4096)  # 64 MiB: above glibc's mmap ceiling of 32 MiB
    t.fill_(1.0)
    del t
print(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
"""


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's malloc")
def test_large_tensors_fault_in_once_not_every_step():
    def faults(mode: str) -> int:
        env = {k: v for k, v in os.environ.items() if k != "THP_MEM_ALLOC_ENABLE"}  # training's 4 KiB pages
        out = subprocess.run([sys.executable, "-c", CHILD, mode], capture_output=True, text=True, check=True,
                             env=env)
        return int(out.stdout.strip())

    pages = 64 * 2**20 // 4096  # 16,384 pages per tensor
    default, reuse = faults("default"), faults("reuse")
    assert default > 12 * pages  # every allocation is a fresh mapping: 16 x 16,384 faults
    # the heap grows, then its pages are reused: 2 tensors' worth of faults in 8 allocations when this test ran
    # alone, 6 when it ran inside the whole suite of a fresh clone (not understood); either way under the default
    assert reuse < 0.8 * default
