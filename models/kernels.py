"""CPU kernels that PyTorch has no fused op for, compiled with numba (LLVM) on first use.

`maxplus_cpu` is the (max, +) matrix product at the heart of Viterbi: out[b, j] = max_i delta[b, i] +
log_trans[i, j] with argmax. Written as a broadcast in PyTorch it materialises B x K x K candidates and
runs memory-bound (~0.3 G entries/s on 2 cores); this kernel streams `log_trans` once per step, keeps a
(B x block) tile of running maxima in cache and vectorises the inner loop (~5-10x faster).
"""

from __future__ import annotations

import numpy as np
import torch
from torch import Tensor

try:  # numba is a hard dependency, but keep the engine usable if its LLVM build is unavailable
    from numba import njit

    HAVE_NUMBA = True
except ImportError:  # pragma: no cover
    HAVE_NUMBA = False

BLOCK = 256  # columns per task: a block of running maxima and argmaxes stays in L1
CHECK_EVERY = 16  # sources between pruning checks


def _make_kernels(scalar):  # pragma: no cover - compiled
    """The (max, +) kernel for one float type (single-threaded: numba's thread pool costs milliseconds
    per call on a busy 2-core machine, more than the work itself). Each task is a (row b, column block)
    pair; the argmax is kept in the value's float type so the compare/select pairs vectorise (exact for
    K < 2**24)."""

    def body(delta, log_trans, col_max, order, out_val, out_arg, task, n_blocks):
        K = delta.shape[1]
        b = task // n_blocks
        j0 = (task % n_blocks) * BLOCK
        j1 = min(K, j0 + BLOCK)
        best = out_val[b, j0:j1]  # 1-D views: LLVM vectorises these loops, not the 2-D indexing
        arg = out_arg[b, j0:j1]
        cmax = col_max[j0:j1]
        best[:] = -np.inf
        arg[:] = 0
        for n in range(K):
            i = order[b, n]
            di = delta[b, i]
            if n % CHECK_EVERY == 0:
                # sources come in decreasing delta: once delta_i + max_i' log_trans[i', j] cannot beat
                # the current best of any column j, no remaining source can (exact pruning)
                done = True
                for j in range(j1 - j0):
                    if di + cmax[j] > best[j]:
                        done = False
                        break
                if done:
                    break
            row = log_trans[i, j0:j1]
            fi = scalar(i)
            for j in range(j1 - j0):
                v = di + row[j]
                better = v > best[j]
                best[j] = v if better else best[j]
                arg[j] = fi if better else arg[j]

    jbody = njit(nogil=True, inline="always")(body)

    @njit(nogil=True)
    def serial(delta, log_trans, col_max, order, out_val, out_arg):
        n_blocks = (delta.shape[1] + BLOCK - 1) // BLOCK
        for task in range(delta.shape[0] * n_blocks):
            jbody(delta, log_trans, col_max, order, out_val, out_arg, task, n_blocks)

    return serial


_KERNELS: dict = {}


def _kernels(dtype: np.dtype):
    if dtype not in _KERNELS:
        _KERNELS[dtype] = _make_kernels(np.float32 if dtype == np.float32 else np.float64)
    return _KERNELS[dtype]


def maxplus_cpu(delta: Tensor, log_trans: Tensor, col_max: Tensor | None = None) -> tuple[Tensor, Tensor]:
    """(B, K) x (K, K) -> values (B, K), argmax (B, K) int64; CPU float32/float64. O(B K^2) worst case.

    Sources are visited in decreasing delta and a column block stops as soon as the bound
    delta_i + col_max[j] (col_max = log_trans.max(0)) cannot improve any of its columns: exact, and
    typically 3-10x less work. Among tied sources the one with the larger delta wins."""
    d = np.ascontiguousarray(delta.detach().numpy())
    a = np.ascontiguousarray(log_trans.detach().numpy())
    cm = a.max(axis=0) if col_max is None else np.ascontiguousarray(col_max.numpy())
    order = np.argsort(-d, axis=1, kind="stable")
    val = np.empty_like(d)
    arg = np.empty_like(d)
    _kernels(d.dtype)(d, a, cm, order, val, arg)
    return torch.from_numpy(val), torch.from_numpy(arg).long()


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
