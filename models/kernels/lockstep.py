"""Lockstep sum-product kernels: one BLAS GEMM per step.

For a batch, each thread advances all of its sequences together (every `threads`-th in length order, so the
threads' work is balanced and the sequences still running at step t are a prefix of the thread's list).
A step is one GEMM over those rows, by the BLAS chosen for the call (`blas.gemm_rows`: MKL or OpenBLAS), run
single-threaded on this thread (so the threads never wait on each other or on a BLAS thread pool), then the
emission product, normaliser and log of the scale in one compiled sweep per row. BLAS packs and blocks the
GEMM better than any loop here (single-threaded MKL runs these (rows x K) x (K x K) steps at 75-100% of a core's peak).
Defined only where a BLAS is callable (`blas.HAVE_GEMM`).
"""

from __future__ import annotations

import numpy as np

from latentlm.models.kernels.blas import HAVE_GEMM
from latentlm.models.kernels.jit import BORROWED, FASTMATH, njit

if HAVE_GEMM:
    from latentlm.models.kernels.blas import gemm_rows
    from latentlm.models.kernels.rows import backward_row, forward_row

    @njit(nogil=True, inline="always", cache=True)
    def _lockstep_rows(order, first, stride, K, dtype, transpose, ints):  # pragma: no cover - compiled
        """This thread's sequences order[first::stride] and the GEMM arguments for its (rows x K) x (K x K)
        steps: dims (M, N, K, lda, ldb, ldc) in the integer width of `ints` (the BLAS's: 32 or 64 bits),
        coef (alpha, beta), op (transposes, 'T' / 'N')."""
        mine = order[first::stride]
        dims = ints.copy()
        dims[:] = K
        dims[1] = mine.shape[0]
        coef = np.array([1.0, 0.0], dtype=dtype)
        return mine, dims, coef, np.array([84 if transpose else 78, 78], dtype=np.uint8)

    @njit(nogil=True, fastmath=FASTMATH, cache=True)
    def forward_lockstep(gemm, compute, packed, ints, init, table, rows, trans, lengths, order, log_cond, alphas, keep,
                         last, first, stride):  # pragma: no cover - compiled
        """`forward_groups` for the sequences order[first::stride], advanced together: per step one GEMM over
        the rows still running, then per row the emission product, normaliser and log. Same arguments and
        outputs as `forward_groups`, plus `gemm` (sgemm/dgemm matching the dtype, `ints` its integer width)
        and, when `packed` is not empty, MKL's `compute` on `trans` packed there. O(B T K^2)."""
        K = table.shape[1]
        mine, dims, coef, op = _lockstep_rows(order, first, stride, K, table.dtype, False, ints)
        m = mine.shape[0]
        if m == 0:
            return
        x, y = np.zeros((m, K), dtype=table.dtype), np.zeros((m, K), dtype=table.dtype)
        _forward_lockstep(gemm, compute, packed, init, table, rows, trans, lengths, log_cond, alphas, keep, last,
                          mine, dims, coef, op, x, y)

    @njit(nogil=True, fastmath=FASTMATH, cache=True, **BORROWED)
    def _forward_lockstep(gemm, compute, packed, init, table, rows, trans, lengths, log_cond, alphas, keep, last,
                          mine, dims, coef, op, x, y):  # pragma: no cover - compiled
        """`forward_lockstep` for its rows `mine` (non-empty), GEMM arguments and scratch x, y (m, K), without
        reference counting."""
        active = mine.shape[0]
        for t in range(lengths[mine[0]]):
            while active > 0 and lengths[mine[active - 1]] <= t:
                active -= 1
            if t > 0:
                gemm_rows(gemm, compute, packed, x, trans, y, active, dims, coef, op)
            for i in range(active):
                b = mine[i]
                forward_row(init[b] if t == 0 else y[i], table[rows[b, t]], x[i], b, t, lengths, log_cond,
                            alphas, keep, last)

    @njit(nogil=True, fastmath=FASTMATH, cache=True)
    def backward_lockstep(gemm, compute, packed, ints, table, rows, mat, lengths, order, log_cond, out, to_gamma,
                          mat_is_trans, first, stride):  # pragma: no cover - compiled
        """`backward_groups` for the sequences order[first::stride], stepped back together: per step the
        per-row sweep (posterior or beta out, next vector v = emit_t * beta_t / c_t), then one GEMM
        v @ trans^T over the rows that have started. Same arguments and outputs as `backward_groups`, but
        `mat` is trans itself when `mat_is_trans` (no transposed copy; the GEMM transposes), else trans^T;
        plus `gemm`, `compute` and `packed` as in `forward_lockstep` (packed: trans^T). O(B T K^2)."""
        K = table.shape[1]
        mine, dims, coef, op = _lockstep_rows(order, first, stride, K, table.dtype, mat_is_trans, ints)
        m = mine.shape[0]
        _backward_lockstep(gemm, compute, packed, table, rows, mat, lengths, log_cond, out, to_gamma, mine, dims, coef,
                           op, np.ones((m, K), dtype=table.dtype), np.zeros((m, K), dtype=table.dtype))

    @njit(nogil=True, fastmath=FASTMATH, cache=True, **BORROWED)
    def _backward_lockstep(gemm, compute, packed, table, rows, mat, lengths, log_cond, out, to_gamma, mine, dims, coef,
                           op, x, v):  # pragma: no cover - compiled
        """`backward_lockstep` for its rows `mine`, GEMM arguments and scratch x, v (m, K), without reference
        counting."""
        T = rows.shape[1]
        m = mine.shape[0]
        active = 0  # rows with t < length: a prefix, growing as t falls
        for t in range(T - 1, -1, -1):
            while active < m and lengths[mine[active]] > t:
                active += 1
            for i in range(active, m):
                out[mine[i], t, :] = 0.0 if to_gamma else 1.0
            for i in range(active):
                b = mine[i]
                backward_row(x[i], out[b, t], v[i], table[rows[b, t]], log_cond[b, t], to_gamma)
            if t > 0 and active > 0:
                gemm_rows(gemm, compute, packed, v, mat, x, active, dims, coef, op)

    @njit(nogil=True, fastmath=FASTMATH, cache=True)
    def posterior_lockstep(gemm, compute, packed, ints, packed_b, init, table, rows, trans, mat_b, lengths, order,
                           log_cond, out, mat_is_trans, first, stride):  # pragma: no cover - compiled
        """`forward_lockstep` keeping the filtered marginals, then `backward_lockstep` turning them into
        posteriors, for the same sequences on the same thread: no meeting between the passes, and the
        thread's marginals are still in its cache for the backward. packed / packed_b: trans / trans^T
        packed (or empty); mat_b: trans (mat_is_trans) or trans^T. O(B T K^2)."""
        no_last = np.empty((0, table.shape[1]), dtype=table.dtype)
        forward_lockstep(gemm, compute, packed, ints, init, table, rows, trans, lengths, order, log_cond, out, True,
                         no_last, first, stride)
        backward_lockstep(gemm, compute, packed_b, ints, table, rows, mat_b, lengths, order, log_cond, out, True,
                          mat_is_trans, first, stride)
