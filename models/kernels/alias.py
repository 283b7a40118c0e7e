"""Walker/Vose alias tables, built by a compiled kernel: a categorical draw is then one uniform column and
one biased coin, O(1) whatever the number of categories (used by `models.sampling.CategoricalTable`)."""

from __future__ import annotations

import numpy as np
import torch
from torch import Tensor

from latentlm.models.kernels.jit import HAVE_NUMBA, njit

if HAVE_NUMBA:

    @njit(nogil=True, cache=True)
    def _alias_rows(probs, accept, alias):  # pragma: no cover - compiled
        """Vose's alias tables for each row of probs (R, C), rows summing to 1. O(R C)."""
        R, C = probs.shape
        small = np.empty(C, dtype=np.int64)
        large = np.empty(C, dtype=np.int64)
        scaled = np.empty(C, dtype=np.float64)
        for r in range(R):
            ns = 0
            nl = 0
            for c in range(C):
                scaled[c] = probs[r, c] * C
                alias[r, c] = c
                if scaled[c] < 1.0:
                    small[ns] = c
                    ns += 1
                else:
                    large[nl] = c
                    nl += 1
            while ns > 0 and nl > 0:
                ns -= 1
                s = small[ns]
                g = large[nl - 1]
                accept[r, s] = scaled[s]
                alias[r, s] = g
                scaled[g] = (scaled[g] + scaled[s]) - 1.0
                if scaled[g] < 1.0:
                    nl -= 1
                    small[ns] = g
                    ns += 1
            for i in range(nl):
                accept[r, large[i]] = 1.0
            for i in range(ns):  # leftovers from rounding: accept outright
                accept[r, small[i]] = 1.0


def alias_tables(probs: Tensor) -> tuple[Tensor, Tensor]:
    """(R, C) row-stochastic -> (accept (R, C) float64, alias (R, C) int64) on CPU. O(R C)."""
    p = np.ascontiguousarray(probs.detach().double().cpu().numpy())
    p = p / p.sum(axis=1, keepdims=True)
    accept = np.empty_like(p)
    alias = np.empty(p.shape, dtype=np.int64)
    _alias_rows(p, accept, alias)
    return torch.from_numpy(accept), torch.from_numpy(alias)
