"""What every compiled kernel shares: numba's `njit` (or its absence) and the fast-math flags.

numba is a hard dependency, but the engine stays usable (plain PyTorch everywhere) if its LLVM build is
unavailable: then `HAVE_NUMBA` is False and no kernel module defines its compiled functions.
Kernels are compiled on first use and cached on disk (`cache=True`). numba invalidates a cached function
when its own source file changes, not when a function it calls in another module does: after editing a
kernel that others inline (`rows.py`, `blas.py`, `threads.py`), delete models/kernels/__pycache__.

`BORROWED` compiles a function without numba's reference counting: every array it touches belongs to its
caller (arguments and views of them), so taking a row `a[i]` costs nothing, where reference counting makes it
an atomic increment and decrement. In the small-state kernels those atomics took 17-35% of all samples
(`perf`, Z = 64: score, posteriors, Viterbi; bench/results/kernel_refcounts.md). Such a function cannot
allocate, return an array or assign one array to a slice of another (write the loop): numba refuses to
compile one that does. The recursions run in such functions; thin wrappers allocate their scratch.
"""

from __future__ import annotations

try:
    from numba import njit

    HAVE_NUMBA = True
except ImportError:  # pragma: no cover
    njit = None
    HAVE_NUMBA = False

BORROWED = {"_nrt": False}  # numba's flag for "no runtime": no reference counting (and no allocation)
FASTMATH = {"contract", "reassoc"}  # vectorised reductions; never assumes finite values (-inf is data here)
