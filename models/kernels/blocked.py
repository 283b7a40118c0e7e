"""Compiled sweeps of a blocked (emission-constrained) HMM, reading each step's k x k block of the
transition matrix where it lies (no gathered (B, k, k) copies):

* `blocked_score`: the scaled forward, log p(x_t | x_<t) and optionally the last filtered marginal:
  `BlockedHMM.score` and `.filtered_last` on CPU (the service's scoring, training's validation);
* `blocked_viterbi`: the max-product and its backtrace: `BlockedHMM.viterbi` on CPU;
* `blocked_forward_backward` and `block_counts`: forward, backward and the transition / emission / start
  counts: the training E-step of `blocked_hmm` (the gradient of log p(x) with respect to each log-potential
  is its expected count) and `BlockedHMM.posterior` on CPU. `models.blocked_hmm.expected_counts` holds the
  PyTorch reference.
"""

from __future__ import annotations

import numpy as np
import torch
from torch import Tensor

from latentlm.models.kernels.blas import as_array
from latentlm.models.kernels.jit import BORROWED, FASTMATH, HAVE_NUMBA, njit, widen
from latentlm.models.kernels.threads import run_ranges, run_split

VITERBI_FLOOR = 1e-250  # `blocked_viterbi`: a state's max-product below this share of the step's best is 0
BIG = 1e280  # cap of beta and of emit * beta / c: sums of a few products stay finite, so 0 * overflow never
# turns counts into NaN (a capped entry meets alpha * trans below 1e-280 in any count it enters)

if HAVE_NUMBA:

    @njit(nogil=True, fastmath=FASTMATH, inline="always", cache=True)
    def _block_step(prev, trans, cp, cn, out):  # pragma: no cover - compiled
        """out (k,) = prev (k,) @ trans[cp:cp+k, cn:cn+k]: four block rows per sweep over contiguous row
        segments (vectorised fused multiply-adds). `trans` float32/float64, or bfloat16 bits (uint16: widened
        to float32 as they are read, `jit.widen`)."""
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
                out[j] += (a0 * widen(s0[j]) + a1 * widen(s1[j])) + (a2 * widen(s2[j]) + a3 * widen(s3[j]))
        for i in range(k4, k):
            a = prev[i]
            seg = trans[cp + i, cn : cn + k]
            for j in range(k):
                out[j] += a * widen(seg[j])

    @njit(nogil=True, fastmath=FASTMATH, inline="always", cache=True)
    def _block_dots(trans, cp, cn, vec, out):  # pragma: no cover - compiled
        """out (k,) = trans[cp:cp+k, cn:cn+k] @ vec (k,): four block rows per sweep, one running sum each
        (`trans` as in `_block_step`)."""
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
                c0 += widen(s0[j]) * v
                c1 += widen(s1[j]) * v
                c2 += widen(s2[j]) * v
                c3 += widen(s3[j]) * v
            out[i], out[i + 1], out[i + 2], out[i + 3] = c0, c1, c2, c3
        for i in range(k4, k):
            seg = trans[cp + i, cn : cn + k]
            c = 0.0
            for j in range(k):
                c += widen(seg[j]) * vec[j]
            out[i] = c

    @njit(nogil=True, fastmath=FASTMATH, cache=True)
    def blocked_score(init, emit_table, ids, clusters, lengths, trans, log_cond, last
                      ):  # pragma: no cover - compiled
        """Scaled forward of a blocked HMM with k states per cluster, log_cond only (float32 or float64).

        init (B, k): distribution of position 0 within its cluster; emit_table (V, k): p(w | state i of w's
        cluster), read by row for each token (no gathered (B, T, k) copy); ids, clusters (B, T) int64;
        lengths (B,) int64; trans (Z, Z). Writes log_cond[b, t] = log p(x_t | x_<t) for t < lengths[b]
        (-inf from an impossible position on; padding untouched) and, unless `last` is (0, k), last[b] =
        the filtered marginal at the last position (over its token's cluster; 0 for an impossible
        sequence). The scale of each step is summed in float64. O(B T k^2), O(k) memory."""
        _blocked_score(init, emit_table, ids, clusters, lengths, trans, log_cond, last, np.empty_like(init[0]),
                       np.empty_like(init[0]))

    @njit(nogil=True, fastmath=FASTMATH, cache=True, **BORROWED)
    def _blocked_score(init, emit_table, ids, clusters, lengths, trans, log_cond, last, alpha, nxt
                       ):  # pragma: no cover - compiled
        """`blocked_score` with its scratch alpha, nxt (k,), without reference counting."""
        B = ids.shape[0]
        k = alpha.shape[0]
        keep_last = last.shape[0] > 0
        for b in range(B):
            L = lengths[b]
            row = emit_table[ids[b, 0]]
            c = 0.0
            for j in range(k):
                a = init[b, j] * row[j]
                alpha[j] = a
                c += a
            t = 0
            while t < L:
                if not c > 0.0:  # impossible from here on (p = 0; NaN cannot arise from probabilities)
                    for s in range(t, L):
                        log_cond[b, s] = -np.inf
                    for j in range(k):
                        alpha[j] = 0.0
                    break
                log_cond[b, t] = np.log(c)
                inv = 1.0 / c
                for j in range(k):
                    alpha[j] *= inv
                t += 1
                if t < L:
                    _block_step(alpha, trans, clusters[b, t - 1] * k, clusters[b, t] * k, nxt)
                    row = emit_table[ids[b, t]]
                    c = 0.0
                    for j in range(k):
                        v = nxt[j] * row[j]
                        alpha[j] = v
                        c += v
            if keep_last:
                for j in range(k):
                    last[b, j] = alpha[j]

    @njit(nogil=True, cache=True)
    def blocked_viterbi(init, emit_table, ids, clusters, lengths, trans, path, score
                        ):  # pragma: no cover - compiled
        """Max-product of a blocked HMM with k states per cluster, on probabilities: init (B, k) the start
        distribution over each first token's cluster, emit_table (V, k) read by row for each token (float32 or
        float64); ids and clusters (B, T) int64, lengths (B,) int64; trans (Z, Z) (float32/float64, or bfloat16
        bits as uint16, `jit.widen`), read where it lies: no log of any table is made. The recursion runs in
        float64, rescaled to a maximum of 1 after every step (the logs of the scales summed):
        delta_t(j) = max_i delta_{t-1}(i) trans(i, j) x p(x_t | j); a state whose delta falls below
        `VITERBI_FLOOR` (575 nats below the step's best) is set to 0, so that no product is subnormal (~100x
        slower arithmetic on x86). That state could win a next state j only through a transition from the
        step's best state below 1e-250, which in float32 or bfloat16 is an exact 0: only there can the result
        differ from the log-space recursion. Writes path[b, t] (the best state within each position's cluster,
        for t < lengths[b]; padding untouched) and score[b] = log p(x, z*) (-inf for an impossible sequence).
        Ties go to the lowest state. O(B T k^2) time, O(T k) backpointers."""
        k = init.shape[1]
        _blocked_viterbi(init, emit_table, ids, clusters, lengths, trans, path, score,
                         np.empty((ids.shape[1], k), dtype=np.int32), np.empty(k), np.empty(k))

    @njit(nogil=True, cache=True, **BORROWED)
    def _rescale(delta, log_scale):  # pragma: no cover - compiled
        """delta /= max(delta) with entries below VITERBI_FLOOR set to 0; returns log_scale + log(max), or
        -inf when every entry is 0 (no path so far)."""
        top = 0.0
        for j in range(delta.shape[0]):
            top = max(top, delta[j])
        if not top > 0.0:
            return -np.inf
        inv = 1.0 / top
        for j in range(delta.shape[0]):
            v = delta[j] * inv
            delta[j] = v if v >= VITERBI_FLOOR else 0.0
        return log_scale + np.log(top)

    @njit(nogil=True, cache=True, **BORROWED)
    def _blocked_viterbi(init, emit_table, ids, clusters, lengths, trans, path, score, back, delta, nxt
                         ):  # pragma: no cover - compiled
        """`blocked_viterbi` with its scratch back (T, k), delta and nxt (k,) float64."""
        k = delta.shape[0]
        for b in range(ids.shape[0]):
            L = lengths[b]
            row = emit_table[ids[b, 0]]
            for j in range(k):
                delta[j] = np.float64(init[b, j]) * row[j]
            log_scale = _rescale(delta, 0.0)
            for t in range(1, L):
                cp, cn = clusters[b, t - 1] * k, clusters[b, t] * k
                bt = back[t]
                for j in range(k):
                    nxt[j] = 0.0
                    bt[j] = 0
                for i in range(k):  # row i of the block, contiguous: one candidate per next state
                    d = delta[i]
                    src = np.int32(i)
                    seg = trans[cp + i, cn : cn + k]
                    for j in range(k):  # branch-free selects (vectorisable); a tie keeps the lower state
                        v = d * widen(seg[j])
                        take = v > nxt[j]
                        nxt[j] = v if take else nxt[j]
                        bt[j] = src if take else bt[j]
                row = emit_table[ids[b, t]]
                for j in range(k):
                    delta[j] = nxt[j] * row[j]
                log_scale = _rescale(delta, log_scale)
            best = 0.0
            arg = 0
            for j in range(k):
                if delta[j] > best:
                    best = delta[j]
                    arg = j
            score[b] = log_scale if best > 0.0 else -np.inf  # best is 1 after the last rescale
            path[b, L - 1] = arg
            for t in range(L - 1, 0, -1):
                arg = back[t, arg]
                path[b, t - 1] = arg

    @njit(nogil=True, fastmath=FASTMATH, cache=True, error_model="numpy")
    def blocked_forward_backward(init, emit, clusters, lengths, trans, log_cond, alphas, gamma, right
                                 ):  # pragma: no cover - compiled
        """Forward-backward of a blocked HMM with k states per cluster (float32 or float64 arrays, one dtype;
        the backward's scratch in float64).

        init (B, k): distribution of position 0 within its cluster; emit (B, T, k) emission likelihoods
        (padding ignored); clusters (B, T) int64; lengths (B,) int64; trans (Z, Z). Writes log_cond (B, T)
        (log of each step's scale; padding untouched), alphas (B, T, k) filtered marginals, gamma (B, T, k)
        posteriors and right (B, T, k) = emit_t beta_t / c_t (both 0 at padding), from which the expected
        transition counts are alpha_{t-1} (x) right_t times the step's block. O(B T k^2)."""
        k = emit.shape[2]
        _blocked_forward_backward(init, emit, clusters, lengths, trans, log_cond, alphas, gamma, right, np.empty(k),
                                  np.empty(k))

    @njit(nogil=True, fastmath=FASTMATH, cache=True, error_model="numpy", **BORROWED)
    def _blocked_forward_backward(init, emit, clusters, lengths, trans, log_cond, alphas, gamma, right, beta,
                                  nxt):  # pragma: no cover - compiled
        """`blocked_forward_backward` with its scratch beta, nxt (k,), without reference counting. A zero scale
        (an impossible sequence) divides by zero as numpy does (inf / NaN from there on; `posterior_cpu` turns
        that row into zeros, training retries the batch in float64)."""
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
    def count_entries(clusters, lengths, M, carried_from):  # pragma: no cover - compiled
        """The terms of a batch's expected transition counts, sorted by the block they fall in (stable): one
        per step t >= 1 of each row (block (cluster at t - 1, cluster at t)) and, for each row that starts
        from a carried state (`carried_from` (B,) int64: its cluster, -1 for none), one for the carried step
        (block (that cluster, the row's first cluster), step 0). Returns (keys, rows, steps) (n,) int64, key =
        source cluster * M + target cluster. O(B T + n log n)."""
        B = clusters.shape[0]
        n = 0
        for b in range(B):
            if lengths[b] > 0:
                n += lengths[b] - 1 + (1 if carried_from[b] >= 0 else 0)
        keys = np.empty(n, dtype=np.int64)
        rows = np.empty(n, dtype=np.int64)
        steps = np.empty(n, dtype=np.int64)
        s = 0
        for b in range(B):
            if lengths[b] == 0:
                continue
            if carried_from[b] >= 0:
                keys[s], rows[s], steps[s] = carried_from[b] * M + clusters[b, 0], b, 0
                s += 1
            for t in range(1, lengths[b]):
                keys[s], rows[s], steps[s] = clusters[b, t - 1] * M + clusters[b, t], b, t
                s += 1
        order = np.argsort(keys, kind="mergesort")
        return keys[order], rows[order], steps[order]

    @njit(nogil=True, inline="always", cache=True)
    def _count_source(alphas, prior, b, t):  # pragma: no cover - compiled
        """The left factor of a count term: alpha_{t-1} (k,) of row b, or at step 0 its carried state (prior
        (B, k))."""
        if t > 0:
            return alphas[b, t - 1]
        return prior[b]

    @njit(nogil=True, fastmath=FASTMATH, cache=True)
    def block_counts(alphas, right, prior, keys, rows, steps, i_lo, i_hi, trans, M, out
                     ):  # pragma: no cover - compiled
        """Rows i_lo <= i < i_hi of every k x k block of the expected transition counts (out (Z, Z) in trans's
        dtype; block (key // M, key % M)): a block that the terms of `count_entries` step through gets (the
        sum over them of source (x) right_t, in float64) * the block of trans, where the source is alpha_{t-1}
        or, at step 0, the row's carried state (prior (B, k)); every other block gets zeros. Threads given disjoint
        row ranges never meet, and every entry is summed over the same terms in the same order whatever the
        split: the same bits for any number of threads, and the work split evenly even when most terms fall
        in one block. Four terms per sweep over the rows' sums. O(n (i_hi - i_lo) k + M^2 (i_hi - i_lo) k)
        for n terms."""
        k = alphas.shape[2]
        n = keys.shape[0]
        acc = np.empty((k, k))
        s = 0
        for key in range(M * M):
            r0, c0 = (key // M) * k, (key % M) * k
            if s >= n or keys[s] != key:
                for i in range(i_lo, i_hi):
                    for j in range(k):
                        out[r0 + i, c0 + j] = 0.0
                continue
            for i in range(i_lo, i_hi):
                for j in range(k):
                    acc[i, j] = 0.0
            while s < n and keys[s] == key:
                if s + 3 < n and keys[s + 3] == key:
                    a0 = _count_source(alphas, prior, rows[s], steps[s])
                    a1 = _count_source(alphas, prior, rows[s + 1], steps[s + 1])
                    a2 = _count_source(alphas, prior, rows[s + 2], steps[s + 2])
                    a3 = _count_source(alphas, prior, rows[s + 3], steps[s + 3])
                    q0, q1 = right[rows[s], steps[s]], right[rows[s + 1], steps[s + 1]]
                    q2, q3 = right[rows[s + 2], steps[s + 2]], right[rows[s + 3], steps[s + 3]]
                    for i in range(i_lo, i_hi):
                        x0, x1, x2, x3 = a0[i], a1[i], a2[i], a3[i]
                        row = acc[i]
                        for j in range(k):
                            row[j] += (x0 * q0[j] + x1 * q1[j]) + (x2 * q2[j] + x3 * q3[j])
                    s += 4
                else:
                    a0 = _count_source(alphas, prior, rows[s], steps[s])
                    q0 = right[rows[s], steps[s]]
                    for i in range(i_lo, i_hi):
                        x0 = a0[i]
                        row = acc[i]
                        for j in range(k):
                            row[j] += x0 * q0[j]
                    s += 1
            for i in range(i_lo, i_hi):
                for j in range(k):
                    out[r0 + i, c0 + j] = acc[i, j] * trans[r0 + i, c0 + j]

    @njit(nogil=True, fastmath=FASTMATH, cache=True, **BORROWED)
    def _logit_grad_rows(counts, trans, scale, lo, hi):  # pragma: no cover - compiled
        """Rows lo <= i < hi, in place: counts[i] <- scale * (counts[i] - (sum of counts[i]) * trans[i]), the sum
        in float64. Each row is summed and rewritten while it is in cache: one pass over memory."""
        n = counts.shape[1]
        for i in range(lo, hi):
            c = counts[i]
            p = trans[i]
            s = 0.0
            for j in range(n):
                s += c[j]
            for j in range(n):
                c[j] = scale * (c[j] - s * p[j])


# -- drivers: tensors in, tensors out, rows split over threads ---------------------------------------------
def score_cpu(init: Tensor, emit_table: Tensor, ids: Tensor, clusters: Tensor, lengths: Tensor, trans: Tensor,
              threads: int, want_last: bool = False) -> tuple[Tensor, Tensor | None]:
    """(log_cond (B, T) in emit_table's dtype (0 at padding, -inf from an impossible position on), and with
    `want_last` each row's filtered marginal at its last position (B, k)) of `blocked_score` over init
    (B, k), emit_table (V, k), ids and clusters (B, T), lengths (B,) and trans (Z, Z) (float32/float64, or
    bfloat16: read as its uint16 bits, each entry widened to float32), the rows split over `threads` threads.
    O(B T k^2)."""
    B, k = init.shape
    log_cond = torch.zeros(ids.shape, dtype=emit_table.dtype)
    last = torch.zeros(B if want_last else 0, k, dtype=emit_table.dtype)
    first, rows, cl, lens = (as_array(x) for x in (init, ids, clusters, lengths))
    mat = _stored(trans)
    table, out, out_last = as_array(emit_table), log_cond.numpy(), last.numpy()

    def part(lo: int, hi: int) -> None:
        blocked_score(first[lo:hi], table, rows[lo:hi], cl[lo:hi], lens[lo:hi], mat, out[lo:hi],
                      out_last[lo:hi] if want_last else out_last)

    run_ranges(lens, threads, part)
    return log_cond, (last if want_last else None)


def _stored(trans: Tensor) -> np.ndarray:
    """The transition matrix as the kernels read it: float32/float64 as is, bfloat16 as its uint16 bits."""
    return as_array(trans.view(torch.uint16) if trans.dtype == torch.bfloat16 else trans)


def viterbi_cpu(init: Tensor, emit_table: Tensor, ids: Tensor, clusters: Tensor, lengths: Tensor,
                trans: Tensor, threads: int) -> tuple[Tensor, Tensor]:
    """(path (B, T) int64 within each position's cluster, -1 at padding; log p(x, z*) (B,) float64) of
    `blocked_viterbi` over probabilities: init (B, k), emit_table (V, k) read by the rows `ids`, and the
    transition matrix `trans` (Z, Z) (float32, float64 or bfloat16), the rows split over `threads` threads.
    O(B T k^2)."""
    B, T = ids.shape
    path = torch.full((B, T), -1, dtype=torch.long)
    score = torch.empty(B, dtype=torch.float64)
    first, rows, cl, lens = (as_array(x) for x in (init, ids, clusters, lengths))
    table, mat, out_path, out_score = as_array(emit_table), _stored(trans), path.numpy(), score.numpy()

    def part(lo: int, hi: int) -> None:
        blocked_viterbi(first[lo:hi], table, rows[lo:hi], cl[lo:hi], lens[lo:hi], mat, out_path[lo:hi],
                        out_score[lo:hi])

    run_ranges(lens, threads, part)
    return path, score


def forward_backward_cpu(init: Tensor, emit: Tensor, clusters: Tensor, lengths: Tensor, trans: Tensor,
                         threads: int) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """(log_cond (B, T), alphas, gamma, right (B, T, k)) of `blocked_forward_backward` over init (B, k), emit
    (B, T, k) (the tokens' emission rows, in the dtype of the DP), clusters (B, T), lengths (B,) and trans
    (Z, Z) (float32, float64 or bfloat16), the rows split over `threads` threads. log_cond is 0 at padding,
    gamma and right too; alphas there are undefined. O(B T k^2)."""
    B, T, k = emit.shape
    log_cond = torch.zeros(B, T, dtype=emit.dtype)
    alphas, gamma, right = (torch.empty(B, T, k, dtype=emit.dtype) for _ in range(3))
    first, em, cl, lens, mat = (*(as_array(x) for x in (init, emit, clusters, lengths)), _stored(trans))
    outs = [x.numpy() for x in (log_cond, alphas, gamma, right)]
    run_ranges(lens, threads, lambda lo, hi: blocked_forward_backward(
        first[lo:hi], em[lo:hi], cl[lo:hi], lens[lo:hi], mat, *(x[lo:hi] for x in outs)))
    return log_cond, alphas, gamma, right


def counts_cpu(alphas: Tensor, right: Tensor, clusters: Tensor, lengths: Tensor, trans: Tensor, M: int,
               prior: Tensor | None = None, carried_from: Tensor | None = None, threads: int = 1) -> Tensor:
    """Expected transition counts (Z', Z') in trans's dtype from `forward_backward_cpu`'s alphas and right, with
    the carried step too where `prior` (B, k) holds each row's carried state in the cluster `carried_from` (B,)
    (-1: the row carries nothing) (`count_entries`, `block_counts`): the rows of every block split evenly over
    `threads` threads (the same bits for any split). O(B T k^2 + Z^2)."""
    B, T, k = alphas.shape
    if carried_from is None:
        carried_from = torch.full((B,), -1, dtype=torch.long)
    # without a carried state no term reads it (every term has a step >= 1): an empty array of the kernel's type
    prior2 = prior.to(alphas.dtype) if prior is not None else alphas.new_empty(0, k)
    keys, rows, steps = count_entries(as_array(clusters), as_array(lengths), M, as_array(carried_from))
    out = torch.empty_like(trans)
    threads = max(1, min(threads, k))
    bounds = [k * p // threads for p in range(threads + 1)]
    args = (as_array(alphas), as_array(right), as_array(prior2), keys, rows, steps)
    mat, target = as_array(trans), out.numpy()
    run_split(lambda p: block_counts(*args, bounds[p], bounds[p + 1], mat, M, target), threads)
    return out


def logit_grad_cpu(counts: Tensor, trans: Tensor, scale: float, threads: int) -> Tensor:
    """In place over `counts` (Z', Z'), contiguous: scale * (counts - rowsum(counts) * trans), the gradient of
    scale * log p(x) with respect to the row logits of trans = softmax(logits) given its expected counts; rows split
    over `threads` threads (the same bits for any split). One pass over memory. O(Z'^2)."""
    if not (counts.is_contiguous() and trans.is_contiguous()):
        raise ValueError("logit_grad_cpu: counts and trans must be contiguous")
    c, p = counts.detach().numpy(), trans.detach().numpy()
    run_ranges(np.ones(c.shape[0]), threads, lambda lo, hi: _logit_grad_rows(c, p, scale, lo, hi))
    return counts


def posterior_cpu(init: Tensor, emit: Tensor, clusters: Tensor, lengths: Tensor, trans: Tensor, threads: int
                  ) -> tuple[Tensor, Tensor]:
    """(posteriors (B, T, k), log_cond (B, T)) of `forward_backward_cpu`, in emit's dtype. Padding:
    posteriors 0, log_cond 0. An impossible sequence: log_cond -inf from its impossible position on and
    posteriors 0 (as the chain engine's). O(B T k^2)."""
    T = emit.shape[1]
    log_cond, _, posteriors, _ = forward_backward_cpu(init, emit, clusters, lengths, trans, threads)
    valid = torch.arange(T)[None, :] < lengths[:, None]
    dead = ~(log_cond > -np.inf) & valid  # -inf, or NaN after the 0 / 0 that follows it
    if bool(dead.any()):
        log_cond.masked_fill_((dead.cumsum(1) > 0) & valid, -np.inf)
        posteriors[dead.any(1)] = 0.0
    return posteriors, log_cond
