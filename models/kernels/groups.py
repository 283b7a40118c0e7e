"""Sum-product recursions run whole in compiled code, with no BLAS: groups of ROWS sequences, and one
sequence alone (optionally split over two threads by columns).

A batch step is alpha (B, K) @ trans (K, K). At the sizes served here (K <= 512, tens of sequences) a
BLAS call per step spends as long in dispatch, threading and the separate emission / normalisation
passes as in the product itself. `forward_groups` / `backward_groups` run the whole recursion of a group of
ROWS sequences in compiled code: each streamed row of `trans` (cache-resident) feeds ROWS x 4 fused
multiply-adds, and the emission product, normaliser and log of the scale happen in the same sweep. Groups
are independent, so threads split them with no synchronisation at all. `forward_one` is the recursion of
one sequence (a matrix-vector product per step); `forward_one_split` the same on two threads that meet
every step.
"""

from __future__ import annotations

import numpy as np

from latentlm.models.kernels.jit import BORROWED, FASTMATH, HAVE_NUMBA, njit
from latentlm.models.kernels.rows import ROWS

if HAVE_NUMBA:
    from latentlm.models.kernels.rows import (
        backward_row,
        copy_row,
        forward_row,
        matmul4,
        product_normalised,
        vec_matmul_cols,
    )
    from latentlm.models.kernels.threads import spin_until, store_release

    @njit(nogil=True, inline="always", cache=True)
    def _group(g, B, lengths, order):  # pragma: no cover - compiled
        """Group g of ROWS sequences: (first row in `order`, rows in the group, longest length)."""
        g0 = g * ROWS
        n = min(ROWS, B - g0)
        t_max = 0
        for r in range(n):
            t_max = max(t_max, lengths[order[g0 + r]])
        return g0, n, t_max

    @njit(nogil=True, fastmath=FASTMATH, cache=True)
    def forward_groups(init, table, rows, trans, lengths, order, log_cond, alphas, keep, last,  # pragma: no cover
                       first, stride):
        """Scaled forward of groups first, first + stride, ... of ROWS sequences (rows `order[4g:4g+4]`).

        init (B, K); emissions as table (N, K) rows: p(x_t | z_t = k) = table[rows[b, t], k], rows (B, T);
        trans (K, K), lengths (B,) -> log_cond (B, T) float64 (log p(x_t | x_<t); left untouched at padding;
        -inf from an impossible step on) and, when `keep`, the filtered marginals into alphas (B, T, K) (left
        untouched at padding); when last is (B, K), each sequence's filtered marginal at its last position (0
        if impossible). O(B T K^2)."""
        K = table.shape[1]
        x = np.zeros((ROWS, K), dtype=table.dtype)
        y = np.zeros((ROWS, K), dtype=table.dtype)
        _forward_groups(init, table, rows, trans, lengths, order, log_cond, alphas, keep, last, first, stride, x, y)

    @njit(nogil=True, fastmath=FASTMATH, cache=True, **BORROWED)
    def _forward_groups(init, table, rows, trans, lengths, order, log_cond, alphas, keep, last,  # pragma: no cover
                        first, stride, x, y):
        """`forward_groups` with its scratch x, y (ROWS, K), without reference counting."""
        B = rows.shape[0]
        for g in range(first, (B + ROWS - 1) // ROWS, stride):
            g0, n, t_max = _group(g, B, lengths, order)
            x[:] = 0.0
            for t in range(t_max):
                if t > 0 and n == 1:  # a lone sequence (e.g. one long input): a matrix-vector product
                    vec_matmul_cols(x[0], trans, y[0], 0, trans.shape[1])
                elif t > 0:
                    matmul4(x, trans, y)
                for r in range(n):
                    b = order[g0 + r]
                    if t < lengths[b]:
                        forward_row(init[b] if t == 0 else y[r], table[rows[b, t]], x[r], b, t, lengths,
                                    log_cond, alphas, keep, last)

    @njit(nogil=True, fastmath=FASTMATH, cache=True)
    def backward_groups(table, rows, trans_t, lengths, order, log_cond, out, to_gamma,  # pragma: no cover
                        first, stride):
        """Scaled backward matching `forward_groups`' scales, beta_{t-1} = trans @ (emit_t * beta_t / c_t).

        trans_t is trans transposed (contiguous). Without `to_gamma`, out (B, T, K) receives the betas (1 at
        the last position and at padding). With `to_gamma`, out holds the alphas and is overwritten in place
        by the posteriors p(z_t | x) = alpha_t beta_t / sum (0 at padding and for impossible sequences):
        no (B, T, K) beta tensor is ever allocated. Emissions as in `forward_groups`. O(B T K^2)."""
        K = table.shape[1]
        x = np.ones((ROWS, K), dtype=table.dtype)
        v = np.zeros((ROWS, K), dtype=table.dtype)
        y = np.zeros((ROWS, K), dtype=table.dtype)
        _backward_groups(table, rows, trans_t, lengths, order, log_cond, out, to_gamma, first, stride, x, v, y)

    @njit(nogil=True, fastmath=FASTMATH, cache=True, **BORROWED)
    def _backward_groups(table, rows, trans_t, lengths, order, log_cond, out, to_gamma,  # pragma: no cover
                         first, stride, x, v, y):
        """`backward_groups` with its scratch x, v, y (ROWS, K), without reference counting."""
        B, T = rows.shape
        for g in range(first, (B + ROWS - 1) // ROWS, stride):
            g0, n, t_max = _group(g, B, lengths, order)
            x[:] = 1.0
            v[:] = 0.0
            for t in range(T - 1, -1, -1):
                for r in range(n):
                    b = order[g0 + r]
                    if t >= lengths[b]:
                        out[b, t, :] = 0.0 if to_gamma else 1.0
                    else:
                        backward_row(x[r], out[b, t], v[r], table[rows[b, t]], log_cond[b, t], to_gamma)
                if t == 0 or t >= t_max:
                    continue
                if n == 1:
                    vec_matmul_cols(v[0], trans_t, y[0], 0, trans_t.shape[1])
                else:
                    matmul4(v, trans_t, y)
                for r in range(n):
                    if t <= lengths[order[g0 + r]] - 1:
                        copy_row(y[r], x[r])

    @njit(nogil=True, fastmath=FASTMATH, cache=True)
    def forward_one(init, table, rows, trans, log_cond):  # pragma: no cover - compiled
        """Scaled forward of one sequence: init (K,), emissions table[rows[t]] (table (N, K), rows (T,)),
        trans (K, K) -> log_cond (T,) float64. O(T K^2), one pass over `trans` per step and no interpreter
        work between steps."""
        K = table.shape[1]
        _forward_one(init, table, rows, trans, log_cond, np.empty(K, dtype=table.dtype), np.empty(K, dtype=table.dtype))

    @njit(nogil=True, fastmath=FASTMATH, cache=True, **BORROWED)
    def _forward_one(init, table, rows, trans, log_cond, alpha, nxt):  # pragma: no cover - compiled
        """`forward_one` with its scratch alpha, nxt (K,), without reference counting."""
        T = rows.shape[0]
        K = table.shape[1]
        for t in range(T):
            if t > 0:
                vec_matmul_cols(alpha, trans, nxt, 0, K)
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

    @njit(nogil=True, fastmath=FASTMATH, cache=True)
    def forward_one_split(init, table, rows, trans, log_cond, shared, partial, flags, tid, j0, j1):  # pragma: no cover
        """One of two threads of the scaled forward of one sequence; thread `tid` owns columns [j0, j1).

        Each step a thread multiplies the whole previous alpha by its column slice of `trans` (so each
        thread streams only its half of the matrix, which stays in its own core's cache), publishes its
        slice of the new unnormalised alpha and its partial normaliser, and waits for the other thread's
        (release/acquire step counters, `threads.spin_until`). shared (2, K)
        and partial (2, 16) float64 (the two sums 64 bytes apart) are double-buffered by step parity;
        flags (32,) int64 holds the two counters on separate cache lines. Both threads form the same total
        c_t; thread 0 writes log_cond.
        Same result as `forward_one` up to float rounding. O(T K^2 / 2) per thread."""
        _forward_one_split(init, table, rows, trans, log_cond, shared, partial, flags, tid, j0, j1,
                           np.zeros(table.shape[1], dtype=table.dtype))

    @njit(nogil=True, fastmath=FASTMATH, cache=True, **BORROWED)
    def _forward_one_split(init, table, rows, trans, log_cond, shared, partial, flags, tid, j0, j1,  # pragma: no cover
                           nxt):
        """`forward_one_split` with its scratch nxt (K,), without reference counting."""
        T = rows.shape[0]
        other = 1 - tid
        inv_prev = 1.0
        for t in range(T):
            buf = shared[t % 2]
            if t > 0:
                vec_matmul_cols(shared[(t - 1) % 2], trans, nxt, j0, j1)
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
            store_release(flags, tid * 16, t + 1)
            spin_until(flags, other * 16, t + 1)
            total = partial[t % 2, 0] + partial[t % 2, 8]
            if not total > 0.0:
                if tid == 0:
                    log_cond[t:] = -np.inf
                return
            if tid == 0:
                log_cond[t] = np.log(total)
            inv_prev = 1.0 / total

    @njit(nogil=True, fastmath=FASTMATH, cache=True)
    def halves_forward(init, table, rows, trans, t0, t1, combine, log_cond, gamma, x, y):  # pragma: no cover
        """Forward steps t0 .. t1 - 1 of one sequence for the meet-in-the-middle posterior (`halves_backward`
        is the other thread). rows (T,) index table (N, K); x (K,) holds alpha_{t0 - 1} on entry (unused when
        t0 = 0) and alpha_{t1 - 1} on exit, normalised; y (K,) is scratch; log_cond (1, T) float64 gets log c_t
        (-inf from an impossible step on). Without `combine` (the first half) alpha_t goes to gamma[0, t]
        (gamma (1, T, K)); with it gamma[0, t] already holds a beta_t (any scale) and becomes alpha_t beta_t /
        sum, the posterior (0 for an impossible sequence). O((t1 - t0) K^2)."""
        _halves_forward(init, table, rows, trans, t0, t1, combine, log_cond, gamma, x, y,
                        np.full(1, rows.shape[0], dtype=np.int64), np.empty((0, table.shape[1]), dtype=table.dtype))

    @njit(nogil=True, fastmath=FASTMATH, cache=True, **BORROWED)
    def _halves_forward(init, table, rows, trans, t0, t1, combine, log_cond, gamma, x, y, lengths,  # pragma: no cover
                        no_last):
        """`halves_forward` with `forward_row`'s lengths (1,) and an empty `last`, without reference counting."""
        K = table.shape[1]
        for t in range(t0, t1):
            if t > 0:
                vec_matmul_cols(x, trans, y, 0, K)
            forward_row(init if t == 0 else y, table[rows[t]], x, 0, t, lengths, log_cond, gamma, not combine,
                        no_last)
            if combine:
                product_normalised(gamma[0, t], x, gamma[0, t])

    @njit(nogil=True, fastmath=FASTMATH, cache=True, **BORROWED)
    def halves_backward(table, rows, trans_t, t0, t1, combine, gamma, beta, v, y):  # pragma: no cover
        """Backward steps t1 - 1 down to t0 of one sequence of T positions for the meet-in-the-middle posterior
        (`halves_forward` is the other thread): beta_{t-1} = trans @ (emit_t * beta_t), each normalised to sum
        1 by its own total (the posterior does not depend on the betas' scale, so this thread never waits for
        the forward's scales). trans_t is trans transposed (contiguous); beta (K,) holds beta_{t1 - 1} on entry
        (ones at the last position) and beta_{t0 - 1} on exit (when t0 > 0); v, y (K,) scratch. Without
        `combine` (the second half) beta_t goes to gamma[0, t]; with it gamma[0, t] holds alpha_t and becomes
        the posterior as in `halves_forward`. O((t1 - t0) K^2)."""
        K = table.shape[1]
        for t in range(t1 - 1, t0 - 1, -1):
            if combine:
                product_normalised(gamma[0, t], gamma[0, t], beta)
            else:
                copy_row(beta, gamma[0, t])
            if t == 0:
                break
            e = table[rows[t]]
            for j in range(K):
                v[j] = e[j] * beta[j]
            vec_matmul_cols(v, trans_t, y, 0, K)
            c = 0.0
            for j in range(K):
                c += y[j]
            if c > 0.0:
                inv = y.dtype.type(1.0 / c)
                for j in range(K):
                    beta[j] = y[j] * inv
            else:
                beta[:] = 0.0
