"""Compiled building blocks of the sum-product kernels: small row-block matrix products and the per-row
sweeps (emission product, normaliser and log of the scale in one pass; the backward's posterior or beta and
next vector in one pass). Inlined into `groups` and `lockstep`."""

from __future__ import annotations

import numpy as np

from latentlm.models.kernels.jit import BORROWED, FASTMATH, HAVE_NUMBA, njit

ROWS = 4  # sequences per group: `matmul4` feeds ROWS x 4 fused multiply-adds from each streamed row


if HAVE_NUMBA:

    @njit(nogil=True, fastmath=FASTMATH, inline="always", cache=True)
    def matmul4(x, mat, out):  # pragma: no cover - compiled
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

    @njit(nogil=True, fastmath=FASTMATH, cache=True, **BORROWED)
    def rows_matmul(x, mat, out):  # pragma: no cover - compiled
        """out = x @ mat for x, out (N, K), mat (K, K), on the calling thread: ROWS rows at a time."""
        N = x.shape[0]
        N4 = N - N % ROWS
        for i in range(0, N4, ROWS):
            matmul4(x[i : i + ROWS], mat, out[i : i + ROWS])
        for i in range(N4, N):
            vec_matmul_cols(x[i], mat, out[i], 0, mat.shape[1])

    @njit(nogil=True, fastmath=FASTMATH, inline="always", cache=True)
    def forward_row(src, e, xr, b, t, lengths, log_cond, alphas, keep, last):  # pragma: no cover - compiled
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
            copy_row(xr, alphas[b, t])
        if t == lengths[b] - 1 and last.shape[0] == log_cond.shape[0]:
            copy_row(xr, last[b])

    @njit(nogil=True, inline="always", cache=True)
    def copy_row(src, dst):  # pragma: no cover - compiled
        """dst[:] = src as a loop (a slice assignment from an array needs numba's runtime; see `jit.BORROWED`)."""
        for j in range(dst.shape[0]):
            dst[j] = src[j]

    @njit(nogil=True, fastmath=FASTMATH, inline="always", cache=True)
    def backward_row(beta, o, v, e, lc, to_gamma):  # pragma: no cover - compiled
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

    @njit(nogil=True, fastmath=FASTMATH, inline="always", cache=True)
    def product_normalised(out, a, b):  # pragma: no cover - compiled
        """out = a * b / sum(a * b) (out may be a or b), 0 where the sum is 0: a posterior from an alpha and a
        beta of any scale (0 for an impossible sequence)."""
        s = 0.0
        for j in range(out.shape[0]):
            w = a[j] * b[j]
            out[j] = w
            s += w
        if s > 0.0:
            inv = out.dtype.type(1.0 / s)
            for j in range(out.shape[0]):
                out[j] *= inv
        else:
            out[:] = 0.0

    @njit(nogil=True, fastmath=FASTMATH, cache=True, **BORROWED)
    def products_normalised(a, b, lo, hi):  # pragma: no cover - compiled
        """a[i] = a[i] * b[i] / sum(a[i] * b[i]) (0 where the sum is 0) for rows lo .. hi - 1 of a, b (N, K):
        posteriors from alphas and betas of any scale, in one pass."""
        for i in range(lo, hi):
            product_normalised(a[i], a[i], b[i])

    @njit(nogil=True, fastmath=FASTMATH, inline="always", cache=True)
    def vec_matmul_cols(x, mat, out, j0, j1):  # pragma: no cover - compiled
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
