"""CPU kernels that PyTorch has no fused op for, compiled with numba (LLVM) on first use.

`maxplus_cpu` is the (max, +) matrix product at the heart of Viterbi: out[b, j] = max_i delta[b, i] +
log_trans[i, j] with argmax. Written as a broadcast in PyTorch it materialises B x K x K candidates and
runs memory-bound (~0.3 G entries/s on 2 cores); this kernel streams `log_trans` once per step, keeps a
(B x block) tile of running maxima in cache and vectorises the inner loop (~5-10x faster).
"""

from __future__ import annotations

import threading

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
    score = viterbi_one(np.ascontiguousarray(log_init.numpy()), e,
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


# ---------------------------------------------------------------------------------------------------------
# Sum-product (scaled forward / backward) on CPU.
#
# A batch step is alpha (B, K) @ trans (K, K). At the sizes served here (K <= 512, tens of sequences) a
# BLAS call per step spends as long in dispatch, threading and the separate emission / normalisation
# passes as in the product itself. These kernels run the whole recursion of a group of ROWS sequences in
# compiled code: each streamed row of `trans` (cache-resident) feeds ROWS x 4 fused multiply-adds, and
# the emission product, normaliser and log of the scale happen in the same sweep. Groups are independent,
# so threads split them with no synchronisation at all (`run_groups`).

ROWS = 4  # sequences per group


if HAVE_NUMBA:
    _FM = {"contract", "reassoc"}  # vectorised reductions; never assumes finite values (-inf is data here)

    @njit(nogil=True, fastmath=_FM, inline="always", cache=True)
    def _rows_matmul(x, mat, out):  # pragma: no cover - compiled
        """out = x @ mat for x, out (ROWS, K), mat (K, K): four source rows per sweep, 16 FMAs per load."""
        K = mat.shape[0]
        x0 = x[0]
        x1 = x[1]
        x2 = x[2]
        x3 = x[3]
        o0 = out[0]
        o1 = out[1]
        o2 = out[2]
        o3 = out[3]
        for j in range(K):
            o0[j] = 0.0
            o1[j] = 0.0
            o2[j] = 0.0
            o3[j] = 0.0
        K4 = K - K % 4
        for i in range(0, K4, 4):
            p0 = mat[i]
            p1 = mat[i + 1]
            p2 = mat[i + 2]
            p3 = mat[i + 3]
            a00, a01, a02, a03 = x0[i], x0[i + 1], x0[i + 2], x0[i + 3]
            a10, a11, a12, a13 = x1[i], x1[i + 1], x1[i + 2], x1[i + 3]
            a20, a21, a22, a23 = x2[i], x2[i + 1], x2[i + 2], x2[i + 3]
            a30, a31, a32, a33 = x3[i], x3[i + 1], x3[i + 2], x3[i + 3]
            for j in range(K):
                q0 = p0[j]
                q1 = p1[j]
                q2 = p2[j]
                q3 = p3[j]
                o0[j] += (a00 * q0 + a01 * q1) + (a02 * q2 + a03 * q3)
                o1[j] += (a10 * q0 + a11 * q1) + (a12 * q2 + a13 * q3)
                o2[j] += (a20 * q0 + a21 * q1) + (a22 * q2 + a23 * q3)
                o3[j] += (a30 * q0 + a31 * q1) + (a32 * q2 + a33 * q3)
        for i in range(K4, K):
            p = mat[i]
            a0, a1, a2, a3 = x0[i], x1[i], x2[i], x3[i]
            for j in range(K):
                q = p[j]
                o0[j] += a0 * q
                o1[j] += a1 * q
                o2[j] += a2 * q
                o3[j] += a3 * q

    @njit(nogil=True, fastmath=_FM, cache=True)
    def rows_matmul(x, mat, out):  # pragma: no cover - compiled
        """out = x @ mat for x, out (N, K), mat (K, K), on the calling thread: ROWS rows at a time."""
        N = x.shape[0]
        N4 = N - N % ROWS
        for i in range(0, N4, ROWS):
            _rows_matmul(x[i : i + ROWS], mat, out[i : i + ROWS])
        for i in range(N4, N):
            _vec_matmul_cols(x[i], mat, out[i], 0, mat.shape[1])

    @njit(nogil=True, fastmath=_FM, inline="always", cache=True)
    def _forward_row(src, e, xr, b, t, lengths, log_cond, alphas, keep, last):  # pragma: no cover - compiled
        """One forward position of sequence b: xr = src * e normalised, log_cond[b, t] = log of the normaliser
        (-inf and xr = 0 from an impossible step on); xr also to alphas[b, t] when `keep` and to last[b] at
        the sequence's last position when `last` has a row per sequence."""
        K = xr.shape[0]
        c = 0.0
        for j in range(K):
            v = src[j] * e[j]
            xr[j] = v
            c += v
        if c > 0.0 and (t == 0 or log_cond[b, t - 1] > -np.inf):
            log_cond[b, t] = np.log(c)
            inv = xr.dtype.type(1.0 / c)
            for j in range(K):
                xr[j] *= inv
        else:  # impossible from here on
            log_cond[b, t] = -np.inf
            xr[:] = 0.0
        if keep:
            alphas[b, t] = xr
        if t == lengths[b] - 1 and last.shape[0] == log_cond.shape[0]:
            last[b] = xr

    @njit(nogil=True, fastmath=_FM, inline="always", cache=True)
    def _backward_row(beta, o, v, e, lc, to_gamma):  # pragma: no cover - compiled
        """One backward position of one sequence, with beta = beta_t: o (the alpha_t row of the output) becomes
        the posterior alpha_t beta_t / sum when `to_gamma` (0 if impossible), else beta_t; v becomes the vector
        for the next step back, emit_t * beta_t / c_t (0 once impossible), in the same sweep."""
        K = beta.shape[0]
        inv_c = v.dtype.type(np.exp(-lc) if lc > -np.inf else 0.0)
        if to_gamma:
            s = 0.0
            for j in range(K):
                bj = beta[j]
                w = o[j] * bj
                o[j] = w
                s += w
                v[j] = e[j] * bj * inv_c
            if s > 0.0:
                inv = o.dtype.type(1.0 / s)
                for j in range(K):
                    o[j] *= inv
            else:
                o[:] = 0.0
        else:
            for j in range(K):
                bj = beta[j]
                o[j] = bj
                v[j] = e[j] * bj * inv_c

    @njit(nogil=True, inline="always", cache=True)
    def _group(g, B, lengths, order):  # pragma: no cover - compiled
        """Group g of ROWS sequences: (first row in `order`, rows in the group, longest length)."""
        g0 = g * ROWS
        n = min(ROWS, B - g0)
        t_max = 0
        for r in range(n):
            t_max = max(t_max, lengths[order[g0 + r]])
        return g0, n, t_max

    @njit(nogil=True, fastmath=_FM, cache=True)
    def forward_groups(init, table, rows, trans, lengths, order, log_cond, alphas, keep, last,  # pragma: no cover
                       first, stride):
        """Scaled forward of groups first, first + stride, ... of ROWS sequences (rows `order[4g:4g+4]`).

        init (B, K); emissions as table (N, K) rows: p(x_t | z_t = k) = table[rows[b, t], k], rows (B, T);
        trans (K, K), lengths (B,) -> log_cond (B, T) float64 (log p(x_t | x_<t); left untouched at padding;
        -inf from an impossible step on) and, when `keep`, the filtered marginals into alphas (B, T, K) (left
        untouched at padding); when last is (B, K), each sequence's filtered marginal at its last position (0
        if impossible). O(B T K^2)."""
        B, T = rows.shape
        K = table.shape[1]
        x = np.zeros((ROWS, K), dtype=table.dtype)
        y = np.zeros((ROWS, K), dtype=table.dtype)
        for g in range(first, (B + ROWS - 1) // ROWS, stride):
            g0, n, t_max = _group(g, B, lengths, order)
            x[:] = 0.0
            for t in range(t_max):
                if t > 0 and n == 1:  # a lone sequence (e.g. one long input): a matrix-vector product
                    _vec_matmul_cols(x[0], trans, y[0], 0, K)
                elif t > 0:
                    _rows_matmul(x, trans, y)
                for r in range(n):
                    b = order[g0 + r]
                    if t < lengths[b]:
                        _forward_row(init[b] if t == 0 else y[r], table[rows[b, t]], x[r], b, t, lengths,
                                     log_cond, alphas, keep, last)

    @njit(nogil=True, fastmath=_FM, cache=True)
    def backward_groups(table, rows, trans_t, lengths, order, log_cond, out, to_gamma,  # pragma: no cover
                        first, stride):
        """Scaled backward matching `forward_groups`' scales, beta_{t-1} = trans @ (emit_t * beta_t / c_t).

        trans_t is trans transposed (contiguous). Without `to_gamma`, out (B, T, K) receives the betas (1 at
        the last position and at padding). With `to_gamma`, out holds the alphas and is overwritten in place
        by the posteriors p(z_t | x) = alpha_t beta_t / sum (0 at padding and for impossible sequences):
        no (B, T, K) beta tensor is ever allocated. Emissions as in `forward_groups`. O(B T K^2)."""
        B, T = rows.shape
        K = table.shape[1]
        x = np.ones((ROWS, K), dtype=table.dtype)
        v = np.zeros((ROWS, K), dtype=table.dtype)
        y = np.zeros((ROWS, K), dtype=table.dtype)
        for g in range(first, (B + ROWS - 1) // ROWS, stride):
            g0, n, t_max = _group(g, B, lengths, order)
            x[:] = 1.0
            v[:] = 0.0
            for t in range(T - 1, -1, -1):
                for r in range(n):
                    b = order[g0 + r]
                    if t >= lengths[b]:
                        out[b, t] = 0.0 if to_gamma else 1.0
                    else:
                        _backward_row(x[r], out[b, t], v[r], table[rows[b, t]], log_cond[b, t], to_gamma)
                if t == 0 or t >= t_max:
                    continue
                if n == 1:
                    _vec_matmul_cols(v[0], trans_t, y[0], 0, K)
                else:
                    _rows_matmul(v, trans_t, y)
                for r in range(n):
                    if t <= lengths[order[g0 + r]] - 1:
                        x[r] = y[r]

    @njit(nogil=True, fastmath=_FM, inline="always", cache=True)
    def _vec_matmul_cols(x, mat, out, j0, j1):  # pragma: no cover - compiled
        """out[j0:j1] = (x @ mat)[j0:j1] for x (K,), mat (K, K): eight source rows per sweep of a row slice
        (a matrix-vector product is bound by streaming `mat`; this keeps the accumulator traffic below it)."""
        K = mat.shape[0]
        o = out[j0:j1]
        o[:] = 0.0
        K8 = K - K % 8
        for i in range(0, K8, 8):
            a0, a1, a2, a3 = x[i], x[i + 1], x[i + 2], x[i + 3]
            a4, a5, a6, a7 = x[i + 4], x[i + 5], x[i + 6], x[i + 7]
            p0 = mat[i, j0:j1]
            p1 = mat[i + 1, j0:j1]
            p2 = mat[i + 2, j0:j1]
            p3 = mat[i + 3, j0:j1]
            p4 = mat[i + 4, j0:j1]
            p5 = mat[i + 5, j0:j1]
            p6 = mat[i + 6, j0:j1]
            p7 = mat[i + 7, j0:j1]
            for j in range(j1 - j0):
                o[j] += ((a0 * p0[j] + a1 * p1[j]) + (a2 * p2[j] + a3 * p3[j])) + (
                    (a4 * p4[j] + a5 * p5[j]) + (a6 * p6[j] + a7 * p7[j]))
        for i in range(K8, K):
            a = x[i]
            p = mat[i, j0:j1]
            for j in range(j1 - j0):
                o[j] += a * p[j]

    @njit(nogil=True, fastmath=_FM, cache=True)
    def forward_one(init, table, rows, trans, log_cond):  # pragma: no cover - compiled
        """Scaled forward of one sequence: init (K,), emissions table[rows[t]] (table (N, K), rows (T,)),
        trans (K, K) -> log_cond (T,) float64. O(T K^2), one pass over `trans` per step and no interpreter
        work between steps."""
        T = rows.shape[0]
        K = table.shape[1]
        alpha = np.empty(K, dtype=table.dtype)
        nxt = np.empty(K, dtype=table.dtype)
        for t in range(T):
            if t > 0:
                _vec_matmul_cols(alpha, trans, nxt, 0, K)
            src = init if t == 0 else nxt
            e = table[rows[t]]
            c = 0.0
            for j in range(K):
                v = src[j] * e[j]
                alpha[j] = v
                c += v
            if not c > 0.0:
                log_cond[t:] = -np.inf
                return
            log_cond[t] = np.log(c)
            inv = alpha.dtype.type(1.0 / c)
            for j in range(K):
                alpha[j] *= inv

    from llvmlite import ir
    from numba.core import cgutils, types
    from numba.core.extending import intrinsic

    @intrinsic
    def _load_acquire(typingctx, arr, idx):  # pragma: no cover - compiled
        """arr[idx] (int64) read with acquire ordering: a spin loop on it is never hoisted or torn."""
        def codegen(context, builder, sig, args):
            ary = context.make_array(sig.args[0])(context, builder, args[0])
            ptr = cgutils.get_item_pointer(context, builder, sig.args[0], ary, [args[1]], wraparound=False)
            return builder.load_atomic(ptr, "acquire", 8)
        return types.int64(arr, idx), codegen

    @intrinsic
    def _store_release(typingctx, arr, idx, val):  # pragma: no cover - compiled
        """arr[idx] = val (int64) with release ordering: every earlier write is visible to an acquirer."""
        def codegen(context, builder, sig, args):
            ary = context.make_array(sig.args[0])(context, builder, args[0])
            ptr = cgutils.get_item_pointer(context, builder, sig.args[0], ary, [args[1]], wraparound=False)
            builder.store_atomic(args[2], ptr, "release", 8)
            return context.get_dummy_value()
        return types.void(arr, idx, val), codegen

    @intrinsic
    def _yield_core(typingctx):  # pragma: no cover - compiled
        """sched_yield(2): let another runnable thread have this core (a call by symbol name, so the
        function stays cacheable, unlike a ctypes pointer)."""
        def codegen(context, builder, sig, args):
            fn = cgutils.get_or_insert_function(builder.module, ir.FunctionType(ir.IntType(32), []), "sched_yield")
            builder.call(fn, [])
            return context.get_dummy_value()
        return types.void(), codegen

    SPINS_BEFORE_YIELD = 2000

    @njit(nogil=True, fastmath=_FM, cache=True)
    def forward_one_split(init, table, rows, trans, log_cond, shared, partial, flags, tid, j0, j1):  # pragma: no cover
        """One of two threads of the scaled forward of one sequence; thread `tid` owns columns [j0, j1).

        Each step a thread multiplies the whole previous alpha by its column slice of `trans` (so each
        thread streams only its half of the matrix, which stays in its own core's cache), publishes its
        slice of the new unnormalised alpha and its partial normaliser, and waits for the other thread's
        (release/acquire step counters; after SPINS_BEFORE_YIELD polls it yields the core). shared (2, K)
        and partial (2, 16) float64 (the two sums 64 bytes apart) are double-buffered by step parity;
        flags (32,) int64 holds the two counters on separate cache lines. Both threads form the same total
        c_t; thread 0 writes log_cond.
        Same result as `forward_one` up to float rounding. O(T K^2 / 2) per thread."""
        T = rows.shape[0]
        K = table.shape[1]
        other = 1 - tid
        nxt = np.zeros(K, dtype=table.dtype)
        inv_prev = 1.0
        for t in range(T):
            buf = shared[t % 2]
            if t > 0:
                _vec_matmul_cols(shared[(t - 1) % 2], trans, nxt, j0, j1)
            scale = buf.dtype.type(inv_prev)
            src = init if t == 0 else nxt
            if t == 0:
                scale = buf.dtype.type(1.0)
            e = table[rows[t]]
            c = 0.0
            for j in range(j0, j1):
                v = src[j] * scale * e[j]
                buf[j] = v
                c += v
            partial[t % 2, tid * 8] = c
            _store_release(flags, tid * 16, t + 1)
            spins = 0
            while _load_acquire(flags, other * 16) < t + 1:
                spins += 1
                if spins >= SPINS_BEFORE_YIELD:
                    _yield_core()
                    spins = 0
            total = partial[t % 2, 0] + partial[t % 2, 8]
            if not total > 0.0:
                if tid == 0:
                    log_cond[t:] = -np.inf
                return
            if tid == 0:
                log_cond[t] = np.log(total)
            inv_prev = 1.0 / total


# -- lockstep kernels: one BLAS GEMM per step --------------------------------------------------------------
# For a batch, each thread advances all of its sequences together (every `threads`-th in length order, so the
# threads' work is balanced and the sequences still running at step t are a prefix of the thread's list).
# A step is one GEMM over those rows, by the BLAS that torch links, run single-threaded on this thread (so
# the threads never wait on each other or on a BLAS thread pool), then the emission product, normaliser and
# log of the scale in one compiled sweep per row. BLAS packs and blocks the GEMM better than any loop here
# (single-threaded MKL runs these (rows x K) x (K x K) steps at 75-100% of a core's peak).


def _torch_blas():
    """The BLAS inside torch's CPU library (MKL in x86 wheels), or None where that library does not export it
    (then the batch kernels above run instead): sgemm, dgemm (Fortran interface), set_local_threads, and
    MKL's packed-matrix float32 API (pack_get_size, pack, compute) or None."""
    import ctypes
    import os

    vp, ci = ctypes.c_void_p, ctypes.c_int
    try:
        lib = ctypes.CDLL(os.path.join(os.path.dirname(torch.__file__), "lib", "libtorch_cpu.so"))
        gemms = [getattr(lib, name) for name in ("sgemm_", "dgemm_")]
        # through PyDLL: an instant call that keeps the GIL (a ctypes call releases it, and in a busy server
        # each reacquisition can wait a whole switch interval)
        local = ctypes.PyDLL(lib._name).MKL_Set_Num_Threads_Local
    except (OSError, AttributeError):
        return None
    for f in gemms:  # Fortran interface: every argument by reference
        f.restype, f.argtypes = None, [vp] * 13
    local.restype, local.argtypes = ci, [ci]
    try:
        size, pack, compute = lib.cblas_sgemm_pack_get_size, lib.cblas_sgemm_pack, lib.cblas_sgemm_compute
    except AttributeError:
        return gemms[0], gemms[1], local, None
    size.restype, size.argtypes = ctypes.c_size_t, [ci] * 4
    pack.restype, pack.argtypes = None, [ci] * 6 + [ctypes.c_float, vp, ci, vp]
    compute.restype, compute.argtypes = None, [ci] * 6 + [vp, ci, vp, ci, ctypes.c_float, vp, ci]
    return gemms[0], gemms[1], local, (size, pack, compute)


_BLAS = _torch_blas() if HAVE_NUMBA else None
HAVE_GEMM = _BLAS is not None


def _address(fn) -> int:
    """The address of a ctypes function (what the lockstep kernels call)."""
    import ctypes

    return ctypes.cast(fn, ctypes.c_void_p).value or 0


LOCKSTEP_MIN_ROWS = 4  # fewer rows per thread than this: use fewer threads (fewer rows in all: ROWS groups)
GROUPS_MAX_K = 512  # = models.chain.COMPILED_MAX_K: beyond it the ROWS groups lose to any GEMM
PACK_MIN_K = 512  # float32 matrices this large are packed once (MKL's gemm_pack, cached) rather than per GEMM
USE_GEMM = True  # switch for tests and benchmarks: False runs the ROWS-group kernels even where GEMM is available


if HAVE_GEMM:

    @intrinsic
    def _fortran_gemm(typingctx, addr, op, dims, coef, a, b, c):  # pragma: no cover - compiled
        """Call the Fortran ?gemm_ at address `addr` (int64): c = op(a) op(b), column-major, transposes op[0]
        and op[1] ('N' or 'T'), (M, N, K, lda, ldb, ldc) = dims, (alpha, beta) = coef. The address is an
        argument, not a constant, so the calling kernels stay in numba's on-disk cache."""
        def codegen(context, builder, sig, args):
            i8p = ir.IntType(8).as_pointer()

            def at(i, k):  # pointer to element k of array argument i
                data = context.make_array(sig.args[i])(context, builder, args[i]).data
                return builder.bitcast(builder.gep(data, [ir.Constant(ir.IntType(64), k)]), i8p)

            argv = [at(1, 0), at(1, 1), at(2, 0), at(2, 1), at(2, 2), at(3, 0), at(4, 0), at(2, 3), at(5, 0),
                    at(2, 4), at(3, 1), at(6, 0), at(2, 5)]
            fn = builder.inttoptr(args[0], ir.FunctionType(ir.VoidType(), [i8p] * 13).as_pointer())
            builder.call(fn, argv)
            return context.get_dummy_value()
        return types.void(addr, op, dims, coef, a, b, c), codegen

    @intrinsic
    def _packed_sgemm(typingctx, addr, m, k, a, packed, c):  # pragma: no cover - compiled
        """Call MKL's cblas_sgemm_compute at address `addr`: c[:m] = a[:m] @ B, row-major float32 with B
        (k x k) packed by cblas_sgemm_pack into `packed`."""
        def codegen(context, builder, sig, args):
            i8p, i32 = ir.IntType(8).as_pointer(), ir.IntType(32)

            def ptr(i):
                return builder.bitcast(context.make_array(sig.args[i])(context, builder, args[i]).data, i8p)

            m32, k32 = builder.trunc(args[1], i32), builder.trunc(args[2], i32)
            row_major, no_trans, packed_b = (ir.Constant(i32, v) for v in (101, 111, 151))
            argv = [row_major, no_trans, packed_b, m32, k32, k32, ptr(3), k32, ptr(4), k32,
                    ir.Constant(ir.FloatType(), 0.0), ptr(5), k32]
            fnty = ir.FunctionType(ir.VoidType(), [i32] * 6 + [i8p, i32, i8p, i32, ir.FloatType(), i8p, i32])
            builder.call(builder.inttoptr(args[0], fnty.as_pointer()), argv)
            return context.get_dummy_value()
        return types.void(addr, m, k, a, packed, c), codegen

    @njit(nogil=True, inline="always", cache=True)
    def _gemm_rows(gemm, compute, packed, x, mat, out, n, dims, coef, op):  # pragma: no cover - compiled
        """out[:n] = x[:n] @ mat, or x[:n] @ mat^T when op[0] is 'T' (row-major; x, out (m, K), mat (K, K));
        gemm, compute: function addresses. With `packed` non-empty, by MKL's gemm_compute on the operand
        packed once; otherwise by Fortran GEMM: in column-major terms out^T = op(mat^T) x^T, as a row-major
        matrix read column-major is its transpose."""
        if packed.shape[0] > 0:
            _packed_sgemm(compute, n, mat.shape[0], x, packed, out)
            return
        dims[1] = n
        _fortran_gemm(gemm, op, dims, coef, mat, x, out)

    @njit(nogil=True, inline="always", cache=True)
    def _lockstep_rows(order, first, stride, K, dtype, transpose):  # pragma: no cover - compiled
        """This thread's sequences order[first::stride] and the GEMM arguments for its (rows x K) x (K x K)
        steps: dims (M, N, K, lda, ldb, ldc), coef (alpha, beta), op (transposes, 'T' / 'N')."""
        mine = order[first::stride]
        dims = np.array([K, mine.shape[0], K, K, K, K], dtype=np.int32)
        coef = np.array([1.0, 0.0], dtype=dtype)
        return mine, dims, coef, np.array([84 if transpose else 78, 78], dtype=np.uint8)

    @njit(nogil=True, fastmath=_FM, cache=True)
    def forward_lockstep(gemm, compute, packed, init, table, rows, trans, lengths, order, log_cond, alphas, keep, last,
                         first, stride):  # pragma: no cover - compiled
        """`forward_groups` for the sequences order[first::stride], advanced together: per step one GEMM over
        the rows still running, then per row the emission product, normaliser and log. Same arguments and
        outputs as `forward_groups`, plus `gemm` (sgemm_/dgemm_ matching the dtype) and, when `packed` is not
        empty, MKL's `compute` on `trans` packed there. O(B T K^2)."""
        K = table.shape[1]
        mine, dims, coef, op = _lockstep_rows(order, first, stride, K, table.dtype, False)
        active = m = mine.shape[0]
        if m == 0:
            return
        x = np.zeros((m, K), dtype=table.dtype)
        y = np.zeros((m, K), dtype=table.dtype)
        for t in range(lengths[mine[0]]):
            while active > 0 and lengths[mine[active - 1]] <= t:
                active -= 1
            if t > 0:
                _gemm_rows(gemm, compute, packed, x, trans, y, active, dims, coef, op)
            for i in range(active):
                b = mine[i]
                _forward_row(init[b] if t == 0 else y[i], table[rows[b, t]], x[i], b, t, lengths, log_cond,
                             alphas, keep, last)

    @njit(nogil=True, fastmath=_FM, cache=True)
    def backward_lockstep(gemm, compute, packed, table, rows, mat, lengths, order, log_cond, out, to_gamma,
                          mat_is_trans, first, stride):  # pragma: no cover - compiled
        """`backward_groups` for the sequences order[first::stride], stepped back together: per step the
        per-row sweep (posterior or beta out, next vector v = emit_t * beta_t / c_t), then one GEMM
        v @ trans^T over the rows that have started. Same arguments and outputs as `backward_groups`, but
        `mat` is trans itself when `mat_is_trans` (no transposed copy; the GEMM transposes), else trans^T;
        plus `gemm`, `compute` and `packed` as in `forward_lockstep` (packed: trans^T). O(B T K^2)."""
        T, K = rows.shape[1], table.shape[1]
        mine, dims, coef, op = _lockstep_rows(order, first, stride, K, table.dtype, mat_is_trans)
        m = mine.shape[0]
        x = np.ones((m, K), dtype=table.dtype)
        v = np.zeros((m, K), dtype=table.dtype)
        active = 0  # rows with t < length: a prefix, growing as t falls
        for t in range(T - 1, -1, -1):
            while active < m and lengths[mine[active]] > t:
                active += 1
            for i in range(active, m):
                out[mine[i], t] = 0.0 if to_gamma else 1.0
            for i in range(active):
                b = mine[i]
                _backward_row(x[i], out[b, t], v[i], table[rows[b, t]], log_cond[b, t], to_gamma)
            if t > 0 and active > 0:
                _gemm_rows(gemm, compute, packed, v, mat, x, active, dims, coef, op)

    @njit(nogil=True, fastmath=_FM, cache=True)
    def posterior_lockstep(gemm, compute, packed, packed_b, init, table, rows, trans, mat_b, lengths, order,
                           log_cond, out, mat_is_trans, first, stride):  # pragma: no cover - compiled
        """`forward_lockstep` keeping the filtered marginals, then `backward_lockstep` turning them into
        posteriors, for the same sequences on the same thread: no meeting between the passes, and the
        thread's marginals are still in its cache for the backward. packed / packed_b: trans / trans^T
        packed (or empty); mat_b: trans (mat_is_trans) or trans^T. O(B T K^2)."""
        no_last = np.empty((0, table.shape[1]), dtype=table.dtype)
        forward_lockstep(gemm, compute, packed, init, table, rows, trans, lengths, order, log_cond, out, True,
                         no_last, first, stride)
        backward_lockstep(gemm, compute, packed_b, table, rows, mat_b, lengths, order, log_cond, out, True,
                          mat_is_trans, first, stride)


def lockstep(B: int, K: int) -> bool:
    """Whether a batch of B sequences over K states runs the lockstep kernels: GEMM available and enabled, and
    enough rows for a GEMM to pay (a few sequences on a cache-sized matrix run faster in the ROWS groups)."""
    return HAVE_GEMM and USE_GEMM and (B >= LOCKSTEP_MIN_ROWS or K > GROUPS_MAX_K)


def _packs(dtype, K: int) -> bool:
    """Whether lockstep calls use MKL's packed matrix (float32, K >= PACK_MIN_K, packed API available)."""
    return (_BLAS is not None and _BLAS[3] is not None and dtype in (np.float32, torch.float32)
            and K >= PACK_MIN_K)


_DERIVED: dict = {}  # (id(trans), kind) -> (weakref to trans, its version counter, derived array)


def _derived(trans: Tensor, kind: str, build) -> np.ndarray:
    """`build()`, an array derived from `trans`, cached while the tensor lives and is not modified in place
    (torch's version counter): a model's matrix is transposed or packed once, not on every call."""
    import weakref

    key = (id(trans), kind)
    hit = _DERIVED.get(key)
    if hit is not None and hit[0]() is trans and hit[1] == trans._version:
        return hit[2]
    value = build()
    _DERIVED[key] = (weakref.ref(trans, lambda _ref: _DERIVED.pop(key, None)), trans._version, value)
    return value


def packed_matrix(trans: Tensor, transpose: bool) -> np.ndarray:
    """trans (K, K) float32 (or trans^T) packed by MKL as the B operand of row-major GEMMs (cached: packing a
    4 MiB matrix costs as much as several steps)."""
    def build() -> np.ndarray:
        assert _BLAS is not None and _BLAS[3] is not None
        size, pack, _ = _BLAS[3]
        K = trans.shape[0]
        mat = _np(trans)
        packed = np.empty(size(162, 32, K, K) // 4 + 16, dtype=np.float32)  # 162: B operand; 32 rows: a hint
        pack(101, 162, 112 if transpose else 111, 32, K, K, 1.0, mat.ctypes.data, K, packed.ctypes.data)
        return packed

    return _derived(trans, f"packed{int(transpose)}", build)


def transposed(trans: Tensor) -> np.ndarray:
    """trans^T as a contiguous array (cached)."""
    return _derived(trans, "T", lambda: np.ascontiguousarray(trans.detach().numpy().T))


def _forward_packed(trans: Tensor) -> np.ndarray | None:
    """trans packed for the forward steps, or None where lockstep calls do not pack."""
    return packed_matrix(trans, False) if _packs(trans.dtype, trans.shape[0]) else None


def _backward_operands(trans: Tensor) -> tuple[np.ndarray | None, np.ndarray, bool]:
    """What the backward steps multiply by: (trans^T packed or None, the matrix, whether it is trans itself).
    Packed: trans^T straight from trans, no transposed copy; otherwise a (cached) transposed copy, which is
    faster than GEMM on 'T' at these sizes."""
    if _packs(trans.dtype, trans.shape[0]):
        return packed_matrix(trans, True), _np(trans), True
    return None, transposed(trans), False


def run_lockstep(kernel, args: tuple, dtype: np.dtype, num_rows: int, threads: int,
                 packed: np.ndarray | None = None) -> None:
    """Run `kernel(gemm, compute, packed, *args, k, threads)` for k < threads (a lockstep kernel over `dtype`
    data: sgemm_ or dgemm_), each thread with BLAS held to one thread of its own; fewer threads when they would
    get under LOCKSTEP_MIN_ROWS rows each. With `packed` (from `packed_matrix`), the steps run MKL's compute
    on it."""
    assert _BLAS is not None
    sgemm, dgemm, local, packing = _BLAS
    threads = max(1, min(threads, num_rows // LOCKSTEP_MIN_ROWS))
    compute = _address(packing[2]) if packing is not None else 0
    if packed is None:
        packed = np.empty(0, dtype=dtype)

    def part(k: int) -> None:
        before = local(1 if threads > 1 else 0)  # one lockstep thread: BLAS may use every torch thread
        try:
            kernel(_address(sgemm if dtype == np.float32 else dgemm), compute, packed, *args, k, threads)
        finally:
            local(before)

    futures = [_pool(threads - 1).submit(part, k) for k in range(1, threads)] if threads > 1 else []
    part(0)
    for f in futures:
        f.result()


_POOL: list = []
_POOL_LOCK = threading.Lock()
SPLIT_MIN_K = 128  # below this a step is too short to amortise two threads meeting every step
SPLIT_MIN_WORK = 1 << 24  # T K^2 above which starting a second thread for one sequence pays off


def _pool(workers: int):
    """A process-wide pool of `workers` helper threads (grown on demand, never shrunk)."""
    from concurrent.futures import ThreadPoolExecutor

    with _POOL_LOCK:
        if not _POOL or _POOL[0]._max_workers < workers:
            _POOL[:] = [ThreadPoolExecutor(max_workers=workers, thread_name_prefix="latentlm-chain")]
        return _POOL[0]


def run_groups(kernel, num_rows: int, args: tuple, threads: int) -> None:
    """Run `kernel(*args, first, stride)` over the ROWS-sequence groups of `num_rows` rows on `threads`
    threads: thread k takes groups k, k + threads, ... (rows sorted by length, so this balances work)."""
    groups = (num_rows + ROWS - 1) // ROWS
    threads = max(1, min(threads, groups))
    if threads == 1:
        kernel(*args, 0, 1)
        return
    futures = [_pool(threads - 1).submit(kernel, *args, k, threads) for k in range(1, threads)]
    kernel(*args, 0, threads)
    for f in futures:
        f.result()


def _np(x: Tensor) -> np.ndarray:
    return np.ascontiguousarray(x.detach().numpy())


def _length_order(lengths: np.ndarray) -> np.ndarray:
    return np.argsort(-lengths, kind="stable")


def emission_rows(table: Tensor, rows: Tensor | None) -> tuple[np.ndarray, np.ndarray]:
    """(table (N, K), rows (B, T) or None) -> contiguous numpy views for the kernels. Without rows the table
    is a dense (B, T, K) emission tensor, seen as B T rows read in order (no copy)."""
    if rows is None:
        B, T, K = table.shape
        return _np(table).reshape(B * T, K), np.arange(B * T, dtype=np.int64).reshape(B, T)
    r = np.ascontiguousarray(rows.numpy(), dtype=np.int64)
    if r.size and (r.min() < 0 or r.max() >= table.shape[0]):  # compiled code does not bounds-check
        raise IndexError(f"emission row index out of range: rows span [{r.min()}, {r.max()}], table has "
                         f"{table.shape[0]} rows")
    return _np(table), r


def forward_cpu(init: Tensor, table: Tensor, rows: Tensor | None, trans: Tensor, lengths: Tensor, *,
                keep_alphas: bool, threads: int, out_last: Tensor | None = None) -> tuple[Tensor, Tensor | None]:
    """Scaled forward on CPU in compiled code: init (B, K), emissions table[rows[b, t]] (table (N, K), rows
    (B, T); or a dense (B, T, K) table with rows None), trans (K, K), lengths (B,) -> log_cond (B, T) in
    the table's dtype (0 at padding) and, with `keep_alphas`, filtered marginals (B, T, K) (0 at padding).
    With `out_last` (B, K), also writes there each sequence's filtered marginal at its last position.
    One sequence runs `forward_one` (split over two threads when large); a batch runs `forward_groups`
    with groups spread over `threads`. O(B T K^2)."""
    e, r = emission_rows(table, rows)
    a, L = _np(trans), lengths.numpy().astype(np.int64)
    B, T = r.shape
    K = e.shape[1]
    log_cond = np.zeros((B, T), dtype=np.float64)
    if B == 1 and not keep_alphas and out_last is None:
        n = int(L[0])
        _forward_one_np(_np(init[0]), e, r[0, :n], a, log_cond[0, :n], threads)
    else:
        # np.empty, not np.zeros: calloc maps fresh zero pages on every call, and first-touch page faults
        # then cost more than the recursion (in a VM, ~20 ms for 13 MB); malloc reuses the freed heap
        alphas = np.empty((B, T, K) if keep_alphas else (1, 1, K), dtype=e.dtype)
        last = np.zeros((B, K) if out_last is not None else (0, K), dtype=e.dtype)
        args = (_np(init), e, r, a, L, _length_order(L), log_cond, alphas, keep_alphas, last)
        if lockstep(B, K):
            run_lockstep(forward_lockstep, args, e.dtype, B, threads, _forward_packed(trans))
        else:
            run_groups(forward_groups, B, args, threads)
        if out_last is not None:
            out_last.copy_(torch.from_numpy(last))
        if keep_alphas:
            for b in np.flatnonzero(L < T):
                alphas[b, L[b]:] = 0.0
    out = torch.from_numpy(log_cond).to(table.dtype)
    return out, (torch.from_numpy(alphas) if keep_alphas else None)


def _forward_one_np(init: np.ndarray, table: np.ndarray, rows: np.ndarray, trans: np.ndarray,
                    log_cond: np.ndarray, threads: int) -> None:
    T, K = rows.shape[0], table.shape[1]
    if threads < 2 or K < SPLIT_MIN_K or T * K * K < SPLIT_MIN_WORK:
        forward_one(init, table, rows, trans, log_cond)
        return
    half = (K // 2 + 15) // 16 * 16  # 64-byte aligned column split
    shared = np.zeros((2, K), dtype=table.dtype)
    partial = np.zeros((2, 16), dtype=np.float64)
    flags = np.zeros(32, dtype=np.int64)
    helper = threading.Thread(target=forward_one_split,
                              args=(init, table, rows, trans, log_cond, shared, partial, flags, 1, half, K))
    helper.start()
    forward_one_split(init, table, rows, trans, log_cond, shared, partial, flags, 0, 0, half)
    helper.join()


def posterior_cpu(init: Tensor, table: Tensor, rows: Tensor | None, trans: Tensor, lengths: Tensor, *,
                  threads: int) -> tuple[Tensor, Tensor]:
    """`forward_cpu` with the filtered marginals and `backward_cpu` into them, fused per thread (lockstep
    kernels only: check `lockstep` first): -> posteriors (B, T, K) (0 at padding) and log_cond (B, T)."""
    e, r = emission_rows(table, rows)
    L = lengths.numpy().astype(np.int64)
    B, T = r.shape
    K = e.shape[1]
    log_cond = np.zeros((B, T), dtype=np.float64)
    gamma = np.empty((B, T, K), dtype=e.dtype)  # every position written: posteriors, 0 at padding
    packed_b, mat_b, mat_is_trans = _backward_operands(trans)
    args = (np.empty(0, dtype=e.dtype) if packed_b is None else packed_b, _np(init), e, r, _np(trans), mat_b, L,
            _length_order(L), log_cond, gamma, mat_is_trans)
    run_lockstep(posterior_lockstep, args, e.dtype, B, threads, _forward_packed(trans))
    return torch.from_numpy(gamma), torch.from_numpy(log_cond).to(table.dtype)


def backward_cpu(table: Tensor, rows: Tensor | None, trans: Tensor, lengths: Tensor, log_cond: Tensor, *,
                 threads: int, alphas: Tensor | None = None) -> Tensor:
    """Scaled backward on CPU in compiled code, with `forward_cpu`'s scales `log_cond` (B, T) and its
    emission arguments.

    Without `alphas`: the betas (B, T, K) (1 at the last position and at padding). With `alphas` (as
    returned by `forward_cpu`): the posteriors p(z_t | x) (B, T, K), written into `alphas` in place (0 at
    padding), so a posterior needs one (B, T, K) tensor, not three. O(B T K^2)."""
    e, r = emission_rows(table, rows)
    B, T = r.shape
    L = lengths.numpy().astype(np.int64)
    lc = np.ascontiguousarray(log_cond.detach().double().numpy())
    out = np.empty((B, T, e.shape[1]), dtype=e.dtype) if alphas is None else alphas.numpy()
    if lockstep(B, trans.shape[0]):
        packed_b, mat_b, mat_is_trans = _backward_operands(trans)
        args = (e, r, mat_b, L, _length_order(L), lc, out, alphas is not None, mat_is_trans)
        run_lockstep(backward_lockstep, args, e.dtype, B, threads, packed_b)
    else:
        run_groups(backward_groups, B, (e, r, transposed(trans), L, _length_order(L), lc, out, alphas is not None),
                   threads)
    return alphas if alphas is not None else torch.from_numpy(out)


_WARM: set = set()


def warm_up(dtype: torch.dtype = torch.float32) -> None:
    """Compile (or load from numba's cache) every CPU kernel for `dtype` on tiny inputs, so that the first
    real request does not pay seconds of JIT. Idempotent per process and dtype; no-op without numba."""
    if not HAVE_NUMBA or dtype in _WARM:
        return
    K, T, B = 8, 5, LOCKSTEP_MIN_ROWS  # B rows: the lockstep kernels; their first 2: the ROWS groups
    g = torch.Generator().manual_seed(0)
    trans = torch.rand(K, K, generator=g, dtype=dtype)
    trans /= trans.sum(1, keepdim=True)
    emit = torch.rand(B, T, K, generator=g, dtype=dtype)
    init = torch.full((B, K), 1.0 / K, dtype=dtype)
    lengths = torch.tensor([T, T - 2] * (B // 2))
    ids = torch.randint(0, T, (B, T), generator=g)
    for table, rows in ((emit, None), (emit[0], ids)):
        for n in (2, B):
            sub = (table if rows is not None else table[:n]), (rows[:n] if rows is not None else None)
            cond, alphas = forward_cpu(init[:n], *sub, trans, lengths[:n], keep_alphas=True, threads=1)
            backward_cpu(*sub, trans, lengths[:n], cond, threads=1)
            backward_cpu(*sub, trans, lengths[:n], cond, threads=1, alphas=alphas)
            if lockstep(n, K):
                posterior_cpu(init[:n], *sub, trans, lengths[:n], threads=1)
        e, r = emission_rows(table, rows)
        out = np.zeros(T)
        forward_one(_np(init[0]), e, r[0], _np(trans), out)
        shared, partial, flags = np.zeros((2, K), dtype=e.dtype), np.zeros((2, 16)), np.zeros(32, np.int64)
        flags[16] = T  # the other thread's step counter reads "finished": thread 0 runs every column alone
        forward_one_split(_np(init[0]), e, r[0], _np(trans), out, shared, partial, flags, 0, 0, K)
        rows_matmul(e[:3], _np(trans), np.empty_like(e[:3]))
    log_trans = trans.log()
    maxplus_cpu(emit[:, 0].log(), log_trans)
    viterbi_one_cpu(init[0].log(), emit[0].log(), log_trans, log_trans.amax(0))
    _WARM.add(dtype)
