"""The (max, +) product and whole Viterbi recursions on CPU (numba).

The product out[b, j] = max_i delta[b, i] + log_trans[i, j] (with argmax) is the heart of Viterbi. It
cannot use BLAS, so it is written here like a GEMM micro-kernel, for each row of `delta`:
- sources are visited in decreasing delta, CHUNK at a time; for a block of BLOCK columns the chunk's
  maxima are formed branch-free (one add and one max per entry: `fmax` is a single select that LLVM turns
  into `maxps` on AVX2 / AVX-512), into a buffer other than the one read, because a read-modify-write of
  the same array compiles to masked stores that run several times slower;
- no argmax in the product: Viterbi keeps each step's (re-centred) scores instead of backpointers, and the
  backtrace recovers the one backpointer it needs per step as argmax_i delta_{t-1}[i] + log_trans[i, j]
  with the very float operations the product used (O(K) a step instead of a compare and a blend per
  entry of the product: half the instructions of the inner loop);
- exact pruning: sources come in decreasing delta by a counting sort into buckets (O(K), `source_order`),
  and once the bucket bound plus max_i' log_trans[i', j] (the column maxima `col_max`) cannot beat any
  column of the block, no remaining source can, and the block is done (checked every CHECK_EVERY chunks:
  a chunk more than needed changes no maximum);
- the matrix is read from a copy with padded rows (`blas.padded_rows`): where a row is a multiple of 2 KiB,
  the 16 rows of a chunk would all start in one L1 set and evict each other.
`viterbi_lockstep` runs the whole recursion of a set of sequences in compiled code (one thread's share of
a batch; threads split the rows with no synchronisation), `viterbi_chunks` one sequence on several threads
that each take a chunk of it, by exact speculation. `maxplus_cpu` / `viterbi_cpu` are the tensor-level entry points.
Ties: the standalone product's argmax is the source first in that order (a larger delta, up to the bucket
width); Viterbi's backtrace takes the lowest state among tied sources.
"""

from __future__ import annotations

import numpy as np
import torch
from torch import Tensor

from latentlm.models.kernels import blas
from latentlm.models.kernels.jit import BORROWED, FASTMATH, HAVE_NUMBA, njit
from latentlm.models.kernels.sum_product import emission_rows
from latentlm.models.kernels.threads import run_split

BLOCK = 256  # most columns per block: the block's running maxima and chunk indices stay in L1
MIN_BLOCK = 32
PANEL_BYTES = 1 << 18  # a K x block panel of the matrix this large stays in a core's L2 while rows sweep it
CHUNK = 16  # sources per chunk (the argmax rescan is CHUNK entries per column)
CHECK_EVERY = 2  # chunks per pruning check: the check costs more than its arithmetic (an interleaved A/B in one
# process, real pruning: 1.12x at Z = 256, 1.03x at 1,024 over a check every chunk; every 4th: 1.09x / 0.95x)
BUCKETS = 64  # source ordering: buckets of BUCKET_WIDTH nats below the row maximum, the last one open
BUCKET_WIDTH = 0.25
BUCKET_SLACK = 1e-3  # the bucket bounds are loosened by this much, so float rounding never makes one too tight
LANES = 4  # the counting sort keeps LANES interleaved histograms (source i counts in lane i % LANES), so that
# consecutive sources never wait on each other's increment of one counter (a store-to-load chain)
COUNT_SLOTS = BUCKETS * LANES  # the counting sort's scratch size


if HAVE_NUMBA:
    from numba import uint64
    from numba.core.extending import intrinsic

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
    def _eight(order, scores, n, last, ld, j0):  # pragma: no cover - compiled
        """Sources order[n : n + 8] (repeating order[last] past the end: a maximum is idempotent) as
        (their row offsets i * ld + j0 as unsigned ints, ld the row stride; their deltas scores[i])."""
        n0, n1, n2, n3 = min(n, last), min(n + 1, last), min(n + 2, last), min(n + 3, last)
        n4, n5, n6, n7 = min(n + 4, last), min(n + 5, last), min(n + 6, last), min(n + 7, last)
        rows = (uint64(order[n0] * ld + j0), uint64(order[n1] * ld + j0), uint64(order[n2] * ld + j0),
                uint64(order[n3] * ld + j0), uint64(order[n4] * ld + j0), uint64(order[n5] * ld + j0),
                uint64(order[n6] * ld + j0), uint64(order[n7] * ld + j0))
        return rows, (scores[order[n0]], scores[order[n1]], scores[order[n2]], scores[order[n3]],
                      scores[order[n4]], scores[order[n5]], scores[order[n6]], scores[order[n7]])

    @njit(nogil=True, inline="always", fastmath=FASTMATH, cache=True)
    def _max8(flat, r, d, u):  # pragma: no cover - compiled
        """max over the 8 sources (row offsets r, deltas d) of d + A at column offset u: a balanced tree of
        maxima, branch-free (one add and one max per source: vectorises to addps / maxps)."""
        a0, a1 = d[0] + flat[r[0] + u], d[1] + flat[r[1] + u]
        a2, a3 = d[2] + flat[r[2] + u], d[3] + flat[r[3] + u]
        a4, a5 = d[4] + flat[r[4] + u], d[5] + flat[r[5] + u]
        a6, a7 = d[6] + flat[r[6] + u], d[7] + flat[r[7] + u]
        return fmax(fmax(fmax(a1, a0), fmax(a3, a2)), fmax(fmax(a5, a4), fmax(a7, a6)))

    @njit(nogil=True, inline="always", fastmath=FASTMATH, cache=True)
    def _chunk(flat, order, scores, n0, n1, ld, j0, best, nbest, next_top, col_max, w):  # pragma: no cover
        """The CHUNK (= 16) sources order[n0:n1] against columns [j0, j0 + w): their maxima of scores[i] + A[i, j]
        in registers (16 adds with their loads, 15 maxima per entry), merged into the running maxima `best`
        as nbest: a buffer other than the one read, since a read-modify-write of one array compiles to slow
        masked stores. Unsigned indices (no negative-index wrap), so the loop vectorises. Returns whether the
        next chunk (deltas at most next_top) could still improve any column: False ends the block (exact
        pruning)."""
        ra, da = _eight(order, scores, n0, n1 - 1, ld, j0)
        rb, db = _eight(order, scores, n0 + 8, n1 - 1, ld, j0)
        ft = best.dtype.type
        zero, one = ft(0.0), ft(1.0)
        alive = zero  # how many columns the next chunk could improve (a float sum: it vectorises)
        for j in range(w):
            nb = _max16(flat, ra, da, rb, db, best, j)
            nbest[j] = nb
            alive += pick(next_top + col_max[j0 + j], nb, one, zero)
        return alive > zero

    @njit(nogil=True, inline="always", fastmath=FASTMATH, cache=True)
    def _chunk_free(flat, order, scores, n0, n1, ld, j0, best, nbest, w):  # pragma: no cover - compiled
        """`_chunk` without the pruning check (the chunks between two checks, `CHECK_EVERY`)."""
        ra, da = _eight(order, scores, n0, n1 - 1, ld, j0)
        rb, db = _eight(order, scores, n0 + 8, n1 - 1, ld, j0)
        for j in range(w):
            nbest[j] = _max16(flat, ra, da, rb, db, best, j)

    @njit(nogil=True, inline="always", fastmath=FASTMATH, cache=True)
    def _max16(flat, ra, da, rb, db, best, j):  # pragma: no cover - compiled
        """One column j of a chunk: the maximum of best[j] and the 16 sources (two `_eight`s) at offset j."""
        u = uint64(j)
        return fmax(fmax(_max8(flat, rb, db, u), _max8(flat, ra, da, u)), best[j])

    @njit(nogil=True, fastmath=FASTMATH, cache=True, **BORROWED)
    def source_order(drow, centre, order, bounds, scores, counts, keys):  # pragma: no cover - compiled
        """Sources in decreasing delta, by buckets of BUCKET_WIDTH below the row's maximum (a counting sort,
        O(K), instead of an O(K log K) sort that costs as much as the product itself at K = 256): order (K,)
        the sources; scores (K,) the deltas by state, re-centred on the row maximum with `centre`
        (Viterbi's re-centring, in the same pass; what its backtrace replays); keys (K,) int32 each state's slot
        (bucket * LANES + lane) and bounds (BUCKETS,) each bucket's upper edge (re-centred likewise), so
        that bounds[keys[order[n]] // LANES] (`bound_at`) bounds every delta from position n on. Only the
        order is scattered: the deltas and bounds are read through it. counts (COUNT_SLOTS,) int64 scratch.
        Returns the row maximum."""
        K = drow.shape[0]
        top = row_max(drow)
        shift = top if centre and np.isfinite(top) else drow.dtype.type(0.0)
        inv_width, last = drow.dtype.type(1.0 / BUCKET_WIDTH), drow.dtype.type(BUCKETS - 1)
        for i in range(K):  # branch-free, so it vectorises (int32 keys: AVX2 converts floats to int32 only)
            d = drow[i]
            scores[i] = d - shift
            gap = (top - d) * inv_width  # the bucket: NaN (an impossible row) and the far tail go to the last one
            keys[i] = np.int32(gap if gap < last else last) * LANES + (i & (LANES - 1))
        for k in range(BUCKETS):
            bounds[k] = (top - shift) - (k * BUCKET_WIDTH - BUCKET_SLACK) if k > 0 else top - shift
        counts[:] = 0
        for i in range(K):  # slot = bucket * LANES + lane: a bucket's lanes are adjacent in the prefix sum
            counts[keys[i]] += 1
        start = 0  # exclusive prefix sum, the running total in a register (not a store-to-load chain)
        for k in range(BUCKETS * LANES):
            c = counts[k]
            counts[k] = start
            start += c
        for i in range(K):
            k = keys[i]
            n = counts[k]
            counts[k] = n + 1
            order[n] = i
        return top

    @njit(nogil=True, inline="always", cache=True)
    def bound_at(order, keys, bounds, n):  # pragma: no cover - compiled
        """An upper bound of every (re-centred) delta from position n of `order` on (-inf past the end)."""
        if n >= order.shape[0]:
            return bounds.dtype.type(-np.inf)
        return bounds[keys[order[n]] // LANES]

    @njit(nogil=True, inline="always", fastmath=FASTMATH, cache=True)
    def row_max(row):  # pragma: no cover - compiled
        """The maximum of a row (-inf if empty), branch-free: it vectorises, where np.max checks for NaN."""
        top = row.dtype.type(-np.inf)
        for i in range(row.shape[0]):
            top = fmax(row[i], top)
        return top

    @njit(nogil=True, fastmath=FASTMATH, cache=True, **BORROWED)
    def maxplus_block(flat, K, ld, col_max, order, keys, bounds, scores, j0, w, val, scratch):  # pragma: no cover
        """Columns [j0, j0 + w) of one row of the (max, +) product: val[j] = max_i scores[i] + A[i, j], for A
        (K, K) given flat with row stride ld (`padded_rows`), sources in `order` with `keys`, `bounds` from
        `source_order`. scratch (2, >= w). O(K w) worst case."""
        b0, b1 = scratch[0], scratch[1]  # running maxima, ping-pong by `flip` (no array swaps: each costs
        for j in range(w):  # reference counting)
            b0[j] = -np.inf
        flip = False
        n_chunks = (K + CHUNK - 1) // CHUNK
        for c in range(n_chunks):
            n0 = c * CHUNK
            n1 = min(K, n0 + CHUNK)
            if c % CHECK_EVERY != CHECK_EVERY - 1 and c + 1 < n_chunks:  # no check: an exact maximum either way
                if flip:
                    _chunk_free(flat, order, scores, n0, n1, ld, j0, b1, b0, w)
                else:
                    _chunk_free(flat, order, scores, n0, n1, ld, j0, b0, b1, w)
                flip = not flip
                continue
            next_top = bound_at(order, keys, bounds, n1)
            if flip:
                alive = _chunk(flat, order, scores, n0, n1, ld, j0, b1, b0, next_top, col_max, w)
            else:
                alive = _chunk(flat, order, scores, n0, n1, ld, j0, b0, b1, next_top, col_max, w)
            flip = not flip
            if not alive:
                break
        best = b1 if flip else b0
        for j in range(w):
            val[j] = best[j]

    @njit(nogil=True, cache=True, **BORROWED)
    def block_argmax(flat, K, ld, order, scores, j0, w, val, arg):  # pragma: no cover - compiled
        """arg[j] for columns [j0, j0 + w) of a product `maxplus_block` formed (values val): the first source
        in `order` whose scores[i] + A[i, j] equals val[j] (the same float operations, so the equality is
        exact; sources come in decreasing delta, so the scan usually stops within the first few)."""
        for j in range(w):
            arg[j] = order[0]
            for n in range(K):
                i = order[n]
                if scores[i] + flat[i * ld + j0 + j] == val[j]:
                    arg[j] = i
                    break

    @njit(nogil=True, cache=True, **BORROWED)
    def backpointer(scores, trans_t, j):  # pragma: no cover - compiled
        """argmax_i scores[i] + A[i, j] (the lowest i among ties; 0 if every term is -inf), with A[:, j] read
        as the contiguous row trans_t[j] of A transposed. O(K)."""
        col = trans_t[j]
        best = -np.inf
        arg = 0
        for i in range(scores.shape[0]):
            v = scores[i] + col[i]
            if v > best:
                best = v
                arg = i
        return arg

    @njit(nogil=True, cache=True)
    def block_width(K, itemsize):  # pragma: no cover - compiled
        """Columns per block: the K x width panel of the matrix stays in a core's L2 while every row of a
        batch sweeps it (whole rows for small K)."""
        w = PANEL_BYTES // (K * itemsize)
        return max(MIN_BLOCK, min(BLOCK, w - w % 8))

    @njit(nogil=True, cache=True)
    def maxplus_rows(delta, padded, col_max, val, arg):  # pragma: no cover - compiled
        """The (max, +) product of every row of delta (B, K) with the matrix `padded` (K, ld)
        (`padded_rows`): val (B, K), arg (B, K) int64."""
        B, K = delta.shape
        dt = delta.dtype
        _maxplus_rows(delta, padded.reshape(-1), padded.shape[1], col_max, val, arg, np.empty((2, BLOCK), dtype=dt),
                      np.empty((B, K), dtype=np.int64), np.empty((B, K), dtype=np.int32),
                      np.empty((B, BUCKETS), dtype=dt), np.empty((B, K), dtype=dt),
                      np.empty(COUNT_SLOTS, dtype=np.int64))

    @njit(nogil=True, cache=True, **BORROWED)
    def _maxplus_rows(delta, flat, ld, col_max, val, arg, scratch, order, keys, bounds, scores,  # pragma: no cover
                      counts):
        """`maxplus_rows` on the matrix as flat rows of stride ld, with its scratch, without reference counting."""
        B, K = delta.shape
        for b in range(B):
            source_order(delta[b], False, order[b], bounds[b], scores[b], counts, keys[b])
        w = block_width(K, delta.itemsize)
        for j0 in range(0, K, w):
            wj = min(w, K - j0)
            for b in range(B):
                maxplus_block(flat, K, ld, col_max, order[b], keys[b], bounds[b], scores[b], j0, wj, val[b, j0:],
                              scratch)
                block_argmax(flat, K, ld, order[b], scores[b], j0, wj, val[b, j0:], arg[b, j0:])

    @njit(nogil=True, fastmath=FASTMATH, cache=True)
    def viterbi_lockstep(log_init, table, ids, padded, col_max, trans_t, lengths, rows, first, stride, history,
                         paths, scores):  # pragma: no cover - compiled
        """Viterbi of the sequences rows[first::stride] (one thread's share of a batch; `rows` in decreasing
        length), advanced together so that each panel of the matrix is swept by all of them while it is in
        cache. log_init (B, K); emission log-likelihoods as rows of a table: log p(x_t | z_t = k) =
        table[ids[b, t], k], table (N, K), ids (B, T); the matrix as `padded` (K, ld) (`padded_rows`) and
        transposed, trans_t (K, K), with its column maxima col_max (K,); lengths (B,);
        history (B, T, K) scratch for each step's re-centred scores (what the backtrace replays, in place of
        backpointers); paths (B, T) int64 out (-1 at padding), scores (B,) float64 out. Scores are re-centred
        every step as the sources are ordered (the float64 offset carries the scale), so float32 keeps the
        differences that decide the path."""
        K = table.shape[1]
        mine = rows[first::stride]
        m = mine.shape[0]
        if m == 0:
            return
        dt = table.dtype
        _viterbi_lockstep(log_init, table, ids, padded.reshape(-1), padded.shape[1], col_max, trans_t, lengths, mine,
                          history, paths, scores, np.empty((m, K), dtype=dt), np.empty((m, K), dtype=dt),
                          np.empty((m, K), dtype=np.int64), np.empty((m, K), dtype=np.int32),
                          np.empty((m, BUCKETS), dtype=dt), np.empty(COUNT_SLOTS, dtype=np.int64),
                          np.empty((2, BLOCK), dtype=dt), np.zeros(m))

    @njit(nogil=True, fastmath=FASTMATH, cache=True, **BORROWED)
    def _viterbi_lockstep(log_init, table, ids, flat, ld, col_max, trans_t, lengths, mine, history, paths, scores,
                          delta, nxt, order, keys, bounds, counts, scratch, offset):  # pragma: no cover - compiled
        """`viterbi_lockstep` for its rows `mine` (non-empty), on the matrix as flat rows of stride ld, with its
        scratch, without reference counting."""
        K = table.shape[1]
        m = mine.shape[0]
        w = block_width(K, table.itemsize)
        active = m
        for t in range(lengths[mine[0]]):
            while active > 0 and lengths[mine[active - 1]] <= t:
                active -= 1
            for r in range(active):
                b = mine[r]
                d = delta[r]
                if t == 0:
                    e = table[ids[b, 0]]
                    for j in range(K):
                        d[j] = log_init[b, j] + e[j]
                else:
                    top = source_order(d, True, order[r], bounds[r], history[b, t - 1], counts, keys[r])
                    if np.isfinite(top):
                        offset[r] += top
            if t > 0:
                for j0 in range(0, K, w):
                    wj = min(w, K - j0)
                    for r in range(active):
                        maxplus_block(flat, K, ld, col_max, order[r], keys[r], bounds[r], history[mine[r], t - 1],
                                      j0, wj, nxt[r, j0:], scratch)
                for r in range(active):
                    d, v, e = delta[r], nxt[r], table[ids[mine[r], t]]
                    for j in range(K):
                        d[j] = v[j] + e[j]
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
                state = backpointer(history[b, t - 1], trans_t, state)
                paths[b, t - 1] = state

    @njit(nogil=True, cache=True, **BORROWED)
    def backtrack(last, step_tops, history, trans_t, path):  # pragma: no cover - compiled
        """The path of `viterbi_chunks` from its last (not re-centred) delta, the per-step maxima and the
        re-centred scores of every earlier step (L, K): path[:L] out. Returns the path's float64
        log-probability."""
        L = history.shape[0]
        state = int(np.argmax(last))
        offset = 0.0
        for t in range(L - 1):
            if np.isfinite(step_tops[t]):
                offset += step_tops[t]
        score = offset + last[state]
        path[L - 1] = state
        for t in range(L - 1, 0, -1):
            state = backpointer(history[t - 1], trans_t, state)
            path[t - 1] = state
        return score

    @njit(nogil=True, fastmath=FASTMATH, cache=True)
    def viterbi_steps(table, ids, padded, col_max, delta, lo, hi, history, tops, verify):  # pragma: no cover
        """Advance one sequence's Viterbi through steps lo..hi-1 (lo >= 1): delta (K,) holds the un-centred
        scores of step lo - 1 and is updated in place; each step t writes the re-centred scores it orders
        (history[t - 1], what the backtrace replays) and their maximum (tops[t - 1], the offset). With
        `verify`, history already holds a speculative run's rows (from a guessed delta, `viterbi_chunks`):
        the first step whose re-centred scores equal that row bit for bit stops the run, since from there on
        the same float operations on the same inputs give the rows already there. Returns where it stopped
        (hi when it ran through). Emissions as table[ids[t]], the matrix as `padded` (K, ld) (`padded_rows`)
        with its column maxima col_max. O((hi - lo) K^2) worst case."""
        K = table.shape[1]
        dt = table.dtype
        return _viterbi_steps(table, ids, padded.reshape(-1), padded.shape[1], col_max, delta, lo, hi, history, tops,
                              verify, np.empty(K, dtype=np.int64), np.empty(K, dtype=np.int32),
                              np.empty(BUCKETS, dtype=dt), np.empty(COUNT_SLOTS, dtype=np.int64),
                              np.empty((2, BLOCK), dtype=dt), np.empty(K, dtype=dt), np.empty(K, dtype=dt))

    @njit(nogil=True, fastmath=FASTMATH, cache=True, **BORROWED)
    def _viterbi_steps(table, ids, flat, ld, col_max, delta, lo, hi, history, tops, verify,  # pragma: no cover
                       order, keys, bounds, counts, scratch, nxt, fresh):
        """`viterbi_steps` on the matrix as flat rows of stride ld, with its scratch, without reference counting."""
        K = table.shape[1]
        w = block_width(K, table.itemsize)
        for t in range(lo, hi):
            scores = history[t - 1]
            if verify:
                tops[t - 1] = source_order(delta, True, order, bounds, fresh, counts, keys)
                same = True
                for i in range(K):
                    if fresh[i] != scores[i]:
                        same = False
                        break
                if same:
                    return t
                for i in range(K):
                    scores[i] = fresh[i]
            else:
                tops[t - 1] = source_order(delta, True, order, bounds, scores, counts, keys)
            for j0 in range(0, K, w):
                maxplus_block(flat, K, ld, col_max, order, keys, bounds, scores, j0, min(w, K - j0), nxt[j0:],
                              scratch)
            e = table[ids[t]]
            for j in range(K):
                delta[j] = nxt[j] + e[j]
        return hi


def viterbi_chunks(init: np.ndarray, table: np.ndarray, ids: np.ndarray, padded: np.ndarray, col_max: np.ndarray,
                   history: np.ndarray, tops: np.ndarray, threads: int) -> np.ndarray:
    """One sequence's Viterbi recursion on `threads` threads, exact, by speculation: the sequence is cut into
    `threads` chunks run at once, each after the first from a guessed start (all states equal); then each
    chunk in turn is re-run from the true scores its predecessor ends with (`viterbi_steps` with verify)
    until its re-centred scores meet the speculative ones bit for bit. Viterbi forgets its start quickly:
    on the benchmark's random HMMs the rows meet after 13-26 steps (Z = 64-1,024), so a chunk's re-run is a
    few dozen steps and no thread waits for another inside the recursion. Where they never meet (a chain
    that remembers its start, e.g. disconnected components), the re-run covers the whole chunk: as slow as
    one thread, never wrong. init (K,), emissions table[ids] (ids (L,), L >= 1), the matrix as `padded`
    (`padded_rows`) with its column maxima; history (L - 1, K) and
    tops (L - 1,) out, as `viterbi_steps` writes them. Returns the last step's un-centred scores (K,)."""
    L, K = ids.shape[0], table.shape[1]
    bounds = [round(c * L / threads) for c in range(threads + 1)]
    bounds[0] = 1  # step 0 is the start: chunk 0 runs steps 1 .. bounds[1] - 1
    ends = np.zeros((threads, K), dtype=table.dtype)  # chunk c: the scores at its last step, bounds[c + 1] - 1
    ends[0] = init + table[ids[0]]

    def run(c: int) -> None:  # chunks after the first start from the guess: all states equal (zeros)
        viterbi_steps(table, ids, padded, col_max, ends[c], bounds[c], bounds[c + 1], history, tops, False)

    run_split(run, threads)
    for c in range(1, threads):  # the true scores reach chunk c from chunk c - 1, now exact
        delta = ends[c - 1].copy()
        if viterbi_steps(table, ids, padded, col_max, delta, bounds[c], bounds[c + 1], history, tops, True) \
                == bounds[c + 1]:
            ends[c] = delta  # never met: the re-run is the exact chunk
    return ends[threads - 1]


def _arr(x: Tensor) -> np.ndarray:
    return np.ascontiguousarray(x.detach().numpy())


def maxplus_cpu(delta: Tensor, log_trans: Tensor, col_max: Tensor | None = None) -> tuple[Tensor, Tensor]:
    """(B, K) x (K, K) -> values (B, K), argmax (B, K) int64; CPU float32/float64. O(B K^2) worst case.

    Sources are visited in decreasing delta and a column block stops as soon as the bound
    delta_i + col_max[j] (col_max = log_trans.max(0)) cannot improve any of its columns: exact, and
    typically 3-10x less work. The argmax is found afterwards by a scan in the same order that stops at the
    first source attaining the value. Among tied sources the one with the larger delta wins."""
    d = _arr(delta)
    cm = blas.column_max(log_trans) if col_max is None else _arr(col_max)
    val = np.empty_like(d)
    arg = np.empty(d.shape, dtype=np.int64)
    maxplus_rows(d, blas.padded_rows(log_trans), cm, val, arg)
    return torch.from_numpy(val), torch.from_numpy(arg)


def viterbi_cpu(log_init: Tensor, table: Tensor, rows: Tensor | None, log_trans: Tensor, lengths: Tensor,
                threads: int) -> tuple[Tensor, Tensor]:
    """Viterbi of a batch, whole in compiled code: `threads` threads split the sequences (every threads-th
    in decreasing length, so their shares balance), each advancing its share together. log_init (B, K);
    emission log-likelihoods table[rows[b, t]] (table (N, K), rows (B, T): read where they lie, no gathered
    copy) or, with rows None, a dense (B, T, K) table; log_trans (K, K), lengths (B,) -> paths (B, T) int64
    (-1 at padding), scores (B,) float64. The padded, transposed matrix and its column maxima are derived
    once per matrix (`blas`'s cache). O(B T K^2) worst case; O(B T K) memory for the re-centred scores the backtrace
    replays."""
    e, r = emission_rows(table, rows)
    B, T = r.shape
    K = e.shape[1]
    padded, trans_t, cm = blas.padded_rows(log_trans), blas.transposed(log_trans), blas.column_max(log_trans)
    if B == 1 and threads >= 2:
        return _viterbi_one_sequence(_arr(log_init[0]), e, r[0, : int(lengths[0])], padded, trans_t, cm, T, threads)
    lens = lengths.detach().cpu().numpy().astype(np.int64)
    order = np.argsort(-lens, kind="stable")
    threads = max(1, min(threads, B))
    history = np.empty((B, max(T - 1, 1), K), dtype=e.dtype)
    paths = np.empty((B, T), dtype=np.int64)
    scores = np.empty(B, dtype=np.float64)
    init = _arr(log_init)
    run_split(lambda k: viterbi_lockstep(init, e, r, padded, cm, trans_t, lens, order, k, threads, history, paths,
                                         scores), threads)
    return torch.from_numpy(paths), torch.from_numpy(scores)


def _viterbi_one_sequence(init: np.ndarray, table: np.ndarray, ids: np.ndarray, padded: np.ndarray,
                          trans_t: np.ndarray, cm: np.ndarray, T: int, threads: int) -> tuple[Tensor, Tensor]:
    """One sequence's Viterbi on `threads` threads (`viterbi_chunks`), then the backtrace. init (K,),
    emissions table[ids] (ids (L,)), the matrix as `padded` rows, transposed and its column maxima; the path
    is padded to T with -1."""
    L, K = ids.shape[0], table.shape[1]
    paths = np.full((1, T), -1, dtype=np.int64)
    if L == 0:
        return torch.from_numpy(paths), torch.zeros(1, dtype=torch.float64)
    history = np.empty((L, K), dtype=table.dtype)  # rows 0 .. L - 2 used (`backtrack` takes L rows)
    step_tops = np.zeros(L)
    # how many threads pay is the dispatch's call (`backend.max_product_threads`); each chunk needs a step
    last = viterbi_chunks(init, table, ids, padded, cm, history, step_tops, max(1, min(threads, L - 1)))
    score = backtrack(last, step_tops, history, trans_t, paths[0])
    return torch.from_numpy(paths), torch.tensor([score], dtype=torch.float64)
