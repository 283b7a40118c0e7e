"""Expected counts of a blocked (emission-constrained) HMM in one compiled sweep: forward, backward and the
transition / emission / start counts, reading each step's k x k block of the transition matrix where it
lies (no gathered (B, k, k) copies). This is the training E-step of `blocked_hmm` (the gradient of
log p(x) with respect to each log-potential is its expected count); `models.blocked_hmm.expected_counts`
holds the PyTorch reference and calls this on CPU.
"""

from __future__ import annotations

import numpy as np

from latentlm.models.kernels.jit import BORROWED, FASTMATH, HAVE_NUMBA, njit

BIG = 1e280  # cap of beta and of emit * beta / c: sums of a few products stay finite, so 0 * overflow never
# turns counts into NaN (a capped entry meets alpha * trans below 1e-280 in any count it enters)

if HAVE_NUMBA:

    @njit(nogil=True, fastmath=FASTMATH, inline="always", cache=True)
    def _block_step(prev, trans, cp, cn, out):  # pragma: no cover - compiled
        """out (k,) = prev (k,) @ trans[cp:cp+k, cn:cn+k]: four block rows per sweep over contiguous row
        segments (vectorised fused multiply-adds)."""
        k = out.shape[0]
        for j in range(k):
            out[j] = 0.0
        k4 = k - k % 4
        for i in range(0, k4, 4):
            a0, a1, a2, a3 = prev[i], prev[i + 1], prev[i + 2], prev[i + 3]
            s0 = trans[cp + i, cn : cn + k]
            s1 = trans[cp + i + 1, cn : cn + k]
            s2 = trans[cp + i + 2, cn : cn + k]
            s3 = trans[cp + i + 3, cn : cn + k]
            for j in range(k):
                out[j] += (a0 * s0[j] + a1 * s1[j]) + (a2 * s2[j] + a3 * s3[j])
        for i in range(k4, k):
            a = prev[i]
            seg = trans[cp + i, cn : cn + k]
            for j in range(k):
                out[j] += a * seg[j]

    @njit(nogil=True, fastmath=FASTMATH, inline="always", cache=True)
    def _block_dots(trans, cp, cn, vec, out):  # pragma: no cover - compiled
        """out (k,) = trans[cp:cp+k, cn:cn+k] @ vec (k,): four block rows per sweep, one running sum each."""
        k = out.shape[0]
        k4 = k - k % 4
        for i in range(0, k4, 4):
            s0 = trans[cp + i, cn : cn + k]
            s1 = trans[cp + i + 1, cn : cn + k]
            s2 = trans[cp + i + 2, cn : cn + k]
            s3 = trans[cp + i + 3, cn : cn + k]
            c0 = 0.0
            c1 = 0.0
            c2 = 0.0
            c3 = 0.0
            for j in range(k):
                v = vec[j]
                c0 += s0[j] * v
                c1 += s1[j] * v
                c2 += s2[j] * v
                c3 += s3[j] * v
            out[i], out[i + 1], out[i + 2], out[i + 3] = c0, c1, c2, c3
        for i in range(k4, k):
            seg = trans[cp + i, cn : cn + k]
            c = 0.0
            for j in range(k):
                c += seg[j] * vec[j]
            out[i] = c

    @njit(nogil=True, fastmath=FASTMATH, cache=True)
    def blocked_forward_backward(init, emit, clusters, lengths, trans, log_cond, alphas, gamma, right
                                 ):  # pragma: no cover - compiled
        """Forward-backward of a blocked HMM with k states per cluster (float64 arrays).

        init (B, k): distribution of position 0 within its cluster; emit (B, T, k) emission likelihoods
        (padding ignored); clusters (B, T) int64; lengths (B,) int64; trans (Z, Z). Writes log_cond (B, T)
        (log of each step's scale; padding untouched), alphas (B, T, k) filtered marginals, gamma (B, T, k)
        posteriors and right (B, T, k) = emit_t beta_t / c_t (both 0 at padding), from which the expected
        transition counts are alpha_{t-1} (x) right_t times the step's block. O(B T k^2)."""
        k = emit.shape[2]
        _blocked_forward_backward(init, emit, clusters, lengths, trans, log_cond, alphas, gamma, right, np.empty(k),
                                  np.empty(k))

    @njit(nogil=True, fastmath=FASTMATH, cache=True, **BORROWED)
    def _blocked_forward_backward(init, emit, clusters, lengths, trans, log_cond, alphas, gamma, right, beta,
                                  nxt):  # pragma: no cover - compiled
        """`blocked_forward_backward` with its scratch beta, nxt (k,), without reference counting."""
        B, T, k = emit.shape
        for b in range(B):
            L = lengths[b]
            c = 0.0
            for j in range(k):
                a = init[b, j] * emit[b, 0, j]
                alphas[b, 0, j] = a
                c += a
            log_cond[b, 0] = np.log(c)
            for j in range(k):
                alphas[b, 0, j] /= c
            for t in range(1, L):
                _block_step(alphas[b, t - 1], trans, clusters[b, t - 1] * k, clusters[b, t] * k, nxt)
                c = 0.0
                for j in range(k):
                    v = nxt[j] * emit[b, t, j]
                    alphas[b, t, j] = v
                    c += v
                log_cond[b, t] = np.log(c)
                for j in range(k):
                    alphas[b, t, j] /= c
            for j in range(k):
                beta[j] = 1.0
            for t in range(L - 1, -1, -1):
                s = 0.0
                for j in range(k):
                    g = alphas[b, t, j] * beta[j]
                    gamma[b, t, j] = g
                    s += g
                inv_s = 1.0 / s
                inv_c = np.exp(-log_cond[b, t])
                for j in range(k):
                    gamma[b, t, j] *= inv_s
                    right[b, t, j] = min(emit[b, t, j] * beta[j] * inv_c, BIG)
                if t > 0:
                    _block_dots(trans, clusters[b, t - 1] * k, clusters[b, t] * k, right[b, t], beta)
                    for j in range(k):  # beta of a state the past cannot reach may overflow; it meets alpha = 0
                        beta[j] = min(beta[j], BIG)
            for t in range(L, T):
                for j in range(k):
                    gamma[b, t, j] = 0.0
                    right[b, t, j] = 0.0

    @njit(nogil=True, cache=True)
    def block_counts(alphas, right, clusters, lengths, trans, M, out):  # pragma: no cover - compiled
        """Expected transition counts of `blocked_forward_backward`'s outputs into out (Z, Z) (zeros on
        entry, trans's dtype): for each (cluster, cluster) block the batch steps through, (the sum over
        those steps t >= 1 of alpha_{t-1} (x) right_t, in float64) * the block. Steps are grouped by block
        (a stable sort of the block ids), so each block is written once. O(B T k^2), no (B T, k, k)
        buffer."""
        B, T, k = alphas.shape
        n = 0
        for b in range(B):
            n += max(lengths[b] - 1, 0)
        keys = np.empty(n, dtype=np.int64)
        where = np.empty(n, dtype=np.int64)  # b * T + t
        s = 0
        for b in range(B):
            for t in range(1, lengths[b]):
                keys[s] = clusters[b, t - 1] * M + clusters[b, t]
                where[s] = b * T + t
                s += 1
        order = np.argsort(keys, kind="mergesort")
        acc = np.empty((k, k))
        s = 0
        while s < n:
            pair = keys[order[s]]
            acc[:] = 0.0
            while s < n and keys[order[s]] == pair:
                b, t = divmod(where[order[s]], T)
                for i in range(k):
                    a = alphas[b, t - 1, i]
                    for j in range(k):
                        acc[i, j] += a * right[b, t, j]
                s += 1
            r0, c0 = (pair // M) * k, (pair % M) * k
            for i in range(k):
                for j in range(k):
                    out[r0 + i, c0 + j] = acc[i, j] * trans[r0 + i, c0 + j]
