"""The (max, +) product and whole Viterbi recursions on CPU (numba).

The product out[b, j] = max_i delta[b, i] + log_trans[i, j] (with argmax) is the heart of Viterbi. It
cannot use BLAS, so it is written here like a GEMM micro-kernel, for each row of `delta`:
- sources are visited in decreasing delta, CHUNK at a time; for a block of BLOCK columns the chunk's
  maxima are formed branch-free (one add and one max per entry: `fmax` is a single select that LLVM turns
  into `maxps` on AVX2 / AVX-512), into a buffer other than the one read, because a read-modify-write of
  the same array compiles to masked stores that run several times slower;
- the argmax rides along: every node of the chunk's tree of maxima also selects the winning side's slot
  (a select, no branch), and the merge into the running maxima keeps the position of the winner;
- exact pruning: sources come in decreasing delta by a counting sort into buckets (O(K), `source_order`),
  and once the bucket bound plus max_i' log_trans[i', j] (the column maxima `col_max`) cannot beat any
  column of the block, no remaining source can, and the block is done.
`viterbi_lockstep` runs the whole recursion of a set of sequences in compiled code (one thread's share of
a batch; threads split the rows with no synchronisation), `viterbi_split` one sequence on two threads that
split the columns. `maxplus_cpu` / `viterbi_cpu` are the tensor-level entry points.
Ties go to the source first in that order (a larger delta, up to the bucket width).
"""

from __future__ import annotations

import numpy as np
import torch
from torch import Tensor

from latentlm.models.kernels.jit import FASTMATH, HAVE_NUMBA, njit
from latentlm.models.kernels.threads import run_split

BLOCK = 256  # most columns per block: the block's running maxima and chunk indices stay in L1
MIN_BLOCK = 32
PANEL_BYTES = 1 << 18  # a K x block panel of the matrix this large stays in a core's L2 while rows sweep it
CHUNK = 16  # sources per chunk (a pruning check per chunk; the argmax rescan is CHUNK entries per column)
BUCKETS = 64  # source ordering: buckets of BUCKET_WIDTH nats below the row maximum, the last one open
BUCKET_WIDTH = 0.25
BUCKET_SLACK = 1e-3  # the bucket bounds are loosened by this much, so float rounding never makes one too tight


if HAVE_NUMBA:
    from numba import uint64
    from numba.core.extending import intrinsic

    from latentlm.models.kernels.threads import spin_until, store_release

    @intrinsic
    def fmax(typingctx, a, b):  # pragma: no cover - compiled
        """a if a > b else b as one select, with no branch (vectorises to maxps / maxpd)."""
        def codegen(context, builder, sig, args):
            return builder.select(builder.fcmp_ordered(">", args[0], args[1]), args[0], args[1])
        return a(a, b), codegen

    @intrinsic
    def pick(typingctx, a, b, x, y):  # pragma: no cover - compiled
        """x if a > b else y as one select, with no branch (vectorises to a compare and a blend)."""
        def codegen(context, builder, sig, args):
            return builder.select(builder.fcmp_ordered(">", args[0], args[1]), args[2], args[3])
        return x(a, b, x, y), codegen

    @njit(nogil=True, inline="always", cache=True)
    def _eight(order, srt, n, last, K, j0):  # pragma: no cover - compiled
        """Sources order[n : n + 8] (repeating order[last] past the end: a maximum is idempotent) as
        (their row offsets i * K + j0 as unsigned ints, their deltas)."""
        n0, n1, n2, n3 = min(n, last), min(n + 1, last), min(n + 2, last), min(n + 3, last)
        n4, n5, n6, n7 = min(n + 4, last), min(n + 5, last), min(n + 6, last), min(n + 7, last)
        rows = (uint64(order[n0] * K + j0), uint64(order[n1] * K + j0), uint64(order[n2] * K + j0),
                uint64(order[n3] * K + j0), uint64(order[n4] * K + j0), uint64(order[n5] * K + j0),
                uint64(order[n6] * K + j0), uint64(order[n7] * K + j0))
        return rows, (srt[n0], srt[n1], srt[n2], srt[n3], srt[n4], srt[n5], srt[n6], srt[n7])

    @njit(nogil=True, inline="always", fastmath=FASTMATH, cache=True)
    def _max8_arg(flat, r, d, u, zero, one, two, four):  # pragma: no cover - compiled
        """(max over the 8 sources (row offsets r, deltas d) of d + A at column offset u, the slot 0..7 of
        the first source holding it, as a float): a balanced tree of maxima whose every node also selects
        the winning side's slot, all branch-free (vectorises: no argmax rescan, no mispredicted branches)."""
        a0, a1 = d[0] + flat[r[0] + u], d[1] + flat[r[1] + u]
        a2, a3 = d[2] + flat[r[2] + u], d[3] + flat[r[3] + u]
        a4, a5 = d[4] + flat[r[4] + u], d[5] + flat[r[5] + u]
        a6, a7 = d[6] + flat[r[6] + u], d[7] + flat[r[7] + u]
        m0, s0 = fmax(a1, a0), pick(a1, a0, one, zero)
        m1, s1 = fmax(a3, a2), pick(a3, a2, one, zero) + two
        m2, s2 = fmax(a5, a4), pick(a5, a4, one, zero)
        m3, s3 = fmax(a7, a6), pick(a7, a6, one, zero) + two
        n0, t0 = fmax(m1, m0), pick(m1, m0, s1, s0)
        n1, t1 = fmax(m3, m2), pick(m3, m2, s3, s2) + four
        return fmax(n1, n0), pick(n1, n0, t1, t0)

    @njit(nogil=True, inline="always", fastmath=FASTMATH, cache=True)
    def _chunk(flat, order, srt, n0, n1, K, j0, best, at, nbest, nat, next_top, col_max, w):  # pragma: no cover
        """The CHUNK (= 16) sources order[n0:n1] against columns [j0, j0 + w): their maxima of srt + A[i, j]
        and the position of each, in registers (16 loads, 16 adds, 15 maxima, 15 selects per entry), merged
        into the running maxima `best` and their positions `at` (float) as nbest, nat: buffers other than
        those read, since a read-modify-write of one array compiles to slow masked stores. Unsigned indices
        (no negative-index wrap), so the loop vectorises. Returns whether the next chunk (deltas at most
        next_top) could still improve any column: False ends the block (exact pruning)."""
        ra, da = _eight(order, srt, n0, n1 - 1, K, j0)
        rb, db = _eight(order, srt, n0 + 8, n1 - 1, K, j0)
        ft = best.dtype.type
        zero, one, two, four, eight, base = ft(0.0), ft(1.0), ft(2.0), ft(4.0), ft(8.0), ft(n0)
        alive = zero  # how many columns the next chunk could improve (a float sum: it vectorises)
        for j in range(w):
            u = uint64(j)
            ma, sa = _max8_arg(flat, ra, da, u, zero, one, two, four)
            mb, sb = _max8_arg(flat, rb, db, u, zero, one, two, four)
            m = fmax(mb, ma)
            where = base + pick(mb, ma, sb + eight, sa)
            nb = fmax(m, best[j])
            nbest[j] = nb
            nat[j] = pick(m, best[j], where, at[j])
            alive += pick(next_top + col_max[j0 + j], nb, one, zero)
        return alive > zero

    @njit(nogil=True, fastmath=FASTMATH, cache=True)
    def source_order(drow, centre, order, tops, srt, counts, keys):  # pragma: no cover - compiled
        """Sources in decreasing delta, by buckets of BUCKET_WIDTH below the row's maximum (a counting sort,
        O(K), instead of an O(K log K) sort that costs as much as the product itself at K = 256): order (K,)
        the sources, srt (K,) the deltas in that order, tops (K,) for each position an upper bound of every
        delta from there on (the upper edge of its bucket). With `centre`, srt and tops are re-centred on the
        row maximum (Viterbi's re-centring, in the same pass). counts (BUCKETS + 1,) and keys (K,) int64
        scratch. Returns the row maximum."""
        K = drow.shape[0]
        top = drow.max()
        shift = top if centre and np.isfinite(top) else drow.dtype.type(0.0)
        counts[:] = 0
        for i in range(K):
            k = _bucket(top, drow[i])
            keys[i] = k
            counts[k + 1] += 1
        for k in range(BUCKETS):
            counts[k + 1] += counts[k]
        for i in range(K):
            k = keys[i]
            n = counts[k]
            order[n] = i
            srt[n] = drow[i] - shift
            tops[n] = (top - shift) - (k * BUCKET_WIDTH - BUCKET_SLACK) if k > 0 else top - shift
            counts[k] = n + 1
        return top

    @njit(nogil=True, inline="always", cache=True)
    def _bucket(top, d):  # pragma: no cover - compiled
        """The bucket of delta d below the row maximum `top` (the last one holds everything further down)."""
        gap = (top - d) / BUCKET_WIDTH
        return int(gap) if gap < BUCKETS - 1 else BUCKETS - 1

    @njit(nogil=True, fastmath=FASTMATH, cache=True)
    def maxplus_block(flat, K, col_max, order, tops, srt, j0, w, val, arg, scratch):  # pragma: no cover
        """Columns [j0, j0 + w) of one row of the (max, +) product: val[j] = max_i drow[i] + A[i, j] and
        arg[j] its argmax, for A (K, K) given flat (K * K,), sources in `order` with `tops` from
        `source_order` (srt: the deltas in that order). scratch (4, >= w). O(K w) worst case."""
        b0, b1 = scratch[0], scratch[1]  # running maxima, ping-pong by `flip` (no array swaps: each costs
        c0, c1 = scratch[2], scratch[3]  # reference counting); c0, c1: each maximum's position in `order`
        for j in range(w):
            b0[j] = -np.inf
            c0[j] = 0.0
        flip = False
        n_chunks = (K + CHUNK - 1) // CHUNK
        for c in range(n_chunks):
            n0 = c * CHUNK
            n1 = min(K, n0 + CHUNK)
            next_top = tops[n1] if n1 < K else tops.dtype.type(-np.inf)
            if flip:
                alive = _chunk(flat, order, srt, n0, n1, K, j0, b1, c1, b0, c0, next_top, col_max, w)
            else:
                alive = _chunk(flat, order, srt, n0, n1, K, j0, b0, c0, b1, c1, next_top, col_max, w)
            flip = not flip
            if not alive:
                break
        best = b1 if flip else b0
        ci = c1 if flip else c0
        for j in range(w):
            val[j] = best[j]
            arg[j] = order[min(int(ci[j]), K - 1)]

    @njit(nogil=True, cache=True)
    def block_width(K, itemsize):  # pragma: no cover - compiled
        """Columns per block: the K x width panel of the matrix stays in a core's L2 while every row of a
        batch sweeps it (whole rows for small K)."""
        w = PANEL_BYTES // (K * itemsize)
        return max(MIN_BLOCK, min(BLOCK, w - w % 8))

    @njit(nogil=True, cache=True)
    def maxplus_rows(delta, flat, col_max, val, arg):  # pragma: no cover - compiled
        """The (max, +) product of every row of delta (B, K): val (B, K), arg (B, K) int64."""
        B, K = delta.shape
        scratch = np.empty((4, BLOCK), dtype=delta.dtype)
        order = np.empty((B, K), dtype=np.int64)
        tops = np.empty((B, K), dtype=delta.dtype)
        srt = np.empty((B, K), dtype=delta.dtype)
        counts = np.empty(BUCKETS + 1, dtype=np.int64)
        keys = np.empty(K, dtype=np.int64)
        for b in range(B):
            source_order(delta[b], False, order[b], tops[b], srt[b], counts, keys)
        w = block_width(K, delta.itemsize)
        for j0 in range(0, K, w):
            wj = min(w, K - j0)
            for b in range(B):
                maxplus_block(flat, K, col_max, order[b], tops[b], srt[b], j0, wj, val[b, j0:], arg[b, j0:],
                              scratch)

    @njit(nogil=True, fastmath=FASTMATH, cache=True)
    def viterbi_lockstep(log_init, log_emit, flat, col_max, lengths, rows, first, stride, back, paths,
                         scores):  # pragma: no cover - compiled
        """Viterbi of the sequences rows[first::stride] (one thread's share of a batch; `rows` in decreasing
        length), advanced together so that each panel of the matrix is swept by all of them while it is in
        cache. log_init (B, K), log_emit (B, T, K), lengths (B,); back (B, T, K) int32 scratch; paths
        (B, T) int64 out (-1 at padding), scores (B,) float64 out. Scores are re-centred every step as the
        sources are ordered (the float64 offset carries the scale), so float32 keeps the differences that
        decide the path."""
        B, T, K = log_emit.shape
        mine = rows[first::stride]
        m = mine.shape[0]
        if m == 0:
            return
        dt = log_emit.dtype
        delta = np.empty((m, K), dtype=dt)
        nxt = np.empty((m, K), dtype=dt)
        order = np.empty((m, K), dtype=np.int64)
        tops = np.empty((m, K), dtype=dt)
        srt = np.empty((m, K), dtype=dt)
        counts = np.empty(BUCKETS + 1, dtype=np.int64)
        keys = np.empty(K, dtype=np.int64)
        scratch = np.empty((4, BLOCK), dtype=dt)
        offset = np.zeros(m)
        w = block_width(K, log_emit.itemsize)
        active = m
        for t in range(lengths[mine[0]]):
            while active > 0 and lengths[mine[active - 1]] <= t:
                active -= 1
            for r in range(active):
                b = mine[r]
                d = delta[r]
                if t == 0:
                    for j in range(K):
                        d[j] = log_init[b, j] + log_emit[b, 0, j]
                else:
                    top = source_order(d, True, order[r], tops[r], srt[r], counts, keys)
                    if np.isfinite(top):
                        offset[r] += top
            if t > 0:
                for j0 in range(0, K, w):
                    wj = min(w, K - j0)
                    for r in range(active):
                        maxplus_block(flat, K, col_max, order[r], tops[r], srt[r], j0, wj, nxt[r, j0:],
                                      back[mine[r], t, j0:], scratch)
                for r in range(active):
                    b = mine[r]
                    d, v = delta[r], nxt[r]
                    for j in range(K):
                        d[j] = v[j] + log_emit[b, t, j]
        for r in range(m):
            b = mine[r]
            L = lengths[b]
            paths[b, L:] = -1
            if L == 0:
                scores[b] = 0.0
                continue
            d = delta[r]
            state = int(np.argmax(d))
            scores[b] = offset[r] + d[state]
            paths[b, L - 1] = state
            for t in range(L - 1, 0, -1):
                state = int(back[b, t, state])
                paths[b, t - 1] = state

    @njit(nogil=True, cache=True)
    def backtrack(last, step_tops, back, path):  # pragma: no cover - compiled
        """The path of `viterbi_split` from its last (not re-centred) delta, the per-step maxima and the
        backpointers (L, K): path[:L] out. Returns the path's float64 log-probability."""
        L = back.shape[0]
        state = int(np.argmax(last))
        offset = 0.0
        for t in range(L - 1):
            if np.isfinite(step_tops[t]):
                offset += step_tops[t]
        score = offset + last[state]
        path[L - 1] = state
        for t in range(L - 1, 0, -1):
            state = int(back[t, state])
            path[t - 1] = state
        return score

    @njit(nogil=True, fastmath=FASTMATH, cache=True)
    def viterbi_split(log_init, log_emit, flat, col_max, shared, flags, tid, j_lo, j_hi, back,
                      tops_out):  # pragma: no cover - compiled
        """One of two threads of the Viterbi recursion of one sequence; thread `tid` owns columns
        [j_lo, j_hi). Each step a thread orders (and re-centres) the sources of the whole previous delta
        (both threads, the same order), forms its columns of the (max, +) product and the backpointers,
        publishes its columns of the new delta, and waits for the other thread's (release/acquire step
        counters, `threads.spin_until`): one meeting per step. shared (2, K) is double-buffered by step
        parity (a thread writes buffer t % 2 only after both have finished reading it at step t - 1);
        flags (32,) int64 holds the two counters on separate cache lines. tops_out (T,) float64: thread 0
        writes the maximum of each step's delta (the re-centring offsets). O(T K^2 / 2) per thread."""
        T, K = log_emit.shape
        other = 1 - tid
        dt = log_emit.dtype
        order = np.empty(K, dtype=np.int64)
        tops = np.empty(K, dtype=dt)
        srt = np.empty(K, dtype=dt)
        counts = np.empty(BUCKETS + 1, dtype=np.int64)
        keys = np.empty(K, dtype=np.int64)
        scratch = np.empty((4, BLOCK), dtype=dt)
        nxt = np.empty(K, dtype=dt)
        w = block_width(K, log_emit.itemsize)
        for t in range(T):
            buf = shared[t % 2]
            if t == 0:
                for j in range(j_lo, j_hi):
                    buf[j] = log_init[j] + log_emit[0, j]
            else:
                top = source_order(shared[(t - 1) % 2], True, order, tops, srt, counts, keys)
                if tid == 0:
                    tops_out[t - 1] = top
                for j0 in range(j_lo, j_hi, w):
                    wj = min(w, j_hi - j0)
                    maxplus_block(flat, K, col_max, order, tops, srt, j0, wj, nxt[j0:], back[t, j0:], scratch)
                for j in range(j_lo, j_hi):
                    buf[j] = nxt[j] + log_emit[t, j]
            store_release(flags, tid * 16, t + 1)
            spin_until(flags, other * 16, t + 1)


def _arr(x: Tensor) -> np.ndarray:
    return np.ascontiguousarray(x.detach().numpy())


def maxplus_cpu(delta: Tensor, log_trans: Tensor, col_max: Tensor | None = None) -> tuple[Tensor, Tensor]:
    """(B, K) x (K, K) -> values (B, K), argmax (B, K) int64; CPU float32/float64. O(B K^2) worst case.

    Sources are visited in decreasing delta and a column block stops as soon as the bound
    delta_i + col_max[j] (col_max = log_trans.max(0)) cannot improve any of its columns: exact, and
    typically 3-10x less work. Among tied sources the one with the larger delta wins."""
    d = _arr(delta)
    a = _arr(log_trans)
    cm = a.max(axis=0) if col_max is None else _arr(col_max)
    val = np.empty_like(d)
    arg = np.empty(d.shape, dtype=np.int64)
    maxplus_rows(d, a.reshape(-1), cm, val, arg)
    return torch.from_numpy(val), torch.from_numpy(arg)


def viterbi_cpu(log_init: Tensor, log_emit: Tensor, log_trans: Tensor, lengths: Tensor, threads: int
                ) -> tuple[Tensor, Tensor]:
    """Viterbi of a batch, whole in compiled code: `threads` threads split the sequences (every threads-th
    in decreasing length, so their shares balance), each advancing its share together. log_init (B, K),
    log_emit (B, T, K), log_trans (K, K), lengths (B,) -> paths (B, T) int64 (-1 at padding), scores (B,)
    float64. O(B T K^2) worst case, O(B T K) int32 backpointers."""
    B, T, K = log_emit.shape
    e = _arr(log_emit)
    a = _arr(log_trans)
    if B == 1 and threads >= 2:
        return _viterbi_two_threads(_arr(log_init[0]), e[0, : int(lengths[0])], a, T)
    lens = lengths.detach().cpu().numpy().astype(np.int64)
    rows = np.argsort(-lens, kind="stable")
    threads = max(1, min(threads, B))
    back = np.empty((B, T, K), dtype=np.int32)
    paths = np.empty((B, T), dtype=np.int64)
    scores = np.empty(B, dtype=np.float64)
    init, flat, cm = _arr(log_init), a.reshape(-1), a.max(axis=0)
    run_split(lambda k: viterbi_lockstep(init, e, flat, cm, lens, rows, k, threads, back, paths, scores), threads)
    return torch.from_numpy(paths), torch.from_numpy(scores)


def _viterbi_two_threads(init: np.ndarray, emit: np.ndarray, a: np.ndarray, T: int) -> tuple[Tensor, Tensor]:
    """One sequence's Viterbi on two threads splitting the columns (`viterbi_split`), then the backtrack.
    init (K,), emit (L, K), a (K, K); the path is padded to T with -1."""
    L, K = emit.shape
    paths = np.full((1, T), -1, dtype=np.int64)
    if L == 0:
        return torch.from_numpy(paths), torch.zeros(1, dtype=torch.float64)
    w = int(block_width(K, emit.itemsize))
    half = min(K, ((K // 2 + w - 1) // w) * w)  # the split on a block boundary
    shared = np.empty((2, K), dtype=emit.dtype)
    flags = np.zeros(32, dtype=np.int64)
    back = np.empty((L, K), dtype=np.int32)
    step_tops = np.empty(L)
    flat, cm = a.reshape(-1), a.max(axis=0)
    bounds = ((0, half), (half, K))
    run_split(lambda k: viterbi_split(init, emit, flat, cm, shared, flags, k, bounds[k][0], bounds[k][1], back,
                                      step_tops), 2)
    score = backtrack(shared[(L - 1) % 2], step_tops, back, paths[0])
    return torch.from_numpy(paths), torch.tensor([score], dtype=torch.float64)
