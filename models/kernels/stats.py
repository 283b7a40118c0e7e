"""One compiled pass over a stored matrix for the artifact checks (`models.checks`): every row's sum in float64
and the smallest entry, rows over threads. A 2^15 x 2^15 float32 matrix is read once (~1 s on two cores), where
the checks' torch passes (isfinite, a negative test, a float64 copy per slice for the sums) read it five times
and write temporaries (~20 s). A row sum that is not finite flags a non-finite entry (NaN and infinities reach
the sum; float64 sums of float32 entries cannot overflow), so the checks take the exact torch path only for a
matrix that fails."""

from __future__ import annotations

import math

import numpy as np
import torch
from torch import Tensor

from latentlm.models.kernels.jit import FASTMATH, HAVE_NUMBA, njit, widen
from latentlm.models.kernels.threads import run_ranges

DTYPES = (torch.float32, torch.float64, torch.bfloat16)  # what `row_sums_and_min` reads in place

if HAVE_NUMBA:

    @njit(nogil=True, fastmath=FASTMATH, cache=True)
    def _row_sums_and_min(x, lo, hi, sums, mins):  # pragma: no cover - compiled
        """sums[r] = sum of x[r] in float64 and mins[r] = min of x[r] (inf for an empty row), lo <= r < hi;
        x (R, C) float32/float64 or bfloat16 bits (`jit.widen`). O((hi - lo) C)."""
        C = x.shape[1]
        for r in range(lo, hi):
            row = x[r]
            acc = 0.0
            low = np.inf
            for j in range(C):
                v = np.float64(widen(row[j]))
                acc += v
                if v < low:
                    low = v
            sums[r] = acc
            mins[r] = low


def row_sums_and_min(t: Tensor, threads: int) -> tuple[Tensor, float]:
    """(sums over the last dimension (t.shape[:-1]) float64, the smallest entry as a float (inf when empty))
    of a contiguous CPU tensor of `DTYPES` with at least one dimension, read in place, rows over `threads`
    threads. A NaN entry makes its row's sum NaN (the minimum may skip it). O(numel)."""
    C = t.shape[-1]
    x = (t.view(torch.uint16) if t.dtype == torch.bfloat16 else t).reshape(-1, C).numpy()
    R = x.shape[0]
    sums, mins = np.zeros(R), np.full(R, np.inf)
    if R and C:
        run_ranges(np.full(R, 1), threads, lambda lo, hi: _row_sums_and_min(x, lo, hi, sums, mins))
    low = float(mins.min()) if R else math.inf
    return torch.from_numpy(sums).reshape(t.shape[:-1]), low
