"""The (max, +) product and the single-sequence Viterbi recursion on CPU (numba).

`maxplus_cpu` is the (max, +) matrix product at the heart of Viterbi: out[b, j] = max_i delta[b, i] +
log_trans[i, j] with argmax. Written as a broadcast in PyTorch it materialises B x K x K candidates and
runs memory-bound (~0.3 G entries/s on 2 cores); this kernel streams `log_trans` once per step, keeps a
(B x block) tile of running maxima in cache and vectorises the inner loop (~5-10x faster).
`viterbi_one_cpu` runs the whole recursion of one sequence in compiled code.
"""

from __future__ import annotations

import numpy as np
import torch
from torch import Tensor

from latentlm.models.kernels.jit import HAVE_NUMBA, njit

BLOCK = 256  # columns per task: a block of running maxima and argmaxes stays in L1
CHECK_EVERY = 16  # sources between pruning checks


if HAVE_NUMBA:

    @njit(nogil=True, inline="always", cache=True)
    def _maxplus_task(delta, log_trans, col_max, order, out_val, out_arg, task, n_blocks):  # pragma: no cover
        """One (row b, column block) task of the (max, +) product. The argmax is kept in the value's float
        type so the compare/select pairs vectorise (exact for K < 2**24)."""
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
            fi = arg.dtype.type(i)
            for j in range(j1 - j0):
                v = di + row[j]
                better = v > best[j]
                best[j] = v if better else best[j]
                arg[j] = fi if better else arg[j]

    @njit(nogil=True, cache=True)
    def maxplus_serial(delta, log_trans, col_max, order, out_val, out_arg):  # pragma: no cover - compiled
        """(max, +) product of every row, single-threaded (numba's thread pool costs milliseconds per call
        on a busy 2-core machine, more than the work itself)."""
        n_blocks = (delta.shape[1] + BLOCK - 1) // BLOCK
        for task in range(delta.shape[0] * n_blocks):
            _maxplus_task(delta, log_trans, col_max, order, out_val, out_arg, task, n_blocks)

    @njit(nogil=True, cache=True)
    def viterbi_one(log_init, log_emit, log_trans, col_max, back, path):  # pragma: no cover - compiled
        """Whole Viterbi recursion of one sequence in compiled code (no per-step interpreter work):
        log_init (K,), log_emit (T, K), back (T, K) scratch, path (T,) out. Returns the float64 score."""
        T, K = log_emit.shape
        delta = np.empty((1, K), dtype=log_emit.dtype)
        val = np.empty((1, K), dtype=log_emit.dtype)
        order = np.empty((1, K), dtype=np.int64)
        offset = 0.0
        for t in range(T):
            if t == 0:
                for j in range(K):
                    delta[0, j] = log_init[j] + log_emit[0, j]
            else:
                order[0, :] = np.argsort(-delta[0], kind="mergesort")
                maxplus_serial(delta, log_trans, col_max, order, val, back[t : t + 1])
                for j in range(K):
                    delta[0, j] = val[0, j] + log_emit[t, j]
            top = delta[0].max()
            if np.isfinite(top):  # re-centre; the offset carries the scale in float64
                for j in range(K):
                    delta[0, j] -= top
                offset += top
        state = int(np.argmax(delta[0]))
        best = offset + delta[0, state]
        path[T - 1] = state
        for t in range(T - 1, 0, -1):
            state = int(back[t, state])
            path[t - 1] = state
        return best


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
    maxplus_serial(d, a, cm, order, val, arg)
    return torch.from_numpy(val), torch.from_numpy(arg).long()


def viterbi_one_cpu(log_init: Tensor, log_emit: Tensor, log_trans: Tensor, col_max: Tensor) -> tuple[Tensor, float]:
    """Viterbi of one sequence: log_init (K,), log_emit (T, K), log_trans (K, K) -> (path (T,), log-prob).
    Same recursion, pruning and re-centring as `models.chain.viterbi`, without per-step Python. O(T K^2)."""
    e = np.ascontiguousarray(log_emit.detach().numpy())
    back = np.empty_like(e)
    path = np.empty(e.shape[0], dtype=np.int64)
    score = viterbi_one(np.ascontiguousarray(log_init.numpy()), e, np.ascontiguousarray(log_trans.numpy()),
                        np.ascontiguousarray(col_max.numpy()), back, path)
    return torch.from_numpy(path), float(score)
