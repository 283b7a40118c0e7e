"""Compiled builders of `models.sampling.CategoricalTable`'s tables: Walker/Vose alias tables (a categorical draw
is then one uniform column and one biased coin, O(1) whatever the number of categories), the float64 chunk
masses of `models.sampling.ChunkedCDF` (one pass over the probabilities where they lie, rows over threads), and
its draws at a temperature other than 1 (each draw's row weighed as it is read, draws over threads)."""

from __future__ import annotations

import numpy as np
import torch
from torch import Tensor

from latentlm.models.kernels.jit import FASTMATH, HAVE_NUMBA, njit, widen
from latentlm.models.kernels.threads import run_ranges

CHUNK_MASS_DTYPES = (torch.float32, torch.float64, torch.bfloat16)  # what `chunk_masses` reads in place

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

    @njit(nogil=True, fastmath=FASTMATH, cache=True)
    def _chunk_masses(probs, width, lo, hi, out):  # pragma: no cover - compiled
        """out[r, c] = sum of max(probs[r, j], 0) over the columns j of chunk c (width wide; the last may be
        narrower), in float64, for rows lo <= r < hi; probs float32/float64 or bfloat16 bits (`jit.widen`).
        O((hi - lo) C)."""
        C = probs.shape[1]
        for r in range(lo, hi):
            row = probs[r]
            for c in range(out.shape[1]):
                acc = 0.0
                for j in range(c * width, min(C, (c + 1) * width)):
                    v = np.float64(widen(row[j]))
                    acc += v if v > 0.0 else 0.0
                out[r, c] = acc

    @njit(nogil=True, cache=True)
    def _tempered_draws(probs, rows, u, inv_temp, lo, hi, cum, out):  # pragma: no cover - compiled
        """out[i] = the first column whose cumulative weight exceeds u[i] times the total of row rows[i] of
        probs, weighed exp((log p - log max p) * inv_temp) (p^(1/T) renormalised, without overflow), in float64,
        for lo <= i < hi; past the total (u rounded up) the last positive column. cum (C,) float64 scratch.
        Three passes over the row (its max, the cumulative weights, a binary search): O(C) per draw."""
        C = probs.shape[1]
        for i in range(lo, hi):
            row = probs[rows[i]]
            top = 0.0
            for j in range(C):
                v = np.float64(widen(row[j]))
                if v > top:
                    top = v
            acc = 0.0
            last = C - 1
            if top > 0.0:
                log_top = np.log(top)
                for j in range(C):
                    v = np.float64(widen(row[j]))
                    if v > 0.0:
                        acc += np.exp((np.log(v) - log_top) * inv_temp)
                        last = j
                    cum[j] = acc
            target = u[i] * acc
            a, b = 0, last  # the first j <= last with cum[j] > target (last when none)
            while a < b:
                m = (a + b) // 2
                if cum[m] > target:
                    b = m
                else:
                    a = m + 1
            out[i] = a


def alias_tables(probs: Tensor) -> tuple[Tensor, Tensor]:
    """(R, C) row-stochastic -> (accept (R, C) float64, alias (R, C) int64) on CPU. O(R C)."""
    p = np.ascontiguousarray(probs.detach().double().cpu().numpy())
    p = p / p.sum(axis=1, keepdims=True)
    accept = np.empty_like(p)
    alias = np.empty(p.shape, dtype=np.int64)
    _alias_rows(p, accept, alias)
    return torch.from_numpy(accept), torch.from_numpy(alias)


def chunk_masses(probs: Tensor, width: int, threads: int) -> Tensor:
    """(R, C) float32/float64/bfloat16 on CPU -> (R, ceil(C / width)) float64: each chunk's total of the
    clamped probabilities, read in place (any strides), rows split over `threads` threads. O(R C)."""
    p = (probs.view(torch.uint16) if probs.dtype == torch.bfloat16 else probs).detach().numpy()
    out = np.empty((p.shape[0], -(-p.shape[1] // width)))
    run_ranges(np.full(p.shape[0], 1), threads, lambda lo, hi: _chunk_masses(p, width, lo, hi, out))
    return torch.from_numpy(out)


def tempered_draws(probs: Tensor, rows: Tensor, u: Tensor, temperature: float, threads: int) -> Tensor:
    """Columns (n,) int64 of draws u (n,) float64 in [0, 1) from rows `rows` (n,) of probs (R, C)
    (`CHUNK_MASS_DTYPES`, on CPU, read in place) weighed p^(1/temperature): the inverse CDF of
    `models.sampling.ChunkedCDF` at a temperature other than 1, draws split over `threads` threads. O(n C)."""
    p = (probs.view(torch.uint16) if probs.dtype == torch.bfloat16 else probs).detach().numpy()
    r, x = rows.contiguous().numpy(), u.contiguous().numpy()
    out = np.empty(len(r), dtype=np.int64)
    inv = 1.0 / temperature

    def part(lo: int, hi: int) -> None:
        _tempered_draws(p, r, x, inv, lo, hi, np.empty(p.shape[1]), out)

    if len(r):
        run_ranges(np.full(len(r), 1), threads, part)
    return torch.from_numpy(out)
