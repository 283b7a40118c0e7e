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

    @njit(nogil=True)
    def viterbi_one(log_init, log_emit, log_trans, col_max, back, path):
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
                serial(delta, log_trans, col_max, order, val, back[t : t + 1])
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

    @njit(nogil=True, fastmath={"contract", "reassoc"})
    def forward_one(init, emit, trans, log_scales):
        """Scaled forward of one sequence: init (K,), emit (T, K), trans (K, K) -> log_scales (T,) float64.
        alpha_t = (alpha_{t-1} @ trans) * emit_t, renormalised every step; the row update vectorises."""
        T, K = emit.shape
        alpha = init * emit[0]
        nxt = np.empty_like(alpha)
        for t in range(T):
            if t > 0:
                nxt[:] = 0.0
                for i in range(K):
                    a = alpha[i]
                    if a != 0.0:
                        row = trans[i]
                        for j in range(K):
                            nxt[j] += a * row[j]
                for j in range(K):
                    alpha[j] = nxt[j] * emit[t, j]
            c = 0.0
            for j in range(K):
                c += alpha[j]
            log_scales[t] = np.log(c) if c > 0 else -np.inf
            if c > 0:
                inv = 1.0 / c
                for j in range(K):
                    alpha[j] *= inv
            else:
                for t2 in range(t + 1, T):
                    log_scales[t2] = -np.inf
                break

    return serial, viterbi_one, forward_one


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
    _kernels(d.dtype)[0](d, a, cm, order, val, arg)
    return torch.from_numpy(val), torch.from_numpy(arg).long()


def forward_one_cpu(init: Tensor, emit: Tensor, trans: Tensor) -> Tensor:
    """log p(x_t | x_<t) (T,) of one sequence: init (K,), emit (T, K), trans (K, K). O(T K^2), no per-step
    interpreter work (a long sequence on CPU is otherwise dominated by per-step dispatch)."""
    e = np.ascontiguousarray(emit.detach().numpy())
    out = np.empty(e.shape[0], dtype=np.float64)
    _kernels(e.dtype)[2](np.ascontiguousarray(init.numpy()), e, np.ascontiguousarray(trans.numpy()), out)
    return torch.from_numpy(out).to(emit.dtype)


def viterbi_one_cpu(log_init: Tensor, log_emit: Tensor, log_trans: Tensor, col_max: Tensor) -> tuple[Tensor, float]:
    """Viterbi of one sequence: log_init (K,), log_emit (T, K), log_trans (K, K) -> (path (T,), log-prob).
    Same recursion, pruning and re-centring as `models.chain.viterbi`, without per-step Python. O(T K^2)."""
    e = np.ascontiguousarray(log_emit.detach().numpy())
    back = np.empty_like(e)
    path = np.empty(e.shape[0], dtype=np.int64)
    score = _kernels(e.dtype)[1](np.ascontiguousarray(log_init.numpy()), e,
                                 np.ascontiguousarray(log_trans.numpy()), np.ascontiguousarray(col_max.numpy()),
                                 back, path)
    return torch.from_numpy(path), float(score)


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
