"""What every compiled kernel shares: numba's `njit` (or its absence) and the fast-math flags.

numba is a hard dependency, but the engine stays usable (plain PyTorch everywhere) if its LLVM build is
unavailable: then `HAVE_NUMBA` is False and no kernel module defines its compiled functions.
Kernels are compiled on first use and cached on disk (`cache=True`). numba invalidates a cached function
when its own source file changes, not when a function it calls in another module does: after editing a
kernel that others inline (`rows.py`, `blas.py`, `threads.py`), delete models/kernels/__pycache__.
"""

from __future__ import annotations

try:
    from numba import njit

    HAVE_NUMBA = True
except ImportError:  # pragma: no cover
    njit = None
    HAVE_NUMBA = False

FASTMATH = {"contract", "reassoc"}  # vectorised reductions; never assumes finite values (-inf is data here)
